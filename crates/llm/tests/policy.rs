//! The C step policy (include/bgs_step_policy.h) through its Rust wrapper: examples, input
//! errors, and property tests of its invariants.

use bgs_llm::policy::{
    self, Decision, Limits, PolicyError, SeqState, SeqView, blocks_for, check_abi,
};
use proptest::prelude::*;

fn plan(limits: &Limits, seqs: &[SeqView]) -> Result<(u32, Vec<Decision>), PolicyError> {
    let mut out = vec![Decision::default(); seqs.len()];
    let total = policy::plan(limits, seqs, &mut out)?;
    Ok((total, out))
}

fn waiting(prompt: u32, max_gen: u32) -> SeqView {
    SeqView::new(SeqState::Waiting, prompt, 0, 0, prompt + max_gen - 1, true)
}

fn decoding(pos: u32, reserve: u32, block_size: u32, ready: bool) -> SeqView {
    SeqView::new(
        SeqState::Decode,
        0,
        pos,
        blocks_for(pos as u64, block_size),
        reserve,
        ready,
    )
}

#[test]
fn abi_matches() {
    check_abi().unwrap();
    assert_eq!(blocks_for(0, 4), 0);
    assert_eq!(blocks_for(9, 4), 3);
    assert_eq!(blocks_for(9, 0), 0);
}

#[test]
fn decoders_first_then_prefill_chunks_fifo() {
    let limits = Limits {
        block_size: 4,
        free_blocks: 100,
        max_batched_tokens: 10,
        max_running: 8,
    };
    let seqs = [
        decoding(5, 20, 4, true),
        waiting(6, 4), // admitted, chunk 6
        decoding(7, 20, 4, true),
        waiting(30, 4), // admitted, chunk = what is left (2)
        waiting(3, 4),  // admitted? no budget left: not admitted
    ];
    let (total, out) = plan(&limits, &seqs).unwrap();
    assert_eq!(total, 10);
    let tokens: Vec<u32> = out.iter().map(|d| d.tokens).collect();
    assert_eq!(tokens, [1, 6, 1, 2, 0]);
    let admit: Vec<bool> = out.iter().map(Decision::admit).collect();
    assert_eq!(admit, [false, true, false, true, false]);
    // Decoder at pos 5 holds 2 blocks, needs 2 for 6 tokens; pos 7 holds 2, needs 2 for 8.
    let blocks: Vec<u32> = out.iter().map(|d| d.new_blocks).collect();
    assert_eq!(blocks, [0, 2, 0, 1, 0]);
}

#[test]
fn admission_waits_for_the_whole_reservation_and_keeps_fifo() {
    let limits = Limits {
        block_size: 4,
        free_blocks: 5,
        max_batched_tokens: 64,
        max_running: 8,
    };
    // Running decoder reserves 12 tokens = 3 blocks, holds 1: 2 blocks committed, 3 free.
    let seqs = [
        decoding(4, 12, 4, true),
        waiting(8, 8), // needs ceil(15/4) = 4 > 3: waits
        waiting(1, 1), // would fit, but must not overtake
    ];
    let (_, out) = plan(&limits, &seqs).unwrap();
    assert_eq!(out[0].tokens, 1);
    assert_eq!(out[0].new_blocks, 1, "position 4 opens its second block");
    assert!(!out[1].admit() && !out[2].admit());
    assert_eq!(out[1].tokens + out[2].tokens, 0);
}

#[test]
fn not_ready_sequences_sit_out_and_block_admission_behind_them() {
    let limits = Limits {
        block_size: 2,
        free_blocks: 50,
        max_batched_tokens: 32,
        max_running: 4,
    };
    let mut w = waiting(3, 2);
    w = SeqView::new(
        SeqState::Waiting,
        w.prompt_left,
        0,
        0,
        w.reserve_tokens,
        false,
    );
    let seqs = [decoding(3, 10, 2, false), w, waiting(2, 2)];
    let (total, out) = plan(&limits, &seqs).unwrap();
    assert_eq!(total, 0);
    assert!(out.iter().all(|d| d.tokens == 0 && !d.admit()));
}

#[test]
fn max_running_caps_admission() {
    let limits = Limits {
        block_size: 4,
        free_blocks: 100,
        max_batched_tokens: 100,
        max_running: 2,
    };
    let seqs = [decoding(4, 9, 4, true), waiting(2, 2), waiting(2, 2)];
    let (_, out) = plan(&limits, &seqs).unwrap();
    let admit: Vec<bool> = out.iter().map(Decision::admit).collect();
    assert_eq!(admit, [false, true, false]);
}

