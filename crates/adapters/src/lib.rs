//! Adapters: the work an executor runs in a slot for one request.
//!
//! An adapter turns a request (op, param, payload words) into one or more reply frames through
//! an [`Emit`] sink. One-shot adapters emit exactly one final frame; the generation adapter (a
//! later addition) emits a token frame per generated token and then a final frame. The CPU
//! implementations here define the reference semantics that the GPU adapters must match.

pub mod fft;
pub mod gemm;

use bgs_protocol::{Op, Status};

/// Where an adapter writes its reply frames.
pub trait Emit {
    /// Publish one frame. `final_` ends the request; `stream_seq` is the token index for
    /// streamed frames (0 otherwise).
    fn emit(&mut self, status: Status, final_: bool, stream_seq: u32, words: &[u32]);
}

/// Work that runs in an executor slot.
pub trait Adapter: Send {
    /// Execute one validated request and emit its reply frames (at least one final frame).
    fn run(&mut self, op: Op, param: u32, payload: &[u32], emit: &mut dyn Emit);
}

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
        for _ in 0..repeat.max(1) {
            gemm::gemm8(std::hint::black_box(&af), &self.b, &mut c);
        }
        for (d, s) in self.out.iter_mut().zip(&c) {
            *d = s.to_bits();
        }
        &self.out
    }

    /// Run fft32 `repeat` times on `x` (32 interleaved complex64) and return the result words.
    pub fn fft32(&mut self, x: &[u32], repeat: u32) -> &[u32; 64] {
        let mut xf = [0f32; 64];
        for (d, s) in xf.iter_mut().zip(x) {
            *d = f32::from_bits(*s);
        }
        let mut y = [0f32; 64];
        for _ in 0..repeat.max(1) {
            self.plan.forward(std::hint::black_box(&xf), &mut y);
        }
        for (d, s) in self.out.iter_mut().zip(&y) {
            *d = s.to_bits();
        }
        &self.out
    }
}

impl Adapter for OneShotCpu {
    fn run(&mut self, op: Op, param: u32, payload: &[u32], emit: &mut dyn Emit) {
        // The framer has validated sizes and params; re-check cheaply so that a caller that
        // bypasses it gets an error frame instead of a panic.
        let one_shot_ok = payload.len() == 64 && param <= bgs_protocol::MAX_REPEAT;
        match op {
            Op::Echo => emit.emit(Status::Ok, true, 0, payload),
            Op::Gemm8 if one_shot_ok => {
                let out = *self.gemm8(payload, param);
                emit.emit(Status::Ok, true, 0, &out);
            }
            Op::Fft32 if one_shot_ok => {
                let out = *self.fft32(payload, param);
                emit.emit(Status::Ok, true, 0, &out);
            }
            Op::Gemm8 | Op::Fft32 => emit.emit(Status::BadParam, true, 0, &[]),
            Op::Generate => emit.emit(Status::UnknownOp, true, 0, &[]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Collect(Vec<(Status, bool, u32, Vec<u32>)>);
    impl Emit for Collect {
        fn emit(&mut self, status: Status, final_: bool, stream_seq: u32, words: &[u32]) {
            self.0.push((status, final_, stream_seq, words.to_vec()));
        }
    }

    #[test]
    fn echo_and_errors() {
        let mut a = OneShotCpu::default();
        let mut c = Collect::default();
        a.run(Op::Echo, 5, &[1, 2, 3], &mut c);
        a.run(Op::Gemm8, 1, &[1, 2, 3], &mut c);
        a.run(Op::Generate, 1, &[], &mut c);
        assert_eq!(c.0[0], (Status::Ok, true, 0, vec![1, 2, 3]));
        assert_eq!(c.0[1].0, Status::BadParam);
        assert_eq!(c.0[2].0, Status::UnknownOp);
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
