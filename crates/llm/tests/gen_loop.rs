//! The C step loop (`include/bgs_gen_loop.h`, driven by `CGenEngine`) against the Rust
//! engine (`GenerationEngine`): on the same model, fed the same schedule of requests,
//! cancels, credit changes, refused emits and model failures, both must emit identical frames,
//! answer every admission identically, hand the model identical steps (tokens, positions,
//! block tables, sample flags), and keep their bookkeeping after every step. Property tests
//! draw random schedules; worked examples pin down particular cases.
//!
//! The fake model is the one of `tests/engine.rs` (`tests/common`): a token-level KV cache
//! addressed only through the block tables, whose next token hashes the whole history read
//! back through them, so a wrong table, position or input token changes the tokens.

mod common;

use std::collections::{HashMap, HashSet};

use common::{FakeModel, mix};

use bgs_engine::{Engine, Frame, FrameSink, NoCredit, Progress, Request, StreamId};
use bgs_llm::gen_loop::{CGenLoop, GlLimits, MAX_PROMPT};
use bgs_llm::{
    CGenEngine, EngineConfig, FINISH_EOS, FINISH_LENGTH, FLAG_IGNORE_EOS, GenerationEngine,
};
use bgs_protocol::{Op, Status};
use proptest::prelude::*;

type Recorded = (u32, Status, bool, u32, Vec<u32>);

/// Records frames; a stream with an entry in `credit` has that many frames left (others are
/// unlimited); `refuse` refuses that many next emits (a full completion ring).
#[derive(Debug, Default)]
struct Sink {
    frames: Vec<Recorded>,
    credit: HashMap<u32, u32>,
    refuse: usize,
}

impl FrameSink for Sink {
    fn credit(&self, stream: StreamId) -> u32 {
        self.credit.get(&stream.0).copied().unwrap_or(1_000)
    }
    fn emit(&mut self, stream: StreamId, f: Frame<'_>) -> Result<(), NoCredit> {
        if self.refuse > 0 {
            self.refuse -= 1;
            return Err(NoCredit);
        }
        if let Some(c) = self.credit.get_mut(&stream.0) {
            if *c == 0 {
                return Err(NoCredit);
            }
            *c -= 1;
        }
        self.frames
            .push((stream.0, f.status, f.final_, f.seq, f.words.to_vec()));
        Ok(())
    }
}

/// Both engines with their own model and sink, driven in lock step.
struct Pair {
    rust: GenerationEngine<FakeModel>,
    c: CGenEngine<FakeModel>,
    rs: Sink,
    cs: Sink,
    admitted: HashSet<u32>,
}

impl Pair {
    fn new(m: FakeModel, config: EngineConfig) -> Pair {
        Pair {
            rust: GenerationEngine::new(m.clone(), config).unwrap(),
            c: CGenEngine::new(m, config).unwrap(),
            rs: Sink::default(),
            cs: Sink::default(),
            admitted: HashSet::new(),
        }
    }

    fn admit(&mut self, r: Request<'_>) -> Result<(), Status> {
        let a = self.rust.admit(r);
        let b = self.c.admit(r);
        assert_eq!(a, b, "admission of stream {} differs", r.stream.0);
        if a.is_ok() {
            assert!(
                self.admitted.insert(r.stream.0),
                "stream {} reused",
                r.stream.0
            );
        }
        a
    }

    fn cancel(&mut self, conn: u64) {
        self.rust.cancel(conn);
        self.c.cancel(conn);
        self.check();
    }

    fn step(&mut self) -> Progress {
        let a = self.rust.step(&mut self.rs);
        let b = self.c.step(&mut self.cs);
        assert_eq!(a, b, "progress differs");
        self.check();
        a
    }

    fn set_credit(&mut self, stream: u32, credit: Option<u32>) {
        for s in [&mut self.rs, &mut self.cs] {
            match credit {
                Some(c) => s.credit.insert(stream, c),
                None => s.credit.remove(&stream),
            };
        }
    }

