//! The fake model shared by the engine tests (`engine.rs`, `gen_loop.rs`).
//!
//! It keeps a token-level KV cache addressed only through the block tables it is given, and
//! its next token hashes the whole history it reads back through those tables. So a wrong
//! block table, a block shared with another live sequence, a lost or repeated input token, or
//! a chunk fed at the wrong position changes the sequence's tokens.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use bgs_llm::{Item, KvShape, StepModel};

/// One model step as the model saw it: (tokens, pos, block table, sample) per item.
pub type StepLog = Vec<(Vec<u32>, usize, Vec<u32>, bool)>;

#[derive(Debug, Clone)]
pub struct FakeModel {
    pub vocab: usize,
    pub eos: Vec<u32>,
    pub max_pos: usize,
    pub shape: KvShape,
    /// Token written at each (block, offset) slot.
    kv: Vec<Option<u32>>,
    /// Fail the next step (then clear).
    pub fail_next: bool,
    /// Every step the model was handed, failed ones included.
    pub steps: Vec<StepLog>,
}

impl FakeModel {
    pub fn new(
        vocab: usize,
        eos: &[u32],
        max_pos: usize,
        block_size: usize,
        blocks: usize,
    ) -> Self {
        FakeModel {
            vocab,
            eos: eos.to_vec(),
            max_pos,
            shape: KvShape {
                block_size,
                num_blocks: blocks,
            },
            kv: vec![None; block_size * blocks],
            fail_next: false,
            steps: Vec::new(),
        }
    }

    /// (items, prefill items, decode items) of every step the model was handed.
    pub fn log(&self) -> Vec<(usize, usize, usize)> {
        self.steps
            .iter()
            .map(|items| {
                let decode = items
                    .iter()
                    .filter(|(tokens, pos, _, sample)| tokens.len() == 1 && *pos > 0 && *sample)
                    .count();
                (items.len(), items.len() - decode, decode)
            })
            .collect()
    }

    fn slot(&self, blocks: &[u32], p: usize) -> usize {
        let bs = self.shape.block_size;
        blocks[p / bs] as usize * bs + p % bs
    }
}

/// A 64-bit mixing step (splitmix64's finaliser over `h ^ x`).
pub fn mix(h: u64, x: u64) -> u64 {
    let mut z = h ^ x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl StepModel for FakeModel {
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn eos_ids(&self) -> &[u32] {
        &self.eos
    }
    fn max_positions(&self) -> usize {
        self.max_pos
    }
    fn kv(&self) -> KvShape {
        self.shape
    }
    fn step(&mut self, items: &[Item<'_>], next: &mut [u32]) -> Result<(), String> {
        assert_eq!(items.len(), next.len());
        assert!(!items.is_empty(), "empty step");
        self.steps.push(
            items
                .iter()
                .map(|it| (it.tokens.to_vec(), it.pos, it.blocks.to_vec(), it.sample))
                .collect(),
        );
        if std::mem::take(&mut self.fail_next) {
            return Err("injected failure".into());
        }
        let bs = self.shape.block_size;
        let mut in_step = vec![false; self.shape.num_blocks];
        for it in items {
            assert!(!it.tokens.is_empty(), "item without tokens");
            let end = it.pos + it.tokens.len();
            assert!(
                end <= self.max_pos,
                "position {end} past the model's context"
            );
            assert!(it.blocks.len() >= end.div_ceil(bs), "block table too short");
            for &b in it.blocks {
                assert!(
                    (b as usize) < self.shape.num_blocks,
                    "block {b} out of range"
                );
                assert!(
                    !in_step[b as usize],
                    "block {b} shared by two items of a step"
                );
                in_step[b as usize] = true;
            }
        }
        for (it, out) in items.iter().zip(next.iter_mut()) {
            for (j, &t) in it.tokens.iter().enumerate() {
                assert!((t as usize) < self.vocab);
                let s = self.slot(it.blocks, it.pos + j);
                self.kv[s] = Some(t);
            }
            if it.sample {
                let mut h = 0u64;
                for p in 0..it.pos + it.tokens.len() {
                    let t = self.kv[self.slot(it.blocks, p)]
                        .unwrap_or_else(|| panic!("position {p} read before written"));
                    h = mix(h, ((p as u64) << 32) | t as u64);
                }
                *out = (h % self.vocab as u64) as u32;
            }
        }
        Ok(())
    }
}
