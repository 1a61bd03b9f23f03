//! What the engine needs from a model: one batched forward step over paged KV.

/// The shape of a model's paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
}

/// One sequence's share of a step (mirrors `bgs_model::cpu::StepItem`).
#[derive(Clone, Copy, Debug)]
pub struct Item<'a> {
    /// Input tokens: a prefill chunk, or the one token a decoder feeds back.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions `[0, pos)` are already in the blocks.
    pub pos: usize,
    /// The sequence's block table: block `i` holds positions `[i * block_size, (i + 1) *
    /// block_size)`; it covers at least `pos + tokens.len()` positions.
    pub blocks: &'a [u32],
    /// Sample the greedy next token after the last input token into `next[i]`.
    pub sample: bool,
}

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