    fn refuse(&mut self, n: usize) {
        self.rs.refuse = n;
        self.cs.refuse = n;
    }

    fn fail_next(&mut self) {
        self.rust.model_mut().fail_next = true;
        self.c.model_mut().fail_next = true;
    }

    /// Same frames, same model steps, same counts; both engines' bookkeeping holds.
    fn check(&mut self) {
        assert_eq!(self.rs.frames, self.cs.frames, "frames differ");
        assert_eq!(
            self.rust.model().steps,
            self.c.model().steps,
            "model steps differ"
        );
        assert_eq!(self.rust.live(), self.c.live(), "live differs");
        assert_eq!(self.rust.used_blocks(), self.c.used_blocks(), "used blocks");
        assert_eq!(self.rust.running(), self.c.running(), "running differs");
        assert_eq!(self.rs.refuse, self.cs.refuse);
        self.rust.check_invariants().unwrap();
        self.c.check_invariants().unwrap();
    }

    /// Unlimited credit, no refusals: step until nothing is live; then every admitted stream
    /// has ended with exactly one final frame (the last of its frames) and no block is held.
    fn drain(&mut self) {
        self.rs.credit.clear();
        self.cs.credit.clear();
        self.refuse(0);
        for _ in 0..100_000 {
            if self.rust.live() == 0 && self.c.live() == 0 {
                break;
            }
            assert_eq!(self.step(), Progress::Working, "stalled");
        }
        assert_eq!(self.c.live(), 0, "did not finish");
        assert_eq!(self.c.used_blocks(), 0, "blocks leaked");
        for &stream in &self.admitted {
            let frames: Vec<&Recorded> = self.cs.frames.iter().filter(|f| f.0 == stream).collect();
            let finals = frames.iter().filter(|f| f.2).count();
            assert_eq!(finals, 1, "stream {stream}: {finals} final frames");
            assert!(
                frames.last().unwrap().2,
                "stream {stream}: frames after the final"
            );
            for (k, f) in frames.iter().enumerate() {
                assert_eq!(f.3, k as u32, "stream {stream}: frame seq");
            }
        }
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

fn prompt(i: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|k| 1 + (i * 7 + k * 13) % 49).collect()
}

fn config(slots: usize, waiting: usize, budget: usize) -> EngineConfig {
    EngineConfig {
        slots,
        max_waiting: waiting,
        max_batched_tokens: budget,
        ignore_eos: false,
    }
}

#[test]
fn a_lone_request_streams_its_tokens_and_ends_at_eos_or_length() {
    let mut p = Pair::new(FakeModel::new(50, &[0], 256, 4, 64), config(2, 2, 16));
    for (s, flags) in [(0u32, 0u32), (1, FLAG_IGNORE_EOS)] {
        p.admit(generate(s, 1, &prompt(s, 9), 40, flags)).unwrap();
    }
    p.drain();
    let end = |stream: u32| {
        p.cs.frames
            .iter()
            .find(|f| f.0 == stream && f.2)
            .cloned()
            .unwrap()
    };
    let (_, status, _, seq, words) = end(1);
    assert_eq!(status, Status::EndOfStream);
    assert_eq!(
        words,
        vec![FINISH_LENGTH, 40],
        "ignore EOS runs to max tokens"
    );
    assert_eq!(seq, 40);
    let (_, status, _, seq, words) = end(0);
    assert_eq!(status, Status::EndOfStream);
    assert_eq!(words[1], seq, "final words say how many tokens went out");
    assert!(words[0] == FINISH_EOS || words[0] == FINISH_LENGTH);
    let tokens: Vec<u32> =
        p.cs.frames
            .iter()
            .filter(|f| f.0 == 0 && !f.2)
            .map(|f| f.4[0])
            .collect();
    assert!(!tokens.contains(&0), "the EOS id is never sent as a token");
}

#[test]
fn context_and_pool_limits_end_with_length() {
    // 16 positions, 5 blocks of 4 = 20 pool tokens.
    let mut p = Pair::new(FakeModel::new(50, &[], 16, 4, 5), config(2, 1, 8));
    p.admit(generate(0, 1, &prompt(0, 10), 100, 0)).unwrap();
    p.drain();
    let last = p.cs.frames.last().unwrap().clone();
    assert_eq!(
        last.4,
        vec![FINISH_LENGTH, 6],
        "16 positions - 10 prompt tokens"
    );
}

#[test]
fn bad_requests_get_the_rust_engines_statuses() {
    let mut p = Pair::new(FakeModel::new(50, &[0], 16, 4, 3), config(2, 0, 8));
    let bad: &[(&[u32], u32, u32, Status)] = &[
        (&[1, 50], 4, 0, Status::BadParam),
        (&[], 4, 0, Status::BadParam),
        (&[1; 16], 4, 0, Status::BadParam),
        (&[1; 13], 4, 0, Status::BadParam),
        (&[1], 0, 0, Status::BadParam),
        (&[1], 4097, 0, Status::BadParam),
        (&[1], 4, 2, Status::BadFlags),
        (&[50], 0, 2, Status::BadParam), // the param check comes before the flags check
        (&[50], 4, 2, Status::BadFlags), // the flags check before the vocabulary
    ];
    for (k, &(prompt, max, flags, want)) in bad.iter().enumerate() {
        assert_eq!(
            p.admit(generate(k as u32, 1, prompt, max, flags)),
            Err(want),
            "case {k}"
        );
    }
    p.admit(generate(10, 1, &[1; 12], 4, 0)).unwrap();
    // A live stream id is an executor bug: Internal (before any validation).
    assert_eq!(p.admit(generate(10, 1, &[], 4, 0)), Err(Status::Internal));
    p.admit(generate(11, 1, &[2], 4, 0)).unwrap();
    assert_eq!(p.admit(generate(12, 1, &[3], 4, 0)), Err(Status::Busy));
    p.drain();
}

#[test]
fn prompts_past_the_ring_slot_are_refused_by_the_c_core_only() {
    // The documented bound of the C core: a ring slot's 256 words (the Rust engine has none,
    // and the ring never carries more).
    let m = FakeModel::new(50, &[0], 1024, 16, 64);
    let mut c = CGenEngine::new(m, config(1, 0, 512)).unwrap();
    assert_eq!(MAX_PROMPT as usize, bgs_ring::SLOT_WORDS);
    let long = prompt(1, MAX_PROMPT as usize + 1);
    assert_eq!(c.admit(generate(0, 1, &long, 4, 0)), Err(Status::BadParam));
    let fits = prompt(1, MAX_PROMPT as usize);
    c.admit(generate(0, 1, &fits, 4, 0)).unwrap();
}

#[test]
fn cancel_mid_stream_with_a_full_ring_owes_one_cancelled_frame() {
    let mut p = Pair::new(FakeModel::new(50, &[], 256, 4, 64), config(2, 2, 8));
    p.admit(generate(0, 7, &prompt(0, 6), 30, 0)).unwrap();
    p.admit(generate(1, 8, &prompt(1, 6), 30, 0)).unwrap();
    for _ in 0..4 {
        p.step();
    }
    p.refuse(1); // the next emit (stream 0's pending token) is refused
    p.step();
    p.cancel(7);
    assert_eq!(p.c.used_blocks(), p.rust.used_blocks());
    p.refuse(3);
    p.step();
    p.cancel(7); // a second cancel: still one final frame
    p.drain();
    let s0: Vec<_> = p.cs.frames.iter().filter(|f| f.0 == 0).collect();
    assert_eq!(s0.last().unwrap().1, Status::Cancelled);
}

#[test]
fn credit_stalls_and_model_failures_match() {
    let mut p = Pair::new(FakeModel::new(50, &[0], 256, 4, 32), config(3, 3, 6));
    for s in 0..5 {
        p.admit(generate(
            s,
            s as u64 % 2,
            &prompt(s, 3 + s as usize * 2),
            12,
            FLAG_IGNORE_EOS,
        ))
        .unwrap();
    }
    p.set_credit(1, Some(1)); // below the step credit: sits out
    for _ in 0..5 {
        p.step();
    }
    p.set_credit(1, Some(3));
    p.fail_next();
    p.step();
    p.step();
    p.drain();
    let internal =
        p.cs.frames
            .iter()
            .filter(|f| f.1 == Status::Internal)
            .count();
    assert!(
        internal > 0,
        "the failed step ended its sequences with Internal"
    );
}

#[test]
fn one_shot_ops_are_answered_like_the_rust_engine() {
    let mut p = Pair::new(FakeModel::new(50, &[0], 256, 4, 32), config(2, 2, 8));
    let words = [1u32, 2, 3];
    let echo = Request {
        stream: StreamId(5),
        conn: 3,
        op: Op::Echo,
        param: 1,
        flags: 0,
        payload: &words,
    };
    p.admit(generate(0, 3, &prompt(0, 4), 5, 0)).unwrap();
    p.admit(echo).unwrap();
    assert_eq!(
        p.admit(Request {
            stream: StreamId(0),
            ..echo
        }),
        Err(Status::Internal)
    );
    p.refuse(1);
    p.step();
    p.cancel(3);
    p.drain();
}

#[test]
fn the_c_loop_names_bad_limits() {
    let ok = GlLimits {
        block_size: 4,
        num_blocks: 8,
        max_seqs: 4,
        max_running: 2,
        max_batched_tokens: 8,
        max_prompt: 16,
        vocab_size: 50,
        max_positions: 64,
        max_eos: 1,
        ignore_eos: 0,
    };
    let mut c = CGenLoop::new(ok, &[0]).unwrap();
    assert_eq!(c.live(), 0);
    assert_eq!(c.free_blocks(), 8);
    c.check().unwrap();
    for bad in [
        GlLimits {
            block_size: 0,
            ..ok
        },
        GlLimits { max_seqs: 1, ..ok },
        GlLimits {
            max_batched_tokens: 1,
            ..ok
        },
        GlLimits {
            max_prompt: MAX_PROMPT + 1,
            ..ok
        },
        GlLimits {
            max_positions: 1,
            ..ok
        },
    ] {
        let e = CGenLoop::new(bad, &[]).unwrap_err();
        assert!(e.contains("invalid limits"), "{e}");
    }
    let e = CGenLoop::new(ok, &[0, 1]).unwrap_err();
    assert!(e.contains("EOS"), "{e}");
}

#[test]
fn owed_frames_are_delivered_in_parts() {
    // The C core's publication protocol on its own: a token frame and a final frame owed by
    // one stream; delivering the token first keeps the final owed with the next seq.
    let limits = GlLimits {
        block_size: 4,
        num_blocks: 8,
        max_seqs: 2,
        max_running: 1,
        max_batched_tokens: 8,
        max_prompt: 16,
        vocab_size: 50,
        max_positions: 64,
        max_eos: 1,
        ignore_eos: 0,
    };
    let mut c = CGenLoop::new(limits, &[0]).unwrap();
    c.admit(9, 1, 1, 0, &[3, 4]).unwrap();
    assert_eq!(c.plan(&[2, 2]).unwrap(), 1);
    let it = c.item(0).unwrap();
    assert_eq!((it.tokens, it.pos, it.sample, it.stream), (2, 0, 1, 9));
    assert_eq!(c.item_tokens(&it), &[3, 4]);
    assert_eq!(c.item_blocks(&it), &[0]);
    let frames = c.finish(&[7]).unwrap().to_vec();
    assert_eq!(frames.len(), 2, "max tokens 1: the token and the final");
    assert_eq!(
        (frames[0].status, frames[0].seq, frames[0].word[0]),
        (1, 0, 7)
    );
    assert_eq!(
        (frames[1].status, frames[1].final_, frames[1].seq),
        (2, 1, 1)
    );
    assert_eq!(&frames[1].word, &[FINISH_LENGTH, 1]);
    assert_eq!(
        c.used_blocks(),
        0,
        "blocks freed at the end, before the final is out"
    );
    c.delivered(frames[0].slot, 1);
    let again = c.owed().to_vec();
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].final_, again[0].seq), (1, 1));
    c.delivered(again[0].slot, 1);
    assert_eq!(c.live(), 0);
    assert!(c.owed().is_empty());
    c.check().unwrap();
}

