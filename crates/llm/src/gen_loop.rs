//! The step loop in portable C (`include/bgs_gen_loop.h`): [`CGenLoop`], a safe wrapper over
//! its state, and [`CGenEngine`], an [`Engine`] over any [`StepModel`] that drives it.
//!
//! The C core is the logic the GPU-resident dispatcher will run (admission, cancel, step
//! planning with KV blocks, advancing sequences by the sampled tokens, the frames owed);
//! [`CGenEngine`] is its host driver, and `tests/gen_loop.rs` requires it to emit exactly the
//! frames [`GenerationEngine`](crate::GenerationEngine) emits on the same schedules. The state
//! is one `Vec<u32>` laid out by the C (`bgs_gl_init`); nothing in it points anywhere, so the
//! same words could live in device memory.

use crate::oneshots::OneShots;
use bgs_engine::{Engine, Frame, FrameSink, Progress, Request, StreamId};
use bgs_protocol::{Op, Status};

use crate::engine::EngineConfig;
use crate::model::{Item, StepModel};

/// Layout version the Rust structs below mirror (`BGS_GL_ABI_VERSION`).
const ABI_VERSION: u32 = 1;

/// Most prompt tokens the C core holds (`BGS_GL_MAX_PROMPT` = `BGS_RING_SLOT_WORDS`, a ring
/// slot's payload words; tests/gen_loop.rs checks it against `bgs_ring::SLOT_WORDS`).
pub const MAX_PROMPT: u32 = 256;

/// A table slot without a sequence (`BGS_GL_NO_STREAM`).
const NO_STREAM: u32 = u32::MAX;

/// Engine-wide limits (`struct bgs_gl_limits`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct GlLimits {
    /// Tokens per KV block.
    pub block_size: u32,
    /// Blocks in the KV pool.
    pub num_blocks: u32,
    /// Live sequences at most (running + waiting): the table's size.
    pub max_seqs: u32,
    /// Sequences running at once (slots).
    pub max_running: u32,
    /// Token budget of one step (>= max_running).
    pub max_batched_tokens: u32,
    /// Prompt tokens at most (1..=[`MAX_PROMPT`]).
    pub max_prompt: u32,
    /// Vocabulary size.
    pub vocab_size: u32,
    /// The model's context (prompt + generated).
    pub max_positions: u32,
    /// EOS ids the state can hold.
    pub max_eos: u32,
    /// Nonzero: every request generates past EOS.
    pub ignore_eos: u32,
}

#[derive(Debug)]
#[repr(C)]
struct GlRequest {
    conn: u64,
    stream: u32,
    conn_seq: u32,
    request_id: u32,
    route: u32,
    param: u32,
    flags: u32,
    words: u32,
    reserved: u32,
    payload: *const u32,
}

/// One frame a stream owes (`struct bgs_gl_frame`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct GlFrame {
    /// Sequence table slot (for [`CGenLoop::delivered`]).
    pub slot: u32,
    /// The request's stream.
    pub stream: u32,
    /// Frame status (`Status` code).
    pub status: u32,
    /// 1: ends the stream.
    pub final_: u32,
    /// Token index (token frames) or number of token frames (final).
    pub seq: u32,
    /// Payload words used.
    pub words: u32,
    /// Token id, or `[finish_reason, generated]`.
    pub word: [u32; 2],
}

/// One item of the planned step (`struct bgs_gl_item`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct GlItem {
    /// Sequence table slot.
    pub slot: u32,
    /// Its stream.
    pub stream: u32,
    /// Input tokens this step.
    pub tokens: u32,
    /// Position of the first.
    pub pos: u32,
    /// 1: sample after the last token.
    pub sample: u32,
    /// State word offset of the tokens.
    pub tok_at: u32,
    /// State word offset of the block table.
    pub bt_at: u32,
    /// Blocks in the table.
    pub n_blocks: u32,
}

/// The GPU model's step sizes as C reads them (`struct bgs_llm_step_geometry` of the
/// generated `include/bgs_llm_step.h`; `bgs_model_gpu::c_header` renders that struct from
/// this one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct CStepGeometry {
    /// Token capacity of a step (a bucket).
    pub max_tokens: u32,
    /// Sampled rows capacity.
    pub max_samples: u32,
    /// Items per step.
    pub max_seqs: u32,
    /// Block-table entries one sequence may use.
    pub max_blocks_per_seq: u32,
    /// Positions per KV block.
    pub block_size: u32,
    /// Blocks in the KV pool.
    pub num_blocks: u32,
}

