//! Host-side logic of the GPU model as pure functions (unit-tested without a GPU): token-count
//! buckets, the packed per-step input buffer, fused weight layouts, dtype conversion, option
//! validation and KV pool sizing.

use bgs_model::{ModelConfig, StepItem, Tensor};

/// Token-count buckets: one captured step graph each (the LM head uses the same list for the
/// number of sampled rows). 192 and 384 sit between the powers of two where full decode
/// batches meet the prefill of new admissions: at 256 slots a step of 256 decodes and ~92
/// prefill tokens ran the 512 bucket (docs/gpu-model.md, "Saturation, explained").
pub const BUCKETS: [usize; 12] = [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512];

/// Largest head dimension the attention kernel handles (`BGS_MAX_HEAD_DIM`).
pub const MAX_HEAD_DIM: usize = 128;

/// The smallest bucket holding `n` (`n` ≥ 1), if any.
pub fn bucket_for(n: usize) -> Option<usize> {
    BUCKETS.iter().copied().find(|&b| b >= n.max(1))
}

/// The buckets up to and including `max` (a bucket).
pub fn buckets_up_to(max: usize) -> Vec<usize> {
    BUCKETS.iter().copied().filter(|&b| b <= max).collect()
}

/// Element type of weights, KV cache and GEMM inputs on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum GpuDtype {
    /// f32 everywhere (for exact-token checks against the f32 CPU oracle).
    F32,
    /// IEEE half.
    F16,
    /// bfloat16 (the default).
    #[default]
    Bf16,
}

impl GpuDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            GpuDtype::F32 => 4,
            GpuDtype::F16 | GpuDtype::Bf16 => 2,
        }
    }

    /// The kernels' `BGS_DT` value.
    pub fn kernel_id(self) -> u32 {
        match self {
            GpuDtype::F32 => 0,
            GpuDtype::F16 => 1,
            GpuDtype::Bf16 => 2,
        }
    }

    /// Command-line name.
    pub fn name(self) -> &'static str {
        match self {
            GpuDtype::F32 => "f32",
            GpuDtype::F16 => "f16",
            GpuDtype::Bf16 => "bf16",
        }
    }

    /// `values` converted to this type's bytes (little endian; round to nearest even).
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(values.len() * self.size());
        match self {
            GpuDtype::F32 => values
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            GpuDtype::F16 => values.iter().for_each(|&v| {
                out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes())
            }),
            GpuDtype::Bf16 => values.iter().for_each(|&v| {
                out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes())
            }),
        }
        out
    }

    /// The value `x` has once stored in this type.
    pub fn round(self, x: f32) -> f32 {
        match self {
            GpuDtype::F32 => x,
            GpuDtype::F16 => half::f16::from_f32(x).to_f32(),
            GpuDtype::Bf16 => half::bf16::from_f32(x).to_f32(),
        }
    }
}

impl std::str::FromStr for GpuDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<GpuDtype, String> {
        match s {
            "f32" | "fp32" | "float32" => Ok(GpuDtype::F32),
            "f16" | "fp16" | "float16" => Ok(GpuDtype::F16),
            "bf16" | "bfloat16" => Ok(GpuDtype::Bf16),
            _ => Err(format!("unknown dtype {s:?} (known: f32, f16, bf16)")),
        }
    }
}

/// Rows of several `[rows, cols]` matrices (or vectors) stacked in order: the fused QKV
/// (`[q + 2 kv, hidden]`) and gate/up (`[2 inter, hidden]`) layouts, and the fused QKV bias.
pub fn stack_rows(parts: &[&Tensor]) -> Result<Vec<f32>, String> {
    let cols = |t: &Tensor| t.shape.get(1).copied().unwrap_or(1);
    if let Some(first) = parts.first()
        && let Some(bad) = parts.iter().find(|t| cols(t) != cols(first))
    {
        return Err(format!(
            "cannot stack rows of shapes {:?} and {:?} (column counts differ)",
            first.shape, bad.shape
        ));
    }
    let mut out = Vec::with_capacity(parts.iter().map(|t| t.data.len()).sum());
    for t in parts {
        out.extend_from_slice(&t.data);
    }
    Ok(out)
}