#[test]
fn the_c_check_catches_a_shared_or_lost_block() {
    let limits = GlLimits {
        block_size: 4,
        num_blocks: 8,
        max_seqs: 2,
        max_running: 2,
        max_batched_tokens: 8,
        max_prompt: 16,
        vocab_size: 50,
        max_positions: 64,
        max_eos: 0,
        ignore_eos: 0,
    };
    let mut c = CGenLoop::new(limits, &[]).unwrap();
    c.admit(0, 1, 8, 0, &[1, 2, 3, 4, 5]).unwrap();
    assert_eq!(c.plan(&[2, 2]).unwrap(), 1);
    let it = c.item(0).unwrap();
    assert_eq!(it.n_blocks, 2);
    c.check().unwrap();
    let held = c.item_blocks(&it)[0];
    // Header words of bgs_gen_loop.h: BGS_GL_H_FREE_TOP = 16, BGS_GL_H_FREE_AT = 21.
    let (top, free_at) = (c.state()[16] as usize, c.state()[21] as usize);
    assert_eq!(top, 6);
    let good = c.state().to_vec();
    c.state_mut()[free_at + top - 1] = held; // the top free block is also in a table
    assert!(c.check().unwrap_err().contains("two tables"));
    c.state_mut().copy_from_slice(&good);
    c.state_mut()[16] = 5; // a block vanishes from the free stack
    assert!(c.check().unwrap_err().contains("add up"));
    c.state_mut().copy_from_slice(&good);
    c.check().unwrap();
}

