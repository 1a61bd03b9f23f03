//! Executors take requests from the request ring, run them in engines and publish
//! completions into the completion ring.
//!
//! [`CpuExecutor`] is the embedded default: one resident thread per engine, each consuming the
//! (multi-consumer) request ring directly. [`CpuExecutor::start`] gives each of N slot
//! threads a one-shot engine of capacity 1 (echo, gemm8, fft32), which keeps the semantics the
//! GPU executor has: a request occupies one slot from the moment it is taken until its final
//! completion is published. [`CpuExecutor::start_engines`] runs given engines instead (the
//! generation server passes one engine holding many live sequences).
//!
//! Completions of different threads may be published out of order (the transport restores
//! per-connection order from `conn_seq`). A full completion ring back-pressures the engine (its
//! frame is refused and retried) rather than dropping anything. Streamed frames (generate)
//! also wait for per-stream credit: at most `stream_window` frames of one stream are in the
//! completion path (published and not yet acknowledged in `stream_acks`).
//!
//! Each thread owns a contiguous range of stream ids (its engine's capacity), so credit
//! counters are never shared between threads.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bgs_engine::oneshot::OneShotEngine;
use bgs_engine::{Engine, Frame, FrameSink, NoCredit, Progress, Request, StreamId};
use bgs_protocol::{Op, Status};
use bgs_ring::{MAX_STREAMS, OP_CANCEL, OP_REJECT, RingRegion, SLOT_WORDS};

/// Called after a completion is published while the completion consumer announced that it
/// sleeps (see `bgs_ring` sleep guards); the native transport passes an eventfd writer.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// A sleep used instead of the request ring's futex when the producers cannot wake a futex
/// (BPF programs ring a BPF ring buffer instead). Called with the thread already counted as a
/// sleeper and the ring re-checked empty; it returns after a wake-up or the timeout.
pub type ExternalWait = Arc<dyn Fn(Duration) + Send + Sync>;

/// Whether replies to `op` are a stream that takes credit (`CompletionEntry::stream != 0`).
///
/// The one place that decides it, so that it can move to the protocol's op table.
pub fn op_streams(op: Op) -> bool {
    op == Op::Generate
}

/// Settings of the CPU executor.
#[derive(Clone)]
pub struct CpuExecutorConfig {
    /// Number of slots (one-shot threads) that [`CpuExecutor::start`] runs;
    /// [`CpuExecutor::start_engines`] runs one thread per engine instead.
    pub slots: usize,
    /// Longest an idle thread spins re-checking the ring before it sleeps. The spin actually
    /// used adapts between 0 and this ([`SpinWindow`]): it grows while work keeps arriving
    /// within it and shrinks to nothing when gaps are longer, where spinning would cost every
    /// request its whole length for nothing.
    pub idle_spin: Duration,
    /// Upper bound on one idle sleep (nothing live). Producers wake sleepers (the futex
    /// doorbell, or `external_wait`), so this only bounds a missed wake-up and the time a
    /// thread sleeping in `external_wait` takes to see shutdown; it is long so that idle
    /// threads do not keep waking up.
    pub max_sleep: Duration,
    /// How long a thread whose live streams all wait (for credit, or for room in the
    /// completion ring) sleeps before it looks again. Short, because nothing wakes it when
    /// credit returns: the transport acknowledges frames by bumping `stream_acks` counters
    /// without ringing a doorbell (that would cost it a system call per ack batch).
    pub credit_poll: Duration,
    /// Most frames of one stream in flight (published to the completion ring and not yet
    /// acknowledged by its consumer), at least 1.
    pub stream_window: u32,
    /// Requests a thread whose engine is full may take from the ring ahead of admission, so
    /// that cancel markers queued behind them are still seen while long streams run. Only
    /// threads with live streamed requests look ahead (one-shot requests end within a step).
    pub lookahead: usize,
    /// How an idle thread sleeps when producers cannot wake the ring's futex.
    pub external_wait: Option<ExternalWait>,
}

impl Default for CpuExecutorConfig {
    fn default() -> Self {
        CpuExecutorConfig {
            slots: std::thread::available_parallelism().map_or(2, |n| n.get()),
            idle_spin: Duration::from_micros(20),
            max_sleep: Duration::from_millis(250),
            credit_poll: Duration::from_micros(150),
            stream_window: 16,
            lookahead: 64,
            external_wait: None,
        }
    }
}

impl std::fmt::Debug for CpuExecutorConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuExecutorConfig")
            .field("slots", &self.slots)
            .field("idle_spin", &self.idle_spin)
            .field("max_sleep", &self.max_sleep)
            .field("credit_poll", &self.credit_poll)
            .field("stream_window", &self.stream_window)
            .field("lookahead", &self.lookahead)
            .field("external_wait", &self.external_wait.is_some())
            .finish()
    }
}

/// Counters shared by all threads.
#[derive(Debug, Default)]
pub struct ExecutorStats {
    /// Requests taken from the ring (rejections included, cancel markers not).
    pub requests: AtomicU64,
    /// Completions published.
    pub completions: AtomicU64,
    /// Times a frame found the completion ring full (it is retried later).
    pub completion_stalls: AtomicU64,
    /// Times a thread went to sleep on an empty ring.
    pub sleeps: AtomicU64,
    /// Requests admitted into an engine (streams started).
    pub streams: AtomicU64,
    /// Cancel markers (`OP_CANCEL`) taken from the ring.
    pub cancels: AtomicU64,
    /// Streamed frames refused because their stream had no credit left.
    pub credit_refusals: AtomicU64,
    /// Streams an engine dropped without a final frame, answered `Internal` by the executor.
    pub lost_streams: AtomicU64,
    /// Gauge: resources the engines hold for live streams (KV-cache blocks for generation),
    /// updated after every step and cancel.
    pub held_blocks: AtomicU64,
}

/// What all threads share.
struct Shared {
    region: Arc<RingRegion>,
    stop: AtomicBool,
    stats: Arc<ExecutorStats>,
    waker: Option<Waker>,
    /// Per thread, each on a cache line of its own (written by its owner only on changes, or
    /// by others on cancels).
    threads: Vec<PerThread>,
}

#[derive(Default)]
#[repr(align(64))]
struct PerThread {
    /// The engine can admit a request now. A full thread takes requests ahead of admission
    /// only when no thread has room: otherwise one with room takes them (and the cancel
    /// markers behind them), and looking ahead would only hold requests back from it.
    room: AtomicBool,
    /// `conns` has entries.
    pending: AtomicBool,
    /// Requests this thread holds that still owe a final frame (`Worker::open`), published
    /// when it changes, after intake and after each step, for [`SlotUsage`].
    open: AtomicUsize,
    /// Cancel markers popped by other threads (a connection's streams may live in any
    /// thread's engine).
    conns: Mutex<Vec<u64>>,
}

/// Reads how busy the executor's threads are, from any thread. Values are published by each
/// thread after it takes requests and after each step, so they lag by at most one step.
#[derive(Clone)]
pub struct SlotUsage(Arc<Shared>);

impl std::fmt::Debug for SlotUsage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotUsage")
            .field("threads", &self.0.threads.len())
            .finish()
    }
}

impl SlotUsage {
    /// Threads (slots) holding at least one request that still owes a final frame.
    pub fn busy_slots(&self) -> usize {
        self.0
            .threads
            .iter()
            .filter(|t| t.open.load(Ordering::Relaxed) > 0)
            .count()
    }

    /// Requests (one-shot or streamed) held by all threads that still owe a final frame.
    pub fn live(&self) -> usize {
        self.0
            .threads
            .iter()
            .map(|t| t.open.load(Ordering::Relaxed))
            .sum()
    }

