//! The deterministic CPU forward pass with a paged KV cache.
//!
//! [`CpuModel::step`] runs one forward step over a batch of sequences, each contributing a
//! prefill chunk or one decode token ([`StepItem`]). Keys and values live in a paged cache of
//! `num_blocks` blocks of `block_size` positions; each sequence names its blocks in a block
//! table, so the caller (the scheduler) owns allocation and reuse.
//!
//! # Determinism and batch invariance
//! The logits of a sequence are the same bits whatever else is in the batch, however its
//! prompt was chunked, and however many threads run the step. This holds by construction:
//! - every projection output `out[t][r]` is one dot product of weight row `r` with token
//!   `t`'s activations, computed by one kernel with a fixed accumulation order (16 partial
//!   sums reduced in a fixed tree, see [`kernels`]); the batch only decides how many tokens
//!   share a pass over the row, never the order of any sum;
//! - threads split the *output rows* (or the attention's (token, head) pairs) and never a
//!   reduction;
//! - attention for (token, head) walks positions `0..=pos` in order from the cache, which
//!   holds the same bits whether a position was written by a prefill chunk or a decode step;
//! - norms, RoPE and activations are per token.
//!
//! # Cache layout
//! f32 `[num_blocks][layers][k|v][kv_heads][block_size][head_dim]`: one block holds a run of
//! `block_size` positions for every layer, and one head's keys of a block are contiguous.
//! Items of one step must not write the same (block, slot); a block may be handed to another
//! sequence once its old owner is gone (its stale contents are overwritten before they are
//! read, since a sequence reads only positions it has written).

mod kernels;
mod pool;

use crate::config::ModelConfig;
use crate::weights::{Tensor, Weights};
use kernels::{MatJob, OutPtr};
use pool::{Pool, split};

/// Geometry of the paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvConfig {
    /// Positions per block.
    pub block_size: usize,
    /// Blocks in the cache.
    pub num_blocks: usize,
}

impl KvConfig {
    /// Bytes of one cache block for `cfg` (every layer's keys and values of `block_size`
    /// positions), for sizing `num_blocks` from a memory budget.
    pub fn block_bytes(&self, cfg: &ModelConfig) -> usize {
        self.block_size * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    }
}

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug)]
pub struct StepItem<'a> {
    /// New tokens of this sequence in this step: a prefill chunk, or one decode token.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` (tokens before it are already in the KV cache).
    pub pos: usize,
    /// Block table: KV block ids holding positions `0..` (covers `pos + tokens.len()`).
    pub blocks: &'a [u32],
    /// Produce the next token after the last of `tokens`.
    pub sample: bool,
}

/// Per-step buffers, kept between steps to avoid reallocating.
#[derive(Debug, Default)]
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    tmp: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    head_in: Vec<f32>,
    logits: Vec<f32>,
}

/// A decoder-only model on the CPU with a paged KV cache (see the module docs).
pub struct CpuModel {
    cfg: ModelConfig,
    kv: KvConfig,
    weights: Weights,
    pool: Pool,
    /// `[num_blocks][layers][2][kv_heads][block_size][head_dim]`.
    cache: Vec<f32>,
    /// RoPE inverse frequencies, `head_dim / 2` values.
    inv_freq: Vec<f32>,
    scratch: Scratch,
}

impl std::fmt::Debug for CpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuModel")
            .field("cfg", &self.cfg)
            .field("kv", &self.kv)
            .field("threads", &self.pool.threads())
            .field("cache_floats", &self.cache.len())
            .finish_non_exhaustive()
    }
}

/// Where one token of the batch belongs.
#[derive(Clone, Copy, Debug)]
struct TokInfo {
    item: usize,
    pos: usize,
}