/// One event of a random schedule.
#[derive(Clone, Debug)]
enum Ev {
    /// A generate request: prompt length, seed, max tokens, flags, connection.
    Admit(usize, u32, u32, u32, u64),
    /// A request reusing the stream id of the k-th admitted request.
    Reuse(usize),
    Cancel(u64),
    Step,
    /// Credit of the k-th stream (None: unlimited).
    Credit(usize, Option<u32>),
    Refuse(usize),
    FailNext,
}

fn arb_ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        24 => (1usize..40, any::<u32>(), 1u32..40, prop_oneof![3 => Just(0u32), 1 => Just(FLAG_IGNORE_EOS), 1 => Just(2u32)], 0u64..4)
            .prop_map(|(l, s, m, f, c)| Ev::Admit(l, s, m, f, c)),
        1 => (0usize..8).prop_map(Ev::Reuse),
        3 => (0u64..4).prop_map(Ev::Cancel),
        80 => Just(Ev::Step),
        12 => (0usize..8, prop_oneof![Just(None), (0u32..4).prop_map(Some)])
            .prop_map(|(k, c)| Ev::Credit(k, c)),
        8 => (0usize..4).prop_map(Ev::Refuse),
        1 => Just(Ev::FailNext),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn random_schedules_give_identical_frames(
        slots in 1usize..5,
        waiting in 0usize..5,
        extra_budget in 0usize..12,
        block_size in 1usize..6,
        blocks in 4usize..40,
        max_pos in 8usize..80,
        ignore_all in prop::bool::weighted(0.2),
        events in prop::collection::vec(arb_ev(), 1..300),
    ) {
        let m = FakeModel::new(50, &[0, 7], max_pos, block_size, blocks);
        let mut cfg = config(slots, waiting, slots + extra_budget);
        cfg.ignore_eos = ignore_all;
        let mut p = Pair::new(m, cfg);
        let mut next_stream = 0u32;
        let mut streams: Vec<u32> = Vec::new();
        for ev in events {
            match ev {
                Ev::Admit(len, seed, max, flags, conn) => {
                    let pr: Vec<u32> = (0..len as u32)
                        .map(|k| (mix(seed as u64, k as u64) % 50) as u32)
                        .collect();
                    let _ = p.admit(generate(next_stream, conn, &pr, max, flags));
                    streams.push(next_stream);
                    next_stream += 1;
                }
                Ev::Reuse(k) => {
                    if let Some(&s) = streams.get(k) {
                        // Live: Internal (both); ended: a fresh admission would be a reuse,
                        // which the executor does too, but keep ids unique for the checks.
                        if p.c.holds(StreamId(s)) == Some(true) {
                            let pr = [1u32];
                            let r = p.admit(generate(s, 0, &pr, 3, 0));
                            // Busy comes first at capacity (both engines agree: Pair::admit).
                            prop_assert!(
                                r == Err(Status::Internal) || r == Err(Status::Busy),
                                "{:?}", r
                            );
                        }
                    }
                }
                Ev::Cancel(conn) => p.cancel(conn),
                Ev::Step => {
                    p.step();
                }
                Ev::Credit(k, c) => {
                    if let Some(&s) = streams.get(k) {
                        p.set_credit(s, c);
                    }
                }
                Ev::Refuse(n) => p.refuse(n),
                Ev::FailNext => p.fail_next(),
            }
        }
        p.drain();
    }
}

