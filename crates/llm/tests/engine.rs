//! GenerationEngine with a fake model and a fake frame sink.
//!
//! The fake model keeps a token-level KV cache addressed only through the block tables it is
//! given, and its next token hashes the whole history it reads back through those tables. So a
//! wrong block table, a block shared with another live sequence, a lost or repeated input
//! token, or a chunk fed at the wrong position changes the sequence's tokens, and the tests
//! compare every stream against the same request run alone.

mod common;

use std::collections::HashMap;

use common::{FakeModel, mix};

use bgs_engine::{Engine, Frame, FrameSink, NoCredit, Progress, Request, StreamId};
use bgs_llm::{EngineConfig, FINISH_EOS, FINISH_LENGTH, FLAG_IGNORE_EOS, GenerationEngine};
use bgs_protocol::{Op, Status};

type Recorded = (StreamId, Status, bool, u32, Vec<u32>);

/// Collects frames; a stream with an entry in `credit` has that many frames left, others are
/// unlimited. `refuse` refuses that many next emits (a full completion ring).
#[derive(Debug, Default)]
struct Sink {
    frames: Vec<Recorded>,
    credit: HashMap<StreamId, u32>,
    refuse: usize,
}

impl FrameSink for Sink {
    fn credit(&self, stream: StreamId) -> u32 {
        self.credit.get(&stream).copied().unwrap_or(1_000)
    }
    fn emit(&mut self, stream: StreamId, f: Frame<'_>) -> Result<(), NoCredit> {
        if self.refuse > 0 {
            self.refuse -= 1;
            return Err(NoCredit);
        }
        if let Some(c) = self.credit.get_mut(&stream) {
            if *c == 0 {
                return Err(NoCredit);
            }
            *c -= 1;
        }
        self.frames
            .push((stream, f.status, f.final_, f.seq, f.words.to_vec()));
        Ok(())
    }
}

impl Sink {
    /// The frames of `stream`, checked for shape: token frames with consecutive `seq` from 0,
    /// then exactly one final frame whose `seq` is the number of tokens. Returns (tokens,
    /// final status, final words).
    fn stream(&self, stream: u32) -> (Vec<u32>, Status, Vec<u32>) {
        let frames: Vec<&Recorded> = self
            .frames
            .iter()
            .filter(|f| f.0 == StreamId(stream))
            .collect();
        let mut tokens = Vec::new();
        for (k, f) in frames.iter().enumerate() {
            if k + 1 < frames.len() {
                assert_eq!(
                    f.1,
                    Status::Token,
                    "stream {stream}: non-token before the end"
                );
                assert!(!f.2);
                assert_eq!(f.3, k as u32, "stream {stream}: token seq");
                assert_eq!(f.4.len(), 1);
                tokens.push(f.4[0]);
            }
        }
        let last = frames
            .last()
            .unwrap_or_else(|| panic!("stream {stream}: no frames"));
        assert!(last.2, "stream {stream}: last frame not final");
        assert_eq!(last.3, tokens.len() as u32, "stream {stream}: final seq");
        (tokens, last.1, last.4.clone())
    }
}

fn generate(stream: u32, conn: u64, prompt: &[u32], max: u32, flags: u32) -> Request<'_> {
    Request {
        stream: StreamId(stream),
        conn,
        op: Op::Generate,
        param: max,
        flags,
        payload: prompt,
    }
}

fn engine(
    model: FakeModel,
    slots: usize,
    waiting: usize,
    budget: usize,
) -> GenerationEngine<FakeModel> {
    GenerationEngine::new(
        model,
        EngineConfig {
            slots,
            max_waiting: waiting,
            max_batched_tokens: budget,
            ignore_eos: false,
        },
    )
    .unwrap()
}

/// Step until nothing is live, checking the engine's bookkeeping after every step.
fn drain(e: &mut GenerationEngine<FakeModel>, sink: &mut Sink) {
    for _ in 0..100_000 {
        if e.live() == 0 {
            assert_eq!(e.used_blocks(), 0, "blocks leaked");
            return;
        }
        let p = e.step(sink);
        e.check_invariants().unwrap();
        assert_eq!(p, Progress::Working, "stalled with {} live", e.live());
    }
    panic!("did not finish");
}

fn model() -> FakeModel {
    // EOS id 0 out of 50: frequent enough to show up, rare enough for long streams.
    FakeModel::new(50, &[0], 256, 4, 64)
}

