//! [`GenerationEngine`]: continuous batching of generate streams over a [`StepModel`], with
//! one-shot ops (echo, gemm8, fft32) answered inline.

use crate::oneshots::OneShots;
use bgs_engine::{Engine, Frame, FrameSink, Progress, Request, StreamId};
use bgs_protocol::{Op, Status};

use crate::kv::BlockAllocator;
use crate::model::{Item, StepModel};
use crate::policy::{self, Decision, Limits, SeqState, SeqView};

pub use bgs_protocol::{FINISH_EOS, FINISH_LENGTH, FLAG_IGNORE_EOS, MAX_NEW_TOKENS};
/// Credit a sequence needs to take part in a step: its token frame and possibly its final.
pub const STEP_CREDIT: u32 = 2;

/// Engine sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Sequences running at once (`--slots`): the batch's most sequences.
    pub slots: usize,
    /// Admitted requests beyond `slots` that may wait for a slot or for KV blocks.
    /// [`Engine::capacity`] is `slots + max_waiting`.
    pub max_waiting: usize,
    /// Token budget of one step (decode tokens + prefill chunk tokens); at least `slots`, so
    /// that every ready decoder gets its token in every step.
    pub max_batched_tokens: usize,
    /// Generate past EOS for every request (`bgs serve --ignore-eos`), as if each set
    /// [`FLAG_IGNORE_EOS`].
    pub ignore_eos: bool,
}

impl EngineConfig {
    /// `slots` running sequences, as many waiting ones, and a 512-token step budget (or
    /// `slots` when larger).
    pub fn new(slots: usize) -> EngineConfig {
        EngineConfig {
            slots,
            max_waiting: slots,
            max_batched_tokens: slots.max(512),
            ignore_eos: false,
        }
    }
}

/// A final frame a stream owes.
#[derive(Clone, Copy, Debug)]
struct End {
    status: Status,
    words: [u32; 2],
    len: usize,
}

impl End {
    fn finished(reason: u32, generated: u32) -> End {
        End {
            status: Status::EndOfStream,
            words: [reason, generated],
            len: 2,
        }
    }

    fn bare(status: Status) -> End {
        End {
            status,
            words: [0; 2],
            len: 0,
        }
    }
}

/// One generate stream.
#[derive(Debug)]
struct Seq {
    stream: StreamId,
    conn: u64,
    /// Prompt, then every generated token (the last one not yet fed back).
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose K/V are in `blocks` (the next input position).
    processed: usize,
    /// Tokens generated (EOS excluded).
    generated: u32,
    /// Most tokens it may generate: max new tokens, capped by the context and the pool.
    max_gen: u32,
    ignore_eos: bool,
    blocks: Vec<u32>,
    /// Admitted by the policy (holds a KV reservation).
    running: bool,
    /// Token frames published.
    emitted: u32,
    /// A sampled token whose frame the sink refused (one slot: the sequence does not advance
    /// until it is published).
    pending: Option<u32>,
    /// The final frame owed; set when the stream ended (its blocks are already free).
    end: Option<End>,
}

impl Seq {
    fn state(&self) -> SeqState {
        if !self.running {
            SeqState::Waiting
        } else if self.processed < self.prompt_len {
            SeqState::Prefill
        } else {
            SeqState::Decode
        }
    }

    /// Most tokens it will ever hold in the KV cache (the last sampled one is never fed).
    fn reserve_tokens(&self) -> usize {
        self.prompt_len + self.max_gen as usize - 1
    }

    /// Publish what is owed, in order: the pending token, then the final frame. Returns
    /// (something was published, the final frame was published).
    fn flush(&mut self, sink: &mut dyn FrameSink) -> (bool, bool) {
        let mut any = false;
        if let Some(t) = self.pending {
            let frame = Frame {
                status: Status::Token,
                final_: false,
                seq: self.emitted,
                words: &[t],
            };
            if sink.emit(self.stream, frame).is_err() {
                return (false, false);
            }
            self.pending = None;
            self.emitted += 1;
            any = true;
        }
        if let Some(end) = self.end {
            let frame = Frame {
                status: end.status,
                final_: true,
                seq: self.emitted,
                words: &end.words[..end.len],
            };
            if sink.emit(self.stream, frame).is_ok() {
                return (true, true);
            }
        }
        (any, false)
    }
}