    /// Threads (slots).
    pub fn slots(&self) -> usize {
        self.0.threads.len()
    }
}

/// The embedded CPU executor.
pub struct CpuExecutor {
    threads: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for CpuExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuExecutor")
            .field("threads", &self.threads.len())
            .field("stats", &self.shared.stats)
            .finish()
    }
}

impl CpuExecutor {
    /// Start `cfg.slots` slot threads, each running a one-shot CPU engine of capacity 1.
    pub fn start(
        region: Arc<RingRegion>,
        cfg: &CpuExecutorConfig,
        waker: Option<Waker>,
    ) -> std::io::Result<Self> {
        let engines = (0..cfg.slots.max(1))
            .map(|_| Box::new(OneShotEngine::new(1)) as Box<dyn Engine>)
            .collect();
        Self::start_engines(region, cfg, waker, engines)
    }

    /// Start one thread per engine. Thread `t` owns the stream ids that follow those of
    /// threads `0..t`, as many as its engine's capacity; the capacities must add up to at
    /// most [`MAX_STREAMS`] (the ring's credit counters).
    pub fn start_engines(
        region: Arc<RingRegion>,
        cfg: &CpuExecutorConfig,
        waker: Option<Waker>,
        engines: Vec<Box<dyn Engine>>,
    ) -> std::io::Result<Self> {
        let invalid = |msg: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, msg);
        if engines.is_empty() {
            return Err(invalid("the CPU executor needs at least one engine".into()));
        }
        if cfg.stream_window == 0 {
            return Err(invalid("stream_window must be at least 1 frame".into()));
        }
        let mut total = 0usize;
        for (t, e) in engines.iter().enumerate() {
            if e.capacity() == 0 {
                return Err(invalid(format!("engine {t} has capacity 0")));
            }
            total = total.saturating_add(e.capacity());
        }
        if total > MAX_STREAMS {
            return Err(invalid(format!(
                "the engines hold up to {total} streams at once, more than the {MAX_STREAMS} \
                 stream ids (credit counters) of the ring; use fewer slots or a smaller capacity"
            )));
        }
        let shared = Arc::new(Shared {
            region: region.clone(),
            stop: AtomicBool::new(false),
            stats: Arc::new(ExecutorStats::default()),
            waker,
            threads: (0..engines.len())
                .map(|_| PerThread {
                    room: AtomicBool::new(true),
                    ..PerThread::default()
                })
                .collect(),
        });
        let mut exec = CpuExecutor {
            threads: Vec::with_capacity(engines.len()),
            shared: shared.clone(),
        };
        let mut base = 0u32;
        for (t, engine) in engines.into_iter().enumerate() {
            let cap = engine.capacity();
            let worker = Worker::new(t, shared.clone(), engine, base, cap, cfg);
            base += cap as u32;
            let spawned = std::thread::Builder::new()
                .name(format!("bgs-slot-{t}"))
                .spawn(move || worker.run());
            match spawned {
                Ok(h) => exec.threads.push(h),
                // Dropping `exec` stops the threads started so far.
                Err(e) => return Err(e),
            }
        }
        Ok(exec)
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<ExecutorStats> {
        &self.shared.stats
    }

    /// A reader of slot use for other threads (a metrics scrape).
    pub fn slot_usage(&self) -> SlotUsage {
        SlotUsage(self.shared.clone())
    }

    /// Number of threads (slots, or engines).
    pub fn slots(&self) -> usize {
        self.threads.len()
    }