/// What [`CGenLoop::pack`] wrote (`struct bgs_gl_packed`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct GlPacked {
    /// Real tokens.
    pub tokens: u32,
    /// Token bucket (captured graph).
    pub bucket: u32,
    /// Sampled rows.
    pub samples: u32,
    /// LM-head bucket, 0 when nothing is sampled.
    pub sample_bucket: u32,
    /// Words of the buffer to copy.
    pub words: u32,
    reserved: u32,
}

unsafe extern "C" {
    fn bgs_gl_state_bytes(limits: *const GlLimits) -> u64;
    fn bgs_gl_init(state: *mut u32, limits: *const GlLimits, eos: *const u32, n_eos: u32) -> i32;
    fn bgs_gl_admit(state: *mut u32, request: *const GlRequest) -> u32;
    fn bgs_gl_cancel(state: *mut u32, conn: u64) -> u32;
    fn bgs_gl_owed(state: *const u32, out: *mut GlFrame) -> u32;
    fn bgs_gl_delivered(state: *mut u32, slot: u32, published: u32);
    fn bgs_gl_plan(state: *mut u32, credit: *const u32) -> i32;
    fn bgs_gl_item(state: *const u32, k: u32, out: *mut GlItem) -> i32;
    fn bgs_gl_finish(state: *mut u32, next: *const u32, frames: *mut GlFrame) -> i32;
    fn bgs_gl_fail_step(state: *mut u32);
    fn bgs_gl_pack(
        state: *const u32,
        geo: *const CStepGeometry,
        buf: *mut i32,
        out: *mut GlPacked,
    ) -> i32;
    fn bgs_gl_step_words(geo: *const CStepGeometry) -> u32;
    fn bgs_gl_live(state: *const u32) -> u32;
    fn bgs_gl_running(state: *const u32) -> u32;
    fn bgs_gl_free_blocks(state: *const u32) -> u32;
    fn bgs_gl_holds(state: *const u32, stream: u32) -> u32;
    fn bgs_gl_slot_stream(state: *const u32, slot: u32) -> u32;
    fn bgs_gl_check(state: *mut u32) -> u32;
    fn bgs_gl_abi(
        limits: *mut u32,
        request: *mut u32,
        frame: *mut u32,
        item: *mut u32,
        packed: *mut u32,
        geometry: *mut u32,
    ) -> u32;
}

/// Check that the compiled C agrees with these struct layouts; the message names the
/// mismatch.
pub fn check_abi() -> Result<(), String> {
    let mut s = [0u32; 6];
    let [l, r, f, i, p, g] = &mut s;
    // SAFETY: the C writes one u32 through each pointer; all six point at live locals.
    let version = unsafe { bgs_gl_abi(l, r, f, i, p, g) };
    let want = [
        size_of::<GlLimits>(),
        size_of::<GlRequest>(),
        size_of::<GlFrame>(),
        size_of::<GlItem>(),
        size_of::<GlPacked>(),
        size_of::<CStepGeometry>(),
    ]
    .map(|n| n as u32);
    if version != ABI_VERSION || s != want {
        return Err(format!(
            "bgs_gen_loop.h ABI mismatch: C has version {version} sizes {s:?} (limits, \
             request, frame, item, packed, geometry), Rust expects {ABI_VERSION} {want:?}"
        ));
    }
    Ok(())
}

/// Words of the GPU model's step-input buffer for `geo` (`bgs_llm_step_words` of the
/// generated header, saturating at `usize::MAX` on 32-bit overflow).
pub fn step_words(geo: &CStepGeometry) -> usize {
    let wide = 4 * geo.max_tokens as u64
        + geo.max_samples as u64
        + geo.max_seqs as u64 * (1 + geo.max_blocks_per_seq as u64);
    if wide > u32::MAX as u64 {
        return usize::MAX; // the C's u32 arithmetic would wrap: no buffer is large enough
    }
    // SAFETY: reads the geometry struct only.
    unsafe { bgs_gl_step_words(geo) as usize }
}

/// The policy rejected its inputs while planning (a bug in the loop): every live sequence
/// now owes a final `Internal` frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyFailed;

