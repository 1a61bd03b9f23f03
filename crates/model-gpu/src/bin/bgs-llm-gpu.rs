//! `bgs-llm-gpu`: correctness checks of the GPU forward pass against the CPU oracle, and its
//! decode/prefill benchmark (docs/gpu-model.md).
//!
//! - `check`: logits of a batched prefill (relative max difference), greedy tokens of 1 and 8
//!   concurrent sequences with chunked prefill (CPU vs GPU), and batch invariance (each of 33
//!   sequences alone vs all together, GPU vs GPU). Exit code 1 when a check fails.
//! - `bench`: decode step time at several batch sizes (graph replay, cuEvent timing) against
//!   the memory floor measured in the same run, and prefill throughput of one 512-token chunk.

use std::path::PathBuf;
use std::process::ExitCode;

use bgs_llm::StepModel;
use bgs_model::synth::{DType, SplitMix64, SynthArch, synth_weights};
use bgs_model::{CpuModel, KvConfig, ModelConfig, StepItem, Tensor, Weights};
use bgs_model_gpu::{GpuDtype, GpuModel, GpuModelOptions};
use clap::{Args, Parser, Subcommand};
use serde_json::{Value, json};

#[derive(Parser, Debug)]
#[command(
    name = "bgs-llm-gpu",
    about = "Check and benchmark the GPU forward pass"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Compare the GPU model with the CPU oracle (logits, greedy tokens, batch invariance).
    Check(CheckArgs),
    /// Decode step time and prefill throughput on synthetic weights.
    Bench(BenchArgs),
    /// Compare the GPU model with Hugging Face transformers' logits and greedy tokens
    /// (written by `bench/gpu/hf_reference.py` for the same checkpoint and prompts).
    Hf(HfArgs),
}

#[derive(Args, Debug)]
struct HfArgs {
    /// The checkpoint the reference was computed from (Hugging Face directory or GGUF).
    #[arg(long)]
    model: PathBuf,
    /// The reference JSON (`prompt`, `logits` of its last position, greedy `tokens`).
    #[arg(long)]
    reference: PathBuf,
    /// Device element type (compare with a reference of the same dtype).
    #[arg(long, default_value = "bf16")]
    dtype: GpuDtype,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    dev: DeviceArgs,
}

#[derive(Args, Debug, Clone)]
struct DeviceArgs {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Where the CUDA libraries live.
    #[arg(long)]
    cuda_home: Option<PathBuf>,
    /// Kernel cache directory.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Run the step's launches without CUDA graphs (debugging).
    #[arg(long)]
    no_graphs: bool,
    /// Every projection through the crate's own kernels with a fixed reduction order (the
    /// tensor-core GEMM on 16-bit models, else the fused form), instead of cuBLAS:
    /// batch-invariant by construction.
    #[arg(long)]
    invariant_gemm: bool,
    /// Buckets of at most this many tokens run the fused form (0: cuBLAS for every bucket).
    #[arg(long, default_value_t = GpuModelOptions::default().fused_max_tokens)]
    fused_max_tokens: usize,
    /// Projections over at most this many tokens on tensor cores (`bgs_gemm_tc`, 16-bit
    /// models) instead of cuBLAS (0: cuBLAS for every projection).
    #[arg(long, default_value_t = GpuModelOptions::default().tensor_core_gemm_max_tokens)]
    tc_gemm_max_tokens: usize,
    /// Launch the tensor-core gate/up GEMM and SiLU·up apart (by default SiLU·up is the GEMM's
    /// epilogue, `bgs_gemm_tc_silu`; the check compares the two).
    #[arg(long)]
    no_tc_epilogues: bool,
    /// Buckets of at most this many tokens whose projections all run on the tensor-core GEMM
    /// take the folded form (the residual adds and the norms after them as the epilogues of o
    /// and down, RoPE/KV as QKV's; the same bits, which the check compares; 0: never).
    #[arg(long, default_value_t = GpuModelOptions::default().tensor_core_gemm_fold_max_tokens)]
    tc_fold_max_tokens: usize,
    /// Buckets of at most this many tokens run the tensor-core kernels' 8-token tiles (the
    /// others the 32-token ones; the same bits, which the check compares; 0: never).
    #[arg(long, default_value_t = GpuModelOptions::default().tensor_core_small_tiles_max_tokens)]
    tc_small_max_tokens: usize,
    /// Buckets of more than 8 and at most this many tokens run the tensor-core kernels'
    /// 16-token tiles instead (one token block where the 8-token tiles take two, each reading
    /// the weights; the same bits, which the check compares; 0: never, the default until it is
    /// measured).
    #[arg(long, default_value_t = GpuModelOptions::default().tensor_core_mid_tiles_max_tokens)]
    tc_mid_max_tokens: usize,
    /// Buckets of at least this many tokens (and LM heads of that many rows) run the plain and
    /// the SiLU tensor-core GEMM on their large tiles (blocks of 64 rows and 64 tokens, staged
    /// through shared memory; the same bits, which the check compares; 0: never).
    #[arg(long, default_value_t = GpuModelOptions::default().tensor_core_large_tiles_min_tokens)]
    tc_large_min_tokens: usize,
    /// Where a projection's large grid would have fewer blocks than the device has
    /// multiprocessors (the Qwen2.5-0.5B shape's QKV, o and down_proj), run its large tiles
    /// split over this many blocks a tile (2..=8, more taken as 8; the same bits, which the
    /// check compares) instead of the wide tiles (0 or 1: never). `check` builds with at least
    /// 8 (the split form's scratch), so that it always compares the split tiles.
    #[arg(long, default_value_t = GpuModelOptions::default().tensor_core_large_split)]
    tc_large_split: usize,
    /// Keep the small tiles' weights in registers: no staging in shared memory
    /// (`tensor_core_staged_tiles`, on by default; the same bits, which the check compares).
    #[arg(long)]
    no_tc_stage: bool,
    /// Stage a projection whose warps would take at least this many rounds of register loads
    /// (0: never for that reason).
    #[arg(long, default_value_t = GpuModelOptions::default().tensor_core_stage_min_rounds)]
    tc_stage_min_rounds: usize,
    /// Do not stage a projection for having more row tiles than multiprocessors.
    #[arg(long)]
    no_tc_stage_waves: bool,
    /// Launch the model's kernels without programmatic dependent launch (on by default).
    #[arg(long)]
    no_pdl: bool,
    /// Warps per attention block (positions split across them), 1..=8.
    #[arg(long, default_value_t = GpuModelOptions::default().attention_warps)]
    attention_warps: u32,
    /// Attention in one block per query head (`bgs_attention`) instead of on tensor cores
    /// (`bgs_attention_mma`, the default where the model and device allow it).
    #[arg(long)]
    attention_per_head: bool,
    /// Buckets of at most this many tokens also get the persistent form (the step's ops in
    /// one launch; needs the crate's own projections: --invariant-gemm, --fused-max-tokens or
    /// --tc-gemm-max-tokens). The check compares it with the launched ops bit for bit; the
    /// bench times both.
    #[arg(long, default_value_t = GpuModelOptions::default().persistent_max_tokens)]
    persistent_max_tokens: usize,
    /// The persistent form prefetches into L2 the weights of the op this many ahead (0: off).
    #[arg(long, default_value_t = GpuModelOptions::default().persistent_prefetch_distance)]
    persistent_prefetch: usize,
    /// Blocks of the persistent kernel per multiprocessor (0: as many as fit).
    #[arg(long, default_value_t = GpuModelOptions::default().persistent_blocks_per_sm)]
    persistent_blocks_per_sm: u32,
}

