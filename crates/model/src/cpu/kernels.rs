//! Numeric kernels of the CPU forward pass.
//!
//! Determinism rests on one rule: every output value is computed by one fixed sequence of
//! f32 operations that depends only on the value's own inputs, never on how many tokens,
//! rows or threads share the call. Rust never reassociates floating-point arithmetic and
//! never contracts `a * b + c` into a fused multiply-add on its own, and the explicit AVX
//! kernels below use separate multiplies and adds lane for lane, so the AVX path and the
//! portable one produce the same bits: only the number of lanes processed per instruction
//! differs, not the operations. (An FMA variant of the batched kernel measured no faster on
//! the development machine, and would make the bits depend on the CPU; the non-FMA
//! definition gives the same bits on every machine.)

/// Independent accumulators of one dot product. Sixteen keep two AVX (or four SSE) add
/// chains per output in flight; the final reduction combines them in a fixed tree.
pub(crate) const LANES: usize = 16;

/// Tokens that share one pass over a weight row (their accumulators stay in registers).
const GROUP: usize = 4;

/// Tokens whose activations are kept hot while the weight rows stream past.
const TOKEN_TILE: usize = 32;

/// Sum of 16 partial sums in a fixed pairwise order.
#[inline(always)]
fn reduce(acc: &[f32; LANES]) -> f32 {
    let mut s = *acc;
    let mut width = LANES / 2;
    while width > 0 {
        for j in 0..width {
            s[j] += s[j + width];
        }
        width /= 2;
    }
    s[0]
}

/// `acc[j] += w[j] * x[j]` for the 16 lanes of one chunk.
#[inline(always)]
fn mul_add16(acc: &mut [f32; LANES], w: &[f32], x: &[f32]) {
    let (w, x): (&[f32; LANES], &[f32; LANES]) = (
        w.try_into().expect("chunk of LANES"),
        x.try_into().expect("chunk of LANES"),
    );
    for j in 0..LANES {
        acc[j] += w[j] * x[j];
    }
}

/// The tail of a dot product (fewer than 16 values) into the first lanes, then the fixed
/// reduction.
#[inline(always)]
fn finish(mut acc: [f32; LANES], w: &[f32], x: &[f32]) -> f32 {
    for (j, (a, b)) in w.iter().zip(x).enumerate() {
        acc[j] += a * b;
    }
    reduce(&acc)
}

/// Dot product of `w` and `x` (same length).
#[inline(always)]
fn dot1(w: &[f32], x: &[f32]) -> f32 {
    let x = &x[..w.len()];
    let mut acc = [0f32; LANES];
    let (wc, xc) = (w.chunks_exact(LANES), x.chunks_exact(LANES));
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        mul_add16(&mut acc, a, b);
    }
    finish(acc, wr, xr)
}

/// Dot products of one weight row with four activation rows, sharing each load of `w`.
/// Each result is bit-identical to [`dot1`] of the same pair: every token has its own
/// accumulators, updated by the same operations in the same order.
#[inline(always)]
fn dot4(w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
    let n = w.len();
    let x = x.map(|x| &x[..n]);
    let (mut a0, mut a1, mut a2, mut a3) =
        ([0f32; LANES], [0f32; LANES], [0f32; LANES], [0f32; LANES]);
    let full = n - n % LANES;
    let chunks = w[..full]
        .chunks_exact(LANES)
        .zip(x[0][..full].chunks_exact(LANES))
        .zip(x[1][..full].chunks_exact(LANES))
        .zip(x[2][..full].chunks_exact(LANES))
        .zip(x[3][..full].chunks_exact(LANES));
    for ((((wc, x0), x1), x2), x3) in chunks {
        mul_add16(&mut a0, wc, x0);
        mul_add16(&mut a1, wc, x1);
        mul_add16(&mut a2, wc, x2);
        mul_add16(&mut a3, wc, x3);
    }
    let wr = &w[full..];
    [
        finish(a0, wr, &x[0][full..]),
        finish(a1, wr, &x[1][full..]),
        finish(a2, wr, &x[2][full..]),
        finish(a3, wr, &x[3][full..]),
    ]
}

/// A raw output pointer shared by the workers of one dispatch; every index is written by
/// exactly one worker (the callers' partitions are disjoint).
#[derive(Clone, Copy, Debug)]
pub(crate) struct OutPtr(pub(crate) *mut f32);

// SAFETY: the pointer is only dereferenced inside a pool dispatch whose caller holds the
// exclusive borrow of the buffer for the whole dispatch, and workers write disjoint indices.
unsafe impl Send for OutPtr {}
// SAFETY: as above; no two workers touch the same index.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The address of element `i`. A method (not `.0`) so closures capture the whole
    /// `Sync` wrapper rather than the bare pointer.
    ///
    /// # Safety
    /// `i` must lie inside the buffer the pointer came from.
    #[inline(always)]
    pub(crate) unsafe fn at(self, i: usize) -> *mut f32 {
        // SAFETY: the caller keeps `i` inside the buffer.
        unsafe { self.0.add(i) }
    }
}