impl CpuModel {
    /// A model over `weights` with an all-zero cache of `kv` geometry, running steps on
    /// `threads` threads (the caller's plus `threads - 1` persistent workers).
    pub fn new(
        cfg: ModelConfig,
        weights: Weights,
        kv: KvConfig,
        threads: usize,
    ) -> Result<CpuModel, String> {
        cfg.validate()?;
        weights.check_shapes(&cfg)?;
        if kv.block_size == 0 || kv.num_blocks == 0 {
            return Err(format!(
                "KV cache needs block_size and num_blocks above 0, got {} and {}",
                kv.block_size, kv.num_blocks
            ));
        }
        if kv.num_blocks > u32::MAX as usize {
            return Err(format!(
                "num_blocks {} does not fit u32 block ids",
                kv.num_blocks
            ));
        }
        let floats = [
            kv.num_blocks,
            cfg.num_layers,
            2,
            cfg.num_kv_heads,
            kv.block_size,
            cfg.head_dim,
        ]
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .filter(|&n| n.checked_mul(4).is_some())
        .ok_or_else(|| "KV cache size overflows".to_string())?;
        let pool = Pool::new(threads)?;
        let d = cfg.head_dim;
        // Computed in f64 then rounded, as candle does; Hugging Face computes in f32, which
        // differs by at most an ulp of the angle.
        let inv_freq = (0..d / 2)
            .map(|i| (1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64)) as f32)
            .collect();
        Ok(CpuModel {
            cfg,
            kv,
            weights,
            pool,
            cache: vec![0.0; floats],
            inv_freq,
            scratch: Scratch::default(),
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The KV cache geometry.
    pub fn kv_config(&self) -> &KvConfig {
        &self.kv
    }

    /// Threads that run each step.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// One forward step over a batch: writes K/V of every item's tokens into its blocks and,
    /// for items with `sample`, writes the greedy next token (argmax of the last position's
    /// logits, ties to the lowest id) to `next[i]` (items without `sample` leave `next[i]`
    /// as is). `next` has one entry per item. On error nothing was computed.
    pub fn step(&mut self, items: &[StepItem<'_>], next: &mut [u32]) -> Result<(), String> {
        if next.len() != items.len() {
            return Err(format!(
                "next has {} entries for {} items",
                next.len(),
                items.len()
            ));
        }
        let want: Vec<bool> = items.iter().map(|it| it.sample).collect();
        self.forward(items, &want)?;
        let vocab = self.cfg.vocab_size;
        let mut row = 0;
        for (i, it) in items.iter().enumerate() {
            if it.sample {
                let l = &self.scratch.logits[row * vocab..(row + 1) * vocab];
                next[i] = kernels::argmax(l);
                row += 1;
            }
        }
        Ok(())
    }

    /// The same step as [`CpuModel::step`], returning the last position's logits of every
    /// item (whatever its `sample` flag).
    pub fn step_logits(&mut self, items: &[StepItem<'_>]) -> Result<Vec<Vec<f32>>, String> {
        let want = vec![true; items.len()];
        self.forward(items, &want)?;
        let vocab = self.cfg.vocab_size;
        Ok(self
            .scratch
            .logits
            .chunks_exact(vocab)
            .map(<[f32]>::to_vec)
            .collect())
    }

    fn validate(&self, items: &[StepItem<'_>]) -> Result<(), String> {
        let (vocab, bs) = (self.cfg.vocab_size, self.kv.block_size);
        for (i, it) in items.iter().enumerate() {
            if it.tokens.is_empty() {
                return Err(format!("item {i}: no tokens"));
            }
            if let Some(&t) = it.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(format!(
                    "item {i}: token id {t} is outside the vocabulary ({vocab})"
                ));
            }
            let end = it
                .pos
                .checked_add(it.tokens.len())
                .ok_or_else(|| format!("item {i}: position overflows"))?;
            if end > self.cfg.max_position_embeddings {
                return Err(format!(
                    "item {i}: positions up to {end} exceed max_position_embeddings {}",
                    self.cfg.max_position_embeddings
                ));
            }
            let need = end.div_ceil(bs);
            if it.blocks.len() < need {
                return Err(format!(
                    "item {i}: block table has {} blocks, positions up to {end} need {need}",
                    it.blocks.len()
                ));
            }
            if let Some(&b) = it
                .blocks
                .iter()
                .find(|&&b| b as usize >= self.kv.num_blocks)
            {
                return Err(format!(
                    "item {i}: block id {b} is outside the cache ({} blocks)",
                    self.kv.num_blocks
                ));
            }
        }
        Ok(())
    }

    /// Runs the step; leaves the logits of the last token of every item with `want[i]` in
    /// `scratch.logits` (`[count, vocab]`, in item order).
    fn forward(&mut self, items: &[StepItem<'_>], want: &[bool]) -> Result<(), String> {
        self.validate(items)?;
        let cfg = &self.cfg;
        let (h, inter, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (hd, nh, nkv) = (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let half = hd / 2;
        let eps = cfg.rms_norm_eps as f32;
        let bs = self.kv.block_size;
        let threads = self.pool.threads();

        let toks: Vec<TokInfo> = items
            .iter()
            .enumerate()
            .flat_map(|(item, it)| {
                (0..it.tokens.len()).map(move |j| TokInfo {
                    item,
                    pos: it.pos + j,
                })
            })
            .collect();
        let n = toks.len();
        let s = &mut self.scratch;
        s.x.clear();
        for it in items {
            for &t in it.tokens {
                let t = t as usize;
                s.x.extend_from_slice(&self.weights.embed.data[t * h..(t + 1) * h]);
            }
        }
        for (buf, len) in [
            (&mut s.xn, n * h),
            (&mut s.q, n * qd),
            (&mut s.k, n * kvd),
            (&mut s.v, n * kvd),
            (&mut s.attn, n * qd),
            (&mut s.tmp, n * h),
            (&mut s.gate, n * inter),
            (&mut s.up, n * inter),
            (&mut s.cos, n * half),
            (&mut s.sin, n * half),
        ] {
            buf.clear();
            buf.resize(len, 0.0);
        }
        for (t, ti) in toks.iter().enumerate() {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let angle = ti.pos as f32 * f;
                s.cos[t * half + i] = angle.cos();
                s.sin[t * half + i] = angle.sin();
            }
        }

        let pool = &mut self.pool;
        let cache_layer_stride = 2 * nkv * bs * hd;
        let block_stride = cfg.num_layers * cache_layer_stride;
        let scale = 1.0 / (hd as f32).sqrt();

        for (l, lw) in self.weights.layers.iter().enumerate() {
            for t in 0..n {
                kernels::rms_norm(
                    &s.x[t * h..(t + 1) * h],
                    &lw.input_norm.data,
                    eps,
                    &mut s.xn[t * h..(t + 1) * h],
                );
            }
            par_matmul(
                &mut *pool,
                &[
                    MatJob {
                        w: &lw.q_proj.data,
                        rows: qd,
                        bias: bias_of(&lw.q_bias),
                        out: OutPtr(s.q.as_mut_ptr()),
                        out_stride: qd,
                    },
                    MatJob {
                        w: &lw.k_proj.data,
                        rows: kvd,
                        bias: bias_of(&lw.k_bias),
                        out: OutPtr(s.k.as_mut_ptr()),
                        out_stride: kvd,
                    },
                    MatJob {
                        w: &lw.v_proj.data,
                        rows: kvd,
                        bias: bias_of(&lw.v_bias),
                        out: OutPtr(s.v.as_mut_ptr()),
                        out_stride: kvd,
                    },
                ],
                &s.xn,
                h,
                n,
            );
            for t in 0..n {
                let (c, sn) = (
                    &s.cos[t * half..(t + 1) * half],
                    &s.sin[t * half..(t + 1) * half],
                );
                for head in s.q[t * qd..(t + 1) * qd].chunks_exact_mut(hd) {
                    kernels::rope(head, c, sn);
                }
                for head in s.k[t * kvd..(t + 1) * kvd].chunks_exact_mut(hd) {
                    kernels::rope(head, c, sn);
                }
            }
            // K/V of this step's tokens go to the cache before any attention reads it, so a
            // token sees its own chunk's earlier positions exactly as decode would.
            for (t, ti) in toks.iter().enumerate() {
                let blk = items[ti.item].blocks[ti.pos / bs] as usize;
                let slot = ti.pos % bs;
                for kvh in 0..nkv {
                    for (kind, src) in [(0, &s.k), (1, &s.v)] {
                        let off = blk * block_stride
                            + l * cache_layer_stride
                            + ((kind * nkv + kvh) * bs + slot) * hd;
                        self.cache[off..off + hd]
                            .copy_from_slice(&src[t * kvd + kvh * hd..t * kvd + (kvh + 1) * hd]);
                    }
                }
            }

            // Attention, one task per (token, head).
            {
                let cache = &self.cache;
                let q = &s.q;
                let out = OutPtr(s.attn.as_mut_ptr());
                let toks = &toks;
                let group = nh / nkv;
                let tasks = n * nh;
                let avx = kernels::use_avx();
                let work: usize = toks.iter().map(|t| (t.pos + 1) * nh * hd).sum();
                let serial = work < SERIAL_MACS;
                let parts = if serial { 1 } else { threads };
                let attend = |part: usize| {
                    let mut scores = Vec::new();
                    let mut acc = vec![0f32; hd];
                    for task in split(tasks, parts, part) {
                        let (t, head) = (task / nh, task % nh);
                        let ti = toks[t];
                        let blocks = items[ti.item].blocks;
                        let kvh = head / group;
                        let qv = &q[t * qd + head * hd..t * qd + (head + 1) * hd];
                        let base = |p: usize, kind: usize| {
                            blocks[p / bs] as usize * block_stride
                                + l * cache_layer_stride
                                + ((kind * nkv + kvh) * bs + p % bs) * hd
                        };
                        scores.clear();
                        let mut max = f32::NEG_INFINITY;
                        for p in 0..=ti.pos {
                            let o = base(p, 0);
                            let sc = kernels::dot_with(avx, qv, &cache[o..o + hd]) * scale;
                            max = max.max(sc);
                            scores.push(sc);
                        }
                        let mut sum = 0f32;
                        for sc in scores.iter_mut() {
                            *sc = (*sc - max).exp();
                            sum += *sc;
                        }
                        acc.fill(0.0);
                        for (p, &e) in scores.iter().enumerate() {
                            let w = e / sum;
                            let o = base(p, 1);
                            for (a, &vv) in acc.iter_mut().zip(&cache[o..o + hd]) {
                                *a += w * vv;
                            }
                        }
                        let dst = t * qd + head * hd;
                        for (d, &a) in acc.iter().enumerate() {
                            // SAFETY: `s.attn` holds `n * qd` values and is borrowed only
                            // through `out` during this dispatch; (token, head) tasks are
                            // split disjointly, so this index is written by this task alone.
                            unsafe { *out.at(dst + d) = a };
                        }
                    }
                };
                if serial {
                    attend(0);
                } else {
                    pool.run(&attend);
                }
            }

            par_matmul(
                &mut *pool,
                &[MatJob {
                    w: &lw.o_proj.data,
                    rows: h,
                    bias: None,
                    out: OutPtr(s.tmp.as_mut_ptr()),
                    out_stride: h,
                }],
                &s.attn,
                qd,
                n,
            );
            for (x, &d) in s.x.iter_mut().zip(&s.tmp) {
                *x += d;
            }
            for t in 0..n {
                kernels::rms_norm(
                    &s.x[t * h..(t + 1) * h],
                    &lw.post_norm.data,
                    eps,
                    &mut s.xn[t * h..(t + 1) * h],
                );
            }
            par_matmul(
                &mut *pool,
                &[
                    MatJob {
                        w: &lw.gate_proj.data,
                        rows: inter,
                        bias: None,
                        out: OutPtr(s.gate.as_mut_ptr()),
                        out_stride: inter,
                    },
                    MatJob {
                        w: &lw.up_proj.data,
                        rows: inter,
                        bias: None,
                        out: OutPtr(s.up.as_mut_ptr()),
                        out_stride: inter,
                    },
                ],
                &s.xn,
                h,
                n,
            );
            kernels::silu_mul(&mut s.gate, &s.up);
            par_matmul(
                &mut *pool,
                &[MatJob {
                    w: &lw.down_proj.data,
                    rows: h,
                    bias: None,
                    out: OutPtr(s.tmp.as_mut_ptr()),
                    out_stride: h,
                }],
                &s.gate,
                inter,
                n,
            );
            for (x, &d) in s.x.iter_mut().zip(&s.tmp) {
                *x += d;
            }
        }

        // Final norm and LM head for the last token of each wanted item only.
        s.head_in.clear();
        let mut last = 0;
        for (it, &w) in items.iter().zip(want) {
            last += it.tokens.len();
            if w {
                let t = last - 1;
                let start = s.head_in.len();
                s.head_in.resize(start + h, 0.0);
                kernels::rms_norm(
                    &s.x[t * h..(t + 1) * h],
                    &self.weights.final_norm.data,
                    eps,
                    &mut s.head_in[start..],
                );
            }
        }
        let m = s.head_in.len() / h;
        s.logits.clear();
        s.logits.resize(m * vocab, 0.0);
        if m > 0 {
            par_matmul(
                &mut *pool,
                &[MatJob {
                    w: &self.weights.lm_head().data,
                    rows: vocab,
                    bias: None,
                    out: OutPtr(s.logits.as_mut_ptr()),
                    out_stride: vocab,
                }],
                &s.head_in,
                h,
                m,
            );
        }
        Ok(())
    }
}

/// Below this many multiply-adds a product runs on the caller's thread alone: waking the
/// workers costs more than it saves. (Which thread computes a row never changes its bits.)
const SERIAL_MACS: usize = 1 << 16;

/// A bias tensor's values.
fn bias_of(b: &Option<Tensor>) -> Option<&[f32]> {
    b.as_ref().map(|t| &t.data[..])
}

/// `out[t][r] = x[t] · w[r]` over the rows of all `jobs`, split across the pool's threads by
/// output row. Every job's `out` must point at a buffer of `n * out_stride` values that
/// nothing else touches during the call.
fn par_matmul(pool: &mut Pool, jobs: &[MatJob<'_>], x: &[f32], in_dim: usize, n: usize) {
    let total: usize = jobs.iter().map(|j| j.rows).sum();
    if total * in_dim * n < SERIAL_MACS {
        // SAFETY: as below, with the caller's thread computing every row.
        unsafe { kernels::matmul_rows(jobs, x, in_dim, n, 0..total) };
        return;
    }
    let parts = pool.threads();
    pool.run(&|part| {
        let rows = split(total, parts, part);
        // SAFETY: the callers pass `out` pointers of buffers sized `n * out_stride` that
        // they do not touch until this returns; row ranges of the parts are disjoint.
        unsafe { kernels::matmul_rows(jobs, x, in_dim, n, rows) };
    });
}