#[derive(Args, Debug)]
struct CheckArgs {
    /// Synthetic checkpoint shape: tiny-qwen2, tiny-llama, qwen2.5-0.5b, smollm2-135m.
    #[arg(long, conflicts_with = "model", required_unless_present = "model")]
    arch: Option<SynthArch>,
    /// A checkpoint (Hugging Face directory or GGUF file) instead of synthetic weights.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Device element type: f32 (tokens must equal the oracle's), f16, bf16.
    #[arg(long, default_value = "f32")]
    dtype: GpuDtype,
    /// Greedy steps compared with the CPU oracle (the oracle is slow on big shapes: use few).
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Greedy steps of the batch-invariance check (GPU only).
    #[arg(long, default_value_t = 64)]
    invariance_steps: usize,
    /// Seed of the synthetic weights and prompts.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// CPU oracle threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    dev: DeviceArgs,
}

#[derive(Args, Debug)]
struct BenchArgs {
    /// Synthetic shape: qwen2.5-0.5b or smollm2-135m (any synthetic shape works).
    #[arg(long, default_value = "qwen2.5-0.5b")]
    arch: SynthArch,
    /// Device element type.
    #[arg(long, default_value = "bf16")]
    dtype: GpuDtype,
    /// Decode batch sizes (comma separated, each 1..=512).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    batches: Vec<usize>,
    /// Positions already in each sequence's KV cache at the timed decode step.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Timed steps per batch size.
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// Untimed steps before timing.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Also time every launch of the step (`GpuModel::profile_ops`), summed per operation.
    #[arg(long)]
    per_op: bool,
    /// Bytes of the device-to-device copy that measures bandwidth.
    #[arg(long, default_value_t = 1 << 30)]
    copy_bytes: usize,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    dev: DeviceArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Check(a) => check(a),
        Cmd::Bench(a) => bench(a),
        Cmd::Hf(a) => hf(a),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("bgs-llm-gpu: {e}");
            ExitCode::from(2)
        }
    }
}

fn options(dev: &DeviceArgs, dtype: GpuDtype) -> GpuModelOptions {
    GpuModelOptions {
        device: dev.device,
        dtype,
        cuda_home: dev.cuda_home.clone(),
        cache_dir: dev.cache_dir.clone(),
        use_graphs: !dev.no_graphs,
        batch_invariant_gemm: dev.invariant_gemm,
        fused_max_tokens: dev.fused_max_tokens,
        tensor_core_gemm_max_tokens: dev.tc_gemm_max_tokens,
        tensor_core_gemm_epilogues: !dev.no_tc_epilogues,
        tensor_core_gemm_fold_max_tokens: dev.tc_fold_max_tokens,
        tensor_core_small_tiles_max_tokens: dev.tc_small_max_tokens,
        tensor_core_mid_tiles_max_tokens: dev.tc_mid_max_tokens,
        tensor_core_large_tiles_min_tokens: dev.tc_large_min_tokens,
        tensor_core_large_split: dev.tc_large_split,
        tensor_core_staged_tiles: !dev.no_tc_stage,
        tensor_core_stage_min_rounds: dev.tc_stage_min_rounds,
        tensor_core_stage_waves: !dev.no_tc_stage_waves,
        programmatic_launch: !dev.no_pdl,
        attention_warps: dev.attention_warps,
        tensor_core_attention: !dev.attention_per_head,
        persistent_max_tokens: dev.persistent_max_tokens,
        persistent_prefetch_distance: dev.persistent_prefetch,
        persistent_blocks_per_sm: dev.persistent_blocks_per_sm,
        ..Default::default()
    }
}

fn write_json(path: &Option<PathBuf>, v: &Value) -> Result<(), String> {
    if let Some(p) = path {
        let text = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
        std::fs::write(p, text + "\n").map_err(|e| format!("writing {}: {e}", p.display()))?;
        println!("wrote {}", p.display());
    }
    Ok(())
}

/// Every tensor of `w`, rounded to what `dtype` stores: the oracle then sees the weights the
/// GPU holds, and the check measures the kernels' arithmetic, not weight quantization.
fn round_weights(w: &mut Weights, dtype: GpuDtype) {
    if dtype == GpuDtype::F32 {
        return;
    }
    let round = |t: &mut Tensor| t.data.iter_mut().for_each(|x| *x = dtype.round(*x));
    round(&mut w.embed);
    if let Some(t) = &mut w.lm_head {
        round(t);
    }
    for l in &mut w.layers {
        for t in [
            &mut l.q_proj,
            &mut l.k_proj,
            &mut l.v_proj,
            &mut l.o_proj,
            &mut l.gate_proj,
            &mut l.up_proj,
            &mut l.down_proj,
        ] {
            round(t);
        }
    }
}

/// Deterministic prompt of `len` tokens below `vocab`.
fn prompt(rng: &mut SplitMix64, vocab: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Greedy generation of `steps` tokens for every prompt at once, prefills cut into chunks of
/// `chunk` tokens, so steps mix prefill chunks and decode tokens. Sequence `i` uses blocks
/// `i * per ..` (`per` blocks each). EOS is ignored.
fn generate(
    m: &mut dyn StepModel,
    prompts: &[Vec<u32>],
    steps: usize,
    chunk: usize,
    per: usize,
) -> Result<Vec<Vec<u32>>, String> {
    let bs = m.kv().block_size;
    let tables: Vec<Vec<u32>> = (0..prompts.len())
        .map(|i| ((i * per) as u32..((i + 1) * per) as u32).collect())
        .collect();
    for (p, t) in prompts.iter().zip(&tables) {
        if (p.len() + steps).div_ceil(bs) > t.len() {
            return Err(format!(
                "internal: {} blocks cannot hold {} positions",
                t.len(),
                p.len() + steps
            ));
        }
    }
    let mut fed = vec![0usize; prompts.len()];
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    loop {
        let mut work: Vec<(usize, Vec<u32>, usize, bool)> = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            if out[i].len() >= steps {
                continue;
            }
            if fed[i] < p.len() {
                let end = (fed[i] + chunk).min(p.len());
                work.push((i, p[fed[i]..end].to_vec(), fed[i], end == p.len()));
            } else {
                let last = *out[i].last().expect("a sampled token after the prefill");
                work.push((i, vec![last], p.len() + out[i].len() - 1, true));
            }
        }
        if work.is_empty() {
            return Ok(out);
        }
        let items: Vec<StepItem<'_>> = work
            .iter()
            .map(|(i, toks, pos, sample)| StepItem {
                tokens: toks,
                pos: *pos,
                blocks: &tables[*i],
                sample: *sample,
            })
            .collect();
        let mut next = vec![0u32; items.len()];
        m.step(&items, &mut next)?;
        for ((i, toks, _, sample), &t) in work.iter().zip(&next) {
            if fed[*i] < prompts[*i].len() {
                fed[*i] += toks.len();
            }
            if *sample {
                out[*i].push(t);
            }
        }
    }
}

/// Index of the first differing token (None: equal).
fn first_divergence(a: &[u32], b: &[u32]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then_some(a.len().min(b.len())))
}

/// Class groups the check builds the model with at least (`tensor_core_large_split`: the
/// split large tiles' scratch, so that it compares them), and the largest it compares.
const CHECK_SPLIT: usize = 8;

