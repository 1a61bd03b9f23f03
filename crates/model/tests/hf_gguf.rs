//! The real SmolLM2-135M-Instruct GGUF through our loader and CPU oracle, against Hugging Face
//! transformers loading the same GGUF file itself (issue 9, part 5).
//!
//! transformers dequantizes the GGUF with the `gguf` package, undoes llama.cpp's q/k row
//! permutation and reads the config from the metadata on its own, so unlike
//! `oracle_candle.rs` (candle fed *our* dequantized weights) this catches loader bugs too.
//!
//! A manual check: the reference is computed by `bench/cpu/gguf_hf_reference.py` (torch +
//! transformers, installed under `target/` by `bench/cpu/gguf-vs-hf.sh`, which runs all of it).
//! The test runs when `BGS_SMOLLM2_HF_JSON` names that JSON and otherwise prints a skip notice
//! and passes, under CI too (CI does not install torch). The GGUF is the reference's `model`
//! unless `BGS_SMOLLM2_GGUF` names it; `BGS_SMOLLM2_HF_OUT`, when set, receives the measured
//! differences as JSON.
//!
//! What is compared, per prompt, both sides f32:
//! - prefill (the whole prompt in one step): all logits of the last position;
//! - the prompt fed one token at a time (the decode path): at every position, the logits of
//!   the reference's `--top` largest token ids;
//! - greedy decoding, teacher-forced with the reference's tokens (so a near tie that went the
//!   other way does not end the comparison): after each token the logits of the reference's
//!   top ids, and our argmax must equal the reference's next token.
//!
//! Tolerance: `max |ours - theirs| <= REL_TOL * max(1, max |theirs|)` over each compared row
//! (the same measure as `oracle_candle.rs`). A greedy token may differ only where the
//! reference's top two logits are within twice that bound (a near tie that summation order can
//! flip); such steps are counted and reported, any other difference fails.

use std::path::{Path, PathBuf};

use bgs_model::{CpuModel, KvConfig, StepItem};
use serde::Deserialize;
use serde_json::json;

/// Relative logit tolerance (see the module docs). Both sides are f32; what remains is
/// summation order (ours: 16 partial sums; torch: its own blocked GEMM), `exp` and RoPE's
/// `sin`/`cos`, and the dequantization's rounding (`d * q + m` in f32 on both sides).
const REL_TOL: f32 = 1e-4;

/// The JSON `bench/cpu/gguf_hf_reference.py` writes.
#[derive(Deserialize)]
struct Reference {
    model: PathBuf,
    dtype: String,
    transformers: String,
    torch: String,
    #[serde(default)]
    gguf: String,
    results: Vec<PromptRef>,
}

/// One prompt of the reference.
#[derive(Deserialize)]
struct PromptRef {
    prompt: Vec<u32>,
    /// All logits of the prompt's last position.
    logits: Vec<f32>,
    /// Greedy tokens, `tokens[0]` the argmax of `logits`.
    tokens: Vec<u32>,
    /// Per prompt position: the largest logits as (token id, logit), largest first.
    prefill_top: Vec<Vec<(u32, f32)>>,
    /// Per greedy step `i`: the largest logits after feeding `tokens[i]`.
    step_top: Vec<Vec<(u32, f32)>>,
}

/// Largest absolute and relative (to `max(1, max |theirs|)`) difference over a row; a NaN on
/// either side counts as an infinite difference.
fn row_diff(pairs: impl Iterator<Item = (f32, f32)>) -> (f32, f32) {
    let (mut diff, mut scale) = (0f32, 1f32);
    for (ours, theirs) in pairs {
        let d = (ours - theirs).abs();
        diff = if d.is_nan() {
            f32::INFINITY
        } else {
            diff.max(d)
        };
        scale = scale.max(theirs.abs());
    }
    (diff, diff / scale)
}

/// [`row_diff`] of a full logits row.
fn full_diff(ours: &[f32], theirs: &[f32]) -> (f32, f32) {
    assert_eq!(ours.len(), theirs.len(), "logit rows of different lengths");
    row_diff(ours.iter().copied().zip(theirs.iter().copied()))
}

/// [`row_diff`] at the reference's top ids only.
fn top_diff(ours: &[f32], top: &[(u32, f32)]) -> (f32, f32) {
    row_diff(top.iter().map(|&(id, l)| (ours[id as usize], l)))
}

/// The reference's margin between its two largest logits, relative like [`row_diff`].
fn top_margin(top: &[(u32, f32)]) -> f32 {
    match top {
        [(_, a), (_, b), ..] => (a - b) / a.abs().max(1.0),
        _ => f32::INFINITY,
    }
}