/// The C step loop's state and safe calls into it.
#[derive(Debug, Clone)]
pub struct CGenLoop {
    state: Vec<u32>,
    limits: GlLimits,
    /// Scratch for the C's frame lists (2 per table slot at most).
    frames: Vec<GlFrame>,
    /// Items of the planned step (0: none).
    planned: usize,
}

impl CGenLoop {
    /// A loop with every block free and no sequence; the message names a bad limit.
    pub fn new(limits: GlLimits, eos: &[u32]) -> Result<CGenLoop, String> {
        check_abi()?;
        if eos.len() > limits.max_eos as usize {
            return Err(format!(
                "step loop: {} EOS ids, the limits allow {}",
                eos.len(),
                limits.max_eos
            ));
        }
        // SAFETY: reads the limits struct only.
        let bytes = unsafe { bgs_gl_state_bytes(&limits) };
        if bytes == 0 {
            return Err(format!(
                "step loop: invalid limits {limits:?} (a size is 0, max_seqs < max_running, \
                 max_batched_tokens < max_running, max_prompt > {MAX_PROMPT}, max_positions < 2, \
                 or the state would pass 1 GiB)"
            ));
        }
        let mut state = vec![0u32; (bytes / 4) as usize];
        // SAFETY: `state` holds the bytes bgs_gl_state_bytes asked for (u32-aligned); `eos`
        // holds `eos.len()` ids (<= max_eos, checked above).
        let r = unsafe { bgs_gl_init(state.as_mut_ptr(), &limits, eos.as_ptr(), eos.len() as u32) };
        if r != 0 {
            return Err(format!(
                "step loop: bgs_gl_init failed ({r}) for {limits:?}"
            ));
        }
        Ok(CGenLoop {
            state,
            limits,
            frames: vec![GlFrame::default(); 2 * limits.max_seqs as usize],
            planned: 0,
        })
    }

    /// The limits it was built with.
    pub fn limits(&self) -> &GlLimits {
        &self.limits
    }

    /// The state words (the layout of `bgs_gen_loop.h`).
    pub fn state(&self) -> &[u32] {
        &self.state
    }

    /// The state words, writable: how a copy that ran elsewhere (device memory) is written
    /// back. Words written must keep the layout's invariants; [`CGenLoop::check`] says.
    pub fn state_mut(&mut self) -> &mut [u32] {
        &mut self.state
    }

    /// Validate and queue a generate request (`Err`: the status to answer it with).
    pub fn admit(
        &mut self,
        stream: u32,
        conn: u64,
        param: u32,
        flags: u32,
        prompt: &[u32],
    ) -> Result<(), Status> {
        let Ok(words) = u32::try_from(prompt.len()) else {
            return Err(Status::BadParam);
        };
        let r = GlRequest {
            conn,
            stream,
            conn_seq: 0,
            request_id: 0,
            route: 0,
            param,
            flags,
            words,
            reserved: 0,
            payload: prompt.as_ptr(),
        };
        // SAFETY: the state was laid out by bgs_gl_init; the request points at `words`
        // live prompt words, read only during the call.
        let status = unsafe { bgs_gl_admit(self.state.as_mut_ptr(), &r) };
        match status {
            0 => Ok(()),
            s => Err(Status::from_u16(s as u16).unwrap_or(Status::Internal)),
        }
    }

    /// End every sequence of connection `conn` (one final `Cancelled` each); returns how
    /// many.
    pub fn cancel(&mut self, conn: u64) -> u32 {
        // SAFETY: an initialised state.
        unsafe { bgs_gl_cancel(self.state.as_mut_ptr(), conn) }
    }

    /// The frames owed now, in FIFO order (a stream's token frame before its final frame).
    pub fn owed(&mut self) -> &[GlFrame] {
        // SAFETY: `frames` holds 2 × max_seqs frames, the most the C writes.
        let n = unsafe { bgs_gl_owed(self.state.as_ptr(), self.frames.as_mut_ptr()) };
        &self.frames[..n as usize]
    }

    /// The first `published` frames [`CGenLoop::owed`] listed for `slot` went out.
    pub fn delivered(&mut self, slot: u32, published: u32) {
        // SAFETY: an initialised state; the C checks `slot`.
        unsafe { bgs_gl_delivered(self.state.as_mut_ptr(), slot, published) }
    }

