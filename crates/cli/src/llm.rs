//! Generation in the CLI: the `--model` options shared by `bgs serve` and `bgs generate`,
//! loading a checkpoint into the CPU generation engine, the text codec the OpenAI API uses,
//! and `bgs generate` (text in, text out, in process).

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use bgs_engine::{Engine, Frame, FrameSink, NoCredit, Progress, Request, StreamId};
use bgs_llm::{EngineConfig, GenerationEngine};
use bgs_model::cpu::{CpuModel, KvConfig};
use bgs_model::{ChatTemplate, Checkpoint, Tokenizer};
use bgs_protocol::{Op, Status};

/// Most live sequences (`--slots` with a model): the engine holds `slots` running and as
/// many waiting requests, each a credit stream of the ring's `MAX_STREAMS`.
pub const MAX_SLOTS: usize = bgs_ring::MAX_STREAMS / 2;

/// Live sequences when `--slots` is not given with `--model`.
pub const DEFAULT_SLOTS: usize = 16;

/// Options of the generation engine (with `--model`).
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Serve generation with this checkpoint: a Hugging Face directory (config.json,
    /// *.safetensors, tokenizer.json) or a GGUF file (F32/F16/BF16/Q8_0/Q4_0/Q4_1).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Tokens per KV-cache block (1..=256).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub kv_block_size: u32,
    /// KV-cache blocks in the pool (0: enough for every slot to hold 1,024 tokens, at most
    /// 1 GiB of cache). Admission waits while the pool cannot hold a request's prompt plus
    /// its max new tokens.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=16_777_216))]
    pub kv_blocks: u32,
    /// Token budget of one step (decode tokens plus prefill chunks; 0: max(512, slots)).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=65_536))]
    pub max_batched_tokens: u32,
    /// Threads of the model's forward pass (0: one per CPU the process may run on).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=256))]
    pub model_threads: u32,
    /// Keep generating past end-of-sequence tokens for every request (else per request:
    /// flag bit 0 of generate, `ignore_eos` in the API).
    #[arg(long)]
    pub ignore_eos: bool,
    /// GPU forward pass (`--executor gpu`): element type of the weights, the KV cache and the
    /// projections' inputs (accumulation is f32 throughout). The CPU forward pass is f32.
    #[arg(long, value_enum, default_value_t = DtypeArg::Bf16)]
    pub dtype: DtypeArg,
    /// GPU forward pass: every projection through the server's own kernels, whose reduction
    /// order is fixed by the output's row (a request's tokens do not depend on what else is in
    /// the batch), instead of cuBLAS: the tensor-core GEMM on 16-bit models, the fused form in
    /// f32. Slower than cuBLAS beyond a few tokens a step (docs/gpu-model.md).
    #[arg(long)]
    pub batch_invariant: bool,
    /// GPU forward pass: buckets of at most this many tokens (decode at small batch) run the
    /// fused form (own projections with the norms, RoPE/KV writes, SiLU and residual adds
    /// fused in); larger ones run cuBLAS. 0: cuBLAS for every bucket. Mixing the two forms
    /// changes a request's bits with the batch size (see docs/gpu-model.md).
    #[arg(long, default_value_t = bgs_model_gpu::GpuModelOptions::default().fused_max_tokens)]
    pub gpu_fused_max_tokens: usize,
    /// GPU forward pass: projections over at most this many tokens run on tensor cores in
    /// the server's own GEMM (16-bit models); larger ones run cuBLAS. 0: cuBLAS for every
    /// projection. Mixing the two changes a request's bits with the batch size;
    /// --batch-invariant runs the GEMM for every bucket.
    #[arg(long, default_value_t = bgs_model_gpu::GpuModelOptions::default().tensor_core_gemm_max_tokens)]
    pub gpu_tc_gemm_max_tokens: usize,
    /// GPU forward pass: buckets of 9 up to this many tokens run the tensor-core GEMM in
    /// 16-token blocks (one block reads the weights once where two 8-token blocks read them
    /// twice; the same bits). 0: 8-token blocks there. Only where the tensor-core GEMM runs
    /// (--batch-invariant or --gpu-tc-gemm-max-tokens).
    #[arg(long, default_value_t = bgs_model_gpu::GpuModelOptions::default().tensor_core_mid_tiles_max_tokens)]
    pub gpu_tc_mid_max_tokens: usize,
    /// GPU forward pass: buckets of at least this many tokens run the tensor-core GEMM (the
    /// plain and the gate/up SiLU one) in large tiles, blocks of 64 weight rows and 64 tokens
    /// staged through shared memory (each weight and activation read far fewer times; the same
    /// bits), where that grid has at least a block a multiprocessor (the others keep their
    /// tiles). 0: never. Only where the tensor-core GEMM runs (--batch-invariant or
    /// --gpu-tc-gemm-max-tokens).
    #[arg(long, default_value_t = bgs_model_gpu::GpuModelOptions::default().tensor_core_large_tiles_min_tokens)]
    pub gpu_tc_large_min_tokens: usize,
    /// GPU forward pass: where a projection's large-tile grid would have fewer blocks than the
    /// device has multiprocessors (on the Qwen2.5-0.5B shape QKV, o and down_proj), run its
    /// large tiles split over this many blocks a tile (2..=8, more taken as 8: each block sums
    /// its share of the input, the tile's last one adds the shares in a fixed order; the same
    /// bits) instead of the wide tiles. 0 or 1: never. Only where the large tiles run
    /// (--gpu-tc-large-min-tokens).
    #[arg(long, default_value_t = bgs_model_gpu::GpuModelOptions::default().tensor_core_large_split)]
    pub gpu_tc_large_split: usize,
    /// GPU forward pass: launch the model's kernels one after the other, without programmatic
    /// dependent launch (by default, on sm_90+, each may start while the one before it
    /// drains; the same results either way).
    #[arg(long)]
    pub gpu_no_pdl: bool,
}