#[test]
fn bad_inputs_are_errors() {
    let ok = Limits {
        block_size: 4,
        free_blocks: 1,
        max_batched_tokens: 8,
        max_running: 2,
    };
    for zero in [
        Limits {
            block_size: 0,
            ..ok
        },
        Limits {
            max_batched_tokens: 0,
            ..ok
        },
        Limits {
            max_running: 0,
            ..ok
        },
    ] {
        assert_eq!(plan(&zero, &[]).unwrap_err(), PolicyError::Limits);
    }
    // Reserves 3 blocks, holds 1: owes 2 but only 1 is free.
    let over = [decoding(4, 12, 4, true)];
    assert_eq!(plan(&ok, &over).unwrap_err(), PolicyError::Overcommit);
    // A decoder already at its reservation has nothing left to feed.
    let past = [decoding(12, 12, 4, true)];
    assert_eq!(plan(&ok, &past).unwrap_err(), PolicyError::Reserve);
    let mut out = [];
    assert_eq!(
        policy::plan(&ok, &[waiting(1, 1)], &mut out).unwrap_err(),
        PolicyError::OutputLength
    );
}

/// A valid policy input: running sequences (at most `max_running`) first, then waiting ones,
/// each with consistent positions and blocks; free blocks cover the reservations.
fn arb_input() -> impl Strategy<Value = (Limits, Vec<SeqView>)> {
    let seq = (
        0u32..3,
        1u32..40,
        1u32..24,
        any::<u32>(),
        prop::bool::weighted(0.8),
    );
    (
        1u32..9,
        1u32..9,
        0u32..80,
        0u32..30,
        prop::collection::vec(seq, 0..14),
    )
        .prop_map(|(bs, max_running, budget_extra, slack, raw)| {
            let mut running = Vec::new();
            let mut waits = Vec::new();
            for (kind, prompt, max_gen, r, ready) in raw {
                let reserve = prompt + max_gen - 1;
                match kind {
                    0 => waits.push(SeqView::new(
                        SeqState::Waiting,
                        prompt,
                        0,
                        0,
                        reserve,
                        ready,
                    )),
                    1 => {
                        let done = r % prompt;
                        running.push(SeqView::new(
                            SeqState::Prefill,
                            prompt - done,
                            done,
                            blocks_for(done as u64, bs),
                            reserve,
                            ready,
                        ));
                    }
                    _ if max_gen > 1 => {
                        let pos = prompt + r % (max_gen - 1);
                        running.push(SeqView::new(
                            SeqState::Decode,
                            0,
                            pos,
                            blocks_for(pos as u64, bs),
                            reserve,
                            ready,
                        ));
                    }
                    _ => {}
                }
            }
            running.truncate(max_running as usize);
            let owed: u32 = running
                .iter()
                .map(|s| blocks_for(s.reserve_tokens as u64, bs) - s.blocks_held)
                .sum();
            let limits = Limits {
                block_size: bs,
                free_blocks: owed + slack,
                max_batched_tokens: max_running + budget_extra,
                max_running,
            };
            running.extend(waits);
            (limits, running)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn plan_keeps_its_invariants((limits, seqs) in arb_input()) {
        let (total, out) = plan(&limits, &seqs).unwrap();
        let bs = limits.block_size;
        let sum: u32 = out.iter().map(|d| d.tokens).sum();
        prop_assert_eq!(sum, total);
        prop_assert!(total <= limits.max_batched_tokens, "budget exceeded");

        let new_blocks: u32 = out.iter().map(|d| d.new_blocks).sum();
        prop_assert!(new_blocks <= limits.free_blocks, "blocks over-committed");
        // After the step, what is left free covers every running sequence's remaining
        // reservation: no running sequence can ever starve for a block.
        let mut owed_after = 0u32;
        let mut running_after = 0u32;
        for (s, d) in seqs.iter().zip(&out) {
            let runs = s.state() != SeqState::Waiting || d.admit();
            if runs {
                running_after += 1;
                let need = blocks_for(s.reserve_tokens as u64, bs);
                prop_assert!(s.blocks_held + d.new_blocks <= need, "grew past its reservation");
                owed_after += need - s.blocks_held - d.new_blocks;
            }
            if d.tokens > 0 {
                prop_assert!(runs, "a waiting sequence got tokens without being admitted");
                prop_assert!(s.ready(), "a sequence without credit got tokens");
                prop_assert!(s.pos + d.tokens <= s.reserve_tokens, "past the reservation");
                prop_assert_eq!(
                    s.blocks_held + d.new_blocks,
                    blocks_for((s.pos + d.tokens) as u64, bs),
                    "block table must exactly cover the positions written"
                );
            }
            if d.admit() {
                prop_assert_eq!(s.state(), SeqState::Waiting);
            }
            match s.state() {
                SeqState::Decode => prop_assert_eq!(d.tokens, s.ready() as u32,
                    "every ready decoder gets exactly one token"),
                _ => prop_assert!(d.tokens <= s.prompt_left),
            }
        }
        prop_assert!(owed_after <= limits.free_blocks - new_blocks);
        prop_assert!(running_after <= limits.max_running);

        // Admission is a FIFO prefix of the waiting sequences.
        let waits: Vec<bool> = seqs.iter().zip(&out)
            .filter(|(s, _)| s.state() == SeqState::Waiting)
            .map(|(_, d)| d.admit())
            .collect();
        if let Some(first_not) = waits.iter().position(|a| !a) {
            prop_assert!(waits[first_not..].iter().all(|a| !a), "admission overtook");
        }

        // Prefill chunks in FIFO order: a sequence gets prefill tokens only when every earlier
        // ready prefilling sequence got its whole remaining prompt.
        let mut earlier_short = false;
        for (s, d) in seqs.iter().zip(&out) {
            let prefills = s.ready()
                && (s.state() == SeqState::Prefill || d.admit());
            if !prefills {
                continue;
            }
            if d.tokens > 0 {
                prop_assert!(!earlier_short, "a later prefill got budget before an earlier one");
            }
            if d.tokens < s.prompt_left {
                earlier_short = true;
            }
        }

        // Work conservation: with budget left over, every ready prefill finished its prompt,
        // and the first waiting ready sequence not admitted could not be (slots or blocks).
        if total < limits.max_batched_tokens {
            for (s, d) in seqs.iter().zip(&out) {
                if s.ready() && s.state() == SeqState::Prefill {
                    prop_assert_eq!(d.tokens, s.prompt_left);
                }
            }
            let first_left = seqs.iter().zip(&out)
                .find(|(s, d)| s.state() == SeqState::Waiting && !d.admit());
            if let Some((s, _)) = first_left {
                let need = blocks_for(s.reserve_tokens as u64, bs);
                let uncommitted = limits.free_blocks - new_blocks - owed_after;
                prop_assert!(
                    !s.ready() || running_after >= limits.max_running || need > uncommitted,
                    "a sequence that fit was left waiting"
                );
            }
        }
    }

    /// Drive whole workloads through the policy with random readiness: every sequence
    /// finishes (nothing starves or deadlocks) and blocks in use never exceed the pool.
    #[test]
    fn workloads_always_complete(
        bs in 1u32..6,
        pool_extra in 0u32..12,
        max_running in 1u32..6,
        budget_extra in 0u32..20,
        reqs in prop::collection::vec((1u32..24, 1u32..12), 1..12),
        seed in any::<u64>(),
    ) {
        // The pool fits the largest request alone (the engine clamps requests to the pool).
        let largest = reqs.iter().map(|&(p, g)| blocks_for((p + g - 1) as u64, bs)).max().unwrap();
        let pool = largest + pool_extra;
        let limits0 = Limits {
            block_size: bs,
            free_blocks: pool,
            max_batched_tokens: max_running + budget_extra,
            max_running,
        };
        // (view, generated, max_gen)
        let mut live: Vec<(SeqView, u32, u32)> =
            reqs.iter().map(|&(p, g)| (waiting(p, g), 0, g)).collect();
        let mut free = pool;
        let mut rng = seed | 1;
        let mut steps = 0u32;
        while !live.is_empty() {
            steps += 1;
            prop_assert!(steps < 10_000, "workload did not finish");
            let views: Vec<SeqView> = live.iter().map(|(v, _, _)| {
                rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
                // Ready 3 steps in 4: credit comes and goes.
                SeqView::new(v.state(), v.prompt_left, v.pos, v.blocks_held,
                    v.reserve_tokens, rng % 4 != 0)
            }).collect();
            let limits = Limits { free_blocks: free, ..limits0 };
            let (_, out) = plan(&limits, &views).unwrap();
            for ((v, generated, _), d) in live.iter_mut().zip(&out) {
                let mut state = v.state();
                if d.admit() { state = SeqState::Prefill; }
                prop_assert!(d.new_blocks <= free);
                free -= d.new_blocks;
                let blocks_held = v.blocks_held + d.new_blocks;
                let pos = v.pos + d.tokens;
                let mut prompt_left = v.prompt_left;
                if d.tokens > 0 {
                    if state == SeqState::Prefill {
                        prompt_left -= d.tokens;
                        if prompt_left == 0 { *generated += 1; state = SeqState::Decode; }
                    } else {
                        *generated += 1;
                    }
                }
                *v = SeqView::new(state, prompt_left, pos, blocks_held, v.reserve_tokens, true);
            }
            live.retain(|(v, generated, max_gen)| {
                if generated == max_gen { free += v.blocks_held; false } else { true }
            });
            prop_assert!(free <= pool);
        }
        prop_assert_eq!(free, pool, "blocks leaked");
    }
}