/// Sizes of the step: tokens and sampled rows (both rounded up to a bucket), sequences, and
/// the block-table capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepGeometry {
    /// Token capacity of a step (a bucket).
    pub max_tokens: usize,
    /// Sampled rows capacity (a bucket, at most `max_tokens`).
    pub max_samples: usize,
    /// Items per step.
    pub max_seqs: usize,
    /// Block-table entries one sequence may use.
    pub max_blocks_per_seq: usize,
    /// Positions per KV block.
    pub block_size: usize,
    /// Blocks in the KV pool.
    pub num_blocks: usize,
}

impl StepGeometry {
    /// Word offset of the token ids (then positions, sequence index, slot: `max_tokens`
    /// words each).
    pub const TOK: usize = 0;

    /// Word offset of the positions.
    pub fn pos(&self) -> usize {
        self.max_tokens
    }
    /// Word offset of each token's sequence index.
    pub fn seq(&self) -> usize {
        2 * self.max_tokens
    }
    /// Word offset of each token's KV slot.
    pub fn slot(&self) -> usize {
        3 * self.max_tokens
    }
    /// Word offset of the sampled rows (`max_samples` words).
    pub fn rows(&self) -> usize {
        4 * self.max_tokens
    }
    /// Word offset of each sequence's block-table offset (`max_seqs` words).
    pub fn bt_off(&self) -> usize {
        self.rows() + self.max_samples
    }
    /// Word offset of the packed block tables.
    pub fn bt(&self) -> usize {
        self.bt_off() + self.max_seqs
    }
    /// Words of the whole input buffer.
    pub fn words(&self) -> usize {
        self.bt() + self.max_seqs * self.max_blocks_per_seq
    }
}

/// What [`pack_step`] writes for a padding token (up to the bucket): token id, position,
/// sequence index and KV slot (-1: writes no KV). `include/bgs_llm_step.h` carries these.
pub const PAD_TOKEN: i32 = 0;
/// Position of a padding token.
pub const PAD_POS: i32 = 0;
/// Sequence index of a padding token.
pub const PAD_SEQ: i32 = 0;
/// KV slot of a padding token: none.
pub const PAD_SLOT: i32 = -1;
/// Token row of a padding sampled row (row 0: read, never used).
pub const PAD_ROW: i32 = 0;

/// What [`pack_step`] produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packed {
    /// Real tokens in the step.
    pub tokens: usize,
    /// The token bucket (graph) that runs it.
    pub bucket: usize,
    /// Sampled rows.
    pub samples: usize,
    /// The LM-head bucket (0 when nothing is sampled).
    pub sample_bucket: usize,
    /// Words of the input buffer to copy (the fixed part plus the used block tables).
    pub words: usize,
    /// Item index of each sampled row, in row order.
    pub sampled_items: Vec<usize>,
}

