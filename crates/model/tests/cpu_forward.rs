//! Determinism, batch invariance, chunking, threading, validation and block reuse of the CPU
//! forward pass. Every comparison here is bitwise.

mod cpu_common;

use bgs_model::{Arch, CpuModel, KvConfig, ModelConfig, StepItem};
use cpu_common::{Rng, random_tokens, random_weights, tiny_config};

fn model(cfg: &ModelConfig, kv: KvConfig, threads: usize) -> CpuModel {
    CpuModel::new(cfg.clone(), random_weights(cfg, 7), kv, threads).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// One sequence alone: prefill `prompt` in `chunks`, then `steps` greedy decode steps.
/// Returns the logits bits after the prompt and after each decode step, and the tokens.
fn run_alone(
    m: &mut CpuModel,
    prompt: &[u32],
    chunks: &[usize],
    blocks: &[u32],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<u32>) {
    assert_eq!(chunks.iter().sum::<usize>(), prompt.len());
    let mut pos = 0;
    let mut last = Vec::new();
    for &c in chunks {
        let item = StepItem {
            tokens: &prompt[pos..pos + c],
            pos,
            blocks,
            sample: true,
        };
        last = m.step_logits(&[item]).unwrap().remove(0);
        pos += c;
    }
    let mut logits = vec![bits(&last)];
    let mut tokens = vec![argmax(&last)];
    for _ in 0..steps {
        let tok = [*tokens.last().unwrap()];
        let item = StepItem {
            tokens: &tok,
            pos,
            blocks,
            sample: true,
        };
        let l = m.step_logits(&[item]).unwrap().remove(0);
        // `step` and `step_logits` agree on the greedy token.
        logits.push(bits(&l));
        tokens.push(argmax(&l));
        pos += 1;
    }
    (logits, tokens)
}

fn configs() -> Vec<ModelConfig> {
    vec![
        tiny_config(Arch::Qwen2, true, 2),
        tiny_config(Arch::Llama, false, 3),
    ]
}

#[test]
fn chunked_prefill_equals_one_shot_and_token_by_token() {
    for cfg in configs() {
        let kv = KvConfig {
            block_size: 4,
            num_blocks: 16,
        };
        let blocks: Vec<u32> = (0..16).rev().collect();
        let prompt = random_tokens(&mut Rng::new(3), 37, cfg.vocab_size);
        let mut m = model(&cfg, kv, 1);
        let one_shot = run_alone(&mut m, &prompt, &[37], &blocks, 8);
        let chunked = run_alone(&mut m, &prompt, &[5, 16, 3, 13], &blocks, 8);
        let by_token = run_alone(&mut m, &prompt, &[1; 37], &blocks, 8);
        assert_eq!(one_shot, chunked, "{:?}", cfg.arch);
        assert_eq!(one_shot, by_token, "{:?}", cfg.arch);
    }
}

#[test]
fn batch_invariance_with_fifteen_other_sequences() {
    for cfg in configs() {
        let kv = KvConfig {
            block_size: 8,
            num_blocks: 128,
        };
        let mut rng = Rng::new(11);
        let prompt = random_tokens(&mut rng, 13, cfg.vocab_size);
        let steps = 20;
        let mine: Vec<u32> = (0..8).collect();
        let alone = run_alone(&mut model(&cfg, kv, 1), &prompt, &[13], &mine, steps);

        // The same sequence in a batch of 16: the 15 others were started earlier with
        // prompts of different lengths (so they sit at different positions), and the batch
        // runs the target's prefill alongside their decode steps.
        let mut m = model(&cfg, kv, 2);
        let others: Vec<(Vec<u32>, Vec<u32>)> = (0..15)
            .map(|j| {
                let len = 1 + (j * 7) % 40;
                let blocks = (8 + j as u32 * 8..16 + j as u32 * 8).collect();
                (random_tokens(&mut rng, len, cfg.vocab_size), blocks)
            })
            .collect();
        let mut other_pos = [0usize; 15];
        let mut other_next = [0u32; 15];
        for (j, (p, blocks)) in others.iter().enumerate() {
            let mut next = [0];
            m.step(
                &[StepItem {
                    tokens: p,
                    pos: 0,
                    blocks,
                    sample: true,
                }],
                &mut next,
            )
            .unwrap();
            other_pos[j] = p.len();
            other_next[j] = next[0];
        }
        let mut logits = Vec::new();
        let mut tokens: Vec<u32> = Vec::new();
        let mut pos = 0;
        for s in 0..=steps {
            let tok = tokens.last().map(|&t| [t]);
            let (mine_tokens, mine_pos): (&[u32], usize) = match &tok {
                None => (&prompt, 0),
                Some(t) => (t, pos),
            };
            let other_tok: Vec<[u32; 1]> = other_next.iter().map(|&t| [t]).collect();
            let mut items = Vec::new();
            // Put the target at a different place in the batch every step.
            let at = s % 16;
            for j in 0..15 {
                if j == at {
                    items.push(StepItem {
                        tokens: mine_tokens,
                        pos: mine_pos,
                        blocks: &mine,
                        sample: true,
                    });
                }
                items.push(StepItem {
                    tokens: &other_tok[j],
                    pos: other_pos[j],
                    blocks: &others[j].1,
                    sample: true,
                });
            }
            if at == 15 {
                items.push(StepItem {
                    tokens: mine_tokens,
                    pos: mine_pos,
                    blocks: &mine,
                    sample: true,
                });
            }
            let mut all = m.step_logits(&items).unwrap();
            let l = all.remove(at);
            pos = mine_pos + mine_tokens.len();
            logits.push(bits(&l));
            tokens.push(argmax(&l));
            for (j, lj) in all.iter().enumerate() {
                other_pos[j] += 1;
                other_next[j] = argmax(lj);
            }
        }
        assert_eq!(alone.1, tokens, "{:?}", cfg.arch);
        assert_eq!(alone.0, logits, "{:?}", cfg.arch);
    }
}

/// A mixed workload (prefills of several lengths, then decode of everything together).
fn mixed_workload(m: &mut CpuModel) -> Vec<Vec<u32>> {
    let vocab = m.config().vocab_size;
    let mut rng = Rng::new(5);
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|j| random_tokens(&mut rng, 3 + 9 * j, vocab))
        .collect();
    let tables: Vec<Vec<u32>> = (0..5u32).map(|j| (j * 10..j * 10 + 10).collect()).collect();
    let mut out = Vec::new();
    let items: Vec<StepItem<'_>> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, b)| StepItem {
            tokens: p,
            pos: 0,
            blocks: b,
            sample: true,
        })
        .collect();
    let mut next = vec![0u32; 5];
    let logits = m.step_logits(&items).unwrap();
    out.extend(logits.iter().map(|l| bits(l)));
    for (n, l) in next.iter_mut().zip(&logits) {
        *n = argmax(l);
    }
    let mut pos: Vec<usize> = prompts.iter().map(Vec::len).collect();
    for _ in 0..6 {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let items: Vec<StepItem<'_>> = (0..5)
            .map(|j| StepItem {
                tokens: &toks[j],
                pos: pos[j],
                blocks: &tables[j],
                sample: true,
            })
            .collect();
        let mut stepped = vec![0u32; 5];
        m.step(&items, &mut stepped).unwrap();
        out.push(stepped.clone());
        next = stepped;
        for p in &mut pos {
            *p += 1;
        }
    }
    out
}

