//! The kernel-owned transport: eBPF frames and admits requests; replies leave through
//! io_uring. See docs/kernel.md.
//!
//! Start-up (userspace): bind the socket, load and attach the BPF object for its port (the
//! request and completion rings live in its mmapable map), only then listen (so that no
//! connection is established before the programs see it), set up io_uring with a multishot
//! accept on the listener. Steady state:
//! - receive: the `sock_ops` program puts each new connection into the sockhash at handshake
//!   time; the verdict program frames every byte and publishes requests (and rejections, in
//!   order) into the request ring; busy and connection markers go to the completion ring.
//! - execute: the executor consumes the request ring as with any transport.
//! - reply: the [`reply::ReplyStage`] turns completions into SENDs. `--reply loop` runs it on
//!   a service thread that submits with `io_uring_enter` and waits for a completion event or a
//!   short timer; `--reply executor-sqe` runs it inside the executor, writing SQEs into an
//!   SQPOLL ring whose memory we provide, while a watchdog only wakes the SQPOLL thread when
//!   it sleeps.
//!
//! Per connection, userspace still does: take the accept CQE, read the socket cookie
//! (`getsockopt(SO_COOKIE)`), and close the descriptor (a CLOSE operation) when the connection
//! ends. Nothing per request.
//!
//! With [`KernelConfig::gpu_sends`] (`--reply executor-sqe` with the GPU executor) the GPU puts
//! most replies on the wire itself, through an io_uring ring of its own (SQPOLL, memory we
//! provide, served by the same SQPOLL kernel thread as our ring) and the send table
//! ([`bgs_ring::tx::TxTable`]), whose per-connection turn the reply stage shares with it
//! ([`reply`] module docs). See [`KernelTransport::gpu_tx`] and docs/kernel.md.

pub mod reply;
mod submit;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bgs_bpf::{KernelRx, KernelRxConfig};
use bgs_protocol::FramerConfig;
use bgs_ring::RingRegion;
use bgs_ring::tx::{TxCounters, TxDesc, TxTable};
use bgs_uring::{RingOptions, SqPoll, Uring};
use serde::Serialize;

use crate::native::ShutdownHandle;
use crate::stats::RequestMetrics;
use reply::{ReplyStage, ReplyStats};
pub use submit::DirectCounts;
use submit::{Direct, SqIo};

/// Default of `ReplyMode::ExecutorSqe::sqpoll_above`: replies per second above which the
/// SQPOLL thread submits. Below it a system call per reply (a few µs of the stage's time)
/// is far cheaper than a kernel thread that spins for the whole gap between replies; at
/// 50,000 replies a second the stage would spend a sizeable part of a core in `send(2)`,
/// and the spinning thread's core is paid for by the rate.
pub const DEFAULT_SQPOLL_ABOVE: u32 = 50_000;

/// The watchdog's period with adaptive submission (a safety net: the stage wakes the SQPOLL
/// thread itself).
pub const ADAPTIVE_WATCHDOG: Duration = Duration::from_millis(10);

/// The completion watch's first look after a publish until it has learned the executor's
/// service time: about the H200's gemm8 round trip (docs/cost.md).
const WATCH_FIRST: Duration = Duration::from_micros(20);

/// The reply loop's safety timeout while BPF's completion watch looks for it (a look that
/// fails to ring is a defect: [`KernelStats::wake_timeouts`] counts the waits it ended).
const WATCH_NET: Duration = Duration::from_millis(10);

/// The reply loop's wait with nothing executing and nothing to send: long, since whatever
/// comes next wakes it (a request's doorbell or look, the executor's eventfd, an accept); it
/// still catches the markers BPF publishes (BPF cannot write the eventfd).
const IDLE_WAIT: Duration = Duration::from_millis(5);

/// Where the reply stage runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyMode {
    /// A service thread: waits for a completion event or `timer`, reaps the completion ring,
    /// submits SENDs with `io_uring_enter`.
    Loop {
        /// Longest wait while replies are outstanding.
        timer: Duration,
    },
    /// The executor writes SEND SQEs into an SQPOLL ring (no system calls); a watchdog wakes
    /// the SQPOLL thread when it sleeps.
    ExecutorSqe {
        /// How often the watchdog checks `IORING_SQ_NEED_WAKEUP`.
        watchdog: Duration,
        /// SQPOLL idle time before the kernel thread sleeps.
        sqpoll_idle_ms: u32,
        /// CPU to pin the SQPOLL thread to.
        sqpoll_cpu: Option<u32>,
        /// CPU executor: replies per second above which the SQPOLL thread submits. Below it,
        /// while that thread sleeps, the stage sends with system calls itself instead of
        /// waking it (a spinning SQPOLL thread costs a core; `submit` module docs). 0: always
        /// the SQPOLL ring. With GPU-written SENDs the ring is always used.
        sqpoll_above: u32,
    },
}

/// Settings of the kernel transport.
#[derive(Debug, Clone)]
pub struct KernelConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Reply path.
    pub reply: ReplyMode,
    /// Framing limits (enforced by the BPF framer).
    pub framer: FramerConfig,
    /// Most connections (sockhash and state map sizes).
    pub max_connections: u32,
    /// Whether the executor wakes the reply loop when it publishes a completion (the CPU
    /// executor writes an eventfd; a GPU cannot). Without it the loop watches BPF's doorbell
    /// for new requests and polls at its timer while they execute.
    pub executor_wakes: bool,
    /// `--reply loop` without `executor_wakes`: BPF watches the completion ring for the
    /// sleeping loop (a timer that looks when the reply is expected) and rings the doorbell
    /// when a reply is there, instead of ringing when each request arrives; the loop then
    /// wakes once per reply instead of at the request and again at its timer (docs/kernel.md,
    /// "The completion watch"). Ignored otherwise.
    pub completion_watch: bool,
    /// Print the counters to stderr this often (None: only at shutdown).
    pub stats_every: Option<Duration>,
    /// `--reply loop` with `executor_wakes` and an executor that wakes us for *every*
    /// completion (the GPU executor's completion notifier): while requests are only waiting
    /// in the executor, sleep up to this long instead of the loop's timer. A safety net;
    /// [`KernelStats::wake_timeouts`] counts the waits it ended.
    pub wake_timeout: Option<Duration>,
    /// Request ring slots.
    pub request_slots: u32,
    /// Completion ring slots.
    pub completion_slots: u32,
    /// `ReplyMode::ExecutorSqe` with a GPU executor that writes SEND SQEs itself: create the
    /// send table and the GPU's io_uring ring ([`KernelTransport::gpu_tx`]) and share each
    /// connection's turn with the GPU. Refused with `ReplyMode::Loop`.
    pub gpu_sends: bool,
    /// Per-connection limits of the reply stage: unsent bytes and items ahead beyond which
    /// streamed frames are not acknowledged (their streams run out of credit). BPF cannot
    /// stop reading a connection, so they do not pause input as in the native transport.
    pub limits: crate::conn::ConnLimits,
    /// Publish an `OP_CANCEL` marker when a connection ends. Only for executors that consume
    /// them: one that does not know the op answers it like a request (the GPU executor, which
    /// has no streams to cancel, does so today, and with GPU-written SENDs would put that
    /// answer on the wire).
    pub cancel_markers: bool,
}