/// One weight matrix of a (possibly multi-matrix) product.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatJob<'a> {
    /// `[rows, in_dim]` row-major.
    pub w: &'a [f32],
    /// Output rows of this matrix.
    pub rows: usize,
    /// Optional per-row bias added after the dot product.
    pub bias: Option<&'a [f32]>,
    /// `out[t * out_stride + r]` receives row `r` for token `t`.
    pub out: OutPtr,
    /// Distance between two tokens' outputs.
    pub out_stride: usize,
}

/// `out[t][r] = dot1(w[r], x[t]) (+ bias[r])` for rows `r` in `rows`, tokens `0..n`.
///
/// # Safety
/// `job.out` must be valid for writes at `t * out_stride + r` for every `t < n`, `r in rows`,
/// and no other thread may access those indices during the call.
#[inline(always)]
unsafe fn rows_kernel(
    job: &MatJob<'_>,
    x: &[f32],
    in_dim: usize,
    n: usize,
    rows: std::ops::Range<usize>,
    avx: bool,
) {
    let mut t0 = 0;
    while t0 < n {
        let t1 = (t0 + TOKEN_TILE).min(n);
        for r in rows.clone() {
            let w = &job.w[r * in_dim..(r + 1) * in_dim];
            let b = job.bias.map_or(0.0, |b| b[r]);
            let has_bias = job.bias.is_some();
            let mut t = t0;
            let put = |t: usize, v: f32| {
                let v = if has_bias { v + b } else { v };
                // SAFETY: the caller guarantees `out` is writable at this index and that no
                // other thread touches it.
                unsafe { *job.out.at(t * job.out_stride + r) = v };
            };
            while t + GROUP <= t1 {
                let xs: [&[f32]; GROUP] =
                    std::array::from_fn(|g| &x[(t + g) * in_dim..(t + g + 1) * in_dim]);
                let d = dot4_with(avx, w, xs);
                for (g, v) in d.into_iter().enumerate() {
                    put(t + g, v);
                }
                t += GROUP;
            }
            while t < t1 {
                put(t, dot_with(avx, w, &x[t * in_dim..(t + 1) * in_dim]));
                t += 1;
            }
        }
        t0 = t1;
    }
}

/// Whether the AVX kernels may run (checked once; the answer never changes the bits).
pub(crate) fn use_avx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVX.get_or_init(|| std::is_x86_feature_detected!("avx"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`dot1`] through the AVX kernel when `avx` (same bits either way).
#[inline(always)]
pub(crate) fn dot_with(avx: bool, w: &[f32], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx {
        // SAFETY: `avx` is only true when the CPU has AVX (`use_avx`).
        return unsafe { avx::dot1(w, x) };
    }
    let _ = avx;
    dot1(w, x)
}

/// [`dot4`] through the AVX kernel when `avx` (same bits either way).
#[inline(always)]
fn dot4_with(avx: bool, w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if avx {
        // SAFETY: `avx` is only true when the CPU has AVX (`use_avx`).
        return unsafe { avx::dot4(w, x) };
    }
    let _ = avx;
    dot4(w, x)
}

/// Explicit AVX versions of [`dot1`] and [`dot4`]. Lane `j` of the two 8-wide accumulators
/// is accumulator `j` of the scalar code, updated by the same `acc + w * x` (separate
/// multiply and add, no FMA); the tail and the reduction are the scalar code's. So the
/// results are bit-identical to the portable kernels.
#[cfg(target_arch = "x86_64")]
mod avx {
    use super::{LANES, finish};
    use std::arch::x86_64::{
        __m256, _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };

    #[inline(always)]
    fn spill(lo: __m256, hi: __m256) -> [f32; LANES] {
        let mut a = [0f32; LANES];
        // SAFETY: `a` holds 16 floats: two unaligned 8-float stores fit.
        unsafe {
            _mm256_storeu_ps(a.as_mut_ptr(), lo);
            _mm256_storeu_ps(a.as_mut_ptr().add(8), hi);
        }
        a
    }

    /// # Safety
    /// The CPU must support AVX.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn dot1(w: &[f32], x: &[f32]) -> f32 {
        let n = w.len();
        let x = &x[..n];
        let full = n - n % LANES;
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i < full {
            // SAFETY: `i + 16 <= full <= n`, and both slices hold `n` values.
            unsafe {
                let (w0, w1) = (
                    _mm256_loadu_ps(w.as_ptr().add(i)),
                    _mm256_loadu_ps(w.as_ptr().add(i + 8)),
                );
                lo = _mm256_add_ps(lo, _mm256_mul_ps(w0, _mm256_loadu_ps(x.as_ptr().add(i))));
                hi = _mm256_add_ps(
                    hi,
                    _mm256_mul_ps(w1, _mm256_loadu_ps(x.as_ptr().add(i + 8))),
                );
            }
            i += LANES;
        }
        finish(spill(lo, hi), &w[full..], &x[full..])
    }

    /// # Safety
    /// The CPU must support AVX.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn dot4(w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
        let n = w.len();
        let x = x.map(|x| &x[..n]);
        let full = n - n % LANES;
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut i = 0;
        while i < full {
            // SAFETY: `i + 16 <= full <= n`, and all five slices hold `n` values.
            unsafe {
                let (w0, w1) = (
                    _mm256_loadu_ps(w.as_ptr().add(i)),
                    _mm256_loadu_ps(w.as_ptr().add(i + 8)),
                );
                for t in 0..4 {
                    let p = x[t].as_ptr().add(i);
                    acc[2 * t] = _mm256_add_ps(acc[2 * t], _mm256_mul_ps(w0, _mm256_loadu_ps(p)));
                    acc[2 * t + 1] =
                        _mm256_add_ps(acc[2 * t + 1], _mm256_mul_ps(w1, _mm256_loadu_ps(p.add(8))));
                }
            }
            i += LANES;
        }
        let wr = &w[full..];
        std::array::from_fn(|t| finish(spill(acc[2 * t], acc[2 * t + 1]), wr, &x[t][full..]))
    }
}