/// Sequences of the check's largest decode step (the large tiles' 70: the 128-token bucket);
/// the model is built with blocks and `max_seqs` for it.
const LARGE_SEQS: usize = 70;

/// How a tile check names a step of sequences of `lens` tokens at position `pos` (0: a
/// prefill of their sum, else a decode of one token each): its text and its result's suffix.
fn step_labels(lens: &[usize], pos: usize) -> (String, String) {
    let tokens: usize = lens.iter().sum();
    if pos == 0 {
        (
            format!("prefill step of {tokens} tokens"),
            format!("prefill_{tokens}"),
        )
    } else {
        (
            format!("decode step of {}", lens.len()),
            format!("decode_{}", lens.len()),
        )
    }
}

fn check(a: CheckArgs) -> Result<bool, String> {
    let (name, cfg, mut weights): (String, ModelConfig, Weights) = match (&a.arch, &a.model) {
        (Some(arch), _) => {
            let dt = match a.dtype {
                GpuDtype::F32 => DType::F32,
                GpuDtype::F16 => DType::F16,
                GpuDtype::Bf16 => DType::Bf16,
            };
            let (c, w) = synth_weights(*arch, a.seed, dt);
            (format!("synthetic {}", arch.name()), c, w)
        }
        (None, Some(p)) => {
            let ck = bgs_model::load(p).map_err(|e| e.to_string())?;
            (ck.name, ck.config, ck.weights)
        }
        (None, None) => return Err("give --arch or --model".into()),
    };
    round_weights(&mut weights, a.dtype);
    let bs = 16;
    let tol = match a.dtype {
        GpuDtype::F32 => 1e-3,
        GpuDtype::F16 | GpuDtype::Bf16 => 5e-2,
    };
    let exact = a.dtype == GpuDtype::F32;
    let vocab = cfg.vocab_size;
    let mut rng = SplitMix64::new(a.seed ^ 0x5eed);

    // Block budget: 33 sequences of at most 1 + 7 * 32 prompt tokens plus the steps, and
    // room for the large tiles' decode steps of up to LARGE_SEQS sequences (`per` blocks each,
    // as every step of the check gives a sequence).
    let steps = a.steps.max(1);
    let inv_steps = a.invariance_steps.max(1);
    let longest = 1 + 7 * 32 + steps.max(inv_steps) + 1;
    let per = longest.div_ceil(bs);
    let num_blocks = LARGE_SEQS.max(33) * per;
    let mut opts = options(&a.dev, a.dtype);
    opts.block_size = bs;
    opts.num_blocks = Some(num_blocks);
    opts.max_seqs = 128;
    // With the split large tiles' scratch whatever --tc-large-split (the graphs split where
    // the large grid is short), so that the large-tile check below compares them.
    opts.tensor_core_large_split = opts.tensor_core_large_split.max(CHECK_SPLIT);
    let t0 = std::time::Instant::now();
    let mut gpu = GpuModel::new(cfg.clone(), &weights, &opts).map_err(|e| e.to_string())?;
    let (dev_name, cc) = gpu.device();
    let dev_name = dev_name.to_string();
    println!(
        "{name}: {}{} on {dev_name} (sm_{}{}), weights {} MB, ready in {:.1} s (kernel cache {})",
        a.dtype.name(),
        if a.dev.invariant_gemm {
            ", invariant GEMMs"
        } else {
            ", cuBLAS"
        },
        cc.0,
        cc.1,
        gpu.weight_bytes() / 1_000_000,
        t0.elapsed().as_secs_f64(),
        if gpu.cache_hit() { "hit" } else { "miss" }
    );
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mut cpu = CpuModel::new(
        cfg.clone(),
        weights,
        KvConfig {
            block_size: bs,
            num_blocks: 8 * per,
        },
        threads,
    )?;
    let mut ok = true;
    let mut results = Vec::new();

    // (a) Logits of a batched prefill of three prompts.
    {
        let prompts: Vec<Vec<u32>> = [5, 17, 40]
            .iter()
            .map(|&n| prompt(&mut rng, vocab, n))
            .collect();
        let tables: Vec<Vec<u32>> = (0..3)
            .map(|i| ((i * per) as u32..((i + 1) * per) as u32).collect())
            .collect();
        let items: Vec<StepItem<'_>> = prompts
            .iter()
            .zip(&tables)
            .map(|(p, t)| StepItem {
                tokens: p,
                pos: 0,
                blocks: t,
                sample: true,
            })
            .collect();
        let want = cpu.step_logits(&items)?;
        let got = gpu.step_logits(&items).map_err(|e| e.to_string())?;
        let d = compare_logits(&want, &got, tol);
        let pass = d.worst <= tol;
        ok &= pass;
        println!(
            "[{}] prefill logits (3 prompts of 5, 17, 40 tokens, one step), cpu vs gpu: {}",
            if pass { "PASS" } else { "FAIL" },
            d.describe(tol, "cpu", "gpu"),
        );
        results.push(d.json("prefill_logits", pass, tol));

        // (d) The captured graphs give what the same launches give uncaptured.
        if gpu.uses_graphs() {
            gpu.set_use_graphs(false).map_err(|e| e.to_string())?;
            let direct = gpu.step_logits(&items).map_err(|e| e.to_string());
            gpu.set_use_graphs(true).map_err(|e| e.to_string())?;
            let direct = direct?;
            let d = compare_logits(&direct, &got, tol);
            let bitwise = direct == got;
            let pass = d.worst <= tol;
            ok &= pass;
            println!(
                "[{}] graph replay vs direct launches, same prefill: {} ({})",
                if pass { "PASS" } else { "FAIL" },
                d.describe(tol, "direct", "graph"),
                if bitwise {
                    "bitwise equal"
                } else {
                    "not bitwise equal"
                },
            );
            let mut j = d.json("graphs_vs_direct", pass, tol);
            j["bitwise_equal"] = json!(bitwise);
            results.push(j);
        }

        // (e) Attention on tensor cores against per-head blocks, same prefill (the same
        //     splits and softmax; the products' sums round differently).
        if gpu.set_tensor_core_attention(true) {
            let graphs = gpu.uses_graphs();
            gpu.set_use_graphs(false).map_err(|e| e.to_string())?;
            let mma = gpu.step_logits(&items).map_err(|e| e.to_string());
            gpu.set_tensor_core_attention(false);
            let per_head = gpu.step_logits(&items).map_err(|e| e.to_string());
            gpu.set_tensor_core_attention(!a.dev.attention_per_head);
            gpu.set_use_graphs(graphs).map_err(|e| e.to_string())?;
            let (mma, per_head) = (mma?, per_head?);
            let d = compare_logits(&per_head, &mma, tol);
            let pass = d.worst <= tol;
            ok &= pass;
            println!(
                "[{}] attention on tensor cores vs per-head blocks, same prefill: {}",
                if pass { "PASS" } else { "FAIL" },
                d.describe(tol, "per head", "tensor cores"),
            );
            results.push(d.json("tensor_core_attention", pass, tol));
        } else {
            gpu.set_tensor_core_attention(!a.dev.attention_per_head);
        }
    }

    // (g) The tensor-core GEMM's epilogues (SiLU·up, and where every projection is on it the
    //     folded form: the residual adds and norms as o's and down's epilogues, RoPE/KV as
    //     QKV's)
    //     against the launches apart, direct launches: the same bits, for the prefill and
    //     decode steps of 1, 3 and 33 sequences (33: two token blocks of the GEMM) at position
    //     20 (each run writes the same K/V, so both see the same cache). The prefill's prompts
    //     are (a)'s lengths.
    {
        let graphs = gpu.uses_graphs();
        gpu.set_use_graphs(false).map_err(|e| e.to_string())?;
        // (prompt lengths at position 0, or the decode batch at position 20)
        let cases: [(&[usize], usize); 4] =
            [(&[5, 17, 40], 0), (&[1], 20), (&[1; 3], 20), (&[1; 33], 20)];
        for (lens, pos) in cases {
            let (toks, tables) = step_inputs(lens, per, vocab);
            let step = step_items(&toks, &tables, pos);
            let [apart, folded] = logits_off_on(&mut gpu, &step, GpuModel::set_tc_epilogues)?;
            let b = lens.len();
            let (what, name) = if pos == 0 {
                ("same prefill".to_string(), "tc_epilogues".to_string())
            } else {
                (
                    format!("decode step of {b}"),
                    format!("tc_epilogues_decode_{b}"),
                )
            };
            ok &= report_bitwise(
                &format!("tensor-core GEMM epilogues folded vs launched apart, {what}"),
                &name,
                ("apart", &apart),
                ("folded", &folded),
                tol,
                &mut results,
            );
        }
        gpu.set_tc_epilogues(!a.dev.no_tc_epilogues);
        // The small tensor-core tiles against the wide ones: decode steps of 1, 3, 8 and 16
        // sequences, those whose bucket the small tiles take.
        let small_max = gpu.tc_small_max_tokens();
        for b in [1usize, 3, 8, 16] {
            if bgs_model_gpu::host::bucket_for(b).is_none_or(|n| n > small_max) {
                continue;
            }
            let (toks, tables) = step_inputs(&vec![1; b], per, vocab);
            let step = step_items(&toks, &tables, 20);
            let [wide, small] = logits_off_on(&mut gpu, &step, GpuModel::set_tc_small_tiles)?;
            ok &= report_bitwise(
                &format!("tensor-core small tiles vs wide tiles, decode step of {b}"),
                &format!("tc_small_tiles_decode_{b}"),
                ("wide", &wide),
                ("small", &small),
                tol,
                &mut results,
            );
        }
        gpu.set_tc_small_tiles(true);
        // The staged small tiles against the same tiles loading into registers: decode steps
        // of 1, 3 and 8 sequences (the gate/up and down tiles stage there on the H200).
        if gpu.set_tc_staged_tiles(true) {
            for b in [1usize, 3, 8] {
                if bgs_model_gpu::host::bucket_for(b).is_none_or(|n| n > small_max) {
                    continue;
                }
                let (toks, tables) = step_inputs(&vec![1; b], per, vocab);
                let step = step_items(&toks, &tables, 20);
                let [regs, staged] = logits_off_on(&mut gpu, &step, |g, on| {
                    g.set_tc_staged_tiles(on);
                })?;
                ok &= report_bitwise(
                    &format!("staged small tiles vs registers, decode step of {b}"),
                    &format!("tc_staged_tiles_decode_{b}"),
                    ("registers", &regs),
                    ("staged", &staged),
                    tol,
                    &mut results,
                );
            }
            gpu.set_tc_staged_tiles(!a.dev.no_tc_stage);
        }
        // The mid tensor-core tiles (one 16-token block) against the small tiles (two 8-token
        // blocks, where the small tiles take the bucket) and the wide ones: prefill steps of 9
        // and 16 tokens and decode steps of 9, 12 and 16 sequences, the buckets past the small
        // width that the mid tiles take. Up to TC_MID_TOKENS whatever --tc-mid-max-tokens
        // (these launches are not captured), so that every run of the check compares them.
        let mid_max = gpu.tc_mid_max_tokens();
        let mid_on = |g: &mut GpuModel, on: bool| {
            g.set_tc_mid_max_tokens(if on { bgs_model_gpu::TC_MID_TOKENS } else { 0 });
        };
        let cases: [(&[usize], usize); 5] = [
            (&[4, 5], 0),
            (&[5, 11], 0),
            (&[1; 9], 20),
            (&[1; 12], 20),
            (&[1; 16], 20),
        ];
        for (lens, pos) in cases {
            let (toks, tables) = step_inputs(lens, per, vocab);
            let step = step_items(&toks, &tables, pos);
            let tokens: usize = lens.iter().sum();
            let (what, name) = step_labels(lens, pos);
            if bgs_model_gpu::host::bucket_for(tokens).is_some_and(|n| n <= small_max) {
                let [small, mid] = logits_off_on(&mut gpu, &step, mid_on)?;
                ok &= report_bitwise(
                    &format!("tensor-core mid tiles vs small tiles, {what}"),
                    &format!("tc_mid_tiles_vs_small_{name}"),
                    ("small", &small),
                    ("mid", &mid),
                    tol,
                    &mut results,
                );
            }
            gpu.set_tc_small_tiles(false);
            let wide_mid = logits_off_on(&mut gpu, &step, mid_on);
            gpu.set_tc_small_tiles(true);
            let [wide, mid] = wide_mid?;
            ok &= report_bitwise(
                &format!("tensor-core mid tiles vs wide tiles, {what}"),
                &format!("tc_mid_tiles_vs_wide_{name}"),
                ("wide", &wide),
                ("mid", &mid),
                tol,
                &mut results,
            );
        }
        // The staged mid tiles against the same tiles loading into registers.
        if gpu.set_tc_staged_tiles(true) {
            mid_on(&mut gpu, true);
            let (toks, tables) = step_inputs(&[1; 16], per, vocab);
            let step = step_items(&toks, &tables, 20);
            let [regs, staged] = logits_off_on(&mut gpu, &step, |g, on| {
                g.set_tc_staged_tiles(on);
            })?;
            ok &= report_bitwise(
                "staged mid tiles vs registers, decode step of 16",
                "tc_staged_mid_tiles_decode_16",
                ("registers", &regs),
                ("staged", &staged),
                tol,
                &mut results,
            );
            gpu.set_tc_staged_tiles(!a.dev.no_tc_stage);
        }
        gpu.set_tc_mid_max_tokens(mid_max);
        // The large tensor-core tiles (blocks of 64 rows and 64 tokens, staged through shared
        // memory) against the wide tiles, the small and mid tiles off so that the wide ones
        // take every bucket: prefill steps of 64 tokens (30 + 34) and of 100 (37 + 63: the
        // 128-token bucket, its second token block part padding), decode steps of 64 and of 70
        // sequences (70: the 128-token bucket and an LM head of 128 rows), at the positions of
        // the mid cases. From TC_LARGE_TOKENS whatever --tc-large-min-tokens (these launches
        // are not captured), so that every run of the check compares them.
        let large_min = gpu.tc_large_min_tokens();
        if gpu.set_tc_large_min_tokens(bgs_model_gpu::TC_LARGE_TOKENS) {
            let large_on = |g: &mut GpuModel, on: bool| {
                g.set_tc_large_min_tokens(if on {
                    bgs_model_gpu::TC_LARGE_TOKENS
                } else {
                    0
                });
            };
            let decode_64 = [1; 64];
            let decode_70 = [1; LARGE_SEQS];
            let cases: [(&[usize], usize); 4] = [
                (&[30, 34], 0),
                (&[37, 63], 0),
                (&decode_64, 20),
                (&decode_70, 20),
            ];
            // The large tiles unsplit (the wide tiles where their grid is short of the
            // multiprocessors), and where the model has the split form's scratch (the check
            // builds it so) split over 8 and 3 blocks a tile there: (class groups, what, name).
            let large_split = gpu.tc_large_split();
            let mut forms = vec![(0, "large tiles", "tc_large_tiles")];
            if gpu.set_tc_large_split(CHECK_SPLIT) {
                forms.push((
                    CHECK_SPLIT,
                    "large tiles split in 8",
                    "tc_large_split8_tiles",
                ));
                forms.push((3, "large tiles split in 3", "tc_large_split3_tiles"));
            }
            gpu.set_tc_small_tiles(false);
            gpu.set_tc_mid_max_tokens(0);
            for (lens, pos) in cases {
                let tokens: usize = lens.iter().sum();
                let (what, name) = step_labels(lens, pos);
                if lens.len() > opts.max_seqs || tokens > opts.max_batched_tokens {
                    println!(
                        "[SKIP] tensor-core large tiles vs wide tiles, {what}: the model takes \
                         at most {} sequences and {} tokens a step",
                        opts.max_seqs, opts.max_batched_tokens
                    );
                    continue;
                }
                let (toks, tables) = step_inputs(lens, per, vocab);
                let step = step_items(&toks, &tables, pos);
                for &(groups, form, prefix) in &forms {
                    gpu.set_tc_large_split(groups);
                    let [wide, large] = logits_off_on(&mut gpu, &step, large_on)?;
                    ok &= report_bitwise(
                        &format!("tensor-core {form} vs wide tiles, {what}"),
                        &format!("{prefix}_vs_wide_{name}"),
                        ("wide", &wide),
                        ("large", &large),
                        tol,
                        &mut results,
                    );
                }
            }
            gpu.set_tc_large_split(large_split);
            gpu.set_tc_small_tiles(true);
            gpu.set_tc_mid_max_tokens(mid_max);
        } else {
            println!(
                "[SKIP] tensor-core large tiles vs wide tiles: this device cannot run them (sm_80+ \
                 with {} bytes of shared memory a block)",
                bgs_model_gpu::tc_large_shared_bytes()
            );
        }
        gpu.set_tc_large_min_tokens(large_min);
        gpu.set_use_graphs(graphs).map_err(|e| e.to_string())?;
    }

    // (f) The persistent form against the launched ops: the same bits at every bucket that has
    //     it (decode steps of b sequences at position 20 over whatever their blocks hold; the
    //     two runs see the same cache, since each writes the same K/V).
    for b in gpu.persistent_buckets() {
        if b > 33 {
            continue;
        }
        let (toks, tables) = step_inputs(&vec![1; b], per, vocab);
        let items = step_items(&toks, &tables, 20);
        let [launched, persistent] = logits_off_on(&mut gpu, &items, |m, on| {
            m.set_persistent(on);
        })?;
        ok &= report_bitwise(
            &format!("persistent form vs launched ops, decode step of {b}"),
            &format!("persistent_vs_launched_{b}"),
            ("launched", &launched),
            ("persistent", &persistent),
            tol,
            &mut results,
        );
    }

    // (b) Greedy tokens, CPU vs GPU, 1 and 8 concurrent sequences (chunked prefill).
    for n in [1usize, 8] {
        let prompts: Vec<Vec<u32>> = (0..n).map(|i| prompt(&mut rng, vocab, 3 + 9 * i)).collect();
        let t = std::time::Instant::now();
        let want = generate(&mut cpu, &prompts, steps, 16, per)?;
        let cpu_s = t.elapsed().as_secs_f64();
        let got = generate(&mut gpu, &prompts, steps, 16, per)?;
        let div: Vec<Option<usize>> = want
            .iter()
            .zip(&got)
            .map(|(w, g)| first_divergence(w, g))
            .collect();
        let equal = div.iter().filter(|d| d.is_none()).count();
        let first = div.iter().flatten().min().copied();
        let pass = !exact || equal == n;
        ok &= pass;
        let where_ = match div.iter().position(|d| d.is_some()) {
            Some(s) => format!(
                "; first divergence: sequence {s} at step {} (cpu {}, gpu {})",
                div[s].unwrap_or(0),
                want[s].get(div[s].unwrap_or(0)).copied().unwrap_or(0),
                got[s].get(div[s].unwrap_or(0)).copied().unwrap_or(0)
            ),
            None => String::new(),
        };
        println!(
            "[{}] greedy {steps} steps, {n} sequence(s), prompts 3..{} tokens, chunks of 16: \
             {equal}/{n} equal to the CPU oracle{where_}{} (cpu {cpu_s:.1} s)",
            if !exact {
                "INFO"
            } else if pass {
                "PASS"
            } else {
                "FAIL"
            },
            3 + 9 * (n - 1),
            if exact {
                ""
            } else {
                " (f16/bf16: reported, not failed)"
            },
        );
        results.push(json!({
            "check": format!("greedy_{n}"), "pass": pass, "steps": steps, "sequences": n,
            "equal": equal, "first_divergence_step": first,
            "divergence_per_sequence": div, "exact_required": exact,
        }));
    }

    // (c) Batch invariance on the GPU: each of 33 sequences alone vs all 33 together.
    {
        let n = 33;
        let prompts: Vec<Vec<u32>> = (0..n).map(|i| prompt(&mut rng, vocab, 1 + 7 * i)).collect();
        let together = generate(&mut gpu, &prompts, inv_steps, 8, per)?;
        let mut equal = 0;
        let mut diverged = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let alone = generate(&mut gpu, std::slice::from_ref(p), inv_steps, 8, per)?;
            match first_divergence(&alone[0], &together[i]) {
                None => equal += 1,
                Some(s) => diverged.push(json!({"sequence": i, "step": s})),
            }
        }
        println!(
            "[INFO] batch invariance, {inv_steps} steps: {equal}/{n} sequences give the same \
             tokens alone as in a batch of {n}{}",
            if diverged.is_empty() {
                String::new()
            } else {
                format!("; first divergences {diverged:?}")
            }
        );
        results.push(json!({
            "check": "batch_invariance", "pass": true, "steps": inv_steps, "sequences": n,
            "equal": equal, "diverged": diverged,
        }));
    }

    let v = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "model": name, "dtype": a.dtype.name(), "device": dev_name,
        "graphs": !a.dev.no_graphs, "invariant_gemm": a.dev.invariant_gemm,
        "fused_max_tokens": a.dev.fused_max_tokens, "pdl": !a.dev.no_pdl,
        "tc_epilogues": !a.dev.no_tc_epilogues,
        "tc_fold_max_tokens": a.dev.tc_fold_max_tokens,
        "tc_small_max_tokens": a.dev.tc_small_max_tokens,
        "tc_mid_max_tokens": a.dev.tc_mid_max_tokens,
        "tc_large_min_tokens": a.dev.tc_large_min_tokens,
        // (As built: the check takes at least 8.)
        "tc_large_split": gpu.tc_large_split(),
        "tc_staged_tiles": !a.dev.no_tc_stage,
        "tc_stage_min_rounds": a.dev.tc_stage_min_rounds,
        "tc_stage_waves": !a.dev.no_tc_stage_waves,
        "attention_warps": a.dev.attention_warps,
        "tensor_core_attention": gpu.tensor_core_attention(),
        "persistent_buckets": gpu.persistent_buckets(),
        "persistent_launch": gpu.persistent_launch(),
        "persistent_prefetch": a.dev.persistent_prefetch,
        "persistent_blocks_per_sm": a.dev.persistent_blocks_per_sm,
        "pass": ok, "checks": results,
    });
    write_json(&a.json, &v)?;
    println!(
        "{}",
        if ok {
            "all checks passed"
        } else {
            "CHECKS FAILED"
        }
    );
    Ok(ok)
}