/// Counters of the kernel transport, printed at shutdown.
#[derive(Debug, Clone, Serialize)]
pub struct KernelStats {
    /// BPF counters.
    pub bpf: bgs_bpf::KernelCounters,
    /// Reply stage counters.
    pub reply: ReplyStats,
    /// Times the reply loop woke up (loop mode) or the watchdog woke the SQPOLL thread.
    pub wakeups: u64,
    /// Loop mode with [`KernelConfig::wake_timeout`]: waits that ended at that safety timeout
    /// while requests were in the executor (near zero when the executor's wakes work). With
    /// [`KernelConfig::completion_watch`]: waits that ended at their timeout although BPF's
    /// look should have rung (while it looked, or with a reply waiting); zero when it works.
    pub wake_timeouts: u64,
    /// Accepts seen.
    pub accepts: u64,
    /// Of those, connections BPF had refused at their handshake (its maps were full): reset
    /// at once instead of being left open with nobody reading their bytes.
    pub untracked: u64,
    /// Sockhash entries when the transport stopped (before closing what was still open).
    pub sockhash_entries: usize,
    /// BPF per-connection states at the same moment.
    pub conn_states: usize,
    /// The GPU's send counters, when it writes SENDs ([`KernelConfig::gpu_sends`]).
    pub gpu: Option<GpuSendStats>,
    /// Adaptive submission (`--reply executor-sqe`, CPU executor, `sqpoll_above` > 0).
    pub direct: Option<DirectCounts>,
}

/// The GPU's counters from the send table's header (it writes them; we only read).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct GpuSendStats {
    /// Replies the GPU queued a SEND for.
    pub sends: u64,
    /// SEND completions the GPU reaped.
    pub completed: u64,
    /// Of those, errors or short sends.
    pub send_errors: u64,
    /// Replies the GPU handed to the reply stage (not its turn, not registered, HTTP, closing).
    pub deferred: u64,
    /// Futex wakes the GPU queued for the sleeping reply stage.
    pub wakes: u64,
    /// Times a SEND waited for room in the GPU's submission queue.
    pub sq_full: u64,
    /// Futex wakes that failed (the stage then waits out its timeout).
    pub wake_errors: u64,
}

impl From<TxCounters> for GpuSendStats {
    fn from(c: TxCounters) -> Self {
        GpuSendStats {
            sends: c.gpu_sends,
            completed: c.gpu_completed,
            send_errors: c.gpu_send_errors,
            deferred: c.gpu_deferred,
            wakes: c.gpu_wakes,
            sq_full: c.gpu_sq_full,
            wake_errors: c.gpu_wake_errors,
        }
    }
}

impl std::fmt::Display for KernelStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "bpf: {}", self.bpf)?;
        writeln!(
            f,
            "reply: {} completions, {} frames, {} sends ({} bytes, {} short, {} errors), {} accepted, {} closed, {} eof, {} resets, {} stale, {} never accepted",
            self.reply.completions,
            self.reply.frames,
            self.reply.sends,
            self.reply.bytes_sent,
            self.reply.short_sends,
            self.reply.send_errors,
            self.reply.accepted,
            self.reply.closed,
            self.reply.eof,
            self.reply.resets,
            self.reply.stale,
            self.reply.never_accepted
        )?;
        writeln!(
            f,
            "streams: {} acks ({} withheld first), {} cancel markers ({} retries for room), {} connections aborted over the buffering bound",
            self.reply.acks,
            self.reply.acks_withheld,
            self.reply.cancels,
            self.reply.cancels_deferred,
            self.reply.overflow_aborts
        )?;
        if let Some(g) = &self.gpu {
            let r = &self.reply;
            writeln!(
                f,
                "gpu sends: {} sent, {} completed, {} errors, {} deferred to the stage, {} wakes ({} failed), {} sq-full",
                g.sends, g.completed, g.send_errors, g.deferred, g.wakes, g.wake_errors, g.sq_full
            )?;
            writeln!(
                f,
                "turns: {} registered, {} refused, {} ended before their accept, {} passed by the stage, {} waits, {} replies skipped (sent by the GPU), {} behind the turn, {} forced resets",
                r.tx_registered,
                r.tx_refused,
                r.tx_ended_first,
                r.turn_passes,
                r.turn_waits,
                r.gpu_sent_skipped,
                r.behind_turn,
                r.resets_forced
            )?;
        }
        if let Some(d) = &self.direct {
            writeln!(
                f,
                "adaptive submission: {} sends made by the stage itself ({} found the socket full and went to the ring), {} sends through the SQPOLL ring, {} SQPOLL wake-ups by the stage",
                d.sends, d.fallbacks, d.ring_sends, d.wakes
            )?;
        }
        writeln!(
            f,
            "wake-ups: {} ({} at the completion-wake safety timeout); accepts: {} ({} reset: refused by BPF)",
            self.wakeups, self.wake_timeouts, self.accepts, self.untracked
        )?;
        write!(
            f,
            "bpf maps at stop: sockhash {} entries, {} connection states",
            self.sockhash_entries, self.conn_states
        )
    }
}

const UD_ACCEPT: u64 = 0xff << 56;
const UD_DOORBELL: u64 = 0xfe << 56;
const UD_SHUTDOWN: u64 = 0xfd << 56;
const UD_WATCH: u64 = 0xfc << 56;