/// Validate `items` and write the step's inputs into `buf` (`geo.words()` words, laid out as
/// [`StepGeometry`] says). `want[i]`: item `i` gets a sampled row (its last token's).
/// Padding tokens up to the bucket get token 0, position 0, sequence 0 and slot -1 (they
/// write no KV and are never sampled); padding rows point at row 0.
pub fn pack_step(
    geo: &StepGeometry,
    items: &[StepItem<'_>],
    want: &[bool],
    vocab: usize,
    max_positions: usize,
    buf: &mut [i32],
) -> Result<Packed, String> {
    if want.len() != items.len() {
        return Err(format!(
            "{} sample flags for {} items",
            want.len(),
            items.len()
        ));
    }
    if buf.len() < geo.words() {
        return Err(format!(
            "input buffer has {} words, the geometry needs {}",
            buf.len(),
            geo.words()
        ));
    }
    if items.is_empty() {
        return Err("a step needs at least one item".into());
    }
    if items.len() > geo.max_seqs {
        return Err(format!(
            "{} items in one step, the model was built for at most {} (max_seqs)",
            items.len(),
            geo.max_seqs
        ));
    }
    let bs = geo.block_size;
    let mut tokens = 0usize;
    let mut bt_used = 0usize;
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
        if end > max_positions {
            return Err(format!(
                "item {i}: positions up to {end} exceed the model's limit {max_positions}"
            ));
        }
        let need = end.div_ceil(bs);
        if it.blocks.len() < need {
            return Err(format!(
                "item {i}: block table has {} blocks, positions up to {end} need {need}",
                it.blocks.len()
            ));
        }
        if need > geo.max_blocks_per_seq {
            return Err(format!(
                "item {i}: needs {need} blocks, the model was built for at most {} per sequence",
                geo.max_blocks_per_seq
            ));
        }
        if let Some(&b) = it.blocks[..need]
            .iter()
            .find(|&&b| b as usize >= geo.num_blocks)
        {
            return Err(format!(
                "item {i}: block id {b} is outside the cache ({} blocks)",
                geo.num_blocks
            ));
        }
        tokens += it.tokens.len();
        bt_used += need;
    }
    // The KV rows a step writes belong to the writing token's own item (attention copies the
    // rows below an item's first position in the step before the previous kernel ends), so a
    // block an item writes this step is in no other item's table.
    let mut written = std::collections::HashMap::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let end = it.pos + it.tokens.len();
        for &b in &it.blocks[it.pos / bs..end.div_ceil(bs)] {
            written.insert(b, i);
        }
    }
    for (i, it) in items.iter().enumerate() {
        let need = (it.pos + it.tokens.len()).div_ceil(bs);
        if let Some((b, j)) = it.blocks[..need]
            .iter()
            .find_map(|b| written.get(b).filter(|&&j| j != i).map(|&j| (*b, j)))
        {
            return Err(format!(
                "item {i}: block {b} is also in item {j}, which writes it this step \
                 (a block an item writes belongs to it alone)"
            ));
        }
    }
    if tokens > geo.max_tokens {
        return Err(format!(
            "{tokens} tokens in one step, the model was built for at most {} (max_batched_tokens)",
            geo.max_tokens
        ));
    }
    let samples = want.iter().filter(|&&w| w).count();
    if samples > geo.max_samples {
        return Err(format!(
            "{samples} sampled items in one step, at most {}",
            geo.max_samples
        ));
    }
    let bucket = bucket_for(tokens).ok_or_else(|| format!("no bucket holds {tokens} tokens"))?;
    let sample_bucket = if samples == 0 {
        0
    } else {
        bucket_for(samples).ok_or_else(|| format!("no bucket holds {samples} rows"))?
    };

    let (pos_o, seq_o, slot_o, rows_o) = (geo.pos(), geo.seq(), geo.slot(), geo.rows());
    let (off_o, bt_o) = (geo.bt_off(), geo.bt());
    let mut t = 0usize;
    let mut bt_at = 0usize;
    let mut sampled_items = Vec::with_capacity(samples);
    for (i, (it, &w)) in items.iter().zip(want).enumerate() {
        let need = (it.pos + it.tokens.len()).div_ceil(bs);
        buf[off_o + i] = bt_at as i32;
        for (k, &b) in it.blocks[..need].iter().enumerate() {
            buf[bt_o + bt_at + k] = b as i32;
        }
        bt_at += need;
        for (j, &tok) in it.tokens.iter().enumerate() {
            let p = it.pos + j;
            buf[StepGeometry::TOK + t] = tok as i32;
            buf[pos_o + t] = p as i32;
            buf[seq_o + t] = i as i32;
            buf[slot_o + t] = (it.blocks[p / bs] as usize * bs + p % bs) as i32;
            t += 1;
        }
        if w {
            buf[rows_o + sampled_items.len()] = (t - 1) as i32;
            sampled_items.push(i);
        }
    }
    for pad in t..geo.max_tokens {
        buf[StepGeometry::TOK + pad] = PAD_TOKEN;
        buf[pos_o + pad] = PAD_POS;
        buf[seq_o + pad] = PAD_SEQ;
        buf[slot_o + pad] = PAD_SLOT;
    }
    for r in samples..geo.max_samples {
        buf[rows_o + r] = PAD_ROW;
    }
    for i in items.len()..geo.max_seqs {
        buf[off_o + i] = 0;
    }
    Ok(Packed {
        tokens,
        bucket,
        samples,
        sample_bucket,
        words: bt_o + bt_used,
        sampled_items,
    })
}