/// What the fake model must generate for a request, computed without the engine: the next
/// token hashes the whole history; generation stops at EOS (unless ignored), at `max`, at the
/// context limit or when the KV pool is full.
fn reference(m: &FakeModel, prompt: &[u32], max: u32, flags: u32) -> (Vec<u32>, Status, Vec<u32>) {
    let pool = m.shape.block_size * m.shape.num_blocks;
    let limit = (max as usize)
        .min(m.max_pos - prompt.len())
        .min(pool - prompt.len() + 1);
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < limit {
        let h = seq
            .iter()
            .enumerate()
            .fold(0u64, |h, (p, &t)| mix(h, ((p as u64) << 32) | t as u64));
        let t = (h % m.vocab as u64) as u32;
        if flags & FLAG_IGNORE_EOS == 0 && m.eos.contains(&t) {
            let n = out.len() as u32;
            return (out, Status::EndOfStream, vec![FINISH_EOS, n]);
        }
        out.push(t);
        seq.push(t);
    }
    let n = out.len() as u32;
    (out, Status::EndOfStream, vec![FINISH_LENGTH, n])
}

/// The frames of one request run alone on a fresh engine with a large step budget (checked
/// against [`reference`]).
fn alone(m: FakeModel, prompt: &[u32], max: u32, flags: u32) -> (Vec<u32>, Status, Vec<u32>) {
    let want = reference(&m, prompt, max, flags);
    let mut e = engine(m, 1, 0, 512);
    let mut sink = Sink::default();
    e.admit(generate(0, 1, prompt, max, flags)).unwrap();
    drain(&mut e, &mut sink);
    let got = sink.stream(0);
    assert_eq!(got, want, "engine differs from the reference");
    got
}

fn prompt(i: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|k| 1 + (i * 7 + k * 13) % 49).collect()
}

#[test]
fn concurrent_sequences_match_alone() {
    let reqs: Vec<(Vec<u32>, u32)> = (0..16u32)
        .map(|i| (prompt(i, 1 + (i as usize * 5) % 37), 3 + (i * 11) % 40))
        .collect();
    let solo: Vec<_> = reqs
        .iter()
        .map(|(p, m)| alone(model(), p, *m, FLAG_IGNORE_EOS))
        .collect();
    // 4 slots, 8 waiting, a 7-token budget (prefill is chunked at varying boundaries), and
    // requests arriving every other step.
    let mut e = engine(model(), 4, 8, 7);
    let mut sink = Sink::default();
    let mut next = 0usize;
    let mut step = 0;
    while next < reqs.len() || e.live() > 0 {
        if next < reqs.len() && step % 2 == 0 && e.live() < e.capacity() {
            let (p, m) = &reqs[next];
            e.admit(generate(next as u32, 1, p, *m, FLAG_IGNORE_EOS))
                .unwrap();
            next += 1;
        }
        e.step(&mut sink);
        e.check_invariants().unwrap();
        step += 1;
        assert!(step < 10_000);
    }
    assert_eq!(e.used_blocks(), 0);
    for (i, s) in solo.iter().enumerate() {
        assert_eq!(
            &sink.stream(i as u32),
            s,
            "stream {i} differs from its solo run"
        );
        assert_eq!(s.2, [FINISH_LENGTH, reqs[i].1]);
    }
    // Decode and prefill really were mixed in one step.
    assert!(e.model().log().iter().any(|&(_, p, d)| p > 0 && d > 0));
    assert!(e.model().log().iter().all(|&(n, _, _)| n <= 4));
}

#[test]
fn eos_stops_unless_ignored() {
    // Find a prompt whose continuation hits EOS (id 0) within 30 tokens.
    let (p, ignored) = (0..200u32)
        .map(|i| {
            let p = prompt(i, 3);
            let r = alone(model(), &p, 30, FLAG_IGNORE_EOS);
            (p, r)
        })
        .find(|(_, r)| r.0.contains(&0))
        .expect("some prompt reaches EOS");
    assert_eq!(ignored.1, Status::EndOfStream);
    assert_eq!(ignored.0.len(), 30, "ignore-eos runs to max tokens");
    assert_eq!(ignored.2, [FINISH_LENGTH, 30]);

    let stopped = alone(model(), &p, 30, 0);
    let cut = ignored.0.iter().position(|&t| t == 0).unwrap();
    assert_eq!(stopped.0, ignored.0[..cut], "EOS itself is not sent");
    assert_eq!(stopped.1, Status::EndOfStream);
    assert_eq!(stopped.2, [FINISH_EOS, cut as u32]);
}

