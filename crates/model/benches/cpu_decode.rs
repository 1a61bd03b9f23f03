//! Decode throughput of the CPU forward pass (prints numbers; asserts nothing).
//!
//! `cargo bench -p bgs-model --bench cpu_decode` (env `BGS_BENCH_THREADS`, default 2;
//! `BGS_BENCH_STEPS`, default 8 for the SmolLM2 shape and 64 for tiny).

#[path = "../tests/cpu_common/mod.rs"]
mod cpu_common;

use std::time::Instant;

use bgs_model::{Arch, CpuModel, KvConfig, ModelConfig, StepItem};
use cpu_common::{Rng, random_tokens, random_weights, smollm2_135m_config, tiny_config};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn bench(name: &str, cfg: &ModelConfig, threads: usize, batch: usize, steps: usize) {
    let prompt_len = 32;
    let block_size = 16;
    let per_seq = (prompt_len + steps).div_ceil(block_size);
    let kv = KvConfig {
        block_size,
        num_blocks: per_seq * batch,
    };
    let mut m = CpuModel::new(cfg.clone(), random_weights(cfg, 1), kv, threads).unwrap();
    let mut rng = Rng::new(2);
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|j| ((j * per_seq) as u32..((j + 1) * per_seq) as u32).collect())
        .collect();
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|_| random_tokens(&mut rng, prompt_len, cfg.vocab_size))
        .collect();
    let items: Vec<StepItem<'_>> = prompts
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
    let prefill = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for s in 0..steps {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let items: Vec<StepItem<'_>> = (0..batch)
            .map(|j| StepItem {
                tokens: &toks[j],
                pos: prompt_len + s,
                blocks: &tables[j],
                sample: true,
            })
            .collect();
        m.step(&items, &mut next).unwrap();
    }
    let dt = t0.elapsed().as_secs_f64();
    println!(
        "{name:>14} threads {threads} batch {batch:>2}: decode {:8.1} tok/s ({:7.2} ms/step), prefill {:8.1} tok/s",
        (batch * steps) as f64 / dt,
        dt * 1e3 / steps as f64,
        (batch * prompt_len) as f64 / prefill,
    );
}

fn main() {
    let threads = env("BGS_BENCH_THREADS", 2);
    let tiny = tiny_config(Arch::Qwen2, true, 3);
    let smol = smollm2_135m_config();
    for batch in [1, 16] {
        bench("tiny", &tiny, threads, batch, env("BGS_BENCH_STEPS", 64));
    }
    for batch in [1, 16] {
        bench(
            "smollm2-135m",
            &smol,
            threads,
            batch,
            env("BGS_BENCH_STEPS", 8),
        );
    }
}