    /// Plan one step; `credit[slot]` = frames the slot's stream may publish now (one word per
    /// table slot). Returns the items planned (0: no model step).
    pub fn plan(&mut self, credit: &[u32]) -> Result<usize, PolicyFailed> {
        assert!(
            credit.len() >= self.limits.max_seqs as usize,
            "credit has {} words for {} slots",
            credit.len(),
            self.limits.max_seqs
        );
        // SAFETY: an initialised state; `credit` holds max_seqs words (asserted).
        let r = unsafe { bgs_gl_plan(self.state.as_mut_ptr(), credit.as_ptr()) };
        self.planned = r.max(0) as usize;
        match r {
            0.. => Ok(r as usize),
            _ => Err(PolicyFailed),
        }
    }

    /// Item `k` of the planned step.
    pub fn item(&self, k: usize) -> Option<GlItem> {
        let mut it = GlItem::default();
        // SAFETY: an initialised state; the C checks `k` and writes one item.
        let r = unsafe { bgs_gl_item(self.state.as_ptr(), k as u32, &mut it) };
        (r == 0).then_some(it)
    }

    /// An item's input tokens.
    pub fn item_tokens(&self, it: &GlItem) -> &[u32] {
        &self.state[it.tok_at as usize..(it.tok_at + it.tokens) as usize]
    }

    /// An item's block table.
    pub fn item_blocks(&self, it: &GlItem) -> &[u32] {
        &self.state[it.bt_at as usize..(it.bt_at + it.n_blocks) as usize]
    }

    /// Advance the planned step's sequences by the sampled tokens (`next[k]` for item `k`);
    /// returns the frames owed now.
    pub fn finish(&mut self, next: &[u32]) -> Result<&[GlFrame], String> {
        let items = std::mem::take(&mut self.planned);
        if next.len() < items {
            return Err(format!("{} sampled tokens for {items} items", next.len()));
        }
        // SAFETY: an initialised state; `next` holds a word per item (checked); `frames` holds
        // 2 × max_seqs frames, the most the C writes.
        let r = unsafe {
            bgs_gl_finish(
                self.state.as_mut_ptr(),
                next.as_ptr(),
                self.frames.as_mut_ptr(),
            )
        };
        if r < 0 {
            return Err("step loop: finish without a planned step".into());
        }
        Ok(&self.frames[..r as usize])
    }

    /// The model step failed: the items' sequences end with `Internal`.
    pub fn fail_step(&mut self) {
        self.planned = 0;
        // SAFETY: an initialised state.
        unsafe { bgs_gl_fail_step(self.state.as_mut_ptr()) }
    }

    /// Write the planned step into the GPU model's step-input buffer (`buf` holds the
    /// geometry's words: `bgs_llm_step_words`).
    pub fn pack(&self, geo: &CStepGeometry, buf: &mut [i32]) -> Result<GlPacked, String> {
        let words = step_words(geo);
        if buf.len() < words {
            return Err(format!(
                "step buffer has {} words, the geometry needs {words}",
                buf.len()
            ));
        }
        let mut out = GlPacked::default();
        // SAFETY: an initialised state; `buf` holds the geometry's words (checked above
        // against the layout's size, which the C writes within).
        let r = unsafe { bgs_gl_pack(self.state.as_ptr(), geo, buf.as_mut_ptr(), &mut out) };
        match r {
            0 => Ok(out),
            -5 => Err("step loop: pack without a planned step".into()),
            _ => Err(format!("step loop: the planned step does not fit {geo:?}")),
        }
    }

    /// Sequences in the table (running, waiting, or owing frames).
    pub fn live(&self) -> usize {
        // SAFETY: an initialised state.
        unsafe { bgs_gl_live(self.state.as_ptr()) as usize }
    }

    /// Sequences running (holding a KV reservation).
    pub fn running(&self) -> usize {
        // SAFETY: an initialised state.
        unsafe { bgs_gl_running(self.state.as_ptr()) as usize }
    }

    /// KV blocks free.
    pub fn free_blocks(&self) -> usize {
        // SAFETY: an initialised state.
        unsafe { bgs_gl_free_blocks(self.state.as_ptr()) as usize }
    }

    /// KV blocks in block tables.
    pub fn used_blocks(&self) -> usize {
        self.limits.num_blocks as usize - self.free_blocks()
    }