/// `--dtype` values.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtypeArg {
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
    /// f32 (for checking against the CPU forward pass).
    F32,
}

impl DtypeArg {
    fn gpu(self) -> bgs_model_gpu::GpuDtype {
        match self {
            DtypeArg::Bf16 => bgs_model_gpu::GpuDtype::Bf16,
            DtypeArg::F16 => bgs_model_gpu::GpuDtype::F16,
            DtypeArg::F32 => bgs_model_gpu::GpuDtype::F32,
        }
    }
}

/// Where the forward pass runs. The engine's step loop (scheduling, KV block allocation,
/// frames) runs on the executor's host thread, unless `step_loop_on_device` puts it on the GPU.
#[derive(Debug, Clone)]
pub enum ModelDevice {
    /// The deterministic CPU forward pass.
    Cpu,
    /// The GPU forward pass (`bgs-model-gpu`: cuBLAS and NVRTC kernels, one CUDA graph per
    /// token-count bucket).
    Gpu {
        /// CUDA device ordinal.
        device: usize,
        /// Where CUDA libraries live.
        cuda_home: Option<PathBuf>,
        /// The step loop resident on the GPU (`--gpu-step-loop device`): the model is built
        /// with device-launchable graphs and handed over unwrapped ([`LoadedEngine::Device`]).
        step_loop_on_device: bool,
        /// The resident loop checks its bookkeeping after every step and its lane-parallel
        /// walks against the C functions (`GenLoopConfig::check`; tests, slower).
        step_loop_check: bool,
    },
}

/// What serves the model's requests.
pub enum LoadedEngine {
    /// A generation engine whose step loop runs on a host thread (either forward pass).
    Host(Box<dyn Engine>),
    /// A GPU model for the step loop resident on the device (`bgs_model_gpu::GpuGenExecutor`),
    /// with the loop's settings.
    Device(Box<bgs_model_gpu::GpuModel>, bgs_model_gpu::GenLoopConfig),
}

/// Flags of [`ModelArgs`] that only the GPU forward pass reads (refused with the CPU one).
pub const GPU_ONLY_MODEL_FLAGS: &[&str] = &[
    "dtype",
    "batch_invariant",
    "gpu_fused_max_tokens",
    "gpu_tc_gemm_max_tokens",
    "gpu_tc_mid_max_tokens",
    "gpu_tc_large_min_tokens",
    "gpu_tc_large_split",
    "gpu_no_pdl",
];