/// What a GPU that writes SENDs itself works on: the send table and its own io_uring ring
/// (SQPOLL, `IORING_SETUP_NO_MMAP`). The GPU holds raw addresses into both, so keep this alive
/// (the `Arc` from [`KernelTransport::gpu_tx_owner`]) until the executor has stopped.
///
/// The GPU is the ring's only SQ producer and only CQ consumer: the host creates the ring,
/// wakes its SQPOLL thread when it sleeps, and never touches its queues.
pub struct GpuTx {
    // Field order is drop order: close the ring (its SENDs point into the table's buffers)
    // before unmapping the table.
    ring: Uring,
    table: Arc<TxTable>,
    /// The ring is served by the host ring's SQPOLL thread (`IORING_SETUP_ATTACH_WQ`).
    shared_sqpoll: bool,
}

impl std::fmt::Debug for GpuTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTx")
            .field("ring", &self.ring)
            .field("capacity", &self.table.capacity())
            .field("shared_sqpoll", &self.shared_sqpoll)
            .finish()
    }
}

impl GpuTx {
    /// The descriptor a GPU executor needs (`GpuExecutorConfig::tx`): the table's block and
    /// the ring's memory and offsets.
    pub fn desc(&self) -> TxDesc {
        let m = self.ring.memory();
        TxDesc {
            table: self.table.as_ptr(),
            table_len: self.table.len(),
            rings: m.rings,
            rings_len: m.rings_len,
            sqes: m.sqes,
            sqes_len: m.sqes_len,
            sq_entries: m.sq_entries,
            cq_entries: m.cq_entries,
            sq_head: m.sq_head,
            sq_tail: m.sq_tail,
            sq_flags: m.sq_flags,
            cq_head: m.cq_head,
            cq_tail: m.cq_tail,
            cqes: m.cqes,
        }
    }

    /// The send table.
    pub fn table(&self) -> &Arc<TxTable> {
        &self.table
    }

    /// The GPU's ring (for tests and diagnostics: its queues belong to the GPU).
    pub fn ring(&self) -> &Uring {
        &self.ring
    }

    /// Whether the GPU's ring shares the host ring's SQPOLL thread.
    pub fn shared_sqpoll(&self) -> bool {
        self.shared_sqpoll
    }
}

/// See [`KernelTransport::monitor`].
#[derive(Clone)]
pub struct KernelMonitor {
    rx: Arc<KernelRx>,
}

impl std::fmt::Debug for KernelMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelMonitor")
            .field("port", &self.rx.config().listen_port)
            .finish()
    }
}

impl KernelMonitor {
    /// Entries now in the sockhash (connections BPF frames).
    pub fn sockhash_entries(&self) -> usize {
        self.rx.sockhash_len()
    }

    /// BPF per-connection states now (removed when a socket reaches TCP_CLOSE).
    pub fn conn_states(&self) -> usize {
        self.rx.conn_states_len()
    }

    /// The BPF counters now.
    pub fn counters(&self) -> bgs_bpf::KernelCounters {
        self.rx.counters()
    }
}

/// The kernel transport, bound and loaded.
pub struct KernelTransport {
    cfg: KernelConfig,
    listener: TcpListener,
    local_addr: SocketAddr,
    rx: Arc<KernelRx>,
    uring: Arc<Uring>,
    shutdown_rx: UnixStream,
    shutdown_tx: ShutdownHandle,
    /// Executor completions wake the reply loop through this eventfd (loop mode).
    waker_fd: Arc<OwnedFd>,
    /// The send table and the GPU's ring ([`KernelConfig::gpu_sends`]).
    gpu: Option<Arc<GpuTx>>,
    /// Set by [`KernelTransport::enable_metrics`]; without it nothing is measured.
    metrics: Option<Arc<RequestMetrics>>,
}

impl std::fmt::Debug for KernelTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelTransport")
            .field("local_addr", &self.local_addr)
            .field("reply", &self.cfg.reply)
            .finish()
    }
}

/// The shared part of both reply modes: one pass of the reply stage.
struct StageDriver {
    stage: ReplyStage,
    region: Arc<RingRegion>,
    /// BPF's own completions (busy, markers): a ring of their own, so that each completion
    /// ring has producers on one side only (a GPU executor and CPUs cannot share a
    /// compare-and-swap target without host-native atomics).
    side: Arc<RingRegion>,
    accepts: u64,
    /// Accepted connections BPF does not track (reset at once).
    untracked: u64,
    /// Loop waits ended by `KernelConfig::wake_timeout` ([`KernelStats::wake_timeouts`]).
    wake_timeouts: u64,
    rx: Arc<KernelRx>,
    /// Final completions taken from the executor's completion ring. Every request-ring entry
    /// (request or rejection) ends in exactly one, and cancel markers (published by the stage,
    /// `stage.stats().cancels`) in none, so `requests().produced() - finals - cancels` is the
    /// work still in the executor ([`Self::answered`]).
    finals: u64,
    listener_fd: RawFd,
    accept_armed: bool,
    /// Loop mode: a READ on the executor's eventfd, re-armed after each completion.
    bell: Option<Bell>,
    /// Loop mode: a READ on the shutdown pipe; its completion stops the loop.
    stop: Option<Bell>,
    stop_requested: bool,
    /// Loop mode with an executor that cannot wake us: a poll on BPF's doorbell, which rings
    /// when a request is published while we are registered as a request-ring sleeper.
    watch: Option<(RawFd, bool)>,
    watch_fired: bool,
    /// `--reply executor-sqe` with adaptive submission: what the stage did itself (copied
    /// from its [`Direct`] when stats are printed and at the end).
    direct: Option<DirectCounts>,
}

struct Bell {
    fd: RawFd,
    buf: Box<[u8; 8]>,
    armed: bool,
}

impl StageDriver {
    fn new(
        rx: Arc<KernelRx>,
        listener_fd: RawFd,
        bell_fd: Option<RawFd>,
        stop_fd: Option<RawFd>,
    ) -> Self {
        StageDriver {
            stage: ReplyStage::new(),
            region: rx.region(),
            side: rx.side_region(),
            accepts: 0,
            untracked: 0,
            wake_timeouts: 0,
            rx,
            finals: 0,
            listener_fd,
            accept_armed: false,
            bell: bell_fd.map(|fd| Bell {
                fd,
                buf: Box::new([0; 8]),
                armed: false,
            }),
            stop: stop_fd.map(|fd| Bell {
                fd,
                buf: Box::new([0; 8]),
                armed: false,
            }),
            stop_requested: false,
            watch: None,
            watch_fired: false,
            direct: None,
        }
    }
}

impl StageDriver {
    /// Request-ring entries that need no more work from the executor: final completions seen
    /// and the cancel markers this stage published (never answered).
    fn answered(&self) -> u64 {
        self.finals + self.stage.stats().cancels
    }