#[test]
fn max_tokens_and_context_limit_end_with_length() {
    let p = prompt(1, 5);
    let r = alone(model(), &p, 1, FLAG_IGNORE_EOS);
    assert_eq!((r.0.len(), r.2.clone()), (1, vec![FINISH_LENGTH, 1]));
    // Context of 12 positions: a 5-token prompt can grow by 7.
    let r = alone(
        FakeModel::new(50, &[0], 12, 4, 64),
        &p,
        100,
        FLAG_IGNORE_EOS,
    );
    assert_eq!(r.0.len(), 7);
    assert_eq!(r.2, [FINISH_LENGTH, 7]);
    // A pool of 3 blocks of 4 (12 tokens) caps it the same way.
    let r = alone(
        FakeModel::new(50, &[0], 256, 4, 3),
        &p,
        100,
        FLAG_IGNORE_EOS,
    );
    assert_eq!(
        r.2,
        [FINISH_LENGTH, 8],
        "12 KV tokens: 5 prompt + 7 fed back + 1 last"
    );
}

#[test]
fn block_exhaustion_makes_admission_wait_and_all_complete() {
    // 8 blocks of 4 tokens; each request reserves 10 + 8 - 1 = 17 tokens = 5 blocks, so only
    // one runs at a time although 4 slots are free.
    let small = || FakeModel::new(50, &[0], 256, 4, 8);
    let reqs: Vec<Vec<u32>> = (0..6).map(|i| prompt(i, 10)).collect();
    let mut e = engine(small(), 4, 4, 16);
    let mut sink = Sink::default();
    for (i, p) in reqs.iter().enumerate() {
        e.admit(generate(i as u32, 1, p, 8, FLAG_IGNORE_EOS))
            .unwrap();
    }
    let mut waited = false;
    while e.live() > 0 {
        e.step(&mut sink);
        e.check_invariants().unwrap();
        assert!(e.running() <= 1);
        waited |= e.running() == 1 && e.live() > 1;
    }
    assert!(waited);
    assert_eq!((e.used_blocks(), e.free_blocks()), (0, 8));
    for (i, p) in reqs.iter().enumerate() {
        assert_eq!(sink.stream(i as u32), alone(small(), p, 8, FLAG_IGNORE_EOS));
    }
}

#[test]
fn cancel_frees_blocks_at_once_and_ends_with_one_cancelled_frame() {
    let mut e = engine(model(), 4, 4, 64);
    let mut sink = Sink::default();
    let keep = prompt(9, 6);
    let ps: Vec<Vec<u32>> = (0..5).map(|i| prompt(i, 8)).collect();
    for (i, p) in ps.iter().enumerate() {
        e.admit(generate(i as u32, 7, p, 40, FLAG_IGNORE_EOS))
            .unwrap();
    }
    e.admit(generate(9, 8, &keep, 20, FLAG_IGNORE_EOS)).unwrap();
    for _ in 0..3 {
        e.step(&mut sink);
    }
    // Streams 0..4 run, 4 waits (4 slots), 9 waits.
    assert_eq!(e.running(), 4);
    let before = e.used_blocks();
    assert!(before > 0);
    // The ring is full when the cancel's frames are due: they are retried.
    e.cancel(7);
    e.check_invariants().unwrap();
    assert_eq!(
        e.used_blocks(),
        0,
        "conn 7 held every used block; all freed at once"
    );
    sink.refuse = 3;
    drain(&mut e, &mut sink);
    for i in 0..5 {
        let (tokens, status, words) = sink.stream(i);
        assert_eq!(status, Status::Cancelled, "stream {i}");
        assert!(words.is_empty());
        assert!(tokens.len() <= 3, "no tokens after the cancel");
    }
    assert_eq!(sink.stream(9), alone(model(), &keep, 20, FLAG_IGNORE_EOS));
    // A second cancel of a finished connection is a no-op.
    e.cancel(7);
    assert_eq!(e.live(), 0);
}

#[test]
fn credit_stall_holds_one_sequence_without_affecting_others() {
    let ps: Vec<Vec<u32>> = (0..3).map(|i| prompt(i, 5)).collect();
    let mut e = engine(model(), 3, 0, 64);
    let mut sink = Sink::default();
    sink.credit.insert(StreamId(1), 3);
    for (i, p) in ps.iter().enumerate() {
        e.admit(generate(i as u32, 1, p, 12, FLAG_IGNORE_EOS))
            .unwrap();
    }
    while e.live() > 1 {
        e.step(&mut sink);
        e.check_invariants().unwrap();
    }
    // Stream 1 used its 3 frames' credit: it emitted 2 tokens (needs 2 to go on) and sits out
    // holding its KV; the step reports idle.
    let held = e.used_blocks();
    assert!(held > 0);
    let n1 = sink.frames.iter().filter(|f| f.0 == StreamId(1)).count();
    assert_eq!(n1, 2);
    assert_eq!(e.step(&mut sink), Progress::Idle);
    assert_eq!(e.used_blocks(), held);
    // Credit returns: it resumes and finishes exactly like alone.
    sink.credit.remove(&StreamId(1));
    drain(&mut e, &mut sink);
    for (i, p) in ps.iter().enumerate() {
        assert_eq!(
            sink.stream(i as u32),
            alone(model(), p, 12, FLAG_IGNORE_EOS)
        );
    }
}