/// Flags of [`ModelArgs`] that only the CPU forward pass reads.
pub const CPU_ONLY_MODEL_FLAGS: &[&str] = &["model_threads"];

/// Longest reservation one request can make: a full ring slot of prompt plus the most new
/// tokens (the default KV pool holds this for every slot, so admission never waits on blocks
/// unless `--kv-blocks` says otherwise).
const MAX_REQUEST_TOKENS: usize = bgs_ring::SLOT_WORDS + 4096;

/// A loaded model, ready to become an engine.
pub struct Loaded {
    /// The generation engine (over the CPU or the GPU forward pass), or the GPU model for the
    /// device-resident step loop.
    pub engine: LoadedEngine,
    /// Tokenizer and chat template, for the API and `bgs generate`.
    pub codec: Arc<ModelCodec>,
    /// The model's name.
    pub name: String,
    /// Where the forward pass runs, for the start-up line ("CPU, 8 threads", "GPU 0, bf16").
    pub forward: String,
}

impl std::fmt::Debug for LoadedEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadedEngine::Host(_) => f.write_str("LoadedEngine::Host"),
            LoadedEngine::Device(m, c) => f
                .debug_tuple("LoadedEngine::Device")
                .field(m)
                .field(c)
                .finish(),
        }
    }
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("name", &self.name).finish()
    }
}

/// Load `args.model` and build the engine for `slots` live sequences, its forward pass on
/// `device`.
pub fn load(args: &ModelArgs, slots: usize, device: &ModelDevice) -> Result<Loaded> {
    let Some(path) = &args.model else {
        bail!("--model is required");
    };
    if !(1..=MAX_SLOTS).contains(&slots) {
        bail!("--slots {slots} with --model: must be 1..={MAX_SLOTS}");
    }
    let t0 = Instant::now();
    let ck = bgs_model::load(path).with_context(|| format!("loading {}", path.display()))?;
    let Checkpoint {
        name,
        config,
        weights,
        tokenizer,
        chat_template,
    } = ck;
    let block_size = args.kv_block_size as usize;
    let mut ecfg = EngineConfig::new(slots);
    if args.max_batched_tokens != 0 {
        ecfg.max_batched_tokens = args.max_batched_tokens as usize;
    }
    ecfg.ignore_eos = args.ignore_eos;
    let (engine, num_blocks, on): (LoadedEngine, usize, String) = match device {
        ModelDevice::Cpu => {
            let num_blocks = match args.kv_blocks {
                0 => {
                    // Bytes of K and V for one token across all layers (f32).
                    let per_token = 2 * config.num_layers * config.kv_dim() * 4;
                    let by_memory = (1usize << 30) / per_token.max(1) / block_size;
                    (slots * 1024).div_ceil(block_size).min(by_memory).max(1)
                }
                n => n as usize,
            };
            let threads = match args.model_threads {
                0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
                n => n as usize,
            };
            let model = CpuModel::new(
                config.clone(),
                weights,
                KvConfig {
                    block_size,
                    num_blocks,
                },
                threads,
            )
            .map_err(anyhow::Error::msg)
            .context("building the CPU model")?;
            let engine = GenerationEngine::new(model, ecfg)
                .map_err(anyhow::Error::msg)
                .context("building the generation engine")?;
            (
                LoadedEngine::Host(Box::new(engine)),
                num_blocks,
                format!("CPU, {threads} threads"),
            )
        }
        ModelDevice::Gpu {
            device,
            cuda_home,
            step_loop_on_device,
            step_loop_check,
        } => {
            // Every slot can hold the longest request (a full slot of prompt and 4,096 new
            // tokens): admission waits for blocks only when --kv-blocks says so.
            let num_blocks = match args.kv_blocks {
                0 => (slots * MAX_REQUEST_TOKENS).div_ceil(block_size),
                n => n as usize,
            };
            let opts = bgs_model_gpu::GpuModelOptions {
                device: *device,
                dtype: args.dtype.gpu(),
                block_size,
                num_blocks: Some(num_blocks),
                max_batched_tokens: ecfg.max_batched_tokens,
                max_seqs: slots,
                cuda_home: cuda_home.clone(),
                batch_invariant_gemm: args.batch_invariant,
                fused_max_tokens: args.gpu_fused_max_tokens,
                tensor_core_gemm_max_tokens: args.gpu_tc_gemm_max_tokens,
                tensor_core_mid_tiles_max_tokens: args.gpu_tc_mid_max_tokens,
                tensor_core_large_tiles_min_tokens: args.gpu_tc_large_min_tokens,
                tensor_core_large_split: args.gpu_tc_large_split,
                programmatic_launch: !args.gpu_no_pdl,
                device_launch: *step_loop_on_device,
                ..bgs_model_gpu::GpuModelOptions::default()
            };
            let model = bgs_model_gpu::GpuModel::new(config.clone(), &weights, &opts)
                .context("building the GPU model")?;
            drop(weights);
            let on = format!(
                "GPU {device}, {}{}{}",
                args.dtype.gpu().name(),
                if args.batch_invariant {
                    ", batch-invariant projections"
                } else {
                    ""
                },
                if *step_loop_on_device {
                    ", step loop on the GPU"
                } else {
                    ""
                }
            );
            let engine = if *step_loop_on_device {
                let lcfg = bgs_model_gpu::GenLoopConfig {
                    slots: ecfg.slots,
                    max_waiting: ecfg.max_waiting,
                    max_batched_tokens: ecfg.max_batched_tokens,
                    ignore_eos: ecfg.ignore_eos,
                    check: *step_loop_check,
                    cuda_home: cuda_home.clone(),
                    ..bgs_model_gpu::GenLoopConfig::default()
                };
                LoadedEngine::Device(Box::new(model), lcfg)
            } else {
                let engine = GenerationEngine::new(model, ecfg)
                    .map_err(anyhow::Error::msg)
                    .context("building the generation engine")?;
                LoadedEngine::Host(Box::new(engine))
            };
            (engine, num_blocks, on)
        }
    };
    tracing::info!(
        model = %name,
        layers = config.num_layers,
        hidden = config.hidden_size,
        vocab = config.vocab_size,
        kv_blocks = num_blocks,
        block_size,
        forward = %on,
        "model loaded in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(Loaded {
        engine,
        codec: Arc::new(ModelCodec {
            tokenizer,
            chat_template,
        }),
        name,
        forward: on,
    })
}