#[test]
fn one_thread_and_three_threads_agree_bitwise() {
    // A wider variant too, so that decode steps (not only prefill) are big enough to be
    // split across the workers.
    let mut wide = tiny_config(Arch::Qwen2, false, 2);
    wide.hidden_size = 256;
    wide.head_dim = 64;
    wide.intermediate_size = 512;
    for cfg in configs().into_iter().chain([wide]) {
        let kv = KvConfig {
            block_size: 8,
            num_blocks: 50,
        };
        let a = mixed_workload(&mut model(&cfg, kv, 1));
        let b = mixed_workload(&mut model(&cfg, kv, 3));
        assert_eq!(a, b, "{:?}", cfg.arch);
    }
}

#[test]
fn step_tokens_match_step_logits_and_unsampled_items_are_left_alone() {
    let cfg = tiny_config(Arch::Qwen2, true, 2);
    let kv = KvConfig {
        block_size: 4,
        num_blocks: 8,
    };
    let mut a = model(&cfg, kv, 2);
    let mut b = model(&cfg, kv, 2);
    let p0 = [5u32, 6, 7, 8, 9];
    let p1 = [10u32, 11];
    let (b0, b1) = ([0u32, 1], [2u32, 3]);
    let items = [
        StepItem {
            tokens: &p0,
            pos: 0,
            blocks: &b0,
            sample: true,
        },
        StepItem {
            tokens: &p1,
            pos: 0,
            blocks: &b1,
            sample: false,
        },
    ];
    let logits = a.step_logits(&items).unwrap();
    let mut next = [u32::MAX, 4242];
    b.step(&items, &mut next).unwrap();
    assert_eq!(next, [argmax(&logits[0]), 4242]);
    // The unsampled item's K/V were still written: its continuation agrees in both models.
    let t = [3u32];
    let cont = [StepItem {
        tokens: &t,
        pos: 2,
        blocks: &b1,
        sample: true,
    }];
    let la = a.step_logits(&cont).unwrap();
    let lb = b.step_logits(&cont).unwrap();
    assert_eq!(bits(&la[0]), bits(&lb[0]));
}

