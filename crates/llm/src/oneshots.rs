//! One-shot requests (echo, gemm8, fft32) that a generation engine answers between steps, in
//! arrival order: shared by [`GenerationEngine`](crate::GenerationEngine) and
//! [`CGenEngine`](crate::gen_loop::CGenEngine).

use std::collections::VecDeque;

use bgs_adapters::OneShotCpu;
use bgs_engine::{Frame, FrameSink, Request, StreamId};
use bgs_protocol::{Op, Status};

/// A one-shot request, answered in the next step.
#[derive(Debug)]
struct OneShot {
    stream: StreamId,
    op: Op,
    param: u32,
    /// The payload until computed, then the reply words.
    words: Vec<u32>,
    done: bool,
}

/// The queue of one-shot requests and the CPU that computes them.
#[derive(Debug, Default)]
pub(crate) struct OneShots {
    queue: VecDeque<OneShot>,
    cpu: OneShotCpu,
}

impl OneShots {
    /// Queue `r` after checking it against the op table (its status on refusal).
    pub(crate) fn admit(&mut self, r: &Request<'_>) -> Result<(), Status> {
        bgs_protocol::ops::check(r.op.spec(), r.payload.len() as u32, r.param, r.flags)?;
        self.queue.push_back(OneShot {
            stream: r.stream,
            op: r.op,
            param: r.param,
            words: r.payload.to_vec(),
            done: false,
        });
        Ok(())
    }

    /// Requests not yet answered.
    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    /// `stream` is a queued request's.
    pub(crate) fn holds(&self, stream: StreamId) -> bool {
        self.queue.iter().any(|o| o.stream == stream)
    }

    /// Answer queued requests in order; stop at the first the sink refuses (it is retried in
    /// the next step, computed once). True when any was answered.
    pub(crate) fn run(&mut self, sink: &mut dyn FrameSink) -> bool {
        let mut any = false;
        while let Some(o) = self.queue.front_mut() {
            if !o.done {
                let out: Option<[u32; 64]> = match o.op {
                    Op::Gemm8 => Some(*self.cpu.gemm8(&o.words, o.param)),
                    Op::Fft32 => Some(*self.cpu.fft32(&o.words, o.param)),
                    _ => None,
                };
                if let Some(out) = out {
                    o.words.clear();
                    o.words.extend_from_slice(&out);
                }
                o.done = true;
            }
            let frame = Frame {
                status: Status::Ok,
                final_: true,
                seq: 0,
                words: &o.words,
            };
            if sink.emit(o.stream, frame).is_err() {
                break;
            }
            self.queue.pop_front();
            any = true;
        }
        any
    }
}