    /// `stream` is in the table.
    pub fn holds(&self, stream: u32) -> bool {
        // SAFETY: an initialised state.
        unsafe { bgs_gl_holds(self.state.as_ptr(), stream) != 0 }
    }

    /// The stream in table slot `slot`, if any.
    pub fn slot_stream(&self, slot: u32) -> Option<u32> {
        // SAFETY: an initialised state; the C checks `slot`.
        let s = unsafe { bgs_gl_slot_stream(self.state.as_ptr(), slot) };
        (s != NO_STREAM).then_some(s)
    }

    /// Check the bookkeeping; the message names the broken rule.
    pub fn check(&mut self) -> Result<(), String> {
        // SAFETY: an initialised state (the C writes only its bitmap scratch).
        let r = unsafe { bgs_gl_check(self.state.as_mut_ptr()) };
        Err(match r {
            0 => return Ok(()),
            1 => "a block id outside the pool",
            2 => "a block in two tables, or in a table and on the free stack",
            3 => "block tables and the free stack do not add up to the pool",
            4 => "a sequence that is not running holds blocks",
            5 => "a block table exceeds its reservation",
            6 => "reservations owe more blocks than are free",
            7 => "more sequences running than slots",
            8 => "the FIFO order and the live slots disagree",
            _ => "unknown check failure",
        }
        .to_string())
    }
}

/// The generation engine over the C step loop: the same behaviour as
/// [`GenerationEngine`](crate::GenerationEngine) (same frames on the same schedules), with
/// every decision about sequences made by `bgs_gen_loop.h`. One-shot ops are answered in
/// Rust, as there. Prompts longer than [`MAX_PROMPT`] are refused (bad param).
#[derive(Debug)]
pub struct CGenEngine<M: StepModel> {
    model: M,
    config: EngineConfig,
    core: CGenLoop,
    oneshots: OneShots,
    credit: Vec<u32>,
    next: Vec<u32>,
    owed: Vec<GlFrame>,
}

impl<M: StepModel> CGenEngine<M> {
    /// An engine over `model`; the message names a bad size.
    pub fn new(model: M, config: EngineConfig) -> Result<Self, String> {
        crate::policy::check_abi()?;
        let shape = model.kv();
        let fits = |what: &str, v: usize| {
            u32::try_from(v).map_err(|_| format!("generation engine: {what} {v} does not fit u32"))
        };
        crate::engine::check_config(&config, &model)?;
        if shape.block_size == 0 || shape.num_blocks == 0 {
            return Err(format!(
                "KV pool of {} blocks of {} tokens is empty",
                shape.num_blocks, shape.block_size
            ));
        }
        let eos = model.eos_ids();
        let limits = GlLimits {
            block_size: fits("block_size", shape.block_size)?,
            num_blocks: fits("num_blocks", shape.num_blocks)?,
            max_seqs: fits("slots + max_waiting", config.slots + config.max_waiting)?,
            max_running: fits("slots", config.slots)?,
            max_batched_tokens: fits("max_batched_tokens", config.max_batched_tokens)?,
            max_prompt: MAX_PROMPT,
            vocab_size: fits("vocab_size", model.vocab_size())?,
            max_positions: fits("max positions", model.max_positions())?,
            max_eos: fits("EOS ids", eos.len())?,
            ignore_eos: config.ignore_eos as u32,
        };
        let core = CGenLoop::new(limits, eos)?;
        Ok(CGenEngine {
            model,
            config,
            credit: vec![0; limits.max_seqs as usize],
            core,
            oneshots: OneShots::default(),
            next: Vec::new(),
            owed: Vec::new(),
        })
    }

    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The model, mutably (tests inject failures through it).
    pub fn model_mut(&mut self) -> &mut M {
        &mut self.model
    }

    /// The C loop.
    pub fn core(&self) -> &CGenLoop {
        &self.core
    }

    /// KV blocks free now.
    pub fn free_blocks(&self) -> usize {
        self.core.free_blocks()
    }

    /// KV blocks in block tables now.
    pub fn used_blocks(&self) -> usize {
        self.core.used_blocks()
    }

    /// Generate streams running now.
    pub fn running(&self) -> usize {
        self.core.running()
    }

    /// Check the C loop's bookkeeping (see `bgs_gl_check`).
    pub fn check_invariants(&mut self) -> Result<(), String> {
        self.core.check()
    }