#[test]
fn freed_block_reused_by_another_sequence_gives_fresh_results() {
    let cfg = tiny_config(Arch::Llama, true, 2);
    let kv = KvConfig {
        block_size: 4,
        num_blocks: 6,
    };
    let mut rng = Rng::new(9);
    let first = random_tokens(&mut rng, 8, cfg.vocab_size);
    let second = random_tokens(&mut rng, 9, cfg.vocab_size);

    let mut fresh = model(&cfg, kv, 1);
    let want = run_alone(&mut fresh, &second, &[9], &[3, 4, 5], 3);

    let mut m = model(&cfg, kv, 1);
    // The first sequence fills blocks 0..3 with its keys and values, then ends.
    run_alone(&mut m, &first, &[6, 2], &[0, 1, 2], 3);
    // The second gets the same blocks in another order: stale contents must not leak.
    let got = run_alone(&mut m, &second, &[4, 5], &[2, 0, 1], 3);
    assert_eq!(want, got);
}

#[test]
fn bad_steps_are_errors_and_leave_the_model_usable() {
    let cfg = tiny_config(Arch::Qwen2, true, 2);
    let kv = KvConfig {
        block_size: 4,
        num_blocks: 4,
    };
    let mut m = model(&cfg, kv, 2);
    let ok = [1u32, 2, 3];
    let blocks = [0u32, 1];
    let item = |tokens: &'static [u32], pos: usize, blocks: &'static [u32]| StepItem {
        tokens,
        pos,
        blocks,
        sample: true,
    };
    let cases: Vec<(Vec<StepItem<'static>>, &str)> = vec![
        (vec![item(&[1, 512], 0, &[0])], "outside the vocabulary"),
        (vec![item(&[1], 0, &[4])], "block id 4"),
        (vec![item(&[1, 2, 3], 3, &[0])], "block table has 1 blocks"),
        (
            vec![item(&[1, 2], 511, &[0; 128])],
            "exceed max_position_embeddings",
        ),
        (vec![item(&[], 0, &[0])], "no tokens"),
    ];
    for (items, want) in cases {
        let mut next = vec![0; items.len()];
        let e = m.step(&items, &mut next).unwrap_err();
        assert!(e.contains(want), "{e:?} should mention {want:?}");
        let e = m.step_logits(&items).unwrap_err();
        assert!(e.contains(want), "{e:?} should mention {want:?}");
    }
    let mut short = [0u32; 0];
    let e = m
        .step(
            &[StepItem {
                tokens: &ok,
                pos: 0,
                blocks: &blocks,
                sample: true,
            }],
            &mut short,
        )
        .unwrap_err();
    assert!(e.contains("next has 0 entries"), "{e}");

    // Still usable, and the failed steps wrote nothing that changes a fresh sequence.
    let got = m
        .step_logits(&[StepItem {
            tokens: &ok,
            pos: 0,
            blocks: &blocks,
            sample: true,
        }])
        .unwrap();
    let want = model(&cfg, kv, 1)
        .step_logits(&[StepItem {
            tokens: &ok,
            pos: 0,
            blocks: &blocks,
            sample: true,
        }])
        .unwrap();
    assert_eq!(bits(&got[0]), bits(&want[0]));
}

#[test]
fn bad_construction_is_an_error() {
    let cfg = tiny_config(Arch::Llama, true, 2);
    let w = random_weights(&cfg, 1);
    let kv = KvConfig {
        block_size: 4,
        num_blocks: 4,
    };
    let e = CpuModel::new(cfg.clone(), w.clone(), kv, 0).unwrap_err();
    assert!(e.contains("threads"), "{e}");
    let e = CpuModel::new(
        cfg.clone(),
        w.clone(),
        KvConfig {
            block_size: 0,
            num_blocks: 4,
        },
        1,
    )
    .unwrap_err();
    assert!(e.contains("block_size"), "{e}");
    let mut other = cfg.clone();
    other.num_layers = 3;
    let e = CpuModel::new(other, w, kv, 1).unwrap_err();
    assert!(e.contains("layers"), "{e}");
}

#[test]
fn logits_are_finite_and_not_constant() {
    let cfg = tiny_config(Arch::Qwen2, false, 2);
    let mut m = model(
        &cfg,
        KvConfig {
            block_size: 16,
            num_blocks: 2,
        },
        1,
    );
    let l = m
        .step_logits(&[StepItem {
            tokens: &[1, 2, 3],
            pos: 0,
            blocks: &[0],
            sample: true,
        }])
        .unwrap();
    assert!(l[0].iter().all(|x| x.is_finite()));
    let (lo, hi) = l[0]
        .iter()
        .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    assert!(hi - lo > 1.0, "logit spread {lo}..{hi}");
}

#[test]
fn model_is_send_and_block_bytes_match_the_layout() {
    fn send<T: Send>() {}
    send::<CpuModel>();
    let cfg = tiny_config(Arch::Llama, true, 3);
    let kv = KvConfig {
        block_size: 16,
        num_blocks: 1,
    };
    // 16 positions x 3 layers x (K, V) x 2 heads x 16 dims x 4 bytes.
    assert_eq!(kv.block_bytes(&cfg), 16 * 3 * 2 * 2 * 16 * 4);
}