    /// Stop all threads after their current step and join them. Streams still live are
    /// abandoned (the transport is shutting down too).
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        // Wake futex sleepers so they see the flag now rather than after `max_sleep`. A thread
        // that checked the flag just before it was set may register as a sleeper after this
        // notify: ring again until every thread is out.
        while self.threads.iter().any(|t| !t.is_finished()) {
            self.shared.region.requests().notify();
            std::thread::sleep(Duration::from_millis(1));
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for CpuExecutor {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// A request entry copied out of its ring slot, so the slot is released before the work runs.
struct Job {
    conn: u64,
    conn_seq: u32,
    op: u16,
    request_id: u32,
    param: u32,
    flags: u32,
    route: u32,
    publish_ns: u64,
    words: usize,
    payload: [u32; SLOT_WORDS],
}

impl Job {
    fn boxed() -> Box<Job> {
        Box::new(Job {
            conn: 0,
            conn_seq: 0,
            op: 0,
            request_id: 0,
            param: 0,
            flags: 0,
            route: 0,
            publish_ns: 0,
            words: 0,
            payload: [0; SLOT_WORDS],
        })
    }

    fn reply_to(&self) -> ReplyTo {
        ReplyTo {
            conn: self.conn,
            conn_seq: self.conn_seq,
            request_id: self.request_id,
            route: self.route,
            op: u32::from(self.op),
            publish_ns: self.publish_ns,
        }
    }
}

/// What a completion copies from its request: every completion of a request (tokens, final
/// frame, owed rejections and refusals) carries the request's op and `publish_ns`, which the
/// kernel transport's reply stage counts its request metrics from.
#[derive(Clone, Copy, Debug, Default)]
struct ReplyTo {
    conn: u64,
    conn_seq: u32,
    request_id: u32,
    route: u32,
    op: u32,
    publish_ns: u64,
}

/// Per stream id of a thread.
#[derive(Clone, Copy, Debug, Default)]
struct StreamMeta {
    /// Admitted and its final frame not yet published.
    open: bool,
    /// Takes credit (see [`op_streams`]).
    streamed: bool,
    reply: ReplyTo,
    /// Frames of this credit stream ever published (wrapping, like the ack counter; not reset
    /// when the id is reused, which keeps `published - acked` right across reuse).
    published: u32,
}

/// A final frame the executor owes itself (rejections, refused admissions, cancelled
/// look-ahead requests, lost streams); kept until the completion ring takes it.
#[derive(Clone, Copy, Debug)]
struct Owed {
    reply: ReplyTo,
    status: Status,
}

/// How long a thread waits for the completion consumer when the completion ring is full.
const STALL_SLEEP: Duration = Duration::from_micros(20);

/// Most owed frames before the thread stops taking entries from the ring (they only pile up
/// while the completion ring is full).
const OWED_LIMIT: usize = 64;

struct Worker {
    t: usize,
    shared: Arc<Shared>,
    engine: Box<dyn Engine>,
    /// First stream id of this thread.
    base: u32,
    streams: Vec<StreamMeta>,
    /// Free local stream indices (stack).
    free: Vec<u32>,
    /// Streams admitted whose final frame is not published yet.
    open: usize,
    /// Of those, streamed ones.
    open_streamed: usize,
    /// Requests taken ahead of admission (see `CpuExecutorConfig::lookahead`).
    backlog: VecDeque<Box<Job>>,
    /// Boxed because jobs (1 KiB each) move between `scratch`, `backlog` and this pool.
    #[allow(clippy::vec_box)]
    spare_jobs: Vec<Box<Job>>,
    scratch: Box<Job>,
    owed: VecDeque<Owed>,
    window: u32,
    lookahead: usize,
    spin: SpinWindow,
    max_sleep: Duration,
    credit_poll: Duration,
    external_wait: Option<ExternalWait>,
    /// A frame found the completion ring full in this round.
    ring_full: bool,
    /// This engine's share of `ExecutorStats::held_blocks`.
    held: u64,
    /// What this thread last stored in its `PerThread::room`.
    room: bool,
    /// What this thread last stored in its `PerThread::open`.
    open_published: usize,
    /// The safety net found fewer live streams than owed but could not tell which: logged
    /// once per episode.
    lost_unidentified: bool,
}

/// How long an idle executor thread spins before it sleeps, adapted like the kernel's
/// halt-polling (`haltpoll`): a spin that finds work keeps the window; a sleep that a request
/// ended sooner than the longest window (a longer spin would have caught it) grows it; a
/// longer sleep shrinks it, down to no spin at all. At 1,000 requests a second over a few
/// threads the gaps are far longer than the 20 µs window, so a fixed spin cost each request
/// 20 µs of CPU for nothing; under a burst the window grows back within a few requests.
#[derive(Debug, Clone, Copy)]
struct SpinWindow {
    current: Duration,
    max: Duration,
}

impl SpinWindow {
    /// Windows below this are not worth a clock read per loop: the window drops to zero.
    const FLOOR: Duration = Duration::from_micros(1);

    fn new(max: Duration) -> Self {
        SpinWindow { current: max, max }
    }

    fn current(&self) -> Duration {
        self.current
    }

    /// The thread slept for `slept` after its spin ran out.
    fn slept(&mut self, slept: Duration) {
        if slept < self.max {
            // Work came soon after the spin gave up: spin longer next time.
            self.current = (self.current * 2).clamp(Self::FLOOR, self.max);
        } else {
            self.current /= 2;
            if self.current < Self::FLOOR {
                self.current = Duration::ZERO;
            }
        }
    }
}

/// What one pop from the request ring brought.
enum Popped {
    Nothing,
    Cancel(u64),
    Reject,
    Request,
}

impl Worker {
    fn new(
        t: usize,
        shared: Arc<Shared>,
        engine: Box<dyn Engine>,
        base: u32,
        cap: usize,
        cfg: &CpuExecutorConfig,
    ) -> Worker {
        let acks = shared.region.stream_acks();
        let streams = (0..cap)
            .map(|i| StreamMeta {
                // A region reused from an earlier executor has counters that moved: start
                // level with them so that nothing counts as in flight.
                published: acks[base as usize + i].load(Ordering::Acquire),
                ..StreamMeta::default()
            })
            .collect();
        Worker {
            t,
            shared,
            engine,
            base,
            streams,
            free: (0..cap as u32).rev().collect(),
            open: 0,
            open_streamed: 0,
            backlog: VecDeque::new(),
            spare_jobs: Vec::new(),
            scratch: Job::boxed(),
            owed: VecDeque::new(),
            window: cfg.stream_window,
            lookahead: cfg.lookahead,
            spin: SpinWindow::new(cfg.idle_spin),
            max_sleep: cfg.max_sleep,
            credit_poll: cfg.credit_poll,
            external_wait: cfg.external_wait.clone(),
            room: true,
            open_published: 0,
            ring_full: false,
            held: 0,
            lost_unidentified: false,
        }
    }

    fn run(mut self) {
        while !self.shared.stop.load(Ordering::Acquire) {
            // New requests and cancel markers are looked at between every two steps: a step
            // of a generation engine is one forward pass, and a cancel frees its batch place.
            self.ring_full = false;
            let mut busy = self.intake();
            busy |= self.flush_owed();
            self.publish_open();
            if self.open > 0 {
                let mut sink = Sink {
                    region: &self.shared.region,
                    stats: &self.shared.stats,
                    waker: self.shared.waker.as_ref(),
                    published: false,
                    base: self.base,
                    streams: &mut self.streams,
                    free: &mut self.free,
                    open: &mut self.open,
                    open_streamed: &mut self.open_streamed,
                    ring_full: &mut self.ring_full,
                    window: self.window,
                };
                busy |= self.engine.step(&mut sink) == Progress::Working;
                if sink.published {
                    wake_consumers(&self.shared.region, self.shared.waker.as_ref());
                }
                self.check_lost();
                self.sync_held();
            }
            self.sync_room();
            if !busy {
                self.idle();
            }
        }
    }

    /// Publish the change of this engine's held resources into the shared gauge.
    fn sync_held(&mut self) {
        let now = self.engine.held_blocks() as u64;
        if now != self.held {
            let g = &self.shared.stats.held_blocks;
            if now > self.held {
                g.fetch_add(now - self.held, Ordering::Relaxed);
            } else {
                g.fetch_sub(self.held - now, Ordering::Relaxed);
            }
            self.held = now;
        }
    }

    /// Room in the engine for one more request.
    fn can_admit(&self) -> bool {
        !self.free.is_empty() && self.engine.live() < self.engine.capacity()
    }

    /// Keep this thread's `PerThread::open` up to date (a plain store, only on changes).
    fn publish_open(&mut self) {
        if self.open != self.open_published {
            self.open_published = self.open;
            self.shared.threads[self.t]
                .open
                .store(self.open, Ordering::Relaxed);
        }
    }

    /// Keep this thread's `PerThread::room` up to date (stored only when it changes).
    fn sync_room(&mut self) {
        self.publish_open();
        let room = self.can_admit();
        if room != self.room {
            self.room = room;
            self.shared.threads[self.t]
                .room
                .store(room, Ordering::Release);
        }
    }

    /// Whether the thread takes the next ring entry now: when it can admit it, or, full with
    /// streams that may run long, to look ahead for cancel markers while no thread has room
    /// (see `CpuExecutorConfig::lookahead`).
    fn wants_entries(&mut self) -> bool {
        if self.owed.len() >= OWED_LIMIT {
            return false;
        }
        if self.backlog.is_empty() && self.can_admit() {
            return true;
        }
        self.sync_room();
        self.open_streamed > 0
            && self.backlog.len() < self.lookahead
            && !self
                .shared
                .threads
                .iter()
                .any(|p| p.room.load(Ordering::Acquire))
    }

    /// Apply cancels from other threads, admit waiting requests, take ring entries.
    fn intake(&mut self) -> bool {
        let mut did = false;
        let inbox = &self.shared.threads[self.t];
        // Load first: the swap writes the line, and cancels are rare.
        if inbox.pending.load(Ordering::Relaxed) && inbox.pending.swap(false, Ordering::Acquire) {
            let conns = std::mem::take(&mut *inbox.conns.lock().unwrap_or_else(|e| e.into_inner()));
            for conn in conns {
                self.cancel_local(conn);
            }
            did = true;
        }
        while !self.backlog.is_empty() && self.can_admit() {
            if let Some(job) = self.backlog.pop_front() {
                self.admit(&job);
                self.spare_jobs.push(job);
                did = true;
            }
        }
        while self.wants_entries() {
            match self.pop() {
                Popped::Nothing => break,
                Popped::Cancel(conn) => {
                    self.shared.stats.cancels.fetch_add(1, Ordering::Relaxed);
                    self.cancel_local(conn);
                    self.broadcast_cancel(conn);
                }
                Popped::Reject => {
                    self.shared.stats.requests.fetch_add(1, Ordering::Relaxed);
                    // A rejection the framer placed in the connection's order: answer it as is.
                    let status = u16::try_from(self.scratch.param)
                        .ok()
                        .and_then(Status::from_u16)
                        .unwrap_or(Status::Internal);
                    self.owed.push_back(Owed {
                        reply: self.scratch.reply_to(),
                        status,
                    });
                }
                Popped::Request => {
                    self.shared.stats.requests.fetch_add(1, Ordering::Relaxed);
                    if self.backlog.is_empty() && self.can_admit() {
                        // Admit from `scratch` (swapped out for a spare buffer, so that the
                        // steady state does not allocate).
                        let next = self.spare_jobs.pop().unwrap_or_else(Job::boxed);
                        let job = std::mem::replace(&mut self.scratch, next);
                        self.admit(&job);
                        self.spare_jobs.push(job);
                    } else {
                        let next = self.spare_jobs.pop().unwrap_or_else(Job::boxed);
                        let job = std::mem::replace(&mut self.scratch, next);
                        self.backlog.push_back(job);
                    }
                }
            }
            did = true;
        }
        did
    }

    /// Copy the next ring entry into `scratch`.
    fn pop(&mut self) -> Popped {
        let job = &mut *self.scratch;
        let got = self.shared.region.requests().try_pop(|e| {
            let n = (e.words as usize).min(SLOT_WORDS);
            job.conn = e.conn;
            job.conn_seq = e.conn_seq;
            job.op = e.op;
            job.request_id = e.request_id;
            job.param = e.param;
            job.flags = e.flags;
            job.route = e.route;
            job.publish_ns = e.publish_ns;
            job.words = n;
            if e.op != OP_CANCEL && e.op != OP_REJECT {
                job.payload[..n].copy_from_slice(&e.payload[..n]);
            }
        });
        match got {
            None => Popped::Nothing,
            Some(()) if job.op == OP_CANCEL => Popped::Cancel(job.conn),
            Some(()) if job.op == OP_REJECT => Popped::Reject,
            Some(()) => Popped::Request,
        }
    }

    fn admit(&mut self, job: &Job) {
        let Some(op) = Op::from_u16(job.op) else {
            self.owed.push_back(Owed {
                reply: job.reply_to(),
                status: Status::UnknownOp,
            });
            return;
        };
        let Some(local) = self.free.pop() else {
            // `can_admit` was checked by the caller.
            self.owed.push_back(Owed {
                reply: job.reply_to(),
                status: Status::Internal,
            });
            return;
        };
        let request = Request {
            stream: StreamId(self.base + local),
            conn: job.conn,
            op,
            param: job.param,
            flags: job.flags,
            payload: &job.payload[..job.words],
        };
        match self.engine.admit(request) {
            Ok(()) => {
                let streamed = op_streams(op);
                let m = &mut self.streams[local as usize];
                m.open = true;
                m.streamed = streamed;
                m.reply = job.reply_to();
                self.open += 1;
                self.open_streamed += usize::from(streamed);
                self.shared.stats.streams.fetch_add(1, Ordering::Relaxed);
            }
            Err(status) => {
                self.free.push(local);
                self.owed.push_back(Owed {
                    reply: job.reply_to(),
                    status,
                });
            }
        }
    }

    /// Connection `conn` ended: cancel its streams in this thread's engine and its streamed
    /// requests still waiting for admission (one-shot ones are answered as usual).
    fn cancel_local(&mut self, conn: u64) {
        if self.open > 0 {
            self.engine.cancel(conn);
            self.sync_held();
        }
        if self.backlog.iter().any(|j| j.conn == conn) {
            let mut kept = VecDeque::with_capacity(self.backlog.len());
            for job in self.backlog.drain(..) {
                let streamed = Op::from_u16(job.op).is_some_and(op_streams);
                if job.conn == conn && streamed {
                    self.owed.push_back(Owed {
                        reply: job.reply_to(),
                        status: Status::Cancelled,
                    });
                    self.spare_jobs.push(job);
                } else {
                    kept.push_back(job);
                }
            }
            self.backlog = kept;
        }
    }

    /// Tell the other threads: the connection's streams may live in their engines, or be
    /// about to (another thread may have popped a request of it just before this marker).
    fn broadcast_cancel(&self, conn: u64) {
        for (t, inbox) in self.shared.threads.iter().enumerate() {
            if t != self.t {
                inbox
                    .conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(conn);
                inbox.pending.store(true, Ordering::Release);
            }
        }
    }

    /// Publish owed final frames; true if any went out.
    fn flush_owed(&mut self) -> bool {
        let mut did = false;
        while let Some(o) = self.owed.front().copied() {
            let ok = publish(
                &self.shared.region,
                &self.shared.stats,
                o.reply,
                0,
                Frame {
                    status: o.status,
                    final_: true,
                    seq: 0,
                    words: &[],
                },
            );
            if !ok {
                self.ring_full = true;
                break;
            }
            self.owed.pop_front();
            did = true;
        }
        if did {
            wake_consumers(&self.shared.region, self.shared.waker.as_ref());
        }
        did
    }

    /// The "exactly once" safety net: every admitted request ends with one final frame. An
    /// engine whose `live()` dropped below the streams still owed a final frame lost some;
    /// answer those `Internal` instead of leaving their clients hanging.
    fn check_lost(&mut self) {
        let live = self.engine.live();
        if live >= self.open {
            self.lost_unidentified = false;
            return;
        }
        for local in 0..self.streams.len() {
            if !self.streams[local].open {
                continue;
            }
            let id = StreamId(self.base + local as u32);
            let lost = match self.engine.holds(id) {
                Some(holds) => !holds,
                // Without `holds`, the lost streams are known only when none is live.
                None => live == 0,
            };
            if lost {
                tracing::error!(stream = id.0, "engine ended a stream without a final frame");
                let m = &mut self.streams[local];
                m.open = false;
                self.open -= 1;
                self.open_streamed -= usize::from(m.streamed);
                self.free.push(local as u32);
                self.owed.push_back(Owed {
                    reply: m.reply,
                    status: Status::Internal,
                });
                self.shared
                    .stats
                    .lost_streams
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        if live < self.open && !self.lost_unidentified {
            self.lost_unidentified = true;
            tracing::error!(
                live,
                owed = self.open,
                "engine reports fewer live streams than owe a final frame; \
                 they are answered once it reports none live"
            );
        }
    }

    /// Nothing to do right now.
    fn idle(&mut self) {
        if self.ring_full {
            // The completion consumer is behind: let it run, and look again soon (it rings no
            // doorbell when it frees slots).
            std::thread::sleep(STALL_SLEEP);
            return;
        }
        if self.open > 0 || !self.owed.is_empty() || !self.backlog.is_empty() {
            // Live streams wait for credit. Acks ring no doorbell, so poll; new ring entries cut
            // the wait short when the thread takes them.
            if self.wants_entries() {
                self.sleep(self.credit_poll);
            } else {
                std::thread::sleep(self.credit_poll);
            }
            return;
        }
        // Nothing live: spin briefly if requests have lately come that close together (a
        // burst often has more right behind), then sleep until a producer rings the doorbell.
        let ring = self.shared.region.requests();
        let inbox = &self.shared.threads[self.t];
        let window = self.spin.current();
        if !window.is_zero() {
            let spin_until = Instant::now() + window;
            while Instant::now() < spin_until {
                if !ring.is_empty() || inbox.pending.load(Ordering::Relaxed) {
                    // Found work within the window: it stays as it is.
                    return;
                }
                std::hint::spin_loop();
            }
        }
        self.shared.stats.sleeps.fetch_add(1, Ordering::Relaxed);
        let asleep = Instant::now();
        self.sleep(self.max_sleep);
        self.spin.slept(asleep.elapsed());
    }

    /// Sleep until the request ring has entries or `timeout` passes. A cancel sent to this
    /// thread's inbox does not wake it: a thread sleeping here has no stream to cancel.
    fn sleep(&self, timeout: Duration) {
        let ring = self.shared.region.requests();
        match &self.external_wait {
            Some(wait) => {
                let _guard = ring.sleep_guard();
                if ring.is_empty() && !self.shared.stop.load(Ordering::Acquire) {
                    wait(timeout);
                }
            }
            None => {
                ring.wait_nonempty(timeout);
            }
        }
    }
}

/// Publish one completion; false when the completion ring is full. The caller wakes the
/// consumers ([`wake_consumers`]) once it has published what it has.
fn publish(
    region: &RingRegion,
    stats: &ExecutorStats,
    reply: ReplyTo,
    stream: u32,
    frame: Frame<'_>,
) -> bool {
    let n = frame.words.len().min(SLOT_WORDS);
    if n < frame.words.len() {
        tracing::error!(
            words = frame.words.len(),
            "frame larger than a ring slot; truncated"
        );
    }
    let pushed = region.completions().try_push(|e| {
        e.conn = reply.conn;
        e.conn_seq = reply.conn_seq;
        e.status = frame.status as u16;
        e.final_ = u16::from(frame.final_);
        e.request_id = reply.request_id;
        e.words = n as u32;
        e.stream_seq = frame.seq;
        e.route = reply.route;
        e.stream = stream;
        e.op = reply.op;
        e.publish_ns = reply.publish_ns;
        e.payload[..n].copy_from_slice(&frame.words[..n]);
    });
    if pushed.is_err() {
        stats.completion_stalls.fetch_add(1, Ordering::Relaxed);
        return false;
    }
    stats.completions.fetch_add(1, Ordering::Relaxed);
    true
}

/// After publishing: wake the completion ring's sleeping consumers. Futex sleepers (other
/// executors' consumers, tests) and an epoll sleeper (the native transport, through its
/// eventfd) are both told. One fence and load when nobody sleeps (the common case under
/// load); `notify` re-checks only when someone does.
///
/// Called after each one-shot reply, once per batch of owed frames, and for streamed frames
/// once per engine step, not per frame: a step that publishes a token for each of 32
/// streams wakes the transport once, and it reaps and writes them in one pass.
fn wake_consumers(region: &RingRegion, waker: Option<&Waker>) {
    let ring = region.completions();
    if ring.has_sleepers() {
        ring.notify();
        if let Some(w) = waker {
            w();
        }
    }
}

/// The engine's view of the completion ring, for one thread's streams.
struct Sink<'a> {
    region: &'a RingRegion,
    stats: &'a ExecutorStats,
    waker: Option<&'a Waker>,
    /// A streamed frame was published (the step's end wakes the consumers once).
    published: bool,
    base: u32,
    streams: &'a mut [StreamMeta],
    free: &'a mut Vec<u32>,
    open: &'a mut usize,
    open_streamed: &'a mut usize,
    ring_full: &'a mut bool,
    window: u32,
}

impl Sink<'_> {
    fn local(&self, stream: StreamId) -> Option<usize> {
        let local = stream.0.checked_sub(self.base)? as usize;
        self.streams.get(local).filter(|m| m.open).map(|_| local)
    }

    /// Frames of credit stream `local` in flight (published, not acknowledged).
    fn in_flight(&self, local: usize) -> u32 {
        let acked = self.region.stream_acks()[self.base as usize + local].load(Ordering::Acquire);
        // More acks than frames (a consumer bug, or counters moved by an earlier user of the
        // region) reads as nothing in flight rather than as a stall of ~2^32 frames.
        let d = self.streams[local].published.wrapping_sub(acked);
        if d > i32::MAX as u32 { 0 } else { d }
    }
}

impl FrameSink for Sink<'_> {
    fn credit(&self, stream: StreamId) -> u32 {
        let Some(local) = self.local(stream) else {
            return 0;
        };
        let ring = self.region.completions();
        let room = (ring.capacity() - ring.len()) as u32;
        if self.streams[local].streamed {
            room.min(self.window.saturating_sub(self.in_flight(local)))
        } else {
            room
        }
    }

    fn emit(&mut self, stream: StreamId, frame: Frame<'_>) -> Result<(), NoCredit> {
        let Some(local) = self.local(stream) else {
            // Accepting it keeps a buggy engine from retrying forever; the client of a live
            // stream never sees another stream's frame.
            tracing::error!(
                stream = stream.0,
                "frame for a stream that is not live (ended, or not this thread's); dropped"
            );
            return Ok(());
        };
        let m = self.streams[local];
        let credit_stream = if m.streamed {
            if self.in_flight(local) >= self.window {
                self.stats.credit_refusals.fetch_add(1, Ordering::Relaxed);
                return Err(NoCredit);
            }
            self.base + local as u32 + 1
        } else {
            0
        };
        if !publish(self.region, self.stats, m.reply, credit_stream, frame) {
            *self.ring_full = true;
            return Err(NoCredit);
        }
        if m.streamed {
            self.published = true;
        } else {
            // A one-shot reply goes out at once: the rest of the step may run other
            // requests for a while (the one-shot engine runs every held request in one step).
            wake_consumers(self.region, self.waker);
        }
        let m = &mut self.streams[local];
        if m.streamed {
            m.published = m.published.wrapping_add(1);
        }
        if frame.final_ {
            m.open = false;
            *self.open -= 1;
            *self.open_streamed -= usize::from(m.streamed);
            self.free.push(local as u32);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn spin_window_shrinks_to_nothing_on_long_gaps_and_grows_back_on_short_ones() {
        use super::SpinWindow;
        use std::time::Duration;
        let us = Duration::from_micros;
        let mut w = SpinWindow::new(us(20));
        assert_eq!(w.current(), us(20), "starts at the longest window");
        // 1,000 req/s on one thread: every sleep about 1 ms.
        for _ in 0..6 {
            w.slept(us(1000));
        }
        assert_eq!(
            w.current(),
            Duration::ZERO,
            "no spin at all after a few long gaps"
        );
        w.slept(us(5000));
        assert_eq!(w.current(), Duration::ZERO, "and it stays so");
        // A burst: requests 3 us apart, each caught only after sleeping.
        w.slept(us(3));
        assert_eq!(w.current(), SpinWindow::FLOOR);
        for _ in 0..10 {
            w.slept(us(3));
        }
        assert_eq!(
            w.current(),
            us(20),
            "grown back, never past the longest window"
        );
        // A sleep exactly as long as the longest window would not have been caught.
        w.slept(us(20));
        assert_eq!(w.current(), us(10));
    }

    use super::*;
    use bgs_ring::RingConfig;
    use std::sync::atomic::AtomicUsize;

    fn region() -> Arc<RingRegion> {
        Arc::new(
            RingRegion::new(RingConfig {
                request_slots: 64,
                completion_slots: 64,
            })
            .unwrap(),
        )
    }

    /// A completion as the tests see it.
    #[derive(Clone, Debug, PartialEq, Eq)]
    struct Got {
        conn: u64,
        conn_seq: u32,
        status: u16,
        final_: bool,
        seq: u32,
        route: u32,
        stream: u32,
        op: u32,
        publish_ns: u64,
        words: Vec<u32>,
    }

    /// Pop one completion (acknowledging its credit when `ack`), waiting up to `wait`.
    fn next(region: &RingRegion, ack: bool, wait: Duration) -> Option<Got> {
        let end = Instant::now() + wait;
        loop {
            let got = region.completions().try_pop(|e| Got {
                conn: e.conn,
                conn_seq: e.conn_seq,
                status: e.status,
                final_: e.final_ != 0,
                seq: e.stream_seq,
                route: e.route,
                stream: e.stream,
                op: e.op,
                publish_ns: e.publish_ns,
                words: e.payload().to_vec(),
            });
            if let Some(g) = got {
                if ack {
                    region.ack_stream(g.stream, 1);
                }
                return Some(g);
            }
            let now = Instant::now();
            if now >= end {
                return None;
            }
            region
                .completions()
                .wait_nonempty((end - now).min(Duration::from_millis(5)));
        }
    }

    fn push(region: &RingRegion, conn: u64, conn_seq: u32, op: u16, param: u32, payload: &[u32]) {
        region
            .requests()
            .try_push(|e| {
                e.conn = conn;
                e.conn_seq = conn_seq;
                e.op = op;
                e.param = param;
                e.flags = 0;
                e.request_id = conn_seq + 100;
                e.route = 0;
                e.publish_ns = publish_ns_of(conn, conn_seq);
                e.words = payload.len() as u32;
                e.payload[..payload.len()].copy_from_slice(payload);
            })
            .unwrap();
        region.requests().notify();
    }

    /// The `publish_ns` [`push`] stamps a request with (distinct per request).
    fn publish_ns_of(conn: u64, conn_seq: u32) -> u64 {
        (conn << 32) + u64::from(conn_seq) + 1
    }

    /// What a fake engine saw, shared with the test.
    #[derive(Default)]
    struct Log {
        admitted: Mutex<Vec<(StreamId, u64)>>,
        cancels: Mutex<Vec<u64>>,
        live: AtomicUsize,
    }

    struct Live {
        stream: StreamId,
        conn: u64,
        tokens: u32,
        next: u32,
        cancelled: bool,
    }

    /// Streams `param` tokens (one per step, word = token index), then EndOfStream; a cancel
    /// ends the stream with `Cancelled` at the next step. `step_time` stands for a forward pass.
    struct FakeGen {
        cap: usize,
        live: Vec<Live>,
        log: Arc<Log>,
        step_time: Duration,
    }

    impl FakeGen {
        fn boxed(cap: usize, step_time: Duration) -> (Box<dyn Engine>, Arc<Log>) {
            let log = Arc::new(Log::default());
            let e = FakeGen {
                cap,
                live: Vec::new(),
                log: log.clone(),
                step_time,
            };
            (Box::new(e), log)
        }
    }

    impl Engine for FakeGen {
        fn capacity(&self) -> usize {
            self.cap
        }
        fn live(&self) -> usize {
            self.live.len()
        }
        fn admit(&mut self, r: Request<'_>) -> Result<(), Status> {
            assert!(self.live.len() < self.cap, "admitted past capacity");
            if r.payload.first() == Some(&u32::MAX) {
                return Err(Status::BadParam);
            }
            self.log.admitted.lock().unwrap().push((r.stream, r.conn));
            self.live.push(Live {
                stream: r.stream,
                conn: r.conn,
                tokens: r.param,
                next: 0,
                cancelled: false,
            });
            self.log.live.store(self.live.len(), Ordering::SeqCst);
            Ok(())
        }
        fn step(&mut self, sink: &mut dyn FrameSink) -> Progress {
            if !self.step_time.is_zero() {
                std::thread::sleep(self.step_time);
            }
            let mut progress = Progress::Idle;
            self.live.retain_mut(|s| {
                let (frame, words) = if s.cancelled {
                    ((Status::Cancelled, true, s.next), [0, 0])
                } else if s.next < s.tokens {
                    ((Status::Token, false, s.next), [s.next, 0])
                } else {
                    ((Status::EndOfStream, true, s.next), [1, s.tokens])
                };
                let n = if frame.0 == Status::Token { 1 } else { 2 };
                let n = if frame.0 == Status::Cancelled { 0 } else { n };
                let f = Frame {
                    status: frame.0,
                    final_: frame.1,
                    seq: frame.2,
                    words: &words[..n],
                };
                match sink.emit(s.stream, f) {
                    Ok(()) => {
                        progress = Progress::Working;
                        s.next += 1;
                        !f.final_
                    }
                    Err(NoCredit) => true,
                }
            });
            self.log.live.store(self.live.len(), Ordering::SeqCst);
            progress
        }
        fn cancel(&mut self, conn: u64) {
            self.log.cancels.lock().unwrap().push(conn);
            for s in &mut self.live {
                if s.conn == conn {
                    s.cancelled = true;
                }
            }
        }
    }

    fn cfg(window: u32) -> CpuExecutorConfig {
        CpuExecutorConfig {
            stream_window: window,
            ..CpuExecutorConfig::default()
        }
    }

    const GEN: u16 = Op::Generate as u16;

    #[test]
    fn executes_requests_and_passes_rejections_through() {
        let region = region();
        let exec = CpuExecutor::start(
            region.clone(),
            &CpuExecutorConfig {
                slots: 2,
                ..Default::default()
            },
            None,
        )
        .unwrap();
        region
            .requests()
            .try_push(|e| {
                e.conn = 5;
                e.conn_seq = 0;
                e.op = Op::Echo as u16;
                e.words = 2;
                e.route = bgs_ring::route::HTTP;
                e.payload[..2].copy_from_slice(&[9, 8]);
            })
            .unwrap();
        region
            .requests()
            .try_push(|e| {
                e.conn = 5;
                e.conn_seq = 1;
                e.op = OP_REJECT;
                e.param = Status::BadParam as u32;
                e.words = 0;
                e.route = bgs_ring::route::CLOSE;
            })
            .unwrap();
        push(&region, 5, 2, Op::Generate as u16, 3, &[1, 2]);
        let mut got: Vec<_> = (0..3)
            .map(|_| next(&region, true, Duration::from_secs(10)).expect("a completion"))
            .map(|g| (g.conn_seq, g.status, g.route, g.final_, g.words))
            .collect();
        got.sort();
        assert_eq!(
            got,
            vec![
                (
                    0,
                    Status::Ok as u16,
                    bgs_ring::route::HTTP,
                    true,
                    vec![9, 8]
                ),
                (
                    1,
                    Status::BadParam as u16,
                    bgs_ring::route::CLOSE,
                    true,
                    vec![]
                ),
                // A server without a model.
                (2, Status::UnknownOp as u16, 0, true, vec![]),
            ]
        );
        assert!(next(&region, true, Duration::from_millis(50)).is_none());
        assert_eq!(exec.stats().requests.load(Ordering::Relaxed), 3);
        exec.shutdown();
    }

    /// The kernel transport's reply stage counts requests from what the completions carry:
    /// every completion of a request, whatever produced it, has its op and `publish_ns`.
    #[test]
    fn every_completion_carries_its_requests_op_and_publish_time() {
        // One-shot adapters: a reply, an unknown op, a rejection passed through.
        let region = region();
        let exec = CpuExecutor::start(region.clone(), &CpuExecutorConfig::default(), None).unwrap();
        push(&region, 1, 0, Op::Echo as u16, 0, &[4]);
        push(&region, 1, 1, 77, 0, &[]);
        push(&region, 1, 2, OP_REJECT, Status::BadParam as u32, &[]);
        let mut got: Vec<_> = (0..3)
            .map(|_| next(&region, true, Duration::from_secs(10)).expect("a completion"))
            .map(|g| (g.conn_seq, g.status, g.op, g.publish_ns))
            .collect();
        got.sort();
        assert_eq!(
            got,
            vec![
                (0, Status::Ok as u16, Op::Echo as u32, publish_ns_of(1, 0)),
                (1, Status::UnknownOp as u16, 77, publish_ns_of(1, 1)),
                (
                    2,
                    Status::BadParam as u16,
                    u32::from(OP_REJECT),
                    publish_ns_of(1, 2)
                ),
            ]
        );
        exec.shutdown();
        // A generation stream: every token and the final frame; and an admission refused by
        // the engine (an owed frame).
        let region = self::region();
        let (engine, _log) = FakeGen::boxed(4, Duration::ZERO);
        let exec = CpuExecutor::start_engines(region.clone(), &cfg(8), None, vec![engine]).unwrap();
        push(&region, 2, 0, GEN, 3, &[7]);
        push(&region, 3, 0, GEN, 3, &[u32::MAX]);
        let mut frames = 0;
        let mut finals = 0;
        while finals < 2 {
            let g = next(&region, true, Duration::from_secs(10)).expect("frames");
            assert_eq!(
                (g.op, g.publish_ns),
                (u32::from(GEN), publish_ns_of(g.conn, 0)),
                "{g:?}"
            );
            frames += 1;
            finals += usize::from(g.final_);
        }
        // Three tokens and the end of stream, and the refusal.
        assert_eq!(frames, 5);
        exec.shutdown();
    }

    #[test]
    fn a_full_completion_ring_holds_replies_back_and_loses_none() {
        let region = Arc::new(
            RingRegion::new(RingConfig {
                request_slots: 16,
                completion_slots: 2,
            })
            .unwrap(),
        );
        let exec = CpuExecutor::start(
            region.clone(),
            &CpuExecutorConfig {
                slots: 3,
                ..Default::default()
            },
            None,
        )
        .unwrap();
        for i in 0..10 {
            push(&region, 1, i, Op::Echo as u16, 0, &[i]);
        }
        // Nobody reads until the slots have run into the full ring.
        let end = Instant::now() + Duration::from_secs(10);
        while exec.stats().completion_stalls.load(Ordering::Relaxed) == 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut got: Vec<_> = (0..10)
            .map(|_| next(&region, true, Duration::from_secs(10)).expect("a reply"))
            .map(|g| (g.conn_seq, g.words, g.stream))
            .collect();
        got.sort();
        let want: Vec<_> = (0..10).map(|i| (i, vec![i], 0)).collect();
        assert_eq!(got, want);
        assert!(next(&region, true, Duration::from_millis(50)).is_none());
        assert!(exec.stats().completion_stalls.load(Ordering::Relaxed) > 0);
        exec.shutdown();
    }

    /// Poll `f` until it holds, up to 10 s.
    fn eventually(mut f: impl FnMut() -> bool) -> bool {
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        f()
    }

    #[test]
    fn slot_usage_counts_requests_owing_a_final_frame() {
        let region = region();
        let (e0, _) = FakeGen::boxed(4, Duration::ZERO);
        let (e1, _) = FakeGen::boxed(4, Duration::ZERO);
        let exec = CpuExecutor::start_engines(region.clone(), &cfg(2), None, vec![e0, e1]).unwrap();
        let usage = exec.slot_usage();
        assert_eq!(usage.slots(), 2);
        assert_eq!((usage.busy_slots(), usage.live()), (0, 0));
        // Three streams of 10 tokens with a window of 2 and no acknowledgements: they stall
        // on credit and stay live.
        for c in 0..3 {
            push(&region, c + 1, 0, GEN, 10, &[1]);
        }
        assert!(eventually(|| usage.live() == 3), "live {}", usage.live());
        assert!((1..=2).contains(&usage.busy_slots()));
        // Acknowledge everything until all three streams have ended.
        let mut finals = 0;
        while finals < 3 {
            let g = next(&region, true, Duration::from_secs(10)).expect("frames");
            finals += usize::from(g.final_);
        }
        assert!(eventually(|| usage.live() == 0), "live {}", usage.live());
        assert_eq!(usage.busy_slots(), 0);
        exec.shutdown();
    }

    #[test]
    fn streamed_frames_take_credit_and_stop_at_the_window() {
        let region = region();
        let (engine, _log) = FakeGen::boxed(4, Duration::ZERO);
        let exec = CpuExecutor::start_engines(region.clone(), &cfg(4), None, vec![engine]).unwrap();
        push(&region, 1, 0, GEN, 10, &[7]);
        // Without acks: exactly the window's worth of frames, then nothing.
        let mut frames = Vec::new();
        while let Some(g) = next(&region, false, Duration::from_millis(200)) {
            frames.push(g);
        }
        assert_eq!(frames.len(), 4, "{frames:?}");
        let stream = frames[0].stream;
        assert!(stream != 0);
        for (i, f) in frames.iter().enumerate() {
            assert_eq!(f.stream, stream);
            assert_eq!(
                (f.status, f.final_, f.seq),
                (Status::Token as u16, false, i as u32)
            );
            assert_eq!(f.words, vec![i as u32]);
            assert_eq!(f.conn_seq, 0);
        }
        assert!(exec.stats().credit_refusals.load(Ordering::Relaxed) > 0);
        // Acknowledge them; the rest of the stream flows while the test keeps acknowledging.
        for _ in 0..4 {
            region.ack_stream(stream, 1);
        }
        while let Some(g) = next(&region, true, Duration::from_secs(10)) {
            let last = g.final_;
            frames.push(g);
            if last {
                break;
            }
        }
        assert_eq!(frames.len(), 11);
        let end = frames.last().unwrap();
        assert_eq!(
            (
                end.status,
                end.final_,
                end.seq,
                end.stream,
                end.words.clone()
            ),
            (Status::EndOfStream as u16, true, 10, stream, vec![1, 10])
        );
        assert_eq!(exec.stats().streams.load(Ordering::Relaxed), 1);
        exec.shutdown();
    }

    #[test]
    fn cancel_reaches_the_right_engine_promptly_and_is_not_answered() {
        let region = region();
        // A forward pass of 1 ms per step; two engine threads of one stream each.
        let (e0, log0) = FakeGen::boxed(1, Duration::from_millis(1));
        let (e1, log1) = FakeGen::boxed(1, Duration::from_millis(1));
        let exec =
            CpuExecutor::start_engines(region.clone(), &cfg(16), None, vec![e0, e1]).unwrap();
        push(&region, 10, 0, GEN, 4000, &[1]);
        push(&region, 20, 0, GEN, 4000, &[1]);
        // Both streams running.
        let mut seen = [false; 2];
        while !(seen[0] && seen[1]) {
            let g = next(&region, true, Duration::from_secs(10)).expect("tokens");
            seen[usize::from(g.conn == 20)] = true;
        }
        let owner = |conn: u64| {
            let has = |log: &Log| log.admitted.lock().unwrap().iter().any(|a| a.1 == conn);
            if has(&log0) { &log0 } else { &log1 }
        };
        let target = owner(10);
        let other = owner(20);
        assert!(
            !std::ptr::eq(target, other),
            "capacity 1: one stream per thread"
        );
        let live_before = target.live.load(Ordering::SeqCst);
        let t0 = Instant::now();
        push(&region, 10, 0, OP_CANCEL, 0, &[]);
        let mut cancelled_at = None;
        let mut live_dropped = None;
        while cancelled_at.is_none() || live_dropped.is_none() {
            assert!(t0.elapsed() < Duration::from_secs(10), "no cancel seen");
            if live_dropped.is_none() && target.live.load(Ordering::SeqCst) < live_before {
                live_dropped = Some(t0.elapsed());
            }
            if cancelled_at.is_some() {
                std::thread::yield_now();
                continue;
            }
            let Some(g) = next(&region, true, Duration::from_micros(200)) else {
                continue;
            };
            if g.conn == 10 && g.final_ {
                assert_eq!(g.status, Status::Cancelled as u16);
                cancelled_at = Some(t0.elapsed());
            }
        }
        let (cancelled_at, live_dropped) = (cancelled_at.unwrap(), live_dropped.unwrap());
        println!(
            "cancel latency: final Cancelled frame after {cancelled_at:?}, \
             live() dropped after {live_dropped:?}"
        );
        // Generous for a loaded CI machine; the measured values are printed above.
        assert!(cancelled_at < Duration::from_millis(500));
        assert!(live_dropped < Duration::from_millis(500));
        // Conn 10 stays quiet (the marker itself is never answered) while conn 20 runs on.
        for _ in 0..20 {
            let g = next(&region, true, Duration::from_secs(10)).expect("conn 20 runs on");
            assert_eq!((g.conn, g.final_), (20, false), "{g:?}");
        }
        // The marker reached the engine holding conn 10's stream, whichever thread popped it.
        assert!(target.cancels.lock().unwrap().contains(&10));
        assert_eq!(owner(20).live.load(Ordering::SeqCst), 1);
        assert_eq!(exec.stats().cancels.load(Ordering::Relaxed), 1);
        // End the other one too; then the ring stays empty (markers are never answered).
        push(&region, 20, 0, OP_CANCEL, 0, &[]);
        loop {
            let g = next(&region, true, Duration::from_secs(10)).expect("frames of conn 20");
            assert_eq!(g.conn, 20);
            if g.final_ {
                assert_eq!(g.status, Status::Cancelled as u16);
                break;
            }
        }
        assert!(next(&region, true, Duration::from_millis(50)).is_none());
        exec.shutdown();
    }

    #[test]
    fn a_cancel_behind_a_waiting_request_is_seen_by_a_full_engine() {
        let region = region();
        let (engine, log) = FakeGen::boxed(1, Duration::from_millis(1));
        let exec =
            CpuExecutor::start_engines(region.clone(), &cfg(16), None, vec![engine]).unwrap();
        push(&region, 1, 0, GEN, 100_000, &[1]);
        next(&region, true, Duration::from_secs(10)).expect("a token of conn 1");
        // The engine is full: conn 2's request waits (taken ahead), and its cancel marker
        // behind it still reaches the thread; conn 2 is answered without being admitted.
        push(&region, 2, 0, GEN, 5, &[1]);
        push(&region, 2, 0, OP_CANCEL, 0, &[]);
        push(&region, 1, 0, OP_CANCEL, 0, &[]);
        let mut finals = Vec::new();
        while finals.len() < 2 {
            let g = next(&region, true, Duration::from_secs(10)).expect("finals");
            if g.final_ {
                finals.push((g.conn, g.status, g.stream));
            }
        }
        finals.sort();
        assert_eq!(finals[0].1, Status::Cancelled as u16);
        assert!(finals[0].2 != 0, "conn 1's stream takes credit");
        assert_eq!(
            (finals[1].0, finals[1].1, finals[1].2),
            (2, Status::Cancelled as u16, 0)
        );
        let admitted: Vec<u64> = log.admitted.lock().unwrap().iter().map(|a| a.1).collect();
        assert_eq!(admitted, vec![1]);
        exec.shutdown();
    }

    #[test]
    fn streams_of_different_threads_never_share_an_id() {
        let region = region();
        let caps = [2usize, 3, 1];
        let mut engines = Vec::new();
        let mut logs = Vec::new();
        for &c in &caps {
            let (e, l) = FakeGen::boxed(c, Duration::ZERO);
            engines.push(e);
            logs.push(l);
        }
        let exec = CpuExecutor::start_engines(region.clone(), &cfg(2), None, engines).unwrap();
        let n = 60u32;
        let mut pushed = 0u32;
        let mut finals = 0;
        let mut live_per_stream = std::collections::HashMap::<u32, u64>::new();
        while finals < n {
            if pushed < n && region.requests().len() < 8 {
                push(&region, u64::from(pushed), 0, GEN, 3, &[1]);
                pushed += 1;
            }
            let Some(g) = next(&region, true, Duration::from_millis(5)) else {
                continue;
            };
            // While a stream id is live, all its frames belong to one request.
            let owner = *live_per_stream.entry(g.stream).or_insert(g.conn);
            assert_eq!(owner, g.conn, "stream {} shared", g.stream);
            if g.final_ {
                live_per_stream.remove(&g.stream);
                finals += 1;
            }
        }
        let mut base = 0u32;
        for (t, log) in logs.iter().enumerate() {
            let range = base..base + caps[t] as u32;
            for (id, _) in log.admitted.lock().unwrap().iter() {
                assert!(
                    range.contains(&id.0),
                    "thread {t} used {id:?} outside {range:?}"
                );
            }
            base = range.end;
        }
        let total: usize = logs.iter().map(|l| l.admitted.lock().unwrap().len()).sum();
        assert_eq!(total, n as usize);
        exec.shutdown();
    }

    #[test]
    fn refuses_more_streams_than_the_ring_has_credit_counters() {
        let engines = (0..MAX_STREAMS + 1)
            .map(|_| Box::new(OneShotEngine::new(1)) as Box<dyn Engine>)
            .collect();
        let err = CpuExecutor::start_engines(region(), &cfg(16), None, engines).unwrap_err();
        assert!(err.to_string().contains("513 streams"), "{err}");
        let err = CpuExecutor::start(
            region(),
            &CpuExecutorConfig {
                slots: MAX_STREAMS + 1,
                ..Default::default()
            },
            None,
        )
        .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
        assert!(CpuExecutor::start_engines(region(), &cfg(0), None, vec![]).is_err());
    }

    /// Admits, then drops every stream on its next step without a final frame (a bug the
    /// executor's safety net covers).
    struct Forgetful {
        live: Vec<StreamId>,
        tell: bool,
    }

    impl Engine for Forgetful {
        fn capacity(&self) -> usize {
            2
        }
        fn live(&self) -> usize {
            self.live.len()
        }
        fn admit(&mut self, r: Request<'_>) -> Result<(), Status> {
            self.live.push(r.stream);
            Ok(())
        }
        fn step(&mut self, _sink: &mut dyn FrameSink) -> Progress {
            self.live.clear();
            Progress::Working
        }
        fn cancel(&mut self, _conn: u64) {}
        fn holds(&self, stream: StreamId) -> Option<bool> {
            self.tell.then(|| self.live.contains(&stream))
        }
    }

    #[test]
    fn a_stream_lost_without_a_final_frame_is_answered_internal() {
        for tell in [false, true] {
            let region = region();
            let engine = Box::new(Forgetful {
                live: Vec::new(),
                tell,
            });
            let exec =
                CpuExecutor::start_engines(region.clone(), &cfg(16), None, vec![engine]).unwrap();
            push(&region, 3, 0, GEN, 5, &[1]);
            push(&region, 3, 1, Op::Echo as u16, 0, &[1]);
            let mut got: Vec<_> = (0..2)
                .map(|_| next(&region, true, Duration::from_secs(10)).expect("answers"))
                .map(|g| (g.conn_seq, g.status, g.final_, g.stream))
                .collect();
            got.sort();
            assert_eq!(
                got,
                vec![
                    (0, Status::Internal as u16, true, 0),
                    (1, Status::Internal as u16, true, 0)
                ]
            );
            assert!(next(&region, true, Duration::from_millis(50)).is_none());
            assert_eq!(exec.stats().lost_streams.load(Ordering::Relaxed), 2);
            exec.shutdown();
        }
    }

    #[test]
    fn an_admission_refused_by_the_engine_is_answered_with_its_status() {
        let region = region();
        let (engine, log) = FakeGen::boxed(2, Duration::ZERO);
        let exec =
            CpuExecutor::start_engines(region.clone(), &cfg(16), None, vec![engine]).unwrap();
        push(&region, 4, 0, GEN, 5, &[u32::MAX]);
        let g = next(&region, true, Duration::from_secs(10)).expect("an answer");
        assert_eq!(
            (g.status, g.final_, g.stream),
            (Status::BadParam as u16, true, 0)
        );
        assert!(log.admitted.lock().unwrap().is_empty());
        assert_eq!(exec.stats().streams.load(Ordering::Relaxed), 0);
        exec.shutdown();
    }
}