    /// Reap completions and CQEs, queue operations. Returns true if anything happened.
    fn pass(&mut self, uring: &Uring, io: &mut SqIo<'_>) -> bool {
        let mut did = false;
        while let Some(final_) = self.region.completions().try_pop(|e| {
            self.stage.on_completion(e);
            e.final_ != 0
        }) {
            self.finals += u64::from(final_);
            did = true;
        }
        // BPF's own completions (busy, rejections, markers) never take credit; it does not
        // write their `stream` field, which the zeroed map keeps 0.
        while let Some(()) = self
            .side
            .completions()
            .try_pop(|e| self.stage.on_completion(e))
        {
            did = true;
        }
        did |= self.reap_cqes(uring);
        if !self.accept_armed && io.push(&bgs_uring::accept_multishot(self.listener_fd, UD_ACCEPT))
        {
            self.accept_armed = true;
        }
        if let Some(b) = &mut self.bell
            && !b.armed
        {
            // SAFETY: the buffer is boxed and owned by the driver, which outlives the ring's
            // use of it (the driver is dropped after the loop, the ring after that).
            let sqe = unsafe { bgs_uring::read(b.fd, b.buf.as_mut_ptr(), 8, UD_DOORBELL) };
            b.armed = io.push(&sqe);
        }
        if let Some((fd, armed)) = &mut self.watch
            && !*armed
        {
            // Multishot: it stays armed across wake-ups (one poll registration per
            // connection's life of the loop, not one per request).
            *armed = io.push(&bgs_uring::poll_readable_multishot(*fd, UD_WATCH));
        }
        if let Some(b) = &mut self.stop
            && !b.armed
        {
            // SAFETY: as for the doorbell buffer above.
            let sqe = unsafe { bgs_uring::read(b.fd, b.buf.as_mut_ptr(), 8, UD_SHUTDOWN) };
            b.armed = io.push(&sqe);
        }
        self.stage.flush(io);
        did
    }

    /// At shutdown: reap the completions of CLOSE operations already issued (queueing
    /// nothing new), so that the counters printed at shutdown count every connection whose
    /// descriptor is gone. A CLOSE removes the descriptor before its completion is posted, and
    /// a stop can come in between; without this the printed `closed` lagged behind the
    /// descriptors actually closed. Bounded: an operation that never completes is left alone.
    fn finish(&mut self, uring: &Uring) {
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            self.reap_cqes(uring);
            if self.stage.closes_in_flight() == 0 || Instant::now() >= deadline {
                break;
            }
            // The CLOSE may still sit in the submission queue: the loop stopped before its
            // `io_uring_enter`, or the SQPOLL thread sleeps and the watchdog has stopped
            // (`enter` sets SQ_WAKEUP then).
            let _ = uring.enter(uring.sq().pending(), 0, None);
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Take the io_uring completions: accepts, the loop's own reads, the stage's operations.
    /// Returns true if there were any.
    fn reap_cqes(&mut self, uring: &Uring) -> bool {
        let mut did = false;
        while let Some(cqe) = uring.cq().pop() {
            did = true;
            match cqe.user_data {
                UD_ACCEPT => {
                    if cqe.res >= 0 {
                        self.accepts += 1;
                        let fd = cqe.res;
                        // SAFETY: the accept CQE handed us this live descriptor; the borrow
                        // ends before anything can close it.
                        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
                        match bgs_bpf::socket_cookie(borrowed) {
                            Ok(cookie) if !self.rx.tracks(cookie) && tcp_open(borrowed) => {
                                // BPF refused it at the handshake (maps full): nobody would
                                // ever read its bytes. Reset it so the client sees a refusal
                                // instead of waiting forever. (Checked in this order: BPF
                                // drops a connection's state only at TCP_CLOSE, which is
                                // final, so an open socket without state never had any.)
                                self.untracked += 1;
                                tracing::warn!(
                                    "connection refused by BPF (sockhash or state map full): reset"
                                );
                                let _ = rustix::net::sockopt::set_socket_linger(
                                    borrowed,
                                    Some(Duration::ZERO),
                                );
                                // SAFETY: the accept CQE handed us ownership of `fd`.
                                drop(unsafe { OwnedFd::from_raw_fd(fd) });
                            }
                            Ok(cookie) => {
                                kick_verdict(borrowed);
                                self.stage.on_accept(fd, cookie);
                            }
                            Err(e) => {
                                tracing::warn!("SO_COOKIE failed: {e}");
                                // SAFETY: the accept CQE handed us ownership of `fd`.
                                drop(unsafe { OwnedFd::from_raw_fd(fd) });
                            }
                        }
                    } else {
                        tracing::warn!("accept failed: {}", io::Error::from_raw_os_error(-cqe.res));
                    }
                    if !cqe.more() {
                        self.accept_armed = false;
                    }
                }
                UD_DOORBELL => {
                    if let Some(b) = &mut self.bell {
                        b.armed = false;
                    }
                }
                UD_SHUTDOWN => self.stop_requested = true,
                UD_WATCH => {
                    if let Some((_, armed)) = &mut self.watch
                        && !cqe.more()
                    {
                        *armed = false;
                    }
                    self.watch_fired = true;
                }
                ud => self.stage.on_cqe(ud, cqe.res),
            }
        }
        did
    }
}

fn collect_stats(
    rx: &KernelRx,
    driver: &StageDriver,
    wakeups: u64,
    gpu: Option<&GpuTx>,
) -> KernelStats {
    KernelStats {
        bpf: rx.counters(),
        reply: driver.stage.stats().clone(),
        wakeups,
        wake_timeouts: driver.wake_timeouts,
        accepts: driver.accepts,
        untracked: driver.untracked,
        sockhash_entries: rx.sockhash_len(),
        conn_states: rx.conn_states_len(),
        gpu: gpu.map(|g| g.table.counters().into()),
        direct: driver.direct,
    }
}

/// Prints the counters every `every`, if set.
struct StatsTimer {
    every: Option<Duration>,
    next: Instant,
}

impl StatsTimer {
    fn new(every: Option<Duration>) -> Self {
        StatsTimer {
            every,
            next: Instant::now() + every.unwrap_or_default(),
        }
    }