#[test]
fn refused_emits_are_retried_in_order() {
    let ps: Vec<Vec<u32>> = (0..4).map(|i| prompt(i, 7)).collect();
    let mut e = engine(model(), 4, 0, 64);
    let mut sink = Sink::default();
    for (i, p) in ps.iter().enumerate() {
        e.admit(generate(i as u32, 1, p, 9, 0)).unwrap();
    }
    let mut k = 0;
    while e.live() > 0 {
        // Refuse a varying number of emits each step (a completion ring that fills up).
        sink.refuse = k % 3;
        k += 1;
        e.step(&mut sink);
        e.check_invariants().unwrap();
        assert!(k < 1000);
    }
    for (i, p) in ps.iter().enumerate() {
        assert_eq!(sink.stream(i as u32), alone(model(), p, 9, 0));
    }
}

#[test]
fn bad_requests_are_refused() {
    let mut e = engine(FakeModel::new(50, &[0], 16, 4, 3), 2, 0, 8);
    let bad: &[(&[u32], u32, u32, Status)] = &[
        (&[1, 50], 4, 0, Status::BadParam), // token id outside the vocabulary
        (&[], 4, 0, Status::BadParam),      // empty prompt
        (&[1; 16], 4, 0, Status::BadParam), // prompt + 1 > 16 positions
        (&[1; 13], 4, 0, Status::BadParam), // 13 tokens never fit 3 blocks of 4
        (&[1], 0, 0, Status::BadParam),     // no tokens asked for
        (&[1], 4097, 0, Status::BadParam),  // more than 4096
        (&[1], 4, 2, Status::BadFlags),     // unknown flag bit
    ];
    for (k, &(p, max, flags, want)) in bad.iter().enumerate() {
        assert_eq!(
            e.admit(generate(k as u32, 1, p, max, flags)),
            Err(want),
            "case {k}"
        );
    }
    assert_eq!(e.live(), 0);
    e.admit(generate(0, 1, &[1; 12], 4, 0)).unwrap(); // exactly the pool: ok
    e.admit(generate(1, 1, &[2], 4, 0)).unwrap();
    assert_eq!(e.admit(generate(2, 1, &[3], 4, 0)), Err(Status::Busy));
    assert_eq!(e.admit(generate(1, 1, &[3], 4, 0)), Err(Status::Busy));
    let mut sink = Sink::default();
    drain(&mut e, &mut sink);
    assert_eq!(
        sink.stream(0).2[1],
        1,
        "a prompt filling the pool gets one token"
    );
}

#[test]
fn model_error_ends_the_step_with_internal_and_frees_blocks() {
    let mut e = engine(model(), 4, 4, 64);
    let mut sink = Sink::default();
    let p = prompt(3, 6);
    e.admit(generate(0, 1, &p, 10, 0)).unwrap();
    e.admit(generate(1, 1, &p, 10, 0)).unwrap();
    e.step(&mut sink);
    e.model_mut().fail_next = true;
    e.step(&mut sink);
    e.check_invariants().unwrap();
    assert_eq!(e.used_blocks(), 0);
    drain(&mut e, &mut sink);
    for s in 0..2 {
        assert_eq!(sink.stream(s).1, Status::Internal);
    }
    // The engine keeps serving.
    e.admit(generate(0, 1, &p, 10, 0)).unwrap();
    drain(&mut e, &mut sink);
    let after: Vec<_> = sink
        .frames
        .iter()
        .filter(|f| f.0 == StreamId(0))
        .skip(2)
        .collect();
    assert!(after.last().unwrap().2 && after.last().unwrap().1 == Status::EndOfStream);
}

