//! The generation engine: continuous batching of `generate` streams over a paged KV cache,
//! with decode tokens and prefill chunks mixed in one model step (Sarathi-style).
//!
//! - [`kv`]: the fixed pool of KV blocks and the per-sequence block tables.
//! - [`policy`]: the step policy, written once in portable C (`include/bgs_step_policy.h`, the
//!   code the GPU step loop will run too) and called through a safe wrapper. It decides each
//!   step which waiting sequences start and how many tokens every sequence processes.
//! - [`model`]: [`StepModel`], what the engine needs from a model (one batched forward step).
//! - [`engine`]: [`GenerationEngine`], the [`bgs_engine::Engine`] an executor runs.
//! - [`gen_loop`]: the same engine's step loop written once in portable C
//!   (`include/bgs_gen_loop.h`, the logic the GPU-resident dispatcher will run):
//!   [`CGenLoop`] wraps its state, [`CGenEngine`] drives it over a [`StepModel`] and emits
//!   the same frames as [`GenerationEngine`] (tests/gen_loop.rs checks that).
//!
//! One step of [`GenerationEngine`]:
//! 1. answer queued one-shot ops (echo, gemm8, fft32) inline with [`bgs_adapters::OneShotCpu`];
//! 2. publish what streams owe (a token frame the sink refused earlier, final frames);
//! 3. ask the policy for a plan: every ready decoder gets one token, the rest of the token
//!    budget goes to prefill chunks in FIFO order, and waiting sequences are admitted FIFO when
//!    the blocks for their whole reservation (prompt + max generated - 1 tokens) are not
//!    committed to anyone else, so a running sequence never waits for a block;
//! 4. grow block tables, run the model on the batch, and emit a token frame (or the final
//!    frame) for every sequence that sampled.
//!
//! A sequence takes part in a step only when its stream has credit for two frames (its token
//! and possibly its final frame) and has no refused frame pending; otherwise it sits out and
//! keeps its KV. Cancel and errors free blocks at once and leave one final frame owed.
//! `docs/generation.md` describes the scheduling, paging, credit, cancel and frame format.

pub mod engine;
pub mod gen_loop;
pub mod kv;
pub mod model;
mod oneshots;
pub mod policy;

pub use engine::{
    EngineConfig, FINISH_EOS, FINISH_LENGTH, FLAG_IGNORE_EOS, GenerationEngine, MAX_NEW_TOKENS,
    STEP_CREDIT,
};
pub use gen_loop::{CGenEngine, CGenLoop};
pub use kv::BlockAllocator;
pub use model::{Item, KvShape, StepModel};