/// The generation engine (see the crate docs and `docs/generation.md`).
#[derive(Debug)]
pub struct GenerationEngine<M: StepModel> {
    model: M,
    config: EngineConfig,
    kv: BlockAllocator,
    vocab: usize,
    eos: Vec<u32>,
    max_positions: usize,
    /// Generate streams in admission (FIFO) order.
    seqs: Vec<Seq>,
    oneshots: OneShots,
    // Per-step scratch, kept to avoid allocating every step.
    views: Vec<SeqView>,
    view_of: Vec<usize>,
    decisions: Vec<Decision>,
    batch: Vec<(usize, usize)>,
    next: Vec<u32>,
}

/// The limits every generation engine checks before it starts (the message names a bad one):
/// shared by [`GenerationEngine`] and [`CGenEngine`](crate::gen_loop::CGenEngine).
pub(crate) fn check_config(config: &EngineConfig, model: &impl StepModel) -> Result<(), String> {
    if config.slots == 0 {
        return Err("generation engine: slots is 0".into());
    }
    if config.max_batched_tokens < config.slots || config.max_batched_tokens > i32::MAX as usize {
        return Err(format!(
            "generation engine: max_batched_tokens {} must be between slots ({}) and {}",
            config.max_batched_tokens,
            config.slots,
            i32::MAX
        ));
    }
    if model.vocab_size() == 0 || model.vocab_size() > u32::MAX as usize {
        return Err(format!(
            "generation engine: vocab_size {} does not fit token ids",
            model.vocab_size()
        ));
    }
    if model.max_positions() < 2 {
        return Err(format!(
            "generation engine: max positions {} leaves no room to generate",
            model.max_positions()
        ));
    }
    Ok(())
}