/// First index of the largest value (as `torch.argmax`); NaN never wins.
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Differences measured for one prompt.
#[derive(Debug, Default)]
struct PromptDiff {
    prefill_abs: f32,
    prefill_rel: f32,
    positions_rel: f32,
    steps_rel: f32,
    tokens_equal: usize,
    near_ties: Vec<usize>,
    failures: Vec<String>,
}

fn step(m: &mut CpuModel, tokens: &[u32], pos: usize, blocks: &[u32]) -> Vec<f32> {
    m.step_logits(&[StepItem {
        tokens,
        pos,
        blocks,
        sample: true,
    }])
    .expect("CPU forward step")
    .remove(0)
}

fn compare_prompt(m: &mut CpuModel, p: &PromptRef, blocks: [&[u32]; 2]) -> PromptDiff {
    let mut d = PromptDiff::default();
    let check = |rel: f32, what: String, d: &mut PromptDiff| {
        if rel.is_nan() || rel > REL_TOL {
            d.failures.push(format!(
                "{what}: relative logit difference {rel:e} over {REL_TOL:e}"
            ));
        }
    };
    // The whole prompt in one step.
    let logits = step(m, &p.prompt, 0, blocks[0]);
    (d.prefill_abs, d.prefill_rel) = full_diff(&logits, &p.logits);
    check(d.prefill_rel, "prefill, last position".into(), &mut d);
    let greedy = |ours: &[f32], top: &[(u32, f32)], i: usize, d: &mut PromptDiff| {
        let Some(&want) = p.tokens.get(i) else { return };
        if argmax(ours) == want {
            d.tokens_equal += 1;
        } else if top_margin(top) <= 2.0 * REL_TOL {
            d.near_ties.push(i);
        } else {
            d.failures.push(format!(
                "greedy step {i}: ours {}, transformers {want} (margin {:e})",
                argmax(ours),
                top_margin(top)
            ));
        }
    };
    let last_top = p
        .prefill_top
        .last()
        .expect("prefill_top has the prompt's positions");
    greedy(&logits, last_top, 0, &mut d);
    // Greedy steps, fed the reference's tokens.
    for (i, top) in p.step_top.iter().enumerate() {
        let ours = step(m, &p.tokens[i..=i], p.prompt.len() + i, blocks[0]);
        let (_, rel) = top_diff(&ours, top);
        d.steps_rel = d.steps_rel.max(rel);
        check(
            rel,
            format!("greedy step {i} (after token {})", p.tokens[i]),
            &mut d,
        );
        greedy(&ours, top, i + 1, &mut d);
    }
    // The prompt again, one token per step, in other KV blocks.
    for (pos, top) in p.prefill_top.iter().enumerate() {
        let ours = step(m, &p.prompt[pos..=pos], pos, blocks[1]);
        let (_, rel) = top_diff(&ours, top);
        d.positions_rel = d.positions_rel.max(rel);
        check(
            rel,
            format!("prompt position {pos}, one token per step"),
            &mut d,
        );
    }
    d
}

