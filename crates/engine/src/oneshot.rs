//! The one-shot shim: the CPU adapters (echo, gemm8, fft32) as an [`Engine`].
//!
//! Each admitted request is a stream that ends in one step with one final frame. The shim
//! holds up to `capacity` requests (payloads copied at admission, into buffers reused from
//! request to request, so the steady state does not allocate).

use bgs_adapters::OneShotCpu;
use bgs_protocol::{Op, Status};

use crate::{Engine, Frame, FrameSink, Progress, Request, StreamId};

/// One held request.
#[derive(Debug)]
struct Held {
    stream: StreamId,
    op: Op,
    param: u32,
    payload: Vec<u32>,
    /// The reply, once computed: status and words in `out` (kept when the sink refuses, so a
    /// retry does not redo the work).
    reply: Option<(Status, usize)>,
    out: Vec<u32>,
}

/// [`OneShotCpu`] as an engine of a small capacity (the CPU executor's slot threads use 1).
#[derive(Debug)]
pub struct OneShotEngine {
    cpu: OneShotCpu,
    capacity: usize,
    /// Held requests in admission order (replies are emitted in that order).
    held: Vec<Held>,
    /// Buffers of finished requests, reused by the next admissions.
    spare: Vec<Held>,
}

impl Default for OneShotEngine {
    fn default() -> Self {
        OneShotEngine::new(1)
    }
}

impl OneShotEngine {
    /// A shim holding up to `capacity` requests (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        OneShotEngine {
            cpu: OneShotCpu::default(),
            capacity,
            held: Vec::with_capacity(capacity),
            spare: Vec::with_capacity(capacity),
        }
    }
}

impl Engine for OneShotEngine {
    fn capacity(&self) -> usize {
        self.capacity
    }

    fn live(&self) -> usize {
        self.held.len()
    }

    fn admit(&mut self, request: Request<'_>) -> Result<(), Status> {
        if self.held.len() >= self.capacity {
            // The executor never admits past capacity; refusing keeps the contract if it did.
            return Err(Status::Busy);
        }
        let mut h = self.spare.pop().unwrap_or_else(|| Held {
            stream: request.stream,
            op: request.op,
            param: 0,
            payload: Vec::new(),
            reply: None,
            out: Vec::new(),
        });
        h.stream = request.stream;
        h.op = request.op;
        h.param = request.param;
        h.payload.clear();
        h.payload.extend_from_slice(request.payload);
        h.reply = None;
        self.held.push(h);
        Ok(())
    }

    fn step(&mut self, sink: &mut dyn FrameSink) -> Progress {
        let mut emitted = false;
        let mut i = 0;
        while i < self.held.len() {
            let h = &mut self.held[i];
            let (status, n) = match h.reply {
                Some(r) => r,
                None => {
                    let (status, words) = self.cpu.run(h.op, h.param, &h.payload);
                    h.out.clear();
                    h.out.extend_from_slice(words);
                    h.reply = Some((status, h.out.len()));
                    (status, h.out.len())
                }
            };
            let frame = Frame {
                status,
                final_: true,
                seq: 0,
                words: &h.out[..n],
            };
            match sink.emit(h.stream, frame) {
                Ok(()) => {
                    emitted = true;
                    // Keep admission order for the rest: `remove`, not `swap_remove`
                    // (capacities are small).
                    let done = self.held.remove(i);
                    self.spare.push(done);
                }
                // Refused (no room in the completion ring): keep the reply and retry on the
                // next step. Later requests may still fit (credit is per stream).
                Err(_) => i += 1,
            }
        }
        // Idle when nothing could be published: the executor waits for room instead of
        // calling again at once.
        if emitted {
            Progress::Working
        } else {
            Progress::Idle
        }
    }

    /// One-shot requests framed before their connection ended are still answered (the
    /// decision for EOF: only generation streams are cancelled), and each ends within one
    /// step anyway: nothing to do.
    fn cancel(&mut self, _conn: u64) {}

    fn holds(&self, stream: StreamId) -> Option<bool> {
        Some(self.held.iter().any(|h| h.stream == stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NoCredit;

    #[derive(Default)]
    struct Sink {
        refuse: bool,
        got: Vec<(StreamId, Status, bool, Vec<u32>)>,
    }

    impl FrameSink for Sink {
        fn credit(&self, _stream: StreamId) -> u32 {
            u32::from(!self.refuse)
        }
        fn emit(&mut self, stream: StreamId, frame: Frame<'_>) -> Result<(), NoCredit> {
            if self.refuse {
                return Err(NoCredit);
            }
            self.got
                .push((stream, frame.status, frame.final_, frame.words.to_vec()));
            Ok(())
        }
    }

    fn req(stream: u32, op: Op, param: u32, payload: &[u32]) -> Request<'_> {
        Request {
            stream: StreamId(stream),
            conn: 7,
            op,
            param,
            flags: 0,
            payload,
        }
    }

    #[test]
    fn answers_each_op_with_one_final_frame() {
        let mut e = OneShotEngine::new(4);
        let x: Vec<u32> = (0..64).map(|i| (i as f32).to_bits()).collect();
        e.admit(req(0, Op::Echo, 0, &[1, 2, 3])).unwrap();
        e.admit(req(1, Op::Gemm8, 1, &x)).unwrap();
        e.admit(req(2, Op::Fft32, 1, &x[..10])).unwrap();
        e.admit(req(3, Op::Generate, 5, &[1])).unwrap();
        assert_eq!(e.admit(req(4, Op::Echo, 0, &[])), Err(Status::Busy));
        assert_eq!(e.live(), 4);
        let mut s = Sink::default();
        assert_eq!(e.step(&mut s), Progress::Working);
        assert_eq!(e.live(), 0);
        assert_eq!(e.step(&mut s), Progress::Idle);
        let want_gemm = OneShotCpu::default().gemm8(&x, 1).to_vec();
        assert_eq!(
            s.got,
            vec![
                (StreamId(0), Status::Ok, true, vec![1, 2, 3]),
                (StreamId(1), Status::Ok, true, want_gemm),
                (StreamId(2), Status::BadParam, true, vec![]),
                (StreamId(3), Status::UnknownOp, true, vec![]),
            ]
        );
    }

    #[test]
    fn a_refused_frame_is_retried_on_the_next_step() {
        let mut e = OneShotEngine::default();
        let mut s = Sink {
            refuse: true,
            ..Sink::default()
        };
        e.admit(req(9, Op::Echo, 0, &[4, 5])).unwrap();
        assert_eq!(e.step(&mut s), Progress::Idle);
        assert_eq!(e.live(), 1);
        e.cancel(7);
        assert_eq!(e.live(), 1, "one-shot requests are answered, not cancelled");
        s.refuse = false;
        assert_eq!(e.step(&mut s), Progress::Working);
        assert_eq!(e.live(), 0);
        assert_eq!(s.got, vec![(StreamId(9), Status::Ok, true, vec![4, 5])]);
    }
}