    /// Publish the frames the C loop owes (each stream's in order, stopping at a refusal) and
    /// report what went out.
    fn flush(&mut self, sink: &mut dyn FrameSink) -> bool {
        self.owed.clear();
        let owed = self.core.owed();
        self.owed.extend_from_slice(owed);
        self.publish(sink)
    }

    fn publish(&mut self, sink: &mut dyn FrameSink) -> bool {
        let mut any = false;
        let mut k = 0;
        while k < self.owed.len() {
            let slot = self.owed[k].slot;
            let mut end = k;
            while end < self.owed.len() && self.owed[end].slot == slot {
                end += 1;
            }
            let mut published = 0u32;
            for f in &self.owed[k..end] {
                let status = Status::from_u16(f.status as u16).unwrap_or(Status::Internal);
                let frame = Frame {
                    status,
                    final_: f.final_ != 0,
                    seq: f.seq,
                    words: &f.word[..f.words as usize],
                };
                if sink.emit(StreamId(f.stream), frame).is_err() {
                    break;
                }
                published += 1;
            }
            if published > 0 {
                self.core.delivered(slot, published);
                any = true;
            }
            k = end;
        }
        any
    }

    /// Plan, run and account one batched model step. Returns whether work was done.
    fn run_batch(&mut self, sink: &mut dyn FrameSink) -> bool {
        for (slot, c) in self.credit.iter_mut().enumerate() {
            *c = match self.core.slot_stream(slot as u32) {
                Some(s) => sink.credit(StreamId(s)),
                None => 0,
            };
        }
        let n = match self.core.plan(&self.credit) {
            Ok(0) => return false,
            Ok(n) => n,
            Err(PolicyFailed) => {
                tracing::error!("generation step policy failed; ending every stream");
                return true;
            }
        };
        let core = &self.core;
        let planned: Vec<GlItem> = (0..n).filter_map(|k| core.item(k)).collect();
        let items: Vec<Item<'_>> = planned
            .iter()
            .map(|it| Item {
                tokens: core.item_tokens(it),
                pos: it.pos as usize,
                blocks: core.item_blocks(it),
                sample: it.sample != 0,
            })
            .collect();
        self.next.clear();
        self.next.resize(items.len(), 0);
        let result = self.model.step(&items, &mut self.next);
        drop(items);
        if let Err(e) = result {
            tracing::error!(
                error = %e,
                sequences = n,
                "model step failed; ending its sequences with Internal"
            );
            self.core.fail_step();
            return true;
        }
        if let Err(e) = self.core.finish(&self.next) {
            tracing::error!(error = %e, "step loop: finish failed");
        }
        true
    }
}

impl<M: StepModel> Engine for CGenEngine<M> {
    fn capacity(&self) -> usize {
        self.config.slots + self.config.max_waiting
    }

    fn live(&self) -> usize {
        self.core.live() + self.oneshots.len()
    }

    fn held_blocks(&self) -> usize {
        self.core.used_blocks()
    }

    fn holds(&self, stream: StreamId) -> Option<bool> {
        Some(self.core.holds(stream.0) || self.oneshots.holds(stream))
    }

    fn admit(&mut self, r: Request<'_>) -> Result<(), Status> {
        if self.live() >= self.capacity() {
            return Err(Status::Busy);
        }
        if self.oneshots.holds(r.stream) {
            tracing::error!(stream = r.stream.0, "admit: stream id already live");
            return Err(Status::Internal);
        }
        match r.op {
            Op::Generate => self
                .core
                .admit(r.stream.0, r.conn, r.param, r.flags, r.payload),
            Op::Echo | Op::Gemm8 | Op::Fft32 => {
                if self.core.holds(r.stream.0) {
                    tracing::error!(stream = r.stream.0, "admit: stream id already live");
                    return Err(Status::Internal);
                }
                self.oneshots.admit(&r)
            }
        }
    }

    fn step(&mut self, sink: &mut dyn FrameSink) -> Progress {
        let mut worked = self.oneshots.run(sink);
        worked |= self.flush(sink);
        if self.run_batch(sink) {
            worked = true;
            self.flush(sink);
        }
        if worked {
            Progress::Working
        } else {
            Progress::Idle
        }
    }

    fn cancel(&mut self, conn: u64) {
        self.core.cancel(conn);
    }
}
