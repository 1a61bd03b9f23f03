//! Adapters: the CPU implementations of the one-shot ops (echo, gemm8, fft32).
//!
//! They define the reference semantics the GPU kernels must match. Executors do not call them
//! directly: `bgs_engine::oneshot::OneShotEngine` wraps [`OneShotCpu`] as an engine.

pub mod fft;
pub mod gemm;

use bgs_protocol::{Op, Status};

/// The one-shot CPU adapter: echo, gemm8 (A·B with the fixed server matrix) and fft32.
///
/// gemm8 and fft32 really do the work `repeat` times: the input passes through
/// [`std::hint::black_box`] on every iteration so the compiler cannot hoist the computation.
#[derive(Debug, Clone)]
pub struct OneShotCpu {
    b: [f32; 64],
    plan: fft::Fft32,
    out: [u32; 64],
}

impl Default for OneShotCpu {
    fn default() -> Self {
        OneShotCpu {
            b: bgs_protocol::wire::gemm8_b(),
            plan: fft::Fft32::new(),
            out: [0; 64],
        }
    }
}

impl OneShotCpu {
    /// Run gemm8 `repeat` times on `a` (64 f32 bit patterns) and return the result words.
    pub fn gemm8(&mut self, a: &[u32], repeat: u32) -> &[u32; 64] {
        let mut af = [0f32; 64];
        for (d, s) in af.iter_mut().zip(a) {
            *d = f32::from_bits(*s);
        }
        let mut c = [0f32; 64];
        for _ in 0..Op::Gemm8.spec().param_value(repeat) {
            gemm::gemm8(std::hint::black_box(&af), &self.b, &mut c);
        }
        for (d, s) in self.out.iter_mut().zip(&c) {
            *d = s.to_bits();
        }
        &self.out
    }

    /// Run one validated one-shot request and return its single reply frame (status and
    /// words; the words borrow `payload` for echo, else this adapter's output buffer).
    ///
    /// The framer has validated sizes and params; they are re-checked cheaply so that a caller
    /// that bypasses it gets an error status instead of a panic. `generate` is not a one-shot
    /// op: a server without a model answers it `UnknownOp`.
    pub fn run<'a>(&'a mut self, op: Op, param: u32, payload: &'a [u32]) -> (Status, &'a [u32]) {
        // The op table's rules (the framer checked them; a repeat of 0 means 1).
        let one_shot_ok =
            bgs_protocol::ops::check(op.spec(), payload.len() as u32, param, 0).is_ok();
        match op {
            Op::Echo => (Status::Ok, payload),
            Op::Gemm8 if one_shot_ok => (Status::Ok, &self.gemm8(payload, param)[..]),
            Op::Fft32 if one_shot_ok => (Status::Ok, &self.fft32(payload, param)[..]),
            Op::Gemm8 | Op::Fft32 => (Status::BadParam, &[]),
            Op::Generate => (Status::UnknownOp, &[]),
        }
    }

    /// Run fft32 `repeat` times on `x` (32 interleaved complex64) and return the result words.
    pub fn fft32(&mut self, x: &[u32], repeat: u32) -> &[u32; 64] {
        let mut xf = [0f32; 64];
        for (d, s) in xf.iter_mut().zip(x) {
            *d = f32::from_bits(*s);
        }
        let mut y = [0f32; 64];
        for _ in 0..Op::Fft32.spec().param_value(repeat) {
            self.plan.forward(std::hint::black_box(&xf), &mut y);
        }
        for (d, s) in self.out.iter_mut().zip(&y) {
            *d = s.to_bits();
        }
        &self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echo_and_errors() {
        let mut a = OneShotCpu::default();
        assert_eq!(a.run(Op::Echo, 5, &[1, 2, 3]), (Status::Ok, &[1, 2, 3][..]));
        assert_eq!(a.run(Op::Gemm8, 1, &[1, 2, 3]).0, Status::BadParam);
        assert_eq!(a.run(Op::Fft32, 1, &[0; 63]).0, Status::BadParam);
        assert_eq!(a.run(Op::Generate, 1, &[]).0, Status::UnknownOp);
        let (st, words) = a.run(Op::Gemm8, 1, &[0; 64]);
        assert_eq!((st, words.len()), (Status::Ok, 64));
    }

    #[test]
    fn repeat_does_not_change_the_result() {
        let mut a = OneShotCpu::default();
        let x: Vec<u32> = (0..64).map(|i| (i as f32 * 0.25 - 3.0).to_bits()).collect();
        let g1 = *a.gemm8(&x, 1);
        let g7 = *a.gemm8(&x, 7);
        assert_eq!(g1, g7);
        let f1 = *a.fft32(&x, 1);
        let f3 = *a.fft32(&x, 3);
        assert_eq!(f1, f3);
    }

    #[test]
    fn gemm8_identity_rows() {
        // A = identity gives A·B = B.
        let mut a = OneShotCpu::default();
        let mut id = [0u32; 64];
        for i in 0..8 {
            id[i * 9] = 1f32.to_bits();
        }
        let out = *a.gemm8(&id, 1);
        let b = bgs_protocol::wire::gemm8_b();
        for k in 0..64 {
            assert_eq!(f32::from_bits(out[k]), b[k]);
        }
    }
}