/// Rows `rows` of the concatenation of `jobs` (job 0's rows first), for tokens `0..n` of
/// `x` (`[n, in_dim]`).
///
/// # Safety
/// Every job's `out` must be valid for writes at the indices of the rows in `rows` (see
/// [`rows_kernel`]) and no other thread may touch them during the call.
pub(crate) unsafe fn matmul_rows(
    jobs: &[MatJob<'_>],
    x: &[f32],
    in_dim: usize,
    n: usize,
    rows: std::ops::Range<usize>,
) {
    let avx = use_avx();
    let mut base = 0;
    for job in jobs {
        let lo = rows.start.max(base);
        let hi = rows.end.min(base + job.rows);
        if lo < hi {
            // SAFETY: the caller's contract, for this job's share of `rows`.
            unsafe { rows_kernel(job, x, in_dim, n, lo - base..hi - base, avx) };
        }
        base += job.rows;
    }
}

/// RMSNorm of one row: `x / sqrt(mean(x^2) + eps) * weight`.
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mean = dot1(x, x) / x.len() as f32;
    let inv = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// Rotate-half RoPE of one head in place (Hugging Face `apply_rotary_pos_emb`):
/// `x[i] = x[i] cos - x[i+h] sin`, `x[i+h] = x[i+h] cos + x[i] sin`, `h = head_dim / 2`.
pub(crate) fn rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    let (a, b) = x.split_at_mut(half);
    for i in 0..half {
        let (x1, x2) = (a[i], b[i]);
        a[i] = x1 * cos[i] + (-x2) * sin[i];
        b[i] = x2 * cos[i] + x1 * sin[i];
    }
}

/// SiLU(gate) * up, element-wise into `gate`.
pub(crate) fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let s = *g / (1.0 + (-*g).exp());
        *g = s * u;
    }
}

/// Index of the largest value, the lowest index among equal ones (NaN never wins).
pub(crate) fn argmax(v: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x > best_v {
            best_v = x;
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_dot_kernels_agree_bitwise() {
        for len in [1, 5, 16, 64, 77, 576] {
            let w: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 11) as f32 - 5.3) * 0.37)
                .collect();
            let xs: Vec<Vec<f32>> = (0..4)
                .map(|t| {
                    (0..len)
                        .map(|i| ((i * 13 + t * 7) % 17) as f32 * 0.1 - 0.8)
                        .collect()
                })
                .collect();
            let xr: [&[f32]; 4] = std::array::from_fn(|t| xs[t].as_slice());
            let g = dot4(&w, xr);
            for t in 0..4 {
                let one = dot1(&w, &xs[t]);
                assert_eq!(g[t].to_bits(), one.to_bits());
                let exact: f64 = w
                    .iter()
                    .zip(&xs[t])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                assert!((one as f64 - exact).abs() < 1e-3, "{one} vs {exact}");
                if use_avx() {
                    assert_eq!(dot_with(true, &w, &xs[t]).to_bits(), one.to_bits());
                    assert_eq!(dot4_with(true, &w, xr)[t].to_bits(), one.to_bits());
                }
            }
        }
    }

    #[test]
    fn argmax_ties_to_lowest() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
    }
}