/// How two sets of logits (one row per prompt) differ, relative to each row's max |logit|.
#[derive(Debug)]
struct LogitDiff {
    worst: f64,
    worst_at: (usize, usize),
    worst_values: (f32, f32),
    /// The first (prompt, token id) over the tolerance, in row order, and its values.
    first_over: Option<((usize, usize), (f32, f32))>,
    argmax_equal: usize,
    rows: usize,
}

fn compare_logits(want: &[Vec<f32>], got: &[Vec<f32>], tol: f64) -> LogitDiff {
    let mut d = LogitDiff {
        worst: 0.0,
        worst_at: (0, 0),
        worst_values: (0.0, 0.0),
        first_over: None,
        argmax_equal: 0,
        rows: want.len(),
    };
    if want.len() != got.len() {
        d.worst = f64::INFINITY;
        return d;
    }
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        if w.len() != g.len() {
            d.worst = f64::INFINITY;
            d.worst_at = (i, 0);
            continue;
        }
        let scale = w
            .iter()
            .fold(0f32, |m, x| m.max(x.abs()))
            .max(f32::MIN_POSITIVE);
        for (j, (x, y)) in w.iter().zip(g).enumerate() {
            let r = f64::from((x - y).abs() / scale);
            // A NaN on either side is the worst possible difference.
            let r = if r.is_nan() { f64::INFINITY } else { r };
            if r > d.worst {
                d.worst = r;
                d.worst_at = (i, j);
                d.worst_values = (*x, *y);
            }
            if r > tol && d.first_over.is_none() {
                d.first_over = Some(((i, j), (*x, *y)));
            }
        }
        if argmax(w) == argmax(g) {
            d.argmax_equal += 1;
        }
    }
    d
}