    fn due(&mut self, now: Instant) -> bool {
        match self.every {
            Some(every) if now >= self.next => {
                self.next = now + every;
                true
            }
            _ => false,
        }
    }
}

/// Whether the socket has not reached TCP_CLOSE (`TCP_INFO`'s state; an error counts as
/// closed).
fn tcp_open(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    // SAFETY: tcp_info is plain old data; all zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, a live tcp_info.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    const TCP_CLOSE: u8 = 7;
    rc == 0 && len >= 1 && info.tcpi_state != TCP_CLOSE
}

/// Bytes that arrived between the handshake and the accept sit in the socket's queue: the
/// sockmap verdict path only runs once the socket has a `struct socket`, i.e. after accept,
/// and only when more data arrives. Setting `SO_RCVLOWAT` makes TCP re-check readiness and
/// call the socket's data-ready hook, which is the verdict program's entry point, so those
/// bytes are framed now instead of waiting for the client's next segment (which may never
/// come: it is waiting for our reply).
fn kick_verdict(fd: std::os::fd::BorrowedFd<'_>) {
    let one: libc::c_int = 1;
    // SAFETY: a valid descriptor and a pointer to a live c_int with its exact size; rustix has
    // no wrapper for SO_RCVLOWAT.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw const one).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        tracing::warn!(
            "SO_RCVLOWAT on an accepted socket failed: {}",
            io::Error::last_os_error()
        );
    }
}

/// The listening socket's backlog (the kernel caps it at `net.core.somaxconn`).
const LISTEN_BACKLOG: i32 = 4096;

/// A TCP socket bound to `addr` (with `SO_REUSEADDR`, as `TcpListener::bind` sets it) but not
/// yet listening, and the address it got (the port, when `addr` asked for port 0).
fn bind_unlistened(addr: SocketAddr) -> io::Result<(OwnedFd, SocketAddr)> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let family = if addr.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let socket = rustix::net::socket_with(family, SocketType::STREAM, SocketFlags::CLOEXEC, None)?;
    rustix::net::sockopt::set_socket_reuseaddr(&socket, true)?;
    rustix::net::bind(&socket, &addr)?;
    let local = SocketAddr::try_from(rustix::net::getsockname(&socket)?)
        .map_err(|_| io::Error::other("getsockname returned a non-IP address"))?;
    Ok((socket, local))
}

/// The unprivileged user a server will switch to (`bgs serve --user`), for
/// [`KernelTransport::bind_as`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingOwner {
    /// User id.
    pub uid: u32,
    /// Group id (also the only supplementary group while the rings are created).
    pub gid: u32,
}

/// Run `f` on a thread of its own whose credentials are `owner`'s (no capability), or here
/// when there is no owner.
///
/// An io_uring ring keeps the credentials of the thread that created it where requests run
/// on the ring's behalf: an SQPOLL ring's kernel thread submits every SQE with them (and is a
/// thread of this process that a later `setresuid` cannot reach). A ring created by root
/// would go on executing whatever the process writes into its submission queue as root after
/// the process dropped to `owner`; created by a thread that is already `owner`, it cannot.
/// The raw system calls (`rustix::thread`) change only the calling thread, which exits
/// afterwards; the rest of the process stays root until it drops privileges itself.
fn as_ring_owner<T: Send>(
    owner: Option<RingOwner>,
    f: impl FnOnce() -> io::Result<T> + Send,
) -> io::Result<T> {
    let Some(o) = owner else {
        return f();
    };
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("bgs-ring-setup".into())
            .spawn_scoped(s, move || {
                let gid = rustix::process::Gid::from_raw(o.gid);
                let uid = rustix::process::Uid::from_raw(o.uid);
                rustix::thread::set_thread_groups(&[gid])?;
                rustix::thread::set_thread_res_gid(gid, gid, gid)?;
                rustix::thread::set_thread_res_uid(uid, uid, uid)?;
                f().map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!(
                            "setting up io_uring as uid {} ({e}; with sysctl kernel.io_uring_disabled=1 only root and kernel.io_uring_group may use io_uring)",
                            o.uid
                        ),
                    )
                })
            })?
            .join()
            .map_err(|_| io::Error::other("the io_uring set-up thread panicked"))?
    })
}

impl KernelTransport {
    /// Bind, load and attach the BPF programs for the port, listen, set up io_uring. No
    /// connection can complete its handshake before the programs are attached (see
    /// `bind_unlistened`).
    pub fn bind(cfg: KernelConfig) -> io::Result<Self> {
        Self::bind_as(cfg, None)
    }

