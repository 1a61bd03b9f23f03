//! The kernel transport's settings and counters.

use std::net::SocketAddr;
use std::time::Duration;

use bgs_protocol::FramerConfig;
use bgs_ring::tx::TxCounters;
use serde::Serialize;

use super::reply::ReplyStats;
use super::submit::DirectCounts;

/// Default of `ReplyMode::ExecutorSqe::sqpoll_above`: replies per second above which the
/// SQPOLL thread submits. Below it a system call per reply (a few µs of the stage's time)
/// is far cheaper than a kernel thread that spins for the whole gap between replies; at
/// 50,000 replies a second the stage would spend a sizeable part of a core in `send(2)`,
/// and the spinning thread's core is paid for by the rate.
pub const DEFAULT_SQPOLL_ABOVE: u32 = 50_000;

/// The watchdog's period with adaptive submission: a safety net, since the stage wakes the
/// SQPOLL thread itself after every pass that left SQEs for it (its own, or a GPU's). What it
/// could still catch is an SQE a GPU queued while the stage slept, and the stage sleeps at most
/// 10 ms then (`WATCH_NET`), so a shorter period would buy nothing and cost wake-ups: at 10 ms
/// it was 0.1 sleeps per request at 1,000 req/s (`examples/oneshot_poll.rs`).
pub const ADAPTIVE_WATCHDOG: Duration = Duration::from_millis(100);

/// The completion watch's first look after a publish until it has learned the executor's
/// service time: about the H200's gemm8 round trip (docs/cost.md).
pub(super) const WATCH_FIRST: Duration = Duration::from_micros(20);

/// A reply thread's safety timeout while BPF's completion watch looks for it (a look that
/// fails to ring is a defect: [`KernelStats::wake_timeouts`] counts the waits it ended).
pub(super) const WATCH_NET: Duration = Duration::from_millis(10);

/// A reply thread's wait, woken by BPF (the reply loop; the executor-sqe stage while the
/// GPU's sends are paused), with nothing executing and nothing to send: long, since whatever
/// comes next wakes it (a request's doorbell or look, the executor's eventfd, an accept); it
/// still catches the markers BPF publishes (BPF cannot write the eventfd).
pub(super) const IDLE_WAIT: Duration = Duration::from_millis(5);

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
        /// Replies per second above which the SQPOLL thread submits. Below it, while that
        /// thread sleeps, the stage sends with system calls itself instead of waking it (a
        /// spinning SQPOLL thread costs a core; `submit` module docs), and a GPU that writes
        /// SENDs hands it every reply (its sends paused). 0: always the SQPOLL ring, and the
        /// GPU sends whenever the turn allows.
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
    /// "The completion watch"). The same for the reply stage of `--reply executor-sqe` with
    /// GPU-written SENDs while adaptive submission pauses them. Ignored otherwise.
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
    /// send table and the GPU's io_uring ring ([`super::KernelTransport::gpu_tx`]) and share each
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
    /// Adaptive submission (`--reply executor-sqe`, `sqpoll_above` > 0).
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
            if self.gpu.is_some() {
                writeln!(
                    f,
                    "gpu sends paused below the rate: resumed {} times, paused again {} times",
                    d.gpu_resumed, d.gpu_paused
                )?;
            }
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