/// Check that the forward pass supports `cfg` (on top of `cfg.validate()`).
pub fn check_config(cfg: &ModelConfig) -> Result<(), String> {
    cfg.validate()?;
    if cfg.head_dim > MAX_HEAD_DIM {
        return Err(format!(
            "head_dim {} is not supported (the attention kernel handles up to {MAX_HEAD_DIM})",
            cfg.head_dim
        ));
    }
    let row = cfg.num_heads * cfg.head_dim + 2 * cfg.kv_dim();
    for (what, v) in [
        ("hidden_size", cfg.hidden_size),
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
        ("q + 2 kv width", row),
    ] {
        // cuBLAS takes int dimensions; our kernels index with 32-bit ints within a row.
        if v > i32::MAX as usize / 4 {
            return Err(format!("{what} {v} is too large for the GPU kernels"));
        }
    }
    Ok(())
}

/// The step geometry for `cfg` and the options' limits, with the pool's `num_blocks`.
/// Errors name the bad option.
pub fn geometry(
    cfg: &ModelConfig,
    block_size: usize,
    num_blocks: usize,
    max_batched_tokens: usize,
    max_seqs: usize,
) -> Result<StepGeometry, String> {
    if block_size == 0 || block_size > 1024 {
        return Err(format!("block_size must be 1..=1024, got {block_size}"));
    }
    if num_blocks == 0 {
        return Err("num_blocks must be at least 1".into());
    }
    if num_blocks
        .checked_mul(block_size)
        .is_none_or(|s| s > i32::MAX as usize)
    {
        return Err(format!(
            "num_blocks {num_blocks} × block_size {block_size} does not fit 31-bit KV slot indices"
        ));
    }
    let max_tokens = bucket_for(max_batched_tokens)
        .filter(|_| max_batched_tokens > 0)
        .ok_or_else(|| {
            format!(
                "max_batched_tokens must be 1..={}, got {max_batched_tokens}",
                BUCKETS[BUCKETS.len() - 1]
            )
        })?;
    if max_seqs == 0 {
        return Err("max_seqs must be at least 1".into());
    }
    let max_seqs = max_seqs.min(max_tokens);
    let max_samples = bucket_for(max_seqs).unwrap_or(max_tokens).min(max_tokens);
    let max_blocks_per_seq = cfg
        .max_position_embeddings
        .div_ceil(block_size)
        .min(num_blocks);
    Ok(StepGeometry {
        max_tokens,
        max_samples,
        max_seqs,
        max_blocks_per_seq,
        block_size,
        num_blocks,
    })
}

/// Bytes of one KV block (every layer's K and V of `block_size` positions) in `dtype`.
pub fn kv_block_bytes(cfg: &ModelConfig, block_size: usize, dtype: GpuDtype) -> usize {
    block_size * cfg.num_layers * 2 * cfg.kv_dim() * dtype.size()
}