impl LogitDiff {
    fn describe(&self, tol: f64, a: &str, b: &str) -> String {
        let (i, j) = self.worst_at;
        let mut s = format!(
            "max |diff| / max |logit| = {:.3e} (tolerance {tol:.0e}) at prompt {i} token id {j} \
             ({a} {}, {b} {}); argmax equal for {}/{}",
            self.worst, self.worst_values.0, self.worst_values.1, self.argmax_equal, self.rows
        );
        if let Some(((i, j), (x, y))) = self.first_over {
            s += &format!("; first over tolerance: prompt {i} token id {j} ({a} {x}, {b} {y})");
        }
        s
    }

    fn json(&self, check: &str, pass: bool, tol: f64) -> Value {
        json!({
            "check": check, "pass": pass, "max_rel_diff": self.worst, "tolerance": tol,
            "worst_prompt": self.worst_at.0, "worst_token_id": self.worst_at.1,
            "worst_values": [self.worst_values.0, self.worst_values.1],
            "first_over_tolerance": self.first_over.map(|((i, j), (x, y))| json!({
                "prompt": i, "token_id": j, "values": [x, y]})),
            "argmax_equal": self.argmax_equal, "prompts": self.rows,
        })
    }
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    let mut bv = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x > bv {
            bv = x;
            best = i;
        }
    }
    best
}

