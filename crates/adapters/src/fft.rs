//! A 32-point complex forward DFT (radix-2, decimation in time), unnormalized.

use std::f64::consts::PI;

/// Precomputed twiddles and bit-reversal permutation for n = 32.
#[derive(Debug, Clone)]
pub struct Fft32 {
    /// `(cos, -sin)` of 2πk/32 for k in 0..16, computed in f64 and rounded once.
    twiddle: [(f32, f32); 16],
    bitrev: [u8; 32],
}

impl Default for Fft32 {
    fn default() -> Self {
        Self::new()
    }
}

impl Fft32 {
    /// Build the plan.
    pub fn new() -> Self {
        let mut twiddle = [(0f32, 0f32); 16];
        for (k, t) in twiddle.iter_mut().enumerate() {
            let a = 2.0 * PI * k as f64 / 32.0;
            *t = (a.cos() as f32, (-a.sin()) as f32);
        }
        let mut bitrev = [0u8; 32];
        for (i, r) in bitrev.iter_mut().enumerate() {
            *r = ((i as u8).reverse_bits()) >> 3;
        }
        Fft32 { twiddle, bitrev }
    }

    /// `y = DFT(x)` with x and y as 32 interleaved (re, im) pairs.
    pub fn forward(&self, x: &[f32; 64], y: &mut [f32; 64]) {
        let mut re = [0f32; 32];
        let mut im = [0f32; 32];
        for i in 0..32 {
            let j = usize::from(self.bitrev[i]);
            re[i] = x[2 * j];
            im[i] = x[2 * j + 1];
        }
        let mut half = 1;
        while half < 32 {
            let stride = 16 / half;
            for start in (0..32).step_by(2 * half) {
                for k in 0..half {
                    let (wr, wi) = self.twiddle[k * stride];
                    let (a, b) = (start + k, start + k + half);
                    let tr = re[b] * wr - im[b] * wi;
                    let ti = re[b] * wi + im[b] * wr;
                    re[b] = re[a] - tr;
                    im[b] = im[a] - ti;
                    re[a] += tr;
                    im[a] += ti;
                }
            }
            half *= 2;
        }
        for i in 0..32 {
            y[2 * i] = re[i];
            y[2 * i + 1] = im[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32; 64]) -> Vec<f64> {
        let mut out = vec![0f64; 64];
        for k in 0..32 {
            let (mut sr, mut si) = (0f64, 0f64);
            for n in 0..32 {
                let a = -2.0 * PI * (k * n) as f64 / 32.0;
                let (xr, xi) = (f64::from(x[2 * n]), f64::from(x[2 * n + 1]));
                sr += xr * a.cos() - xi * a.sin();
                si += xr * a.sin() + xi * a.cos();
            }
            out[2 * k] = sr;
            out[2 * k + 1] = si;
        }
        out
    }

    #[test]
    fn matches_naive_dft() {
        let mut x = [0f32; 64];
        let mut s = 12345u32;
        for v in x.iter_mut() {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            *v = (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0;
        }
        let mut y = [0f32; 64];
        Fft32::new().forward(&x, &mut y);
        for (a, b) in y.iter().zip(naive(&x)) {
            assert!((f64::from(*a) - b).abs() < 1e-4, "{a} vs {b}");
        }
    }

    #[test]
    fn delta_transforms_to_ones() {
        let mut x = [0f32; 64];
        x[0] = 1.0;
        let mut y = [0f32; 64];
        Fft32::new().forward(&x, &mut y);
        for k in 0..32 {
            assert_eq!((y[2 * k], y[2 * k + 1]), (1.0, 0.0));
        }
    }
}