/// KV blocks for a budget of `fraction` of `free_bytes`, capped at enough for `max_seqs`
/// sequences of the model's full context (a larger pool could never be used) and at the
/// 31-bit slot limit. At least 1 when the budget allows any block.
pub fn blocks_for_budget(
    cfg: &ModelConfig,
    block_size: usize,
    dtype: GpuDtype,
    free_bytes: usize,
    fraction: f64,
    max_seqs: usize,
) -> Result<usize, String> {
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(format!(
            "kv_memory_fraction must be in (0, 1], got {fraction}"
        ));
    }
    let per = kv_block_bytes(cfg, block_size, dtype).max(1);
    let budget = (free_bytes as f64 * fraction) as usize;
    let n = budget / per;
    if n == 0 {
        return Err(format!(
            "no room for the KV cache: {fraction} of {free_bytes} free bytes is below one block \
             ({per} bytes)"
        ));
    }
    let useful = max_seqs.saturating_mul(cfg.max_position_embeddings.div_ceil(block_size));
    let slot_limit = i32::MAX as usize / block_size;
    Ok(n.min(useful.max(1)).min(slot_limit))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bgs_model::synth::{SynthArch, synth_config};

    fn geo() -> StepGeometry {
        geometry(&synth_config(SynthArch::TinyQwen2), 4, 64, 20, 3).unwrap()
    }

    #[test]
    fn buckets_round_up_and_stop_at_512() {
        assert_eq!(bucket_for(1), Some(1));
        assert_eq!(bucket_for(0), Some(1));
        assert_eq!(bucket_for(3), Some(4));
        assert_eq!(bucket_for(64), Some(64));
        assert_eq!(bucket_for(65), Some(128));
        assert_eq!(bucket_for(512), Some(512));
        assert_eq!(bucket_for(513), None);
        assert_eq!(buckets_up_to(16), vec![1, 2, 4, 8, 16]);
    }

    #[test]
    fn geometry_rounds_limits_and_names_bad_options() {
        let g = geo();
        assert_eq!(g.max_tokens, 32);
        assert_eq!(g.max_seqs, 3);
        assert_eq!(g.max_samples, 4);
        // 8192 positions / 4 = 2048 blocks, but the pool has 64.
        assert_eq!(g.max_blocks_per_seq, 64);
        assert_eq!(g.words(), 4 * 32 + 4 + 3 + 3 * 64);
        let c = synth_config(SynthArch::TinyQwen2);
        let e = geometry(&c, 16, 10, 600, 8).unwrap_err();
        assert!(e.contains("max_batched_tokens"), "{e}");
        let e = geometry(&c, 16, 10, 0, 8).unwrap_err();
        assert!(e.contains("max_batched_tokens"), "{e}");
        let e = geometry(&c, 0, 10, 16, 8).unwrap_err();
        assert!(e.contains("block_size"), "{e}");
        let e = geometry(&c, 16, 0, 16, 8).unwrap_err();
        assert!(e.contains("num_blocks"), "{e}");
        let e = geometry(&c, 16, 10, 16, 0).unwrap_err();
        assert!(e.contains("max_seqs"), "{e}");
        let e = geometry(&c, 1024, 1 << 22, 16, 1).unwrap_err();
        assert!(e.contains("31-bit"), "{e}");
        // More sequences than tokens cannot happen (each item has a token).
        assert_eq!(geometry(&c, 16, 10, 8, 256).unwrap().max_seqs, 8);
    }

    #[test]
    fn packs_tokens_slots_tables_and_rows() {
        let g = geo();
        let mut buf = vec![7i32; g.words()];
        let (a, b) = ([5u32, 6, 7, 8, 9], [42u32]);
        // Item 0: a prefill chunk at positions 2..7 over blocks 10, 11 (block size 4);
        // item 1: one decode token at position 4 of blocks 3, 9 (+ an unused 3rd entry).
        let items = [
            StepItem {
                tokens: &a,
                pos: 2,
                blocks: &[10, 11, 60],
                sample: true,
            },
            StepItem {
                tokens: &b,
                pos: 4,
                blocks: &[3, 9, 1],
                sample: true,
            },
        ];
        let p = pack_step(&g, &items, &[true, true], 512, 8192, &mut buf).unwrap();
        assert_eq!(p.tokens, 6);
        assert_eq!(p.bucket, 8);
        assert_eq!(p.samples, 2);
        assert_eq!(p.sample_bucket, 2);
        assert_eq!(p.sampled_items, vec![0, 1]);
        assert_eq!(&buf[..8], &[5, 6, 7, 8, 9, 42, 0, 0]);
        assert_eq!(&buf[g.pos()..g.pos() + 7], &[2, 3, 4, 5, 6, 4, 0]);
        assert_eq!(&buf[g.seq()..g.seq() + 7], &[0, 0, 0, 0, 0, 1, 0]);
        // Slots: block * 4 + offset; padding gets -1 up to max_tokens.
        assert_eq!(
            &buf[g.slot()..g.slot() + 7],
            &[42, 43, 44, 45, 46, 9 * 4, -1]
        );
        assert!(
            buf[g.slot() + 6..g.slot() + g.max_tokens]
                .iter()
                .all(|&s| s == -1)
        );
        // Sampled rows: the last token of each item; padding rows point at row 0.
        assert_eq!(&buf[g.rows()..g.rows() + 4], &[4, 5, 0, 0]);
        // Block tables: only the needed entries (2 and 2), packed.
        assert_eq!(&buf[g.bt_off()..g.bt_off() + 3], &[0, 2, 0]);
        assert_eq!(&buf[g.bt()..g.bt() + 4], &[10, 11, 3, 9]);
        assert_eq!(p.words, g.bt() + 4);
    }

    #[test]
    fn unsampled_items_get_no_row() {
        let g = geo();
        let mut buf = vec![0i32; g.words()];
        let items = [
            StepItem {
                tokens: &[1, 2],
                pos: 0,
                blocks: &[0],
                sample: false,
            },
            StepItem {
                tokens: &[3],
                pos: 0,
                blocks: &[1],
                sample: true,
            },
        ];
        let p = pack_step(&g, &items, &[false, true], 512, 8192, &mut buf).unwrap();
        assert_eq!(p.samples, 1);
        assert_eq!(p.sample_bucket, 1);
        assert_eq!(p.sampled_items, vec![1]);
        assert_eq!(buf[g.rows()], 2);
        let p = pack_step(&g, &items, &[false, false], 512, 8192, &mut buf).unwrap();
        assert_eq!((p.samples, p.sample_bucket), (0, 0));
    }

    #[test]
    fn bad_steps_are_named() {
        let g = geo();
        let mut buf = vec![0i32; g.words()];
        let one = |tokens: &'static [u32], pos: usize, blocks: &'static [u32]| StepItem {
            tokens,
            pos,
            blocks,
            sample: true,
        };
        let mut go = |items: &[StepItem<'_>]| {
            let want = vec![true; items.len()];
            pack_step(&g, items, &want, 512, 100, &mut buf).unwrap_err()
        };
        assert!(go(&[]).contains("at least one item"));
        assert!(go(&[one(&[], 0, &[0])]).contains("no tokens"));
        assert!(go(&[one(&[512], 0, &[0])]).contains("outside the vocabulary"));
        assert!(go(&[one(&[1], 100, &[0; 26])]).contains("exceed"));
        assert!(go(&[one(&[1], 4, &[0])]).contains("need 2"));
        assert!(go(&[one(&[1], 0, &[64])]).contains("outside the cache"));
        let many = [one(&[1], 0, &[0]); 4];
        assert!(go(&many).contains("max_seqs"));
        let long: &'static [u32] = &[1; 33];
        assert!(go(&[one(long, 0, &[0; 9])]).contains("max_batched_tokens"));
        // Block 1 is written by the first item (position 4) and read by the second.
        let e = go(&[one(&[1], 4, &[0, 1]), one(&[1], 8, &[2, 1, 3])]);
        assert!(e.contains("item 1: block 1 is also in item 0"), "{e}");
        // A block both only read (a full block before either's position) is allowed.
        let want = [true, true];
        let ok = [one(&[1], 4, &[0, 1]), one(&[1], 4, &[0, 2])];
        pack_step(&g, &ok, &want, 512, 100, &mut buf).unwrap();
        let e = pack_step(&g, &[one(&[1], 0, &[0])], &[], 512, 100, &mut buf).unwrap_err();
        assert!(e.contains("sample flags"), "{e}");
        let e = pack_step(&g, &[one(&[1], 0, &[0])], &[true], 512, 100, &mut [0; 3]).unwrap_err();
        assert!(e.contains("input buffer"), "{e}");
    }

    #[test]
    fn stacks_rows_in_order() {
        let q = Tensor::new(vec![2, 3], vec![1., 2., 3., 4., 5., 6.]).unwrap();
        let k = Tensor::new(vec![1, 3], vec![7., 8., 9.]).unwrap();
        assert_eq!(
            stack_rows(&[&q, &k]).unwrap(),
            vec![1., 2., 3., 4., 5., 6., 7., 8., 9.]
        );
        let bad = Tensor::new(vec![1, 2], vec![0., 0.]).unwrap();
        assert!(
            stack_rows(&[&q, &bad])
                .unwrap_err()
                .contains("column counts")
        );
        let (b1, b2) = (
            Tensor::new(vec![2], vec![1., 2.]).unwrap(),
            Tensor::new(vec![1], vec![3.]).unwrap(),
        );
        assert_eq!(stack_rows(&[&b1, &b2]).unwrap(), vec![1., 2., 3.]);
    }

    #[test]
    fn dtype_encoding_rounds_to_nearest_even() {
        assert_eq!(GpuDtype::F32.encode(&[1.5]), 1.5f32.to_le_bytes());
        // 1 + 2^-8 is halfway between two bf16 values: ties to even (1.0).
        assert_eq!(
            GpuDtype::Bf16.encode(&[1.0 + 1.0 / 256.0]),
            0x3f80u16.to_le_bytes()
        );
        assert_eq!(GpuDtype::Bf16.encode(&[-2.0]), 0xc000u16.to_le_bytes());
        assert_eq!(GpuDtype::F16.encode(&[1.0]), 0x3c00u16.to_le_bytes());
        assert_eq!(GpuDtype::F16.encode(&[65536.0]), 0x7c00u16.to_le_bytes());
        assert_eq!(GpuDtype::Bf16.round(1.0 + 1.0 / 128.0), 1.0 + 1.0 / 128.0);
        assert_eq!(GpuDtype::F16.round(1.0 + 1.0 / 4096.0), 1.0);
        assert_eq!("bf16".parse::<GpuDtype>().unwrap(), GpuDtype::Bf16);
        assert!(
            "int8"
                .parse::<GpuDtype>()
                .unwrap_err()
                .contains("unknown dtype")
        );
        assert_eq!(GpuDtype::default(), GpuDtype::Bf16);
    }

    #[test]
    fn config_checks_head_dim() {
        let mut c = synth_config(SynthArch::Qwen25_05b);
        check_config(&c).unwrap();
        c.head_dim = 256;
        c.hidden_size = 14 * 256;
        assert!(check_config(&c).unwrap_err().contains("head_dim 256"));
    }

    #[test]
    fn kv_budget_is_capped_and_sized() {
        let c = synth_config(SynthArch::Qwen25_05b);
        // 16 positions × 24 layers × 2 × 128 × 2 bytes.
        assert_eq!(kv_block_bytes(&c, 16, GpuDtype::Bf16), 196_608);
        let n = blocks_for_budget(&c, 16, GpuDtype::Bf16, 100 << 30, 0.5, 256).unwrap();
        assert_eq!(n, (50usize << 30) / 196_608);
        // A tiny model with 100 GB: capped at max_seqs × full context.
        let t = synth_config(SynthArch::TinyQwen2);
        let n = blocks_for_budget(&t, 16, GpuDtype::F32, 100 << 30, 0.5, 4).unwrap();
        assert_eq!(n, 4 * 8192 / 16);
        let e = blocks_for_budget(&c, 16, GpuDtype::Bf16, 1000, 0.5, 1).unwrap_err();
        assert!(e.contains("no room for the KV cache"), "{e}");
        let e = blocks_for_budget(&c, 16, GpuDtype::Bf16, 1 << 30, 1.5, 1).unwrap_err();
        assert!(e.contains("kv_memory_fraction"), "{e}");
    }
}