/// A check step's owned inputs for sequences of `lens` tokens: sequence i's tokens are
/// (7 + 13 i + 31 j) mod vocab and its block table the `per` blocks from i · per.
fn step_inputs(lens: &[usize], per: usize, vocab: usize) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let toks = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n)
                .map(|j| ((7 + 13 * i + 31 * j) % vocab) as u32)
                .collect()
        })
        .collect();
    let tables = (0..lens.len())
        .map(|i| ((i * per) as u32..((i + 1) * per) as u32).collect())
        .collect();
    (toks, tables)
}

/// The step of `step_inputs` at position `pos`, every sequence sampled.
fn step_items<'a>(toks: &'a [Vec<u32>], tables: &'a [Vec<u32>], pos: usize) -> Vec<StepItem<'a>> {
    toks.iter()
        .zip(tables)
        .map(|(t, b)| StepItem {
            tokens: t,
            pos,
            blocks: b,
            sample: true,
        })
        .collect()
}

/// The logits of `step` with an option of the model off, then on (`set`), left on.
fn logits_off_on(
    gpu: &mut GpuModel,
    step: &[StepItem<'_>],
    set: impl Fn(&mut GpuModel, bool),
) -> Result<[Vec<Vec<f32>>; 2], String> {
    set(gpu, false);
    let off = gpu.step_logits(step).map_err(|e| e.to_string());
    set(gpu, true);
    let on = gpu.step_logits(step).map_err(|e| e.to_string());
    Ok([off?, on?])
}

/// Print and record (as `name`, with `bitwise_equal`) whether `got` is bit for bit `want`;
/// returns whether it is.
fn report_bitwise(
    title: &str,
    name: &str,
    (want_label, want): (&str, &[Vec<f32>]),
    (got_label, got): (&str, &[Vec<f32>]),
    tol: f64,
    results: &mut Vec<Value>,
) -> bool {
    let bitwise = bitwise_equal(want, got);
    let d = compare_logits(want, got, tol);
    println!(
        "[{}] {title}: {} ({})",
        if bitwise { "PASS" } else { "FAIL" },
        d.describe(tol, want_label, got_label),
        if bitwise {
            "bitwise equal"
        } else {
            "NOT bitwise equal"
        },
    );
    let mut j = d.json(name, bitwise, tol);
    j["bitwise_equal"] = json!(bitwise);
    results.push(j);
    bitwise
}

/// Whether two sets of logits are the same bits (rows and lengths included; a NaN equals
/// only the same NaN).
fn bitwise_equal(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

/// Print a step's time per operation (`(name, count, ms per step)`) under `title`, timed as
/// `basis` says, and return it as JSON rows.
fn print_ops(title: &str, basis: &str, ops: &[(String, usize, f64)]) -> Vec<Value> {
    let total: f64 = ops.iter().map(|o| o.2).sum();
    println!("  {title} ({basis} ms per step, {total:.4} in all):");
    for (name, n, ms) in ops {
        println!(
            "    {name:<24} x{n:<4} {ms:.4} ms ({:.1}%, {:.2} us each)",
            100.0 * ms / total.max(1e-12),
            1e3 * ms / *n as f64
        );
    }
    ops.iter()
        .map(|(name, n, ms)| json!({"op": name, "launches": n, "ms": ms}))
        .collect()
}

/// Median and 90th percentile of `v` (sorted in place).
fn median_p90(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.9))
}