/// The model's tokenizer and chat template as the API's [`bgs_api::TextCodec`].
#[derive(Debug)]
pub struct ModelCodec {
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
}

impl bgs_api::TextCodec for ModelCodec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer.encode(text, true).map_err(|e| e.to_string())
    }

    fn encode_chat(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, false)
            .map_err(|e| e.to_string())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.tokenizer.decode(ids, true).map_err(|e| e.to_string())
    }

    fn render_chat(&self, messages: &[bgs_api::ChatMessage]) -> Result<String, String> {
        let Some(t) = &self.chat_template else {
            return Err("this model has no chat template; use /v1/completions".into());
        };
        let messages: Vec<bgs_model::ChatMessage> = messages
            .iter()
            .map(|m| bgs_model::ChatMessage::new(m.role.clone(), m.content.clone()))
            .collect();
        t.render(&messages, true).map_err(|e| e.to_string())
    }
}

/// `bgs generate`: one prompt, completed in process and printed as it is produced.
#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Most new tokens (1..=4096).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_tokens: u32,
    /// Apply the model's chat template (the prompt becomes one user message).
    #[arg(long)]
    pub chat: bool,
    /// Print the generated token ids and timings to stderr.
    #[arg(long)]
    pub verbose: bool,
    /// Where the forward pass runs.
    #[arg(long, value_enum, default_value_t = GenerateExecutor::Cpu)]
    pub executor: GenerateExecutor,
}

/// `bgs generate --executor` values.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum GenerateExecutor {
    /// The CPU forward pass.
    Cpu,
    /// The GPU forward pass (device 0).
    Gpu,
}

/// A sink that always takes frames (`bgs generate` reads them as they come).
#[derive(Default)]
struct Collect {
    frames: Vec<(Status, bool, Vec<u32>)>,
}

impl FrameSink for Collect {
    fn credit(&self, _: StreamId) -> u32 {
        u32::MAX
    }