    /// As [`Self::bind`], for a server that will drop root for `ring_owner` once it is set up:
    /// the io_uring rings are created with that user's credentials (see `as_ring_owner`), so
    /// that nothing the process keeps acts as root after the drop. Everything else (BPF, the
    /// listening socket) is set up with the caller's privileges.
    pub fn bind_as(cfg: KernelConfig, ring_owner: Option<RingOwner>) -> io::Result<Self> {
        if cfg.gpu_sends && !matches!(cfg.reply, ReplyMode::ExecutorSqe { .. }) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "GPU-written SENDs need the executor-sqe reply path (--reply executor-sqe)",
            ));
        }
        // Bind without listening, attach the BPF programs for the bound port, then listen.
        // The sock_ops program puts connections into the sockhash at handshake time
        // (PASSIVE_ESTABLISHED), so it must be attached before the first handshake can
        // complete: until `listen` the kernel answers SYNs with RST (the client sees "refused"
        // and may retry), and from then on every connection passes through the attached
        // program. Binding and listening in one step and loading afterwards left a window in
        // which a connection was accepted but never entered the sockhash, so its requests
        // were never framed and it hung.
        let (socket, local_addr) = bind_unlistened(cfg.listen)?;
        let rx = KernelRx::load(&KernelRxConfig {
            listen_port: local_addr.port(),
            max_words: cfg.framer.max_words,
            max_http_head: cfg.framer.max_http_head as u32,
            max_connections: cfg.max_connections,
            request_slots: cfg.request_slots,
            completion_slots: cfg.completion_slots,
        })
        .map_err(|e| io::Error::other(format!("loading the BPF receive path: {e}")))?;
        rustix::net::listen(&socket, LISTEN_BACKLOG)?;
        let listener = TcpListener::from(socket);
        let opts = match cfg.reply {
            ReplyMode::Loop { .. } => RingOptions {
                entries: 4096,
                cq_entries: 16384,
                sqpoll: None,
                no_mmap: false,
                ..RingOptions::default()
            },
            ReplyMode::ExecutorSqe {
                sqpoll_idle_ms,
                sqpoll_cpu,
                ..
            } => RingOptions {
                entries: 4096,
                cq_entries: 16384,
                sqpoll: Some(SqPoll {
                    idle_ms: sqpoll_idle_ms,
                    cpu: sqpoll_cpu,
                }),
                no_mmap: true,
                ..RingOptions::default()
            },
        };
        let (uring, gpu) = as_ring_owner(ring_owner, || {
            let uring = Uring::new(&opts)?;
            let gpu = if cfg.gpu_sends {
                Some(Arc::new(Self::gpu_ring(&cfg, &opts, &uring)?))
            } else {
                None
            };
            Ok((uring, gpu))
        })?;
        let (shutdown_rx, tx) = UnixStream::pair()?;
        shutdown_rx.set_nonblocking(true)?;
        tx.set_nonblocking(true)?;
        let waker_fd = Arc::new(rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )?);
        Ok(KernelTransport {
            cfg,
            listener,
            local_addr,
            rx: Arc::new(rx),
            uring: Arc::new(uring),
            shutdown_rx,
            shutdown_tx: ShutdownHandle::from_stream(tx),
            waker_fd,
            gpu,
            metrics: None,
        })
    }

    /// The send table and the GPU's ring: the same sizes and SQPOLL settings as ours,
    /// attached to our ring's SQPOLL thread, so one kernel thread spins for both.
    fn gpu_ring(cfg: &KernelConfig, opts: &RingOptions, host: &Uring) -> io::Result<GpuTx> {
        let table = Arc::new(TxTable::new(cfg.max_connections)?);
        let (ring, shared_sqpoll) = match Uring::new_attached(opts, host) {
            Ok(ring) => (ring, true),
            Err(e) => {
                tracing::warn!(
                    "io_uring ATTACH_WQ refused ({e}): the GPU's ring gets an SQPOLL thread of its own"
                );
                (Uring::new(opts)?, false)
            }
        };
        if !ring.memory().user_provided || !ring.is_sqpoll() {
            return Err(io::Error::other(
                "the GPU's io_uring ring needs SQPOLL and user-provided memory",
            ));
        }
        Ok(GpuTx {
            ring,
            table,
            shared_sqpoll,
        })
    }

    /// With [`KernelConfig::gpu_sends`]: what the GPU executor needs to send replies itself
    /// (`GpuExecutorConfig::tx`). The addresses stay valid while the transport or an
    /// [`Self::gpu_tx_owner`] handle lives: the caller must stop the executor (which
    /// unregisters this memory from the device and stops touching it) before dropping the
    /// last of them. [`Self::run`] consumes the transport, so hold the owner handle across it.
    pub fn gpu_tx(&self) -> Option<TxDesc> {
        self.gpu.as_ref().map(|g| g.desc())
    }

    /// Keeps the send table and the GPU's ring alive after the transport is gone (see
    /// [`Self::gpu_tx`]).
    pub fn gpu_tx_owner(&self) -> Option<Arc<GpuTx>> {
        self.gpu.clone()
    }

    /// A read-only view of the BPF maps that stays usable while [`Self::run`] serves and
    /// after it returned (tests wait on it for connection state to settle; health checks can
    /// read it). It keeps the BPF programs loaded and attached until it is dropped, so drop it
    /// once the transport has stopped.
    pub fn monitor(&self) -> KernelMonitor {
        KernelMonitor {
            rx: self.rx.clone(),
        }
    }

    /// The rings (they live in the BPF map).
    pub fn region(&self) -> Arc<RingRegion> {
        self.rx.region()
    }

    /// A reader of BPF's counters (a per-CPU map lookup) for other threads, e.g. a metrics
    /// scrape; it keeps the maps alive.
    pub fn bpf_counters(&self) -> Arc<dyn Fn() -> bgs_bpf::KernelCounters + Send + Sync> {
        let rx = self.rx.clone();
        Arc::new(move || rx.counters())
    }

    /// A counter of open connections for other threads: the sockhash's entries (one map walk,
    /// O(connections); BPF's own opened/closed counters miss connections the server closes,
    /// which are forgotten before their TCP_CLOSE).
    pub fn open_connections(&self) -> Arc<dyn Fn() -> usize + Send + Sync> {
        let rx = self.rx.clone();
        Arc::new(move || rx.sockhash_len())
    }

    /// Count answered requests by op and status, and their durations, for a metrics
    /// scrape: the reply stage counts each request's final frame when it encodes it, from the
    /// op and `publish_ns` (BPF's CLOCK_MONOTONIC stamp at publication) that every completion
    /// carries. Rejections and connection markers are not counted, and neither are replies a
    /// GPU executor sends itself (`gpu_sends`: they never reach the stage). The connection
    /// counters of the returned value stay 0 here: [`Self::open_connections`] counts those.
    /// Call before [`Self::run`].
    pub fn enable_metrics(&mut self) -> Arc<RequestMetrics> {
        self.metrics.get_or_insert_default().clone()
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// A handle that stops [`run`](Self::run).
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown_tx.clone()
    }

    /// For the executor: called after publishing a completion while the reply loop sleeps.
    /// In executor-sqe mode the stage lives in the executor and nothing needs waking.
    pub fn waker(&self) -> Option<Arc<dyn Fn() + Send + Sync>> {
        match self.cfg.reply {
            ReplyMode::Loop { .. } => {
                let fd = self.waker_fd.clone();
                Some(Arc::new(move || {
                    let _ = rustix::io::write(&*fd, &1u64.to_ne_bytes());
                }))
            }
            ReplyMode::ExecutorSqe { .. } => None,
        }
    }

    /// How executor slots sleep: BPF cannot wake the request ring's futex, so it rings a BPF
    /// ring buffer when a consumer announced sleep; a sleeping slot waits on that buffer's
    /// descriptor. One slot at a time drains the doorbell records.
    pub fn executor_wait(&self) -> io::Result<Arc<dyn Fn(Duration) + Send + Sync>> {
        let epoll = rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC)?;
        rustix::event::epoll::add(
            &epoll,
            self.rx.doorbell_fd(),
            rustix::event::epoll::EventData::new_u64(0),
            rustix::event::epoll::EventFlags::IN,
        )?;
        let rx = self.rx.clone();
        let drain = std::sync::Mutex::new(());
        Ok(Arc::new(move |timeout: Duration| {
            let ts = rustix::event::Timespec {
                tv_sec: timeout.as_secs() as _,
                tv_nsec: timeout.subsec_nanos() as _,
            };
            let mut events = Vec::with_capacity(1);
            if let Ok(n) = rustix::event::epoll::wait(
                &epoll,
                rustix::buffer::spare_capacity(&mut events),
                Some(&ts),
            ) && n > 0
                && let Ok(_g) = drain.try_lock()
            {
                rx.drain_doorbell();
            }
        }))
    }

    /// Serve until shut down.
    pub fn run(self) -> io::Result<KernelStats> {
        match self.cfg.reply {
            ReplyMode::Loop { timer } => self.run_loop(timer),
            ReplyMode::ExecutorSqe {
                watchdog,
                sqpoll_above,
                ..
            } => self.run_executor_sqe(watchdog, sqpoll_above),
        }
    }

    /// `--reply loop`: this thread runs the stage and waits in `io_uring_enter` for a CQE (a
    /// send completing, an accept, the executor's eventfd, BPF's doorbell) or the timer.
    fn run_loop(self, timer: Duration) -> io::Result<KernelStats> {
        let mut driver = StageDriver::new(
            self.rx.clone(),
            self.listener.as_raw_fd(),
            Some(self.waker_fd.as_raw_fd()),
            Some(self.shutdown_rx.as_raw_fd()),
        );
        if !self.cfg.executor_wakes {
            driver.watch = Some((self.rx.doorbell_fd().as_raw_fd(), false));
        }
        // The BPF completion watch: only for an executor that cannot wake us (it replaces the
        // doorbell at each request and the timer while that request executes).
        let completion_watch = self.cfg.completion_watch && !self.cfg.executor_wakes;
        if completion_watch {
            self.rx
                .start_completion_watch(WATCH_FIRST.min(timer), timer.max(WATCH_FIRST));
        }
        driver.stage.set_limits(self.cfg.limits);
        driver.stage.set_cancel_markers(self.cfg.cancel_markers);
        if let Some(m) = &self.metrics {
            driver.stage.set_metrics(m.clone());
        }
        let region = self.rx.region();
        let mut wakeups = 0u64;
        let mut last_sweep = Instant::now();
        let mut stats_timer = StatsTimer::new(self.cfg.stats_every);
        loop {
            let mut io = SqIo::ring(&self.uring, &self.rx, &region);
            driver.pass(&self.uring, &mut io);
            if driver.stop_requested {
                // The connections still open end with the transport: cancel their streams.
                driver.stage.end_all();
                driver.stage.publish_cancels(&mut io);
                driver.finish(&self.uring);
                break;
            }
            if std::mem::take(&mut driver.watch_fired) {
                // Consume the records so the doorbell descriptor stops being readable.
                self.rx.drain_doorbell();
            }
            let now = Instant::now();
            if now.duration_since(last_sweep) > Duration::from_millis(5) {
                driver.stage.sweep(now);
                last_sweep = now;
            }
            if stats_timer.due(now) {
                eprintln!("bgs: stats\n{}", self.stats(&driver, wakeups));
            }
            // Announce the sleep, then re-check: a completion published after the check
            // makes its executor write the eventfd, whose READ completion ends the wait.
            let guard = driver.region.completions().sleep_guard();
            // Without executor wake-ups, also count as a request-ring sleeper: BPF then rings
            // its doorbell for the next request, and we start polling at the short timer.
            let request_guard = driver
                .watch
                .is_some()
                .then(|| driver.region.requests().sleep_guard());
            let idle = driver.region.completions().is_empty()
                && driver.side.completions().is_empty()
                && self.uring.cq().is_empty();
            // While requests are in the executor, or sends, shutdowns or accepts are pending,
            // wake at least every `timer` (a GPU executor cannot write the eventfd: this timer
            // is its completion latency); otherwise a longer timer still catches markers BPF
            // published (it cannot write the eventfd either).
            let executing = driver.region.requests().produced() > driver.answered();
            // With the completion watch: a look BPF has scheduled keeps looking while we are
            // announced and requests are unanswered, and rings when a reply is there; read
            // after the announcement above (`KernelRx::watch_scheduled`).
            // The answered count is kept current even while idle: a look that fires then
            // stops at once instead of looking on for a reply already taken.
            if completion_watch {
                self.rx.watch_answered(driver.answered());
            }
            let watched = completion_watch && executing && self.rx.watch_scheduled();
            // With an executor that wakes us for every completion, requests that are only
            // executing need no timer: the wake ends the wait (the long timeout is a net).
            let woken = self.cfg.executor_wakes && !driver.stage.busy();
            let t = match self.cfg.wake_timeout {
                Some(w) if executing && woken => w,
                _ if watched && !driver.stage.busy() => WATCH_NET,
                _ if executing || driver.stage.busy() => timer,
                _ => IDLE_WAIT,
            };
            let wake_wait =
                (executing && woken && self.cfg.wake_timeout.is_some()) || t == WATCH_NET;
            let began = Instant::now();
            match self.uring.enter(io.queued, u32::from(idle), Some(t)) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            // `enter` answers a wait its timeout ended like any other (and, when it also
            // submitted, the kernel reports the submissions, not the timeout): the clock says
            // which waits ran their full time.
            if began.elapsed() >= t {
                // With the watch, an idle wait its timeout ended with a reply waiting also
                // missed the look's doorbell (the request came while we slept idle; its look
                // should have rung).
                let missed =
                    completion_watch && t == IDLE_WAIT && !driver.region.completions().is_empty();
                if wake_wait || missed {
                    driver.wake_timeouts += 1;
                }
            }
            drop(request_guard);
            drop(guard);
            wakeups += 1;
        }
        Ok(self.stats(&driver, wakeups))
    }

    fn stats(&self, driver: &StageDriver, wakeups: u64) -> KernelStats {
        collect_stats(&self.rx, driver, wakeups, self.gpu.as_deref())
    }

    /// `--reply executor-sqe`: the executor's reply thread runs the stage without system
    /// calls (SQEs land in SQPOLL ring memory); this thread is the watchdog. With
    /// `gpu_sends` the stage shares each connection's turn with the GPU, and the watchdog also
    /// wakes the SQPOLL thread for the GPU's ring.
    fn run_executor_sqe(self, watchdog: Duration, sqpoll_above: u32) -> io::Result<KernelStats> {
        let stop = Arc::new(AtomicBool::new(false));
        let wakeups = Arc::new(AtomicU64::new(0));
        let uring = self.uring.clone();
        let rx = self.rx.clone();
        let listener_fd = self.listener.as_raw_fd();
        let stop2 = stop.clone();
        let wakeups2 = wakeups.clone();
        let stats_every = self.cfg.stats_every;
        let gpu = self.gpu.clone();
        let (limits, cancel_markers) = (self.cfg.limits, self.cfg.cancel_markers);
        let metrics = self.metrics.clone();
        let stage_thread = std::thread::Builder::new()
            .name("bgs-exec-sqe".into())
            .spawn(move || {
                let io_region = rx.region();
                let mut driver = StageDriver::new(rx.clone(), listener_fd, None, None);
                if let Some(g) = &gpu {
                    driver.stage = ReplyStage::with_turns(g.table.clone());
                }
                driver.stage.set_limits(limits);
                driver.stage.set_cancel_markers(cancel_markers);
                if let Some(m) = metrics {
                    driver.stage.set_metrics(m);
                }
                let mut last_sweep = Instant::now();
                let mut stats_timer = StatsTimer::new(stats_every);
                // Adaptive submission (`submit` module docs): CPU executors only; a GPU that
                // writes SENDs shares the SQPOLL thread and needs it awake.
                let mut direct =
                    (gpu.is_none() && sqpoll_above > 0).then(|| Direct::new(sqpoll_above));
                let mut done = Vec::new();
                while !stop2.load(Ordering::Acquire) {
                    let now = Instant::now();
                    if let Some(d) = &mut direct {
                        d.begin(&uring, now);
                    }
                    let mut io = SqIo {
                        direct: direct.as_mut(),
                        ..SqIo::ring(&uring, &rx, &io_region)
                    };
                    let mut did = driver.pass(&uring, &mut io);
                    // Operations performed directly completed at once: hand their results to
                    // the stage as if they were CQEs, and flush what they made ready (the rest
                    // of a short send, the next replies of a connection).
                    while let Some(d) = io.direct.as_deref_mut() {
                        d.swap_done(&mut done);
                        if done.is_empty() {
                            break;
                        }
                        did = true;
                        for (user_data, res) in done.drain(..) {
                            driver.stage.on_cqe(user_data, res);
                        }
                        driver.stage.flush(&mut io);
                    }
                    if let Some(d) = io.direct {
                        match d.end(&uring) {
                            Ok(true) => {
                                wakeups2.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(false) => {}
                            Err(e) => tracing::warn!("waking the SQPOLL thread failed: {e}"),
                        }
                    }
                    if now.duration_since(last_sweep) > Duration::from_millis(5) {
                        driver.stage.sweep(now);
                        last_sweep = now;
                    }
                    if stats_timer.due(now) {
                        driver.direct = direct.as_ref().map(|d| d.counts);
                        let w = wakeups2.load(Ordering::Relaxed);
                        eprintln!(
                            "bgs: stats\n{}",
                            collect_stats(&rx, &driver, w, gpu.as_deref())
                        );
                    }
                    if !did {
                        // Sleep on the completion ring's (private) futex: CPU executors wake
                        // it, a GPU queues a private FUTEX_WAKE on its ring, which the
                        // SQPOLL thread (our address space) runs. CQEs are picked up by the
                        // watchdog's nudge or the timeout.
                        let t = match &gpu {
                            None if driver.stage.busy() => Duration::from_micros(100),
                            None => Duration::from_millis(2),
                            Some(g) => {
                                // The GPU cannot wake us when it passes a turn, and its own
                                // SENDs are finals we never see: poll soon while replies wait
                                // for a turn or requests are still on the GPU.
                                let answered = driver.answered() + g.table.gpu_sends();
                                if driver.stage.busy()
                                    || driver.region.requests().produced() > answered
                                {
                                    Duration::from_micros(50)
                                } else {
                                    Duration::from_millis(2)
                                }
                            }
                        };
                        driver.region.completions().wait_nonempty(t);
                    }
                }
                // The connections still open end with the transport: cancel their streams.
                driver.stage.end_all();
                driver
                    .stage
                    .publish_cancels(&mut SqIo::ring(&uring, &rx, &io_region));
                driver.finish(&uring);
                driver.direct = direct.as_ref().map(|d| d.counts);
                driver
            })?;
        let region = self.rx.region();
        // The watchdog sleeps in epoll on the shutdown pipe, so a stop is seen at once and
        // costs no read per round.
        let epoll = rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC)?;
        rustix::event::epoll::add(
            &epoll,
            &self.shutdown_rx,
            rustix::event::epoll::EventData::new_u64(0),
            rustix::event::epoll::EventFlags::IN,
        )?;
        let gpu = self.gpu.clone();
        let adaptive = gpu.is_none() && sqpoll_above > 0;
        // With adaptive submission the stage wakes the SQPOLL thread itself after queueing
        // (`Direct::end`), so the watchdog is only a safety net and need not cost 20,000
        // wake-ups a second.
        let watchdog = if adaptive {
            watchdog.max(ADAPTIVE_WATCHDOG)
        } else {
            watchdog
        };
        let ts = rustix::event::Timespec {
            tv_sec: watchdog.as_secs() as _,
            tv_nsec: watchdog.subsec_nanos() as _,
        };
        let mut events = Vec::with_capacity(1);
        loop {
            // The only thing this thread does: the stage (the executor) cannot make system
            // calls, so someone must wake the SQPOLL thread once it went to sleep. The GPU's
            // ring shares that thread (one wake serves both) unless ATTACH_WQ was refused.
            // With adaptive submission the stage wakes the thread itself when it queues
            // operations for it; woken with nothing to do, it would only spin again until its
            // idle time passes. So only SQEs left waiting count (a safety net).
            let host_sleeps =
                self.uring.needs_wakeup() && (!adaptive || self.uring.sq_unconsumed() > 0);
            let (gpu_sleeps, shared) = gpu
                .as_ref()
                .map_or((false, true), |g| (g.ring.needs_wakeup(), g.shared_sqpoll));
            if host_sleeps || (gpu_sleeps && shared) {
                self.uring.wake_sqpoll()?;
                wakeups.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(g) = &gpu
                && gpu_sleeps
                && !shared
            {
                g.ring.wake_sqpoll()?;
                wakeups.fetch_add(1, Ordering::Relaxed);
            }
            events.clear();
            match rustix::event::epoll::wait(
                &epoll,
                rustix::buffer::spare_capacity(&mut events),
                Some(&ts),
            ) {
                Ok(n) if n > 0 => break,
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        stop.store(true, Ordering::Release);
        region.completions().notify();
        let driver = stage_thread
            .join()
            .map_err(|_| io::Error::other("reply stage thread panicked"))?;
        Ok(self.stats(&driver, wakeups.load(Ordering::Relaxed)))
    }
}