fn env_path(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

#[test]
fn smollm2_gguf_matches_transformers() {
    let Some(ref_path) = env_path("BGS_SMOLLM2_HF_JSON") else {
        eprintln!(
            "skipping: BGS_SMOLLM2_HF_JSON is not set (a manual check: bench/cpu/gguf-vs-hf.sh)"
        );
        return;
    };
    let text = std::fs::read_to_string(&ref_path)
        .unwrap_or_else(|e| panic!("BGS_SMOLLM2_HF_JSON={}: {e}", ref_path.display()));
    let r: Reference = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "{}: not a gguf_hf_reference.py file: {e}",
            ref_path.display()
        )
    });
    assert_eq!(
        r.dtype, "f32",
        "the reference must be computed in f32 (it is {})",
        r.dtype
    );
    let gguf = env_path("BGS_SMOLLM2_GGUF").unwrap_or_else(|| r.model.clone());
    let ck = bgs_model::load(&gguf).unwrap_or_else(|e| panic!("{e}"));
    let cfg = ck.config;
    assert!(!r.results.is_empty(), "the reference has no prompts");
    for (i, p) in r.results.iter().enumerate() {
        assert_eq!(
            p.logits.len(),
            cfg.vocab_size,
            "prompt {i}: reference logits vs our vocabulary"
        );
        assert_eq!(
            p.prefill_top.len(),
            p.prompt.len(),
            "prompt {i}: prefill_top per position"
        );
        assert_eq!(
            p.step_top.len(),
            p.tokens.len(),
            "prompt {i}: step_top per greedy token"
        );
    }
    let block_size = 16;
    let per = r
        .results
        .iter()
        .map(|p| (p.prompt.len() + p.tokens.len()).div_ceil(block_size))
        .max()
        .expect("prompts");
    let kv = KvConfig {
        block_size,
        num_blocks: 2 * per,
    };
    let mut m = CpuModel::new(cfg.clone(), ck.weights, kv, 2).expect("CpuModel");
    // Scrambled block tables, so paging is exercised too.
    let a: Vec<u32> = (0..per as u32).rev().collect();
    let b: Vec<u32> = (per as u32..2 * per as u32).collect();

    let mut rows = Vec::new();
    let mut worst = 0f32;
    let mut failures = Vec::new();
    for (i, p) in r.results.iter().enumerate() {
        let d = compare_prompt(&mut m, p, [&a, &b]);
        println!(
            "prompt {i} ({} tokens): prefill last position max abs {:.3e} rel {:.3e}; \
             every position (top {}) rel {:.3e}; greedy steps rel {:.3e}; \
             greedy tokens {}/{} equal, near ties at {:?}",
            p.prompt.len(),
            d.prefill_abs,
            d.prefill_rel,
            p.prefill_top.first().map_or(0, Vec::len),
            d.positions_rel,
            d.steps_rel,
            d.tokens_equal,
            p.tokens.len(),
            d.near_ties
        );
        worst = worst
            .max(d.prefill_rel)
            .max(d.positions_rel)
            .max(d.steps_rel);
        rows.push(json!({
            "prompt_tokens": p.prompt.len(),
            "greedy_steps": p.tokens.len(),
            "prefill_last_max_abs_diff": d.prefill_abs,
            "prefill_last_max_rel_diff": d.prefill_rel,
            "positions_top_max_rel_diff": d.positions_rel,
            "steps_top_max_rel_diff": d.steps_rel,
            "greedy_tokens_equal": d.tokens_equal,
            "greedy_near_ties": d.near_ties,
            "failures": d.failures,
        }));
        failures.extend(d.failures.into_iter().map(|f| format!("prompt {i}: {f}")));
    }
    let pass = failures.is_empty();
    println!(
        "worst relative logit difference {worst:e} (tolerance {REL_TOL:e}): {}",
        if pass { "ok" } else { "FAILED" }
    );
    if let Some(out) = env_path("BGS_SMOLLM2_HF_OUT") {
        let v = json!({
            "gguf": gguf.display().to_string(),
            "model": ck.name,
            "reference": ref_path.display().to_string(),
            "transformers": r.transformers, "torch": r.torch, "gguf_py": r.gguf,
            "dtype": "f32", "tolerance_rel": REL_TOL,
            "max_rel_diff": worst, "prompts": rows, "pass": pass,
        });
        write_json(&out, &v);
    }
    assert!(pass, "{}", failures.join("\n"));
}

fn write_json(path: &Path, v: &serde_json::Value) {
    let text = serde_json::to_string_pretty(v).expect("JSON");
    std::fs::write(path, text + "\n").unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// The comparison's own arithmetic, without the model (always runs).
#[test]
fn comparison_catches_differences() {
    let theirs = [2.0, -4.0, 0.5];
    assert_eq!(full_diff(&theirs, &theirs), (0.0, 0.0));
    // 0.02 off on a row whose largest |logit| is 4: 0.005 relative.
    let (abs, rel) = full_diff(&[2.0, -4.0, 0.52], &theirs);
    assert!(
        (abs - 0.02).abs() < 1e-6 && (rel - 0.005).abs() < 1e-6,
        "{abs} {rel}"
    );
    // Small logits are measured against 1, not against themselves.
    assert!((full_diff(&[0.011], &[0.01]).1 - 0.001).abs() < 1e-6);
    // A NaN anywhere is an infinite difference, not a silently skipped one.
    assert_eq!(full_diff(&[2.0, f32::NAN, 0.5], &theirs).1, f32::INFINITY);
    assert_eq!(full_diff(&theirs, &[f32::NAN, -4.0, 0.5]).1, f32::INFINITY);
    // Top ids pick the right entries of our row.
    let top = [(1u32, 5.0f32), (2, 4.0)];
    assert_eq!(top_diff(&[9.0, 5.0, 4.5], &top), (0.5, 0.1));
    assert!((top_margin(&top) - 0.2).abs() < 1e-6);
    assert_eq!(top_margin(&top[..1]), f32::INFINITY);
    assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN]), 1);
}