    fn emit(&mut self, _: StreamId, f: Frame<'_>) -> Result<(), NoCredit> {
        self.frames.push((f.status, f.final_, f.words.to_vec()));
        Ok(())
    }
}

/// `bgs generate` (`m`: its matches, to tell flags given from defaults).
pub fn generate(args: &GenerateArgs, m: &clap::ArgMatches) -> Result<()> {
    let device = match args.executor {
        GenerateExecutor::Cpu => ModelDevice::Cpu,
        GenerateExecutor::Gpu => ModelDevice::Gpu {
            device: 0,
            cuda_home: None,
            step_loop_on_device: false,
            step_loop_check: false,
        },
    };
    for (flags, on) in [
        (GPU_ONLY_MODEL_FLAGS, GenerateExecutor::Gpu),
        (CPU_ONLY_MODEL_FLAGS, GenerateExecutor::Cpu),
    ] {
        if args.executor != on
            && let Some(f) = flags.iter().find(|f| crate::args::given(m, f))
        {
            bail!(
                "--{} does nothing with --executor {:?}",
                f.replace('_', "-"),
                args.executor
            );
        }
    }
    let loaded = load(&args.model, 1, &device)?;
    let LoadedEngine::Host(mut engine) = loaded.engine else {
        bail!("bgs generate runs the step loop on the host");
    };
    let codec = loaded.codec;
    let text = if args.chat {
        let m = [bgs_api::ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
        }];
        bgs_api::TextCodec::render_chat(codec.as_ref(), &m).map_err(anyhow::Error::msg)?
    } else {
        args.prompt.clone()
    };
    let ids = if args.chat {
        bgs_api::TextCodec::encode_chat(codec.as_ref(), &text)
    } else {
        bgs_api::TextCodec::encode(codec.as_ref(), &text)
    }
    .map_err(anyhow::Error::msg)?;
    if ids.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    if ids.len() > bgs_ring::SLOT_WORDS {
        bail!(
            "the prompt has {} tokens; at most {} fit one request",
            ids.len(),
            bgs_ring::SLOT_WORDS
        );
    }
    engine
        .admit(Request {
            stream: StreamId(0),
            conn: 0,
            op: Op::Generate,
            param: args.max_tokens,
            flags: 0,
            payload: &ids,
        })
        .map_err(|s| anyhow::anyhow!("the engine refused the prompt: status {s:?}"))?;
    let mut sink = Collect::default();
    let mut detok = bgs_api::detok::Detokenizer::default();
    let mut out = std::io::stdout().lock();
    let start = Instant::now();
    let mut first: Option<f64> = None;
    let mut generated = Vec::new();
    let mut end: Option<(Status, Vec<u32>)> = None;
    while end.is_none() {
        if engine.step(&mut sink) == Progress::Idle && sink.frames.is_empty() {
            bail!("the engine stopped without ending the stream");
        }
        for (status, final_, words) in sink.frames.drain(..) {
            if final_ {
                end = Some((status, words));
                continue;
            }
            let id = words.first().copied().unwrap_or(0);
            first.get_or_insert(start.elapsed().as_secs_f64());
            generated.push(id);
            if let Some(piece) = detok.push(codec.as_ref(), id).map_err(anyhow::Error::msg)? {
                out.write_all(piece.as_bytes())?;
                out.flush()?;
            }
        }
    }
    if let Some(tail) = detok.finish(codec.as_ref()).map_err(anyhow::Error::msg)? {
        out.write_all(tail.as_bytes())?;
    }
    writeln!(out)?;
    let (status, words) = end.unwrap_or((Status::Internal, Vec::new()));
    if status != Status::EndOfStream {
        bail!("generation ended with status {status:?}");
    }
    if args.verbose {
        let total = start.elapsed().as_secs_f64();
        let n = generated.len();
        eprintln!(
            "bgs: {} prompt tokens, {n} generated ({}), first token after {:.1} ms, \
             {:.1} tokens/s after it; ids {generated:?}",
            ids.len(),
            if words.first() == Some(&0) {
                "stopped at EOS"
            } else {
                "length"
            },
            first.unwrap_or(total) * 1e3,
            (n.saturating_sub(1)) as f64 / (total - first.unwrap_or(total)).max(1e-9),
        );
    }
    Ok(())
}
