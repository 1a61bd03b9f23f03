//! Deterministic payloads and the independent f64 references that golden replies are checked
//! against.

use bgs_protocol::Op;
use bgs_protocol::wire::{ONE_SHOT_WORDS, gemm8_b};

/// splitmix64: tiny, seedable, and the same on every platform, so a seed names a payload set.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform f32 in [-1, 1) with 24 random bits (exactly representable).
    pub(crate) fn next_f32(&mut self) -> f32 {
        let m = (self.next_u64() >> 40) as u32; // 24 bits
        (m as f32) / 8_388_608.0 - 1.0
    }
}

/// Payload words actually sent for `op`: gemm8/fft32 always carry 64 words.
pub fn payload_words(op: Op, words: u32) -> u32 {
    match op {
        Op::Gemm8 | Op::Fft32 => ONE_SHOT_WORDS,
        _ => words,
    }
}

/// The deterministic payload number `index` of the set named by `seed`.
///
/// gemm8/fft32: 64 f32 values in [-1, 1) (the `words` argument is ignored); other ops:
/// `words` arbitrary u32 values. Each index gets its own generator stream, so payload `i` does
/// not depend on how many payloads are generated.
pub fn make_payload(op: Op, words: u32, seed: u64, index: usize) -> Vec<u32> {
    let mut rng = SplitMix64::new(
        seed ^ (index as u64)
            .wrapping_add(1)
            .wrapping_mul(0xD1B5_4A32_D192_ED03),
    );
    let n = payload_words(op, words) as usize;
    match op {
        Op::Gemm8 | Op::Fft32 => (0..n).map(|_| rng.next_f32().to_bits()).collect(),
        _ => (0..n).map(|_| rng.next_u64() as u32).collect(),
    }
}

/// The deterministic prompt number `index` of the set named by `seed`: `tokens` token ids drawn
/// uniformly from `0..range` (`range` ≥ 1). Like [`make_payload`], each index has its own
/// generator stream.
pub fn make_prompt(seed: u64, index: usize, tokens: u32, range: u32) -> Vec<u32> {
    let mut rng = SplitMix64::new(
        seed ^ (index as u64)
            .wrapping_add(1)
            .wrapping_mul(0xD1B5_4A32_D192_ED03),
    );
    let range = u64::from(range.max(1));
    (0..tokens)
        .map(|_| (rng.next_u64() % range) as u32)
        .collect()
}

/// The f64 reference result of `op` on `payload`, or an empty vector for ops without a
/// numerical reference (echo is checked for exact equality instead).
///
/// gemm8: A·B (row-major 8x8) with B = [`gemm8_b`]; fft32: the unnormalized forward DFT
/// X[k] = Σ x[n]·e^{-2πi·kn/32}, computed naively (O(n²)) so it shares nothing with the
/// server's FFT; output interleaved re, im.
pub fn golden_reference(op: Op, payload: &[u32]) -> Vec<f64> {
    let x: Vec<f64> = payload
        .iter()
        .map(|&w| f64::from(f32::from_bits(w)))
        .collect();
    match op {
        Op::Gemm8 if x.len() == 64 => {
            let b = gemm8_b();
            let mut c = vec![0f64; 64];
            for i in 0..8 {
                for j in 0..8 {
                    c[i * 8 + j] = (0..8).map(|k| x[i * 8 + k] * f64::from(b[k * 8 + j])).sum();
                }
            }
            c
        }
        Op::Fft32 if x.len() == 64 => {
            let n = 32;
            let mut out = vec![0f64; 64];
            for k in 0..n {
                let (mut re, mut im) = (0f64, 0f64);
                for t in 0..n {
                    // Reduce k·t mod n first: exact angles for the common multiples.
                    let ang = -2.0 * std::f64::consts::PI * ((k * t) % n) as f64 / n as f64;
                    let (s, c) = ang.sin_cos();
                    let (xr, xi) = (x[2 * t], x[2 * t + 1]);
                    re += xr * c - xi * s;
                    im += xr * s + xi * c;
                }
                out[2 * k] = re;
                out[2 * k + 1] = im;
            }
            out
        }
        _ => Vec::new(),
    }
}

