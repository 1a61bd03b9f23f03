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
}

/// A loaded model, ready to become an engine.
pub struct Loaded {
    /// The generation engine.
    pub engine: GenerationEngine<CpuModel>,
    /// Tokenizer and chat template, for the API and `bgs generate`.
    pub codec: Arc<ModelCodec>,
    /// The model's name.
    pub name: String,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("name", &self.name).finish()
    }
}

/// Load `args.model` and build the engine for `slots` live sequences.
pub fn load(args: &ModelArgs, slots: usize) -> Result<Loaded> {
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
    let mut ecfg = EngineConfig::new(slots);
    if args.max_batched_tokens != 0 {
        ecfg.max_batched_tokens = args.max_batched_tokens as usize;
    }
    ecfg.ignore_eos = args.ignore_eos;
    let engine = GenerationEngine::new(model, ecfg)
        .map_err(anyhow::Error::msg)
        .context("building the generation engine")?;
    tracing::info!(
        model = %name,
        layers = config.num_layers,
        hidden = config.hidden_size,
        vocab = config.vocab_size,
        kv_blocks = num_blocks,
        block_size,
        threads,
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

pub fn generate(args: &GenerateArgs) -> Result<()> {
    let loaded = load(&args.model, 1)?;
    let mut engine = loaded.engine;
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