impl<M: StepModel> GenerationEngine<M> {
    /// An engine over `model`; the message names a bad size.
    pub fn new(model: M, config: EngineConfig) -> Result<Self, String> {
        policy::check_abi()?;
        let shape = model.kv();
        let kv = BlockAllocator::new(shape.block_size, shape.num_blocks)?;
        check_config(&config, &model)?;
        Ok(GenerationEngine {
            vocab: model.vocab_size(),
            eos: model.eos_ids().to_vec(),
            max_positions: model.max_positions(),
            model,
            config,
            kv,
            seqs: Vec::new(),
            oneshots: OneShots::default(),
            views: Vec::new(),
            view_of: Vec::new(),
            decisions: Vec::new(),
            batch: Vec::new(),
            next: Vec::new(),
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

    /// The engine's sizes.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// KV blocks free now.
    pub fn free_blocks(&self) -> usize {
        self.kv.free_blocks()
    }

    /// KV blocks in block tables now.
    pub fn used_blocks(&self) -> usize {
        self.kv.used_blocks()
    }

    /// Generate streams running (holding a KV reservation) now.
    pub fn running(&self) -> usize {
        self.seqs
            .iter()
            .filter(|s| s.running && s.end.is_none())
            .count()
    }

    /// Check the engine's bookkeeping: block tables are disjoint and account for every used
    /// block, only running streams hold blocks, no table exceeds its reservation, and the free
    /// blocks cover every running stream's unallocated reservation. The message names the
    /// first broken rule (tests call this after every step).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = vec![false; self.kv.num_blocks()];
        let mut held = 0usize;
        let mut owed = 0usize;
        for s in &self.seqs {
            if (!s.running || s.end.is_some()) && !s.blocks.is_empty() {
                return Err(format!(
                    "stream {:?} holds blocks but is not running",
                    s.stream
                ));
            }
            for &b in &s.blocks {
                let slot = seen
                    .get_mut(b as usize)
                    .ok_or_else(|| format!("block {b} out of range"))?;
                if *slot {
                    return Err(format!("block {b} is in two block tables"));
                }
                *slot = true;
            }
            held += s.blocks.len();
            if s.running && s.end.is_none() {
                let need = self.kv.blocks_for(s.reserve_tokens());
                if s.blocks.len() > need {
                    return Err(format!("stream {:?} holds more than it reserved", s.stream));
                }
                owed += need - s.blocks.len();
            }
        }
        if held != self.kv.used_blocks() {
            return Err(format!(
                "{held} blocks in tables but the allocator counts {} used",
                self.kv.used_blocks()
            ));
        }
        if owed > self.kv.free_blocks() {
            return Err(format!(
                "reservations owe {owed} blocks, only {} free",
                self.kv.free_blocks()
            ));
        }
        if self.running() > self.config.slots {
            return Err(format!(
                "{} running > {} slots",
                self.running(),
                self.config.slots
            ));
        }
        Ok(())
    }

    fn admit_generate(&mut self, r: &Request<'_>) -> Result<Seq, Status> {
        let prompt = r.payload;
        if prompt.is_empty() {
            tracing::debug!(stream = r.stream.0, "generate: empty prompt");
            return Err(Status::BadParam);
        }
        if r.param == 0 || r.param > MAX_NEW_TOKENS {
            tracing::debug!(
                stream = r.stream.0,
                param = r.param,
                "generate: bad max tokens"
            );
            return Err(Status::BadParam);
        }
        if r.flags & !FLAG_IGNORE_EOS != 0 {
            return Err(Status::BadFlags);
        }
        if let Some(t) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            tracing::debug!(
                stream = r.stream.0,
                token = t,
                vocab = self.vocab,
                "generate: token id outside the vocabulary"
            );
            return Err(Status::BadParam);
        }
        let p = prompt.len();
        if p + 1 > self.max_positions {
            tracing::debug!(
                stream = r.stream.0,
                prompt = p,
                max_positions = self.max_positions,
                "generate: prompt leaves no room for a token"
            );
            return Err(Status::BadParam);
        }
        let pool_tokens = self.kv.num_blocks() * self.kv.block_size();
        if p > pool_tokens {
            tracing::warn!(
                stream = r.stream.0,
                prompt = p,
                pool_tokens,
                "generate: prompt can never fit the KV pool"
            );
            return Err(Status::BadParam);
        }
        // Generation ends with `length` at the first of: max new tokens, the model's context
        // (prompt + generated <= max positions), the whole KV pool (a sequence can hold at most
        // every block). All three depend only on the request and the engine's configuration,
        // never on the rest of the batch.
        let max_gen = (r.param as usize)
            .min(self.max_positions - p)
            .min(pool_tokens - p + 1) as u32;
        let mut tokens = Vec::with_capacity(p + max_gen as usize);
        tokens.extend_from_slice(prompt);
        Ok(Seq {
            stream: r.stream,
            conn: r.conn,
            tokens,
            prompt_len: p,
            processed: 0,
            generated: 0,
            max_gen,
            ignore_eos: self.config.ignore_eos || r.flags & FLAG_IGNORE_EOS != 0,
            blocks: Vec::new(),
            running: false,
            emitted: 0,
            pending: None,
            end: None,
        })
    }

    /// End stream `i` now: free its blocks, drop a pending token unless `keep_pending`, owe
    /// `end`.
    fn finish(&mut self, i: usize, end: End, keep_pending: bool) {
        let s = &mut self.seqs[i];
        self.kv.release(&mut s.blocks);
        s.running = false;
        if !keep_pending {
            s.pending = None;
        }
        s.end = Some(end);
    }

    /// Publish what ended or pending streams owe; drop streams whose final frame went out.
    fn flush_all(&mut self, sink: &mut dyn FrameSink) -> bool {
        let mut any = false;
        self.seqs.retain_mut(|s| {
            if s.pending.is_none() && s.end.is_none() {
                return true;
            }
            let (published, done) = s.flush(sink);
            any |= published;
            !done
        });
        any
    }

    /// Plan, run and account one batched model step. Returns whether the model ran.
    fn run_batch(&mut self, sink: &mut dyn FrameSink) -> bool {
        self.views.clear();
        self.view_of.clear();
        for (i, s) in self.seqs.iter().enumerate() {
            if s.end.is_some() {
                continue;
            }
            // A waiting sequence owes nothing until its prompt is done, so it is always ready:
            // gating its admission on credit let one slow reader (or a stream id whose last
            // request's frames were not yet acknowledged) hold up every admission behind it in
            // FIFO order. Once running, it needs credit like any other (its first token frame
            // waits as pending when the credit is short).
            let ready = s.pending.is_none()
                && (s.state() == SeqState::Waiting || sink.credit(s.stream) >= STEP_CREDIT);
            let prompt_left = s.prompt_len.saturating_sub(s.processed);
            self.views.push(SeqView::new(
                s.state(),
                prompt_left as u32,
                s.processed as u32,
                s.blocks.len() as u32,
                s.reserve_tokens() as u32,
                ready,
            ));
            self.view_of.push(i);
        }
        if self.views.is_empty() {
            return false;
        }
        let limits = Limits {
            block_size: self.kv.block_size() as u32,
            free_blocks: self.kv.free_blocks() as u32,
            max_batched_tokens: self.config.max_batched_tokens as u32,
            max_running: self.config.slots as u32,
        };
        self.decisions.clear();
        self.decisions.resize(self.views.len(), Decision::default());
        if let Err(e) = policy::plan(&limits, &self.views, &mut self.decisions) {
            // An engine bug (the engine keeps the policy's invariants). Ending every stream
            // is better than spinning on a plan that keeps failing.
            tracing::error!(error = %e, "generation step policy failed; ending every stream");
            for k in 0..self.view_of.len() {
                self.finish(self.view_of[k], End::bare(Status::Internal), false);
            }
            return true;
        }

        self.batch.clear();
        for k in 0..self.views.len() {
            let d = self.decisions[k];
            let i = self.view_of[k];
            if d.admit() {
                self.seqs[i].running = true;
            }
            if d.tokens == 0 {
                continue;
            }
            let s = &mut self.seqs[i];
            if !self.kv.grow(&mut s.blocks, d.new_blocks as usize) {
                tracing::error!(stream = s.stream.0, "KV pool short of a reserved block");
                self.finish(i, End::bare(Status::Internal), false);
                continue;
            }
            self.batch.push((i, d.tokens as usize));
        }
        if self.batch.is_empty() {
            return false;
        }

        let items: Vec<Item<'_>> = self
            .batch
            .iter()
            .map(|&(i, n)| {
                let s = &self.seqs[i];
                Item {
                    tokens: &s.tokens[s.processed..s.processed + n],
                    pos: s.processed,
                    blocks: &s.blocks,
                    sample: s.processed + n == s.tokens.len(),
                }
            })
            .collect();
        self.next.clear();
        self.next.resize(items.len(), 0);
        let result = self.model.step(&items, &mut self.next);
        drop(items);

        if let Err(e) = result {
            tracing::error!(
                error = %e,
                sequences = self.batch.len(),
                "model step failed; ending its sequences with Internal"
            );
            for k in 0..self.batch.len() {
                self.finish(self.batch[k].0, End::bare(Status::Internal), false);
            }
            return true;
        }

        for k in 0..self.batch.len() {
            let (i, n) = self.batch[k];
            let next = self.next[k];
            let s = &mut self.seqs[i];
            s.processed += n;
            if s.processed != s.tokens.len() {
                continue; // a prefill chunk that did not reach the prompt's end
            }
            if next as usize >= self.vocab {
                tracing::error!(
                    stream = s.stream.0,
                    token = next,
                    "model sampled outside vocab"
                );
                self.finish(i, End::bare(Status::Internal), false);
                continue;
            }
            if !s.ignore_eos && self.eos.contains(&next) {
                let generated = s.generated;
                self.finish(i, End::finished(FINISH_EOS, generated), false);
            } else {
                s.generated += 1;
                s.tokens.push(next);
                s.pending = Some(next);
                if s.generated >= s.max_gen {
                    let generated = s.generated;
                    self.finish(i, End::finished(FINISH_LENGTH, generated), true);
                }
            }
        }
        true
    }
}

impl<M: StepModel> Engine for GenerationEngine<M> {
    fn capacity(&self) -> usize {
        self.config.slots + self.config.max_waiting
    }