/// Check a golden reply against the reference: `Err(reason)` if it is off.
///
/// Tolerance for gemm8/fft32: max |reply - ref| ≤ 1e-4 · (1 + max |ref|); echo: exact.
pub fn check_reference(op: Op, payload: &[u32], reply: &[u32]) -> Result<(), String> {
    match op {
        Op::Gemm8 | Op::Fft32 => {
            let r = golden_reference(op, payload);
            if reply.len() != r.len() {
                return Err(format!(
                    "reply has {} words, the reference {}",
                    reply.len(),
                    r.len()
                ));
            }
            let scale = r.iter().fold(0f64, |m, v| m.max(v.abs()));
            let tol = 1e-4 * (1.0 + scale);
            let (mut worst, mut at) = (0f64, 0usize);
            for (i, (&w, &v)) in reply.iter().zip(&r).enumerate() {
                let got = f64::from(f32::from_bits(w));
                // A NaN must fail the check, so it counts as an infinite error.
                let err = (got - v).abs();
                let err = if err.is_nan() { f64::INFINITY } else { err };
                if err > worst {
                    worst = err;
                    at = i;
                }
            }
            if worst <= tol {
                Ok(())
            } else {
                Err(format!(
                    "max abs error {worst:.3e} at word {at} exceeds tolerance {tol:.3e} \
                     (got {}, reference {})",
                    f32::from_bits(reply[at]),
                    r[at]
                ))
            }
        }
        _ => {
            if reply == payload {
                Ok(())
            } else {
                let at = reply
                    .iter()
                    .zip(payload)
                    .position(|(a, b)| a != b)
                    .unwrap_or(reply.len().min(payload.len()));
                Err(format!(
                    "echo reply differs from the payload (lengths {} / {}, first difference at word {at})",
                    reply.len(),
                    payload.len()
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn payloads_are_deterministic_and_in_range() {
        let a = make_payload(Op::Gemm8, 7, 42, 3);
        assert_eq!(a.len(), 64);
        assert_eq!(a, make_payload(Op::Gemm8, 64, 42, 3));
        assert_ne!(a, make_payload(Op::Gemm8, 64, 42, 4));
        assert_ne!(a, make_payload(Op::Gemm8, 64, 43, 3));
        assert!(a.iter().all(|&w| (-1.0..1.0).contains(&f32::from_bits(w))));
        assert_eq!(make_payload(Op::Echo, 5, 1, 0).len(), 5);
        assert_eq!(make_payload(Op::Echo, 0, 1, 0).len(), 0);
    }

    #[test]
    fn prompts_are_deterministic_and_in_range() {
        let a = make_prompt(5, 2, 100, 7);
        assert_eq!(a.len(), 100);
        assert_eq!(a, make_prompt(5, 2, 100, 7));
        assert_ne!(a, make_prompt(5, 3, 100, 7));
        assert!(a.iter().all(|&t| t < 7));
        // Every value of a small range shows up in a long prompt.
        assert!((0..7).all(|v| a.contains(&v)));
        assert!(make_prompt(1, 0, 50, 1).iter().all(|&t| t == 0));
    }

    #[test]
    fn gemm8_reference_of_identity_is_b() {
        let mut a = [0f32; 64];
        for i in 0..8 {
            a[i * 8 + i] = 1.0;
        }
        let r = golden_reference(Op::Gemm8, &bits(&a));
        let b = gemm8_b();
        for k in 0..64 {
            assert_eq!(r[k], f64::from(b[k]));
        }
        // A with a single 2 at (0, 3): row 0 of the product is 2·B[3][·], the rest zero.
        let mut a = [0f32; 64];
        a[3] = 2.0;
        let r = golden_reference(Op::Gemm8, &bits(&a));
        for (j, v) in r.iter().take(8).enumerate() {
            assert_eq!(*v, 2.0 * ((3 * 8 + j) as f64 - 31.5) / 32.0);
        }
        assert!(r[8..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn fft32_reference_of_delta_and_constant() {
        // x = δ[n]: X[k] = 1 for all k.
        let mut x = [0f32; 64];
        x[0] = 1.0;
        let r = golden_reference(Op::Fft32, &bits(&x));
        for k in 0..32 {
            assert!((r[2 * k] - 1.0).abs() < 1e-12 && r[2 * k + 1].abs() < 1e-12);
        }
        // x = 0.5 + 0.25i everywhere: X[0] = 32·x, X[k≠0] = 0.
        let mut x = [0f32; 64];
        for n in 0..32 {
            x[2 * n] = 0.5;
            x[2 * n + 1] = 0.25;
        }
        let r = golden_reference(Op::Fft32, &bits(&x));
        assert!((r[0] - 16.0).abs() < 1e-12 && (r[1] - 8.0).abs() < 1e-12);
        assert!(r[2..].iter().all(|v| v.abs() < 1e-12));
        // x = δ[n-1]: X[k] = e^{-2πik/32}.
        let mut x = [0f32; 64];
        x[2] = 1.0;
        let r = golden_reference(Op::Fft32, &bits(&x));
        let a = -2.0 * std::f64::consts::PI * 5.0 / 32.0;
        assert!((r[10] - a.cos()).abs() < 1e-12 && (r[11] - a.sin()).abs() < 1e-12);
    }

    #[test]
    fn reference_check_tolerance() {
        let p = make_payload(Op::Gemm8, 64, 9, 0);
        let exact: Vec<u32> = golden_reference(Op::Gemm8, &p)
            .iter()
            .map(|&v| (v as f32).to_bits())
            .collect();
        assert!(check_reference(Op::Gemm8, &p, &exact).is_ok());
        let mut bad = exact.clone();
        bad[5] = (f32::from_bits(bad[5]) + 0.01).to_bits();
        assert!(check_reference(Op::Gemm8, &p, &bad).is_err());
        bad[5] = f32::NAN.to_bits();
        assert!(check_reference(Op::Gemm8, &p, &bad).is_err());
        assert!(check_reference(Op::Gemm8, &p, &exact[..63]).is_err());
        assert!(check_reference(Op::Echo, &[1, 2], &[1, 2]).is_ok());
        assert!(check_reference(Op::Echo, &[1, 2], &[1, 3]).is_err());
    }
}