#[test]
fn one_shot_ops_are_answered_inline() {
    let mut e = engine(model(), 2, 2, 64);
    let mut sink = Sink::default();
    let words: Vec<u32> = (0..64).map(|i| (i as f32 * 0.5).to_bits()).collect();
    let req = |stream, op, param| Request {
        stream: StreamId(stream),
        conn: 1,
        op,
        param,
        flags: 0,
        payload: &words,
    };
    e.admit(req(0, Op::Echo, 0)).unwrap();
    e.admit(req(1, Op::Gemm8, 2)).unwrap();
    e.admit(req(2, Op::Fft32, 1)).unwrap();
    let short = Request {
        payload: &words[..3],
        ..req(3, Op::Gemm8, 1)
    };
    assert_eq!(e.admit(short), Err(Status::BadParam));
    let p = prompt(0, 4);
    e.admit(generate(3, 1, &p, 3, 0)).unwrap();
    assert_eq!(e.live(), 4);
    // A one-shot of a cancelled connection is still answered.
    e.cancel(99);
    drain(&mut e, &mut sink);
    let mut cpu = bgs_adapters::OneShotCpu::default();
    let want: [Vec<u32>; 3] = [
        words.clone(),
        cpu.gemm8(&words, 2).to_vec(),
        cpu.fft32(&words, 1).to_vec(),
    ];
    for (s, w) in want.iter().enumerate() {
        let (tokens, status, got) = sink.stream(s as u32);
        assert!(tokens.is_empty());
        assert_eq!((status, &got), (Status::Ok, w));
    }
    assert_eq!(sink.stream(3), alone(model(), &p, 3, 0));
}

#[test]
fn idle_when_nothing_can_advance() {
    let mut e = engine(model(), 2, 2, 64);
    let mut sink = Sink::default();
    assert_eq!(e.step(&mut sink), Progress::Idle);
    // A waiting request starts without credit (its prompt owes nothing): no stream behind on
    // acknowledgements may hold up admission. Its first token frame then waits for credit.
    sink.credit.insert(StreamId(0), 0);
    let p = prompt(0, 4);
    e.admit(generate(0, 1, &p, 3, 0)).unwrap();
    assert_eq!(e.step(&mut sink), Progress::Working, "the prompt runs");
    assert!(e.used_blocks() > 0);
    assert!(sink.frames.is_empty(), "no credit: the token frame waits");
    assert_eq!(
        e.step(&mut sink),
        Progress::Idle,
        "running with a frame owed and no credit: cannot advance"
    );
    // Credit 1 < 2: the owed frame goes out, but the sequence may not take another step.
    sink.credit.insert(StreamId(0), 1);
    e.step(&mut sink);
    assert_eq!(sink.frames.len(), 1);
    assert_eq!(
        e.step(&mut sink),
        Progress::Idle,
        "credit 0 < 2: cannot step"
    );
    sink.credit.insert(StreamId(0), 2);
    assert_eq!(e.step(&mut sink), Progress::Working);
    sink.credit.remove(&StreamId(0));
    drain(&mut e, &mut sink);
    assert_eq!(sink.stream(0), alone(model(), &p, 3, 0));
}

/// A stream behind on acknowledgements (credit 0, e.g. a reused stream id whose last
/// request's frames are not yet acknowledged) at the head of the waiting queue does not hold
/// up the admissions behind it: both start in the first step, the second streams at once.
#[test]
fn a_reader_behind_on_acknowledgements_does_not_hold_up_admission() {
    let mut e = engine(model(), 2, 2, 64);
    let mut sink = Sink::default();
    sink.credit.insert(StreamId(0), 0);
    let (p0, p1) = (prompt(0, 4), prompt(1, 5));
    e.admit(generate(0, 1, &p0, 3, 0)).unwrap();
    e.admit(generate(1, 2, &p1, 3, 0)).unwrap();
    assert_eq!(e.step(&mut sink), Progress::Working);
    let first: Vec<_> = sink.frames.iter().map(|f| f.0).collect();
    assert_eq!(first, vec![StreamId(1)], "stream 1 admitted and streaming");
    drain_while_working(&mut e, &mut sink);
    assert_eq!(sink.frames.iter().filter(|f| f.0 == StreamId(0)).count(), 0);
    sink.credit.remove(&StreamId(0));
    drain(&mut e, &mut sink);
    assert_eq!(sink.stream(0), alone(model(), &p0, 3, 0));
    assert_eq!(sink.stream(1), alone(model(), &p1, 3, 0));
}

/// Steps until the engine reports idle.
fn drain_while_working(e: &mut impl Engine, sink: &mut Sink) {
    for _ in 0..1_000 {
        if e.step(sink) == Progress::Idle {
            return;
        }
    }
    panic!("still working after 1,000 steps");
}