    fn live(&self) -> usize {
        self.seqs.len() + self.oneshots.len()
    }

    fn held_blocks(&self) -> usize {
        self.kv.used_blocks()
    }

    fn holds(&self, stream: StreamId) -> Option<bool> {
        Some(self.seqs.iter().any(|s| s.stream == stream) || self.oneshots.holds(stream))
    }

    fn admit(&mut self, r: Request<'_>) -> Result<(), Status> {
        if self.live() >= self.capacity() {
            return Err(Status::Busy);
        }
        let taken = self.seqs.iter().any(|s| s.stream == r.stream) || self.oneshots.holds(r.stream);
        if taken {
            tracing::error!(stream = r.stream.0, "admit: stream id already live");
            return Err(Status::Internal);
        }
        match r.op {
            Op::Generate => {
                let seq = self.admit_generate(&r)?;
                self.seqs.push(seq);
            }
            Op::Echo | Op::Gemm8 | Op::Fft32 => {
                self.oneshots.admit(&r)?;
            }
        }
        Ok(())
    }

    fn step(&mut self, sink: &mut dyn FrameSink) -> Progress {
        let mut worked = self.oneshots.run(sink);
        worked |= self.flush_all(sink);
        if self.run_batch(sink) {
            worked = true;
            self.flush_all(sink);
        }
        if worked {
            Progress::Working
        } else {
            Progress::Idle
        }
    }

    fn cancel(&mut self, conn: u64) {
        for i in 0..self.seqs.len() {
            if self.seqs[i].conn == conn {
                self.finish(i, End::bare(Status::Cancelled), false);
            }
        }
    }
}