fn cpu_model() -> bgs_model::cpu::CpuModel {
    let (cfg, weights) =
        bgs_model::synth::synth_weights(bgs_model::SynthArch::TinyLlama, 3, bgs_model::DType::F32);
    let kv = bgs_model::cpu::KvConfig {
        block_size: 16,
        num_blocks: 12,
    };
    bgs_model::cpu::CpuModel::new(cfg, weights, kv, 1).unwrap()
}

/// The real CPU forward pass (a tiny synthetic checkpoint) under both engines: staggered
/// arrivals, chunked prefill, a credit stall, a full ring and a cancel give the same frames.
#[test]
fn the_cpu_model_gives_identical_frames_under_both_engines() {
    let cfg = config(3, 3, 24);
    let mut rust = GenerationEngine::new(cpu_model(), cfg).unwrap();
    let mut c = CGenEngine::new(cpu_model(), cfg).unwrap();
    let (mut rs, mut cs) = (Sink::default(), Sink::default());
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| (0..5 + 4 * i).map(|k| (i * 37 + k * 11) % 256).collect())
        .collect();
    for sink in [&mut rs, &mut cs] {
        sink.credit.insert(2, 3);
    }
    for step in 0..400 {
        if step < 6 {
            let i = step as usize;
            let r = generate(
                step,
                u64::from(step % 3),
                &prompts[i],
                12,
                FLAG_IGNORE_EOS * (step % 2),
            );
            assert_eq!(rust.admit(r), c.admit(r));
        }
        if step == 8 {
            rs.refuse = 2;
            cs.refuse = 2;
        }
        if step == 10 {
            rust.cancel(1);
            c.cancel(1);
        }
        if step == 12 {
            rs.credit.clear();
            cs.credit.clear();
        }
        let a = rust.step(&mut rs);
        let b = c.step(&mut cs);
        assert_eq!(a, b, "step {step}: progress");
        assert_eq!(rs.frames, cs.frames, "step {step}: frames");
        rust.check_invariants().unwrap();
        c.check_invariants().unwrap();
        if rust.live() == 0 && c.live() == 0 && step >= 6 {
            break;
        }
    }
    assert_eq!(c.live(), 0);
    assert_eq!(c.used_blocks(), 0);
    let finals = cs.frames.iter().filter(|f| f.2).count();
    assert_eq!(finals, 6, "one final frame per request");
    assert!(cs.frames.iter().any(|f| f.1 == Status::Cancelled));
    assert!(cs.frames.iter().filter(|f| f.1 == Status::Token).count() > 20);
}