fn bench(a: BenchArgs) -> Result<bool, String> {
    if a.batches.is_empty() || a.batches.iter().any(|&b| b == 0 || b > 512) {
        return Err(format!(
            "--batches must be 1..=512 each, got {:?}",
            a.batches
        ));
    }
    if a.iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    let bs = 16;
    let max_batch = *a.batches.iter().max().unwrap_or(&1);
    let (cfg, weights) = synth_weights(a.arch, a.seed, DType::F32);
    if a.context + 1 > cfg.max_position_embeddings {
        return Err(format!(
            "--context {} exceeds the model's {} positions",
            a.context, cfg.max_position_embeddings
        ));
    }
    let per = (a.context + 1).div_ceil(bs);
    let prefill_blocks = 512usize.div_ceil(bs);
    let mut opts = options(&a.dev, a.dtype);
    opts.block_size = bs;
    opts.num_blocks = Some((max_batch * per).max(prefill_blocks));
    opts.max_seqs = max_batch;
    let t0 = std::time::Instant::now();
    let mut m = GpuModel::new(cfg.clone(), &weights, &opts).map_err(|e| e.to_string())?;
    drop(weights);
    let (dev_name, _) = m.device();
    let dev_name = dev_name.to_string();
    println!(
        "{} {}{} on {dev_name}: weights {:.3} GB, ready in {:.1} s",
        a.arch.name(),
        a.dtype.name(),
        if a.dev.invariant_gemm {
            " (invariant GEMMs)"
        } else {
            ""
        },
        m.weight_bytes() as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    let bw = m
        .copy_bandwidth(a.copy_bytes, 5)
        .map_err(|e| e.to_string())?;
    println!(
        "device copy bandwidth: {:.2} TB/s (read + write, {} MB copied)",
        bw / 1e12,
        a.copy_bytes / 1_000_000
    );
    let mut barrier = Value::Null;
    if let Some(l) = m.persistent_launch() {
        println!("persistent form: {l}, buckets {:?}", m.persistent_buckets());
        // What the grid barriers cost alone: a launch of 1 and of 201 ops that do nothing.
        let one = m.persistent_barrier_ms(1, 50).map_err(|e| e.to_string())?;
        let many = m
            .persistent_barrier_ms(201, 50)
            .map_err(|e| e.to_string())?;
        let each_us = (many - one) * 1e3 / 200.0;
        println!(
            "persistent barriers: a launch of 1 op {one:.4} ms, of 201 ops {many:.4} ms: \
             {each_us:.2} us a barrier"
        );
        barrier = json!({"one_op_ms": one, "ops_201_ms": many, "per_barrier_us": each_us});
    }
    let mut rows = Vec::new();
    println!("| batch | step median ms | p90 ms | tokens/s | floor ms | step / floor |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for &b in &a.batches {
        let tables: Vec<Vec<u32>> = (0..b)
            .map(|i| ((i * per) as u32..((i + 1) * per) as u32).collect())
            .collect();
        let toks: Vec<[u32; 1]> = (0..b).map(|i| [(i % cfg.vocab_size) as u32]).collect();
        let items: Vec<StepItem<'_>> = (0..b)
            .map(|i| StepItem {
                tokens: &toks[i],
                pos: a.context,
                blocks: &tables[i],
                sample: true,
            })
            .collect();
        // The launched ops, then the persistent form where the bucket has one (the row's step
        // is then the persistent one: the form the model replays while it is on).
        let has_persistent =
            bgs_model_gpu::host::bucket_for(b).is_some_and(|k| m.persistent_buckets().contains(&k));
        m.set_persistent(false);
        let mut t = m
            .time_steps(&items, a.warmup, a.iters)
            .map_err(|e| e.to_string())?;
        let (launched_med, launched_p90) = median_p90(&mut t);
        m.set_persistent(true);
        let persistent = if has_persistent {
            let mut t = m
                .time_steps(&items, a.warmup, a.iters)
                .map_err(|e| e.to_string())?;
            Some(median_p90(&mut t))
        } else {
            None
        };
        let (med, p90) = match persistent {
            Some((pm, pp)) => {
                println!(
                    "  batch {b}: launched ops {launched_med:.4} ms, persistent form {pm:.4} ms"
                );
                (pm, pp)
            }
            None => (launched_med, launched_p90),
        };
        let floor_bytes = m.weight_bytes() + b * (a.context + 1) * m.kv_bytes_per_position();
        let floor_ms = floor_bytes as f64 / bw * 1e3;
        let tps = b as f64 / (med / 1e3);
        println!(
            "| {b} | {med:.4} | {p90:.4} | {tps:.0} | {floor_ms:.4} | {:.2} |",
            med / floor_ms
        );
        let per_op = if a.per_op {
            let ops = m
                .profile_ops(&items, a.iters.min(50))
                .map_err(|e| e.to_string())?;
            print_ops(&format!("per operation at batch {b}"), "device", &ops)
        } else {
            Vec::new()
        };
        let persistent_ops = if a.per_op && has_persistent {
            let ops = m
                .profile_persistent(&items, a.iters.min(50))
                .map_err(|e| e.to_string())?;
            print_ops(
                &format!("persistent form at batch {b}, per kernel"),
                "block 0's op starts,",
                &ops,
            )
        } else {
            Vec::new()
        };
        rows.push(json!({
            "batch": b, "context": a.context, "step_ms_median": med, "step_ms_p90": p90,
            "tokens_per_s": tps, "floor_bytes": floor_bytes, "floor_ms": floor_ms,
            "step_over_floor": med / floor_ms, "per_op": per_op,
            "launched_ms_median": launched_med, "launched_ms_p90": launched_p90,
            "persistent_ms_median": persistent.map(|p| p.0),
            "persistent_ms_p90": persistent.map(|p| p.1),
            "persistent_per_op": persistent_ops,
        }));
    }
    let prefill = {
        let toks: Vec<u32> = (0..512).map(|i| (i % cfg.vocab_size) as u32).collect();
        let table: Vec<u32> = (0..prefill_blocks as u32).collect();
        let items = [StepItem {
            tokens: &toks,
            pos: 0,
            blocks: &table,
            sample: true,
        }];
        let mut t = m
            .time_steps(&items, a.warmup.min(5), a.iters.min(50))
            .map_err(|e| e.to_string())?;
        let (med, p90) = median_p90(&mut t);
        let tps = 512.0 / (med / 1e3);
        println!(
            "prefill, one 512-token chunk: {med:.3} ms median ({p90:.3} p90), {tps:.0} tokens/s"
        );
        json!({"tokens": 512, "step_ms_median": med, "step_ms_p90": p90, "tokens_per_s": tps})
    };
    let v = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "arch": a.arch.name(), "dtype": a.dtype.name(), "device": dev_name,
        "graphs": !a.dev.no_graphs, "invariant_gemm": a.dev.invariant_gemm,
        "fused_max_tokens": a.dev.fused_max_tokens, "pdl": !a.dev.no_pdl,
        "tc_epilogues": !a.dev.no_tc_epilogues,
        "tc_fold_max_tokens": a.dev.tc_fold_max_tokens,
        "tc_small_max_tokens": a.dev.tc_small_max_tokens,
        "tc_mid_max_tokens": a.dev.tc_mid_max_tokens,
        "tc_large_min_tokens": a.dev.tc_large_min_tokens,
        "tc_large_split": m.tc_large_split(),
        "tc_staged_tiles": !a.dev.no_tc_stage,
        "tc_stage_min_rounds": a.dev.tc_stage_min_rounds,
        "tc_stage_waves": !a.dev.no_tc_stage_waves,
        "attention_warps": a.dev.attention_warps,
        "tensor_core_attention": m.tensor_core_attention(),
        "persistent_buckets": m.persistent_buckets(),
        "persistent_launch": m.persistent_launch(),
        "persistent_barrier": barrier,
        "persistent_prefetch": a.dev.persistent_prefetch,
        "persistent_blocks_per_sm": a.dev.persistent_blocks_per_sm,
        "weight_bytes": m.weight_bytes(),
        "kv_bytes_per_position": m.kv_bytes_per_position(),
        "copy_bandwidth_bytes_per_s": bw, "decode": rows, "prefill": prefill,
        "iters": a.iters, "warmup": a.warmup,
    });
    write_json(&a.json, &v)?;
    Ok(true)
}

