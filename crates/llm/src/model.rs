//! What the engine needs from a model: one batched forward step over paged KV.

/// The shape of a model's paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
}

/// One sequence's share of a step: the forward pass's own item type (input tokens, the
/// position of the first, the block table covering them, whether to sample after the last).
pub use bgs_model::cpu::StepItem as Item;

/// A model the engine can drive.
///
/// The model must give every item the result it would get alone in a step (per-item
/// invariance), and a prefill cut into chunks must give the same KV and token as unchunked:
/// the engine's determinism (a request's tokens do not depend on the rest of the batch) rests
/// on both.
pub trait StepModel: Send {
    /// Vocabulary size (token ids are below it).
    fn vocab_size(&self) -> usize;
    /// Token ids that end generation.
    fn eos_ids(&self) -> &[u32];
    /// Longest sequence (prompt + generated tokens) the model handles.
    fn max_positions(&self) -> usize;
    /// The paged KV cache's shape.
    fn kv(&self) -> KvShape;
    /// Write the K/V of every item's tokens into its blocks; for items with `sample`, put the
    /// greedy next token in `next[i]` (`next.len() == items.len()`).
    fn step(&mut self, items: &[Item<'_>], next: &mut [u32]) -> Result<(), String>;
}

impl StepModel for bgs_model::cpu::CpuModel {
    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }

    fn eos_ids(&self) -> &[u32] {
        &self.config().eos_token_ids
    }

    fn max_positions(&self) -> usize {
        self.config().max_position_embeddings
    }

    fn kv(&self) -> KvShape {
        let k = self.kv_config();
        KvShape {
            block_size: k.block_size,
            num_blocks: k.num_blocks,
        }
    }

    fn step(&mut self, items: &[Item<'_>], next: &mut [u32]) -> Result<(), String> {
        bgs_model::cpu::CpuModel::step(self, items, next)
    }
}
