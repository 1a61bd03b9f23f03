//! Greedy generation on the CPU, our forward pass beside candle-transformers' on the same
//! weights in the same process: time to first token (the prompt's prefill), decode tokens/s
//! and process CPU per generated token, at several batch sizes. Prints a table and one JSON
//! object per line (for `bench/generate_cpu.sh`); asserts nothing.
//!
//! `cargo bench -p bgs-model --bench generate_vs_candle`; env:
//! - `BGS_BENCH_MODEL`: a checkpoint (GGUF file or Hugging Face directory); default: the
//!   synthetic tiny-llama, built in memory;
//! - `BGS_BENCH_THREADS` (default: the CPUs this process may use) for our model; candle uses
//!   its own thread pool (`RAYON_NUM_THREADS`, printed);
//! - `BGS_BENCH_BATCHES` (default `1,4,16`), `BGS_BENCH_PROMPT` (default 16 tokens),
//!   `BGS_BENCH_STEPS` (decode steps, default 32).
//!
//! Both models run in f32 on the same dequantized weights. Every sequence of a batch has
//! the same prompt length and position, which is what candle's batched forward needs.

#[path = "../tests/candle_ref/mod.rs"]
mod candle_ref;

use std::time::Instant;

use bgs_model::{CpuModel, KvConfig, ModelConfig, StepItem, Weights};
use candle_ref::{Oracle, argmax};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU time of this process (all threads), seconds.
fn cpu_now() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// One measurement: prefill of every prompt (time to first token), then `steps` decode
/// steps of the whole batch.
#[derive(Debug)]
struct Run {
    ttft_s: f64,
    decode_tok_s: f64,
    cpu_per_token_s: f64,
    first_tokens: Vec<u32>,
}

fn prompts(batch: usize, len: usize, vocab: usize) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| {
            (0..len)
                .map(|k| ((b * 7919 + k * 104_729 + 13) % vocab.min(256)) as u32)
                .collect()
        })
        .collect()
}

fn ours(
    cfg: &ModelConfig,
    w: &Weights,
    threads: usize,
    batch: usize,
    plen: usize,
    steps: usize,
) -> Run {
    let block_size = 16;
    let per_seq = (plen + steps + 1).div_ceil(block_size);
    let kv = KvConfig {
        block_size,
        num_blocks: per_seq * batch,
    };
    let mut m = CpuModel::new(cfg.clone(), w.clone(), kv, threads).unwrap();
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|j| ((j * per_seq) as u32..((j + 1) * per_seq) as u32).collect())
        .collect();
    let ps = prompts(batch, plen, cfg.vocab_size);
    let items: Vec<StepItem<'_>> = ps
        .iter()
        .zip(&tables)
        .map(|(p, b)| StepItem {
            tokens: p,
            pos: 0,
            blocks: b,
            sample: true,
        })
        .collect();
    let mut next = vec![0u32; batch];
    let t0 = Instant::now();
    m.step(&items, &mut next).unwrap();
    let ttft_s = t0.elapsed().as_secs_f64();
    let mut first_tokens = next.clone();
    let (t0, c0) = (Instant::now(), cpu_now());
    for s in 0..steps {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let items: Vec<StepItem<'_>> = (0..batch)
            .map(|j| StepItem {
                tokens: &toks[j],
                pos: plen + s,
                blocks: &tables[j],
                sample: true,
            })
            .collect();
        m.step(&items, &mut next).unwrap();
        if s == 0 {
            first_tokens.extend_from_slice(&next);
        }
    }
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_now() - c0);
    let n = (batch * steps) as f64;
    Run {
        ttft_s,
        decode_tok_s: n / wall,
        cpu_per_token_s: cpu / n,
        first_tokens,
    }
}

fn candle(cfg: &ModelConfig, w: &Weights, batch: usize, plen: usize, steps: usize) -> Run {
    let mut m = Oracle::new(cfg, w);
    let ps = prompts(batch, plen, cfg.vocab_size);
    let flat: Vec<u32> = ps.concat();
    let t0 = Instant::now();
    let logits = m.forward_batch(&flat, batch, 0);
    let ttft_s = t0.elapsed().as_secs_f64();
    let mut next: Vec<u32> = logits.iter().map(|l| argmax(l)).collect();
    let mut first_tokens = next.clone();
    let (t0, c0) = (Instant::now(), cpu_now());
    for s in 0..steps {
        let logits = m.forward_batch(&next, batch, plen + s);
        next = logits.iter().map(|l| argmax(l)).collect();
        if s == 0 {
            first_tokens.extend_from_slice(&next);
        }
    }
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_now() - c0);
    let n = (batch * steps) as f64;
    Run {
        ttft_s,
        decode_tok_s: n / wall,
        cpu_per_token_s: cpu / n,
        first_tokens,
    }
}

fn main() {
    let (name, cfg, w) = match std::env::var("BGS_BENCH_MODEL") {
        Ok(p) if !p.is_empty() => {
            let ck = bgs_model::load(std::path::Path::new(&p)).expect("BGS_BENCH_MODEL");
            (ck.name, ck.config, ck.weights)
        }
        _ => {
            let (c, w) = bgs_model::synth::synth_weights(
                bgs_model::SynthArch::TinyLlama,
                1,
                bgs_model::DType::F32,
            );
            ("tiny-llama (synthetic)".to_string(), c, w)
        }
    };
    let threads = env_usize(
        "BGS_BENCH_THREADS",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let plen = env_usize("BGS_BENCH_PROMPT", 16);
    let steps = env_usize("BGS_BENCH_STEPS", 32);
    let batches: Vec<usize> = std::env::var("BGS_BENCH_BATCHES")
        .unwrap_or_else(|_| "1,4,16".into())
        .split(',')
        .filter_map(|b| b.trim().parse().ok())
        .collect();
    let candle_threads = candle_core::utils::get_num_threads();
    eprintln!(
        "model {name}: {} layers, hidden {}, vocab {}; prompt {plen}, {steps} decode steps; \
         ours {threads} threads, candle {candle_threads} threads",
        cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    );
    eprintln!(
        "{:<7} {:>5} {:>10} {:>12} {:>14}  same first tokens",
        "impl", "batch", "ttft ms", "decode tok/s", "cpu us/token"
    );
    for &batch in &batches {
        let a = ours(&cfg, &w, threads, batch, plen, steps);
        let b = candle(&cfg, &w, batch, plen, steps);
        let same = a.first_tokens == b.first_tokens;
        for (who, r, t) in [("bgs", &a, threads), ("candle", &b, candle_threads)] {
            eprintln!(
                "{who:<7} {batch:>5} {:>10.2} {:>12.1} {:>14.1}  {same}",
                r.ttft_s * 1e3,
                r.decode_tok_s,
                r.cpu_per_token_s * 1e6
            );
            println!(
                "{}",
                serde_json::json!({
                    "impl": who, "model": name, "batch": batch, "threads": t,
                    "prompt_tokens": plen, "decode_steps": steps,
                    "ttft_ms": r.ttft_s * 1e3, "decode_tokens_per_s": r.decode_tok_s,
                    "cpu_us_per_token": r.cpu_per_token_s * 1e6,
                    "first_tokens_equal": same,
                })
            );
        }
    }
}
