//! Numeric kernels of the CPU forward pass.
//!
//! Determinism rests on one rule: every output value is computed by one fixed sequence of
//! f32 operations that depends only on the value's own inputs, never on how many tokens,
//! rows or threads share the call. Rust never reassociates floating-point arithmetic and
//! never contracts `a * b + c` into a fused multiply-add on its own, so code compiled with
//! different vector widths (the AVX2 clone below and the baseline SSE2 one) produces the same
//! bits: only the number of lanes processed per instruction differs, not the operations.

/// Independent accumulators of one dot product. Sixteen keep two AVX2 (or four SSE) add
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

/// Dot products of one weight row with `N` activation rows (each as long as `w`).
///
/// The result for each activation row is the same whatever `N` is: each has its own
/// accumulators, updated in the same order.
#[inline(always)]
fn dot_group<const N: usize>(w: &[f32], xs: [&[f32]; N]) -> [f32; N] {
    let len = w.len();
    let full = len - len % LANES;
    let mut acc = [[0f32; LANES]; N];
    let xs = xs.map(|x| &x[..len]);
    for (c, wc) in w[..full].chunks_exact(LANES).enumerate() {
        let base = c * LANES;
        for t in 0..N {
            let xc = &xs[t][base..base + LANES];
            for j in 0..LANES {
                acc[t][j] += wc[j] * xc[j];
            }
        }
    }
    for t in 0..N {
        for j in 0..len - full {
            acc[t][j] += w[full + j] * xs[t][full + j];
        }
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = reduce(&acc[t]);
    }
    out
}

/// The dot product every matrix-vector product and attention score uses.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_group::<1>(a, [b])[0]
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

/// `out[t][r] = dot(w[r], x[t]) (+ bias[r])` for rows `r` in `rows`, tokens `0..n`.
///
/// # Safety
/// `job.out` must be valid for writes at `t * out_stride + r` for every `t < n`, `r in rows`,
/// and no other thread may access those indices during the call.
#[inline(always)]
unsafe fn rows_generic(
    job: &MatJob<'_>,
    x: &[f32],
    in_dim: usize,
    n: usize,
    rows: std::ops::Range<usize>,
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
                let d = dot_group::<GROUP>(w, xs);
                for (g, v) in d.into_iter().enumerate() {
                    put(t + g, v);
                }
                t += GROUP;
            }
            while t < t1 {
                put(t, dot(w, &x[t * in_dim..(t + 1) * in_dim]));
                t += 1;
            }
        }
        t0 = t1;
    }
}

/// [`rows_generic`] compiled for AVX2 (no FMA: the same operations as the baseline clone).
///
/// # Safety
/// As [`rows_generic`], and the CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rows_avx2(
    job: &MatJob<'_>,
    x: &[f32],
    in_dim: usize,
    n: usize,
    rows: std::ops::Range<usize>,
) {
    // SAFETY: forwarded caller contract.
    unsafe { rows_generic(job, x, in_dim, n, rows) }
}

/// Whether the AVX2 clones may run (checked once; the answer never changes the bits).
fn use_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVX2.get_or_init(|| std::is_x86_feature_detected!("avx2"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Rows `rows` of the concatenation of `jobs` (job 0's rows first), for tokens `0..n` of
/// `x` (`[n, in_dim]`).
///
/// # Safety
/// Every job's `out` must be valid for writes at the indices of the rows in `rows` (see
/// [`rows_generic`]) and no other thread may touch them during the call.
pub(crate) unsafe fn matmul_rows(
    jobs: &[MatJob<'_>],
    x: &[f32],
    in_dim: usize,
    n: usize,
    rows: std::ops::Range<usize>,
) {
    let avx2 = use_avx2();
    let mut base = 0;
    for job in jobs {
        let lo = rows.start.max(base);
        let hi = rows.end.min(base + job.rows);
        if lo < hi {
            let local = lo - base..hi - base;
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: AVX2 is present (checked above); the rest is the caller's contract.
                unsafe { rows_avx2(job, x, in_dim, n, local) };
                base += job.rows;
                continue;
            }
            let _ = avx2;
            // SAFETY: the caller's contract.
            unsafe { rows_generic(job, x, in_dim, n, local) };
        }
        base += job.rows;
    }
}

/// RMSNorm of one row: `x / sqrt(mean(x^2) + eps) * weight`.
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mean = dot(x, x) / x.len() as f32;
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
    fn dot_group_matches_single_dot_bitwise() {
        let w: Vec<f32> = (0..77)
            .map(|i| ((i * 37 % 11) as f32 - 5.3) * 0.37)
            .collect();
        let xs: Vec<Vec<f32>> = (0..4)
            .map(|t| {
                (0..77)
                    .map(|i| ((i * 13 + t * 7) % 17) as f32 * 0.1 - 0.8)
                    .collect()
            })
            .collect();
        let g = dot_group::<4>(&w, std::array::from_fn(|t| xs[t].as_slice()));
        for t in 0..4 {
            assert_eq!(g[t].to_bits(), dot(&w, &xs[t]).to_bits());
            let exact: f64 = w
                .iter()
                .zip(&xs[t])
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            assert!((g[t] as f64 - exact).abs() < 1e-3, "{} vs {exact}", g[t]);
        }
    }

    #[test]
    fn argmax_ties_to_lowest() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
    }
}