/// One prompt of a transformers reference.
#[derive(serde::Deserialize)]
struct HfPrompt {
    prompt: Vec<u32>,
    logits: Vec<f32>,
    tokens: Vec<u32>,
}

#[derive(serde::Deserialize)]
struct HfReference {
    dtype: String,
    transformers: String,
    results: Vec<HfPrompt>,
}

/// Each reference prompt alone: the logits of its last position after the prefill, then as
/// many greedy tokens as the reference has. The logits must be within the dtype's tolerance
/// (f32: 1e-3, f16/bf16: 5e-2 of the largest |logit|: transformers keeps the residual stream
/// in the dtype, this model in f32); tokens are reported (first divergence), since a near tie
/// may go either way under a different summation order.
fn hf(a: HfArgs) -> Result<bool, String> {
    let text = std::fs::read_to_string(&a.reference)
        .map_err(|e| format!("reading {}: {e}", a.reference.display()))?;
    let r: HfReference = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a reference file: {e}", a.reference.display()))?;
    if r.dtype != a.dtype.name() && !(r.dtype == "f16" && a.dtype == GpuDtype::F16) {
        eprintln!(
            "note: the reference was computed in {}, the GPU model runs in {}",
            r.dtype,
            a.dtype.name()
        );
    }
    let ck = bgs_model::load(&a.model).map_err(|e| e.to_string())?;
    let (cfg, weights) = (ck.config, ck.weights);
    let bs = 16;
    let longest = r
        .results
        .iter()
        .map(|p| p.prompt.len() + p.tokens.len() + 1)
        .max()
        .ok_or("the reference has no prompts")?;
    let per = longest.div_ceil(bs);
    let mut opts = options(&a.dev, a.dtype);
    opts.block_size = bs;
    opts.num_blocks = Some(per);
    opts.max_seqs = 1;
    let mut gpu = GpuModel::new(cfg.clone(), &weights, &opts).map_err(|e| e.to_string())?;
    drop(weights);
    let tol = match a.dtype {
        GpuDtype::F32 => 1e-3,
        GpuDtype::F16 | GpuDtype::Bf16 => 5e-2,
    };
    let table: Vec<u32> = (0..per as u32).collect();
    let (mut want, mut got) = (Vec::new(), Vec::new());
    let mut per_prompt = Vec::new();
    for (i, p) in r.results.iter().enumerate() {
        if p.logits.len() != cfg.vocab_size {
            return Err(format!(
                "prompt {i}: the reference has {} logits, the model's vocabulary is {}",
                p.logits.len(),
                cfg.vocab_size
            ));
        }
        let item = [StepItem {
            tokens: &p.prompt,
            pos: 0,
            blocks: &table,
            sample: true,
        }];
        let logits = gpu.step_logits(&item).map_err(|e| e.to_string())?.remove(0);
        let mut tokens = vec![argmax(&logits) as u32];
        while tokens.len() < p.tokens.len() {
            let last = [*tokens.last().expect("one token")];
            let item = [StepItem {
                tokens: &last,
                pos: p.prompt.len() + tokens.len() - 1,
                blocks: &table,
                sample: true,
            }];
            let mut next = [0u32];
            StepModel::step(&mut gpu, &item, &mut next)?;
            tokens.push(next[0]);
        }
        let div = first_divergence(&p.tokens, &tokens);
        println!(
            "prompt {i} ({} tokens): greedy tokens {} (of {})",
            p.prompt.len(),
            match div {
                None => "equal".to_string(),
                Some(s) => format!(
                    "diverge at step {s} (transformers {}, ours {})",
                    p.tokens[s], tokens[s]
                ),
            },
            p.tokens.len()
        );
        per_prompt.push(
            json!({"prompt_tokens": p.prompt.len(), "steps": p.tokens.len(),
            "first_divergence": div}),
        );
        want.push(p.logits.clone());
        got.push(logits);
    }
    let d = compare_logits(&want, &got, tol);
    let pass = d.worst <= tol;
    println!(
        "logits: {} -> {}",
        d.describe(tol, "transformers", "gpu"),
        if pass { "ok" } else { "FAILED" }
    );
    let v = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "model": a.model.display().to_string(), "dtype": a.dtype.name(),
        "reference_dtype": r.dtype, "transformers": r.transformers,
        "max_rel_diff": d.worst, "tolerance": tol, "argmax_equal": d.argmax_equal,
        "prompts": per_prompt, "pass": pass,
    });
    write_json(&a.json, &v)?;
    Ok(pass)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divergence_and_percentiles() {
        assert_eq!(first_divergence(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_divergence(&[1, 2, 3], &[1, 5, 3]), Some(1));
        assert_eq!(first_divergence(&[1, 2], &[1, 2, 3]), Some(2));
        let mut v = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(median_p90(&mut v), (3.0, 5.0));
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN]), 1);
        let w = vec![vec![1.0, -4.0, 2.0], vec![0.5, 0.25, 0.0]];
        let g = vec![vec![1.0, -4.0, 2.0], vec![0.5, 0.3, f32::NAN]];
        let d = compare_logits(&w, &g, 0.05);
        assert_eq!(d.worst, f64::INFINITY);
        assert_eq!(d.worst_at, (1, 2));
        // 0.05 / 0.5 = 0.1 > 0.05: the first over the tolerance is (1, 1).
        assert_eq!(d.first_over.map(|f| f.0), Some((1, 1)));
        assert_eq!(d.argmax_equal, 2);
        let text = d.describe(0.05, "cpu", "gpu");
        assert!(
            text.contains("first over tolerance: prompt 1 token id 1"),
            "{text}"
        );
        assert_eq!(compare_logits(&w, &w, 0.0).worst, 0.0);
    }

    #[test]
    fn generate_chunks_prefill_and_mixes_decode() {
        // The CPU oracle through the same driver: one chunked and one short prompt.
        let (cfg, w) = synth_weights(SynthArch::TinyLlama, 3, DType::F32);
        let mut cpu = CpuModel::new(
            cfg,
            w,
            KvConfig {
                block_size: 4,
                num_blocks: 16,
            },
            1,
        )
        .unwrap();
        let prompts = vec![vec![1u32, 2, 3, 4, 5, 6, 7], vec![9u32]];
        let chunked = generate(&mut cpu, &prompts, 5, 3, 8).unwrap();
        let whole = generate(&mut cpu, &prompts, 5, 64, 8).unwrap();
        assert_eq!(chunked.len(), 2);
        assert!(chunked.iter().all(|o| o.len() == 5));
        // Chunking does not change the CPU oracle's tokens.
        assert_eq!(chunked, whole);
        let alone = generate(&mut cpu, &prompts[..1], 5, 3, 8).unwrap();
        assert_eq!(alone[0], chunked[0]);
        let e = generate(&mut cpu, &prompts, 50, 3, 2).unwrap_err();
        assert!(e.contains("blocks cannot hold"), "{e}");
    }

    #[test]
    fn rounding_weights_reaches_every_matrix() {
        let (_, mut w) = synth_weights(SynthArch::TinyQwen2, 3, DType::F32);
        round_weights(&mut w, GpuDtype::Bf16);
        let rounded = |t: &Tensor| t.data.iter().all(|&x| GpuDtype::Bf16.round(x) == x);
        assert!(rounded(&w.embed));
        assert!(rounded(&w.layers[1].down_proj));
        assert!(rounded(&w.layers[0].q_proj));
    }
}
