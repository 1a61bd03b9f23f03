//! Engines: what an executor runs.
//!
//! An engine holds up to [`Engine::capacity`] requests at once (its streams), advances every
//! live stream by one step per [`Engine::step`], and emits reply frames through a
//! [`FrameSink`]. A one-shot op (echo, gemm8, fft32) is a stream that ends in one step;
//! generation is a stream whose step is one token of a batched forward pass.
//!
//! Contracts every engine keeps (the executor and transports rely on them):
//! - every admitted stream ends with exactly one final frame (`final_ = true`), also when it
//!   is cancelled (status `Cancelled`) or fails (status `Internal`);
//! - frames of one stream are emitted in order; `seq` is the token index for streamed frames;
//! - a refused emit ([`NoCredit`]) published nothing: the engine keeps the frame's work
//!   and retries on a later step; it never buffers an unbounded number of frames;
//! - `cancel` frees the stream's resources (KV blocks, batch place) at once; only the final
//!   `Cancelled` frame may still be owed, and it is emitted as soon as the sink takes it.

pub mod oneshot;

use bgs_protocol::{Op, Status};

/// A live stream inside one executor: an index below the executor's stream capacity,
/// assigned at admission and reused after the stream's final frame. For streaming ops it is
/// also the credit stream (`bgs_ring::RegionHeader::stream_acks[index]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u32);

/// A validated request handed to an engine.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// The stream this request becomes.
    pub stream: StreamId,
    /// The connection token (what [`Engine::cancel`] names).
    pub conn: u64,
    /// The op.
    pub op: Op,
    /// The request's param (repeat count, max new tokens).
    pub param: u32,
    /// The request's flags (bit 0 = ignore EOS, generate only; the framer rejects others).
    pub flags: u32,
    /// Payload words (prompt token ids for generate).
    pub payload: &'a [u32],
}

/// One reply frame of a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    /// Frame status (`Token` for streamed frames).
    pub status: Status,
    /// This frame ends the stream.
    pub final_: bool,
    /// Token index of a streamed frame, else 0.
    pub seq: u32,
    /// Payload words.
    pub words: &'a [u32],
}

/// The sink refused a frame: the stream has no credit left (its client is not reading fast
/// enough) or the completion ring is full. Nothing was published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NoCredit;

/// Where engines publish frames (the executor's view of the completion ring).
pub trait FrameSink {
    /// Frames `stream` may emit now without being refused (0 when it must wait).
    fn credit(&self, stream: StreamId) -> u32;
    /// Publish one frame of `stream`.
    fn emit(&mut self, stream: StreamId, frame: Frame<'_>) -> Result<(), NoCredit>;
}

/// What a step did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Nothing to do: no live stream, or every live stream waits for credit. The executor
    /// may sleep until a request, a cancel or credit arrives.
    Idle,
    /// Work was done; call `step` again.
    Working,
}

/// An engine (see the crate docs for the contracts).
pub trait Engine: Send {
    /// Streams this engine can hold at once; the executor admits no more than this many.
    fn capacity(&self) -> usize;
    /// Streams admitted and not yet ended by a published final frame.
    fn live(&self) -> usize;
    /// Take one request. `Err(status)`: refused; the executor answers it at once with a final
    /// frame of that status (for example `BadParam` for a token id outside the vocabulary).
    fn admit(&mut self, request: Request<'_>) -> Result<(), Status>;
    /// Advance every live stream by at most one step and emit what that produced.
    fn step(&mut self, sink: &mut dyn FrameSink) -> Progress;
    /// Connection `conn` ended: every stream of it ends with a final `Cancelled` frame, and
    /// its resources are freed now.
    fn cancel(&mut self, conn: u64);
    /// Whether `stream` is still live (admitted, final frame not yet published), when the
    /// engine can tell; `None` (the default) when it cannot. The executor uses it only for
    /// its safety net: when [`Engine::live`] drops below the streams it still owes a final
    /// frame, it answers the lost ones with `Internal`. Without this method it can only
    /// identify them once `live()` reaches 0.
    fn holds(&self, stream: StreamId) -> Option<bool> {
        let _ = stream;
        None
    }

    /// Resources held for live streams, in the engine's own unit (KV-cache blocks for
    /// generation; 0 for engines that hold nothing between steps). The executor publishes
    /// the sum as a gauge, so that operators and tests see what a cancel frees.
    fn held_blocks(&self) -> usize {
        0
    }
}
