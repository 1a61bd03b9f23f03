//! The reply stage of the kernel transport: completion ring in, SEND/SHUTDOWN/CLOSE operations
//! out. It is the body of the paper's BPF loop, kept free of I/O so that it can run in a
//! service thread (`--reply loop`), inside the executor writing SQEs (`--reply executor-sqe`),
//! or later in an `io_uring_bpf_ops` program.
//!
//! Per connection (keyed by socket cookie) it restores request order from `conn_seq`,
//! encodes frames (bare or HTTP, from the completion's route bits), keeps at most one SEND in
//! flight (later replies accumulate and go out together when it completes), resends the rest
//! of a short send, and reclaims the connection: after an EOF marker once everything owed is
//! sent, after a closing reply (shutdown, then close when the peer closes or a linger timer
//! runs out), and at once on a reset.
//!
//! # Sharing connections with a GPU that sends ([`ReplyStage::with_turns`])
//! With a GPU executor that writes SEND SQEs itself (`--reply executor-sqe --executor gpu`),
//! the replies of one connection are sent by two agents, and the send table's per-connection
//! turn (`bgs_ring::tx`, module docs) decides who may send: the entry's `next_seq` names the
//! reply that goes on the wire next, and only the agent holding that reply acts. The stage
//! then:
//! - registers each accepted connection with the `conn_seq` of the first reply it has not sent
//!   (a connection the table refuses stays host-only: the GPU's lookup fails and it hands every
//!   reply to us);
//! - sends only when the turn names the first reply of its buffer (or it holds the turn
//!   already), and passes the turn on (`next_seq =` the sequence after the last complete reply
//!   sent) when that SEND completed in full while the connection stays open; a connection that
//!   is ending (closing reply, send error, EOF, reset) keeps the turn, so the GPU can never
//!   send on its descriptor again;
//! - catches up with replies the GPU sent (they never reach the stage): when it holds nothing
//!   for a connection and the turn is past its next expected sequence, it skips to the turn
//!   and emits what was parked there;
//! - handles RESET markers in order, like EOF (the GPU may still hold earlier replies, and the
//!   descriptor must not be closed and reused while it might write a SEND for it), and
//!   tombstones the entry before every CLOSE;
//! - counts a connection that waits for the turn as busy, so the caller polls it soon (the GPU
//!   cannot wake the stage when it passes a turn).
//!
//! Streamed replies (several frames per request) are always the stage's: the GPU sends only
//! final one-shot replies (`stream == 0 && final_`) and hands every other completion over, so
//! the turn stays a plain `conn_seq`. While the stage sends a stream's frames it keeps the
//! turn at that item (passing it on only after the SEND that carried the final frame).
//!
//! # Credit and cancels ([`crate::credit`])
//! Every completion with `stream != 0` is acknowledged once ([`ReplyIo::ack_stream`]) when the
//! stage has encoded it (or dropped it: stale, connection ended), but held back while the
//! connection is over [`ConnLimits::max_unsent`]: the front item's frames while its unsent
//! bytes (queued plus the SEND in flight) are, a later item's frames while those plus its
//! parked frames are, or when it is `max_inflight` or more items ahead. They are released as
//! SENDs complete and items finish. Every connection gets one cancel marker
//! ([`ReplyIo::cancel`]): when its EOF or RESET marker arrives (at once, not in its turn: a
//! stream ahead of it would otherwise never end), when a send fails, before its CLOSE, or when
//! it is dropped unaccepted. BPF publishes no cancel markers itself: the stage has to publish
//! them for the connections the server ends anyway (BPF sees no marker for those), so one
//! publisher with one per-connection flag gives exactly one marker per connection; see
//! docs/kernel.md.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bgs_protocol::{Framing, HEADER_LEN, Reject, Status};
use bgs_ring::tx::TxTable;
use bgs_ring::{CompletionEntry, OP_REJECT, monotonic_ns, route};
use serde::Serialize;
use slab::Slab;

use crate::conn::{ConnLimits, FrameOut, encode_frame, encode_reject};
use crate::credit::Withheld;
use crate::stats::RequestMetrics;

/// Operations the stage asks for; an io_uring submission queue in production, a recorder in
/// tests. Each returns false when there is no room (the stage retries on the next flush).
pub trait ReplyIo {
    /// Send `len` bytes at `ptr` on `fd`. The buffer stays untouched until
    /// [`ReplyStage::on_cqe`] reports this `user_data` done.
    fn send(&mut self, fd: RawFd, ptr: *const u8, len: usize, user_data: u64) -> bool;
    /// Shut down the sending side of `fd`.
    fn shutdown(&mut self, fd: RawFd, user_data: u64) -> bool;
    /// Close `fd`, the connection whose socket cookie is `cookie`.
    fn close(&mut self, fd: RawFd, cookie: u64, user_data: u64) -> bool;
    /// Acknowledge `n` disposed-of completions of credit stream `stream` (the completion's
    /// `stream` field; `RingRegion` credit counters, [`crate::credit::ack`]).
    fn ack_stream(&mut self, stream: u32, n: u32);
    /// Publish the cancel marker (`OP_CANCEL`) of the connection whose socket cookie is
    /// `cookie` into the request ring ([`crate::credit::publish_cancel`]). False when the ring
    /// is full: the stage keeps it and retries on the next flush.
    fn cancel(&mut self, cookie: u64) -> bool;
}

const KIND_SEND: u64 = 1;
const KIND_SHUTDOWN: u64 = 2;
const KIND_CLOSE: u64 = 3;

fn user_data(kind: u64, idx: usize, generation: u32) -> u64 {
    (kind << 56) | ((idx as u64 & 0xff_ffff) << 32) | u64::from(generation)
}

/// How long a connection the server ended waits for the peer's FIN before it is closed.
pub const LINGER: Duration = Duration::from_secs(2);
/// How many closed cookies are remembered to recognise late markers.
const RECENTLY_CLOSED: usize = 1 << 16;
/// How long replies for a connection wait for its accept before they are dropped.
pub const ACCEPT_GRACE: Duration = Duration::from_secs(5);
/// Most bytes one reply takes encoded: a frame with a full slot of payload and an HTTP
/// response head. Sizes the overflow bound ([`overflow_bound`]).
pub const MAX_REPLY_BYTES: usize = 1280;

/// Reply bytes a connection may make the stage hold (queued, in flight, parked) before it is
/// aborted: BPF cannot stop reading a connection, so a client that keeps pipelining without
/// reading would otherwise grow them without bound. Within the limits a connection holds at
/// most `max_unsent` plus its streams' unacknowledged windows (credit) plus `max_inflight`
/// one-shot replies; the second `max_unsent` is slack for the windows.
pub fn overflow_bound(limits: &ConnLimits) -> usize {
    2 * limits.max_unsent + limits.max_inflight * MAX_REPLY_BYTES
}

/// With a send table: how long a RESET marker waits for a turn that does not move before the
/// connection is closed anyway (BPF lost a reply before it: both rings were full).
pub const RESET_GRACE: Duration = Duration::from_secs(5);

/// `a` comes after `b` in wrapping `conn_seq` order.
fn seq_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// Counters of the reply stage.
#[derive(Debug, Default, Clone, Serialize)]
pub struct ReplyStats {
    /// Completions consumed.
    pub completions: u64,
    /// Reply frames encoded.
    pub frames: u64,
    /// SEND operations issued.
    pub sends: u64,
    /// Bytes the completed SENDs reported sent.
    pub bytes_sent: u64,
    /// Sends that completed short and were continued.
    pub short_sends: u64,
    /// Send errors (the connection is then closed).
    pub send_errors: u64,
    /// Connections registered by accept.
    pub accepted: u64,
    /// Connections closed.
    pub closed: u64,
    /// EOF markers handled.
    pub eof: u64,
    /// Reset markers handled.
    pub resets: u64,
    /// Completions for connections that were already closed (dropped).
    pub stale: u64,
    /// Connections dropped because no accept arrived in time.
    pub never_accepted: u64,
    /// Send table: connections registered at accept.
    pub tx_registered: u64,
    /// Send table: connections it refused (no free entry in the probe window; host-only).
    pub tx_refused: u64,
    /// Send table: connections never registered because they had already ended (an EOF or a
    /// reset marker reached this stage before their accept did); the stage alone answers them.
    pub tx_ended_first: u64,
    /// Send table: turns passed on after a host SEND completed.
    pub turn_passes: u64,
    /// Send table: flushes that found replies ready but the turn elsewhere.
    pub turn_waits: u64,
    /// Send table: replies skipped because the turn moved past them (the GPU sent them).
    pub gpu_sent_skipped: u64,
    /// Send table: parked replies found behind the turn and dropped (should stay 0).
    pub behind_turn: u64,
    /// Send table: RESET markers whose turn never came within [`RESET_GRACE`].
    pub resets_forced: u64,
    /// Credit acknowledgements given for streamed completions.
    pub acks: u64,
    /// Of those, acknowledgements held back while their connection was over its limit.
    pub acks_withheld: u64,
    /// Cancel markers published into the request ring.
    pub cancels: u64,
    /// Cancel markers that found the request ring full and were retried.
    pub cancels_deferred: u64,
    /// Connections aborted for holding more than [`overflow_bound`] reply bytes.
    pub overflow_aborts: u64,
}

/// A completion's fields as the stage needs them, borrowing the payload from the ring slot.
#[derive(Debug, Clone, Copy)]
struct FrameRef<'a> {
    status: u16,
    final_: bool,
    stream_seq: u32,
    request_id: u32,
    route: u32,
    /// The request's op and publication time (request metrics, counted at the final frame).
    op: u32,
    publish_ns: u64,
    words: &'a [u32],
}

/// A completion that arrived before the items ahead of it: the only case that copies the
/// payload out of the ring.
#[derive(Debug)]
struct Parked {
    status: u16,
    final_: bool,
    stream_seq: u32,
    request_id: u32,
    route: u32,
    op: u32,
    publish_ns: u64,
    words: Vec<u32>,
}

impl Parked {
    fn as_ref(&self) -> FrameRef<'_> {
        FrameRef {
            status: self.status,
            final_: self.final_,
            stream_seq: self.stream_seq,
            request_id: self.request_id,
            route: self.route,
            op: self.op,
            publish_ns: self.publish_ns,
            words: &self.words,
        }
    }
}

/// Most spare send buffers kept for reuse.
const SPARE_BUFFERS: usize = 1024;

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Phase {
    /// Serving.
    Open,
    /// Close once everything owed is sent (EOF seen, or a closing reply queued).
    Closing,
    /// Shut down for writing; waiting for the peer's EOF or the linger deadline.
    Lingering,
    /// CLOSE issued.
    Closed,
}

#[derive(Debug)]
struct ConnOut {
    cookie: u64,
    generation: u32,
    fd: Option<RawFd>,
    created: Instant,
    next_seq: u32,
    /// Frames of later items, waiting for the items before them.
    parked: BTreeMap<u32, Vec<Parked>>,
    /// The current (front) item's HTTP response has been started.
    http_started: bool,
    /// Bytes ready to send.
    out: Vec<u8>,
    /// The buffer being sent (one SEND at a time keeps the byte order).
    inflight: Option<Inflight>,
    phase: Phase,
    /// Counted in `ReplyStage::busy_conns` (see `ConnOut::busy`).
    busy_counted: bool,
    /// The peer's EOF marker arrived (in order).
    eof: bool,
    linger_until: Option<Instant>,
    /// Send table entry (registered at accept; taken when the entry is tombstoned).
    tx: Option<u32>,
    /// `conn_seq` of the first reply in `out` (valid while `out` is non-empty).
    out_first: u32,
    /// `conn_seq` after the last complete reply in the SEND in flight: the turn passed on
    /// when it completes.
    inflight_end: u32,
    /// Registered and took the turn with a SEND that has not passed it on.
    holds_turn: bool,
    /// Registered: a RESET marker is parked waiting for its turn; the turn last seen and
    /// since when it has not moved.
    reset_wait: Option<(u32, Instant)>,
    /// Bytes the parked frames will take encoded (header and payload; HTTP framing not
    /// counted), for the credit limit.
    parked_bytes: usize,
    /// Acknowledgements of streamed frames held back while over the limits.
    withheld: Withheld,
    /// The cancel marker is published or owed.
    cancelled: bool,
    /// Aborted over [`overflow_bound`]: a SHUTDOWN is owed, which also fails a SEND stalled
    /// on the full socket so that the connection can close.
    abort: bool,
}

impl ConnOut {
    /// Waiting on something that will need a timely look: a SEND in flight, a shutdown or
    /// linger, an accept that has not been reaped yet, or (registered) replies waiting for
    /// the turn, which the GPU passes without waking anyone.
    fn busy(&self) -> bool {
        self.inflight.is_some()
            || self.phase != Phase::Open
            || self.fd.is_none()
            || (self.tx.is_some() && (!self.parked.is_empty() || !self.out.is_empty()))
    }

    /// Registered, accepted, and holding replies that wait for the turn: flush again on the
    /// next pass.
    fn waits_for_turn(&self) -> bool {
        self.tx.is_some()
            && self.fd.is_some()
            && self.inflight.is_none()
            && self.phase != Phase::Closed
            && (!self.out.is_empty() || (self.phase == Phase::Open && !self.parked.is_empty()))
    }

    /// Reply bytes not yet on the wire: queued, and the rest of the SEND in flight.
    fn unsent(&self) -> usize {
        self.out.len() + self.inflight.as_ref().map_or(0, |i| i.buf.len() - i.sent)
    }

    /// Whether a streamed frame of item `conn_seq`, already encoded or parked, may be
    /// acknowledged now (module docs). The front item is judged by what is queued for the
    /// wire alone, so it keeps moving when later items fill the budget (they drain only once
    /// it is done).
    fn may_ack(&self, limits: &ConnLimits, conn_seq: u32) -> bool {
        if self.phase != Phase::Open || seq_after(self.next_seq, conn_seq) {
            // The connection is ending (what it holds is dropped or already final), or the
            // item is done.
            return true;
        }
        let ahead = conn_seq.wrapping_sub(self.next_seq) as usize;
        if ahead == 0 {
            self.unsent() <= limits.max_unsent
        } else {
            ahead < limits.max_inflight && self.unsent() + self.parked_bytes <= limits.max_unsent
        }
    }

    /// The connection ends: owe its cancel marker (once).
    fn owe_cancel(&mut self, due: &mut std::collections::VecDeque<u64>) {
        if !self.cancelled {
            self.cancelled = true;
            due.push_back(self.cookie);
        }
    }

    /// Drop every parked frame.
    fn clear_parked(&mut self) {
        self.parked.clear();
        self.parked_bytes = 0;
    }

    /// The first reply not handed to the wire yet: what the turn must name for the host.
    fn first_unsent(&self) -> u32 {
        if self.out.is_empty() {
            self.next_seq
        } else {
            self.out_first
        }
    }
}

#[derive(Debug)]
struct Inflight {
    buf: Vec<u8>,
    sent: usize,
    /// A SEND for `buf[sent..]` is queued and its completion not yet seen.
    issued: bool,
}

/// The reply stage (see the module docs).
#[derive(Debug, Default)]
pub struct ReplyStage {
    conns: Slab<ConnOut>,
    by_cookie: HashMap<u64, usize>,
    next_generation: u32,
    /// Connections with work for the next flush.
    dirty: Vec<usize>,
    /// The list being flushed (kept to reuse its allocation).
    flushing: Vec<usize>,
    /// Send buffers to reuse: steady state allocates and frees nothing.
    spare: Vec<Vec<u8>>,
    /// Connections whose `busy()` is true, kept current by `flush` so that [`Self::busy`]
    /// is O(1) on the loop's hot path.
    busy_conns: usize,
    /// Cookies of the most recently closed connections, so that markers arriving after the
    /// close do not resurrect them (cookies are never reused).
    recently_closed: std::collections::HashSet<u64>,
    recently_closed_order: std::collections::VecDeque<u64>,
    /// The send table shared with a GPU that sends replies itself (module docs).
    turns: Option<Arc<TxTable>>,
    /// Per-connection limits for credit (module docs).
    limits: ConnLimits,
    /// Acknowledgements decided outside [`Self::flush`], given at its end: `(stream, n)`.
    acks_due: Vec<(u32, u32)>,
    /// Cookies of ended connections whose cancel marker is not published yet.
    cancels_due: std::collections::VecDeque<u64>,
    /// Cancel markers are not published (an executor that does not consume them).
    no_cancels: bool,
    /// The last flush found the request ring full with cancel markers owed (poll soon: the
    /// executor cannot tell us when it has room).
    cancels_blocked: bool,
    stats: ReplyStats,
    /// Where answered requests and their durations are counted (`None`: not measured).
    metrics: Option<Arc<RequestMetrics>>,
}

impl ReplyStage {
    /// An empty stage.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty stage that shares its connections with a GPU sending replies through `table`
    /// (module docs).
    pub fn with_turns(table: Arc<TxTable>) -> Self {
        ReplyStage {
            turns: Some(table),
            ..Self::default()
        }
    }

    /// Set the per-connection limits that decide when credit is held back (default:
    /// [`ConnLimits::default`]).
    pub fn set_limits(&mut self, limits: ConnLimits) {
        self.limits = limits;
    }

    /// Count answered requests by op and status, and the time from BPF's publication of each
    /// request to its final frame being encoded, in `metrics` (see `emit`).
    pub fn set_metrics(&mut self, metrics: Arc<RequestMetrics>) {
        self.metrics = Some(metrics);
    }

    /// Counters.
    pub fn stats(&self) -> &ReplyStats {
        &self.stats
    }

    /// The transport stops: every connection still tracked ends, so owe their cancel
    /// markers; [`Self::publish_cancels`] (or the next flush) publishes them.
    pub fn end_all(&mut self) {
        for (_, c) in self.conns.iter_mut() {
            c.owe_cancel(&mut self.cancels_due);
        }
    }

    /// Whether ended connections get a cancel marker (default: yes). Off for an executor
    /// that does not consume them (it would answer them like requests).
    pub fn set_cancel_markers(&mut self, on: bool) {
        self.no_cancels = !on;
    }

    /// Publish owed cancel markers, oldest first, until the request ring is full.
    pub fn publish_cancels(&mut self, io: &mut dyn ReplyIo) {
        if self.no_cancels {
            self.cancels_due.clear();
            return;
        }
        while let Some(&cookie) = self.cancels_due.front() {
            if !io.cancel(cookie) {
                self.stats.cancels_deferred += 1;
                break;
            }
            self.cancels_due.pop_front();
            self.stats.cancels += 1;
        }
        self.cancels_blocked = !self.cancels_due.is_empty();
    }

    /// Owe one acknowledgement of `stream` (0: none), given at the end of the next flush.
    fn ack_later(&mut self, stream: u32) {
        if stream != 0 {
            self.acks_due.push((stream, 1));
        }
    }

    /// Connections currently tracked.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Connections whose CLOSE was issued and has not completed (its completion is what
    /// [`ReplyStats::closed`] counts). O(connections): for shutdown, not the hot path.
    pub fn closes_in_flight(&self) -> usize {
        self.conns
            .iter()
            .filter(|(_, c)| c.phase == Phase::Closed)
            .count()
    }

    /// True when a SEND, SHUTDOWN or linger is outstanding, an accept is awaited, replies
    /// wait for the GPU to pass a turn, or cancel markers wait for room in the request ring
    /// (the caller should poll soon). Exact after [`Self::flush`].
    pub fn busy(&self) -> bool {
        self.busy_conns > 0 || self.cancels_blocked
    }

    /// Re-count connection `idx` in `busy_conns`.
    fn refresh_busy(&mut self, idx: usize) {
        if let Some(c) = self.conns.get_mut(idx) {
            let b = c.busy();
            if b != c.busy_counted {
                c.busy_counted = b;
                if b {
                    self.busy_conns += 1;
                } else {
                    self.busy_conns -= 1;
                }
            }
        }
    }

    /// Take connection `idx` out of the stage.
    fn remove_conn(&mut self, idx: usize) -> ConnOut {
        let c = self.conns.remove(idx);
        if let (Some(t), Some(ti)) = (&self.turns, c.tx) {
            // Every path to here tombstones first (before the CLOSE); keep the table clean
            // regardless.
            debug_assert!(false, "connection removed while registered");
            t.remove(ti);
        }
        if c.busy_counted {
            self.busy_conns -= 1;
        }
        self.by_cookie.remove(&c.cookie);
        c
    }

    fn conn_for(&mut self, cookie: u64) -> usize {
        if let Some(&idx) = self.by_cookie.get(&cookie) {
            return idx;
        }
        self.next_generation = self.next_generation.wrapping_add(1);
        let idx = self.conns.insert(ConnOut {
            cookie,
            generation: self.next_generation,
            fd: None,
            created: Instant::now(),
            next_seq: 0,
            parked: BTreeMap::new(),
            http_started: false,
            out: Vec::new(),
            inflight: None,
            phase: Phase::Open,
            busy_counted: false,
            eof: false,
            linger_until: None,
            tx: None,
            out_first: 0,
            inflight_end: 0,
            holds_turn: false,
            reset_wait: None,
            parked_bytes: 0,
            withheld: Withheld::default(),
            cancelled: false,
            abort: false,
        });
        self.by_cookie.insert(cookie, idx);
        idx
    }

    /// The transport accepted connection `fd` whose socket cookie is `cookie`.
    pub fn on_accept(&mut self, fd: RawFd, cookie: u64) {
        let idx = self.conn_for(cookie);
        let c = &mut self.conns[idx];
        c.fd = Some(fd);
        if let Some(t) = &self.turns {
            if c.phase == Phase::Open {
                // Until now the GPU's lookup failed, so every reply came here: the turn starts
                // at the first one we have not sent (nothing was sent without a descriptor).
                match t.insert(cookie, fd, c.first_unsent()) {
                    Some(ti) => {
                        c.tx = Some(ti);
                        self.stats.tx_registered += 1;
                    }
                    None => self.stats.tx_refused += 1,
                }
            } else {
                self.stats.tx_ended_first += 1;
            }
        }
        self.stats.accepted += 1;
        self.dirty.push(idx);
    }

    /// Consume one completion-ring entry.
    pub fn on_completion(&mut self, e: &CompletionEntry) {
        self.stats.completions += 1;
        if self.recently_closed.contains(&e.conn) {
            // Markers (or late replies) for a connection this stage already closed (its
            // cancel marker went out then).
            self.stats.stale += 1;
            self.ack_later(e.stream);
            return;
        }
        // An unknown cookie is a connection whose accept has not been reaped yet: keep what
        // arrives for it (markers included) until the accept brings its descriptor.
        let idx = self.conn_for(e.conn);
        let c = &mut self.conns[idx];
        if e.route & (route::EOF | route::RESET) != 0 {
            // The peer is done: its streams end now, although the marker itself may have to
            // wait behind them for its turn.
            c.owe_cancel(&mut self.cancels_due);
        }
        if let (Some(t), Some(ti)) = (&self.turns, c.tx) {
            // Skip what the GPU sent meanwhile, so this item is not parked for nothing.
            Self::catch_up(c, t, ti, &mut self.stats, self.metrics.as_deref());
        }
        // A registered, open connection takes its reset in order: the GPU may still hold
        // earlier replies and write SENDs on the descriptor. Otherwise (host-only, or the
        // stage already ended the connection and keeps the turn for good) at once.
        let in_order = c.tx.is_some() && c.phase == Phase::Open;
        if e.route & route::RESET != 0 && !in_order {
            self.stats.resets += 1;
            c.out.clear();
            c.clear_parked();
            c.phase = Phase::Closing;
            c.eof = true;
            // What it held back is released by the next flush (`may_ack`: not open).
            self.dirty.push(idx);
            return;
        }
        if c.phase != Phase::Open {
            // The server already ended this connection; only the peer's EOF still matters.
            if e.route & route::EOF != 0 {
                c.eof = true;
                self.dirty.push(idx);
            } else {
                self.stats.stale += 1;
                self.ack_later(e.stream);
            }
            return;
        }
        let frame = FrameRef {
            status: e.status,
            final_: e.final_ != 0,
            stream_seq: e.stream_seq,
            request_id: e.request_id,
            route: e.route,
            op: e.op,
            publish_ns: e.publish_ns,
            words: &e.payload[..(e.words as usize).min(e.payload.len())],
        };
        if e.conn_seq == c.next_seq {
            Self::emit(c, frame, &mut self.stats, self.metrics.as_deref());
            // Items that were waiting behind this one.
            Self::drain_parked(c, &mut self.stats, self.metrics.as_deref());
        } else {
            if e.route & route::RESET != 0
                && let Some((t, ti)) = self.turns.as_ref().zip(c.tx)
            {
                c.reset_wait = Some((t.next_seq(ti), Instant::now()));
            }
            c.parked_bytes += HEADER_LEN + 4 * frame.words.len();
            c.parked.entry(e.conn_seq).or_default().push(Parked {
                status: frame.status,
                final_: frame.final_,
                stream_seq: frame.stream_seq,
                request_id: frame.request_id,
                route: frame.route,
                op: frame.op,
                publish_ns: frame.publish_ns,
                words: frame.words.to_vec(),
            });
        }
        if e.stream != 0 {
            if e.final_ != 0 {
                // The stream is over: nothing more to hold back (credit::Withheld).
                let due = &mut self.acks_due;
                c.withheld
                    .release_stream(e.stream, |st, n| due.push((st, n)));
            }
            if e.final_ != 0 || c.may_ack(&self.limits, e.conn_seq) {
                self.acks_due.push((e.stream, 1));
            } else {
                c.withheld.push(e.conn_seq, e.stream);
                self.stats.acks_withheld += 1;
            }
        }
        if c.tx.is_none()
            && c.phase == Phase::Open
            && c.unsent() + c.parked_bytes > overflow_bound(&self.limits)
        {
            // Pipelining far beyond the limits without reading. (A connection that shares
            // its turn with the GPU is not aborted here: the GPU may hold the turn with a
            // SEND on the descriptor, which must not close under it.)
            self.stats.overflow_aborts += 1;
            c.out.clear();
            c.clear_parked();
            c.eof = true;
            c.phase = Phase::Closing;
            c.abort = true;
            c.owe_cancel(&mut self.cancels_due);
        }
        self.dirty.push(idx);
    }

    /// Emit the parked items that are now in turn, up to a gap or the end of the connection.
    fn drain_parked(c: &mut ConnOut, stats: &mut ReplyStats, metrics: Option<&RequestMetrics>) {
        while c.phase == Phase::Open && !c.parked.is_empty() {
            let Some(frames) = c.parked.remove(&c.next_seq) else {
                break;
            };
            for p in &frames {
                c.parked_bytes -= HEADER_LEN + 4 * p.words.len();
                Self::emit(c, p.as_ref(), stats, metrics);
            }
        }
    }

    /// Registered connection holding nothing: if the turn moved past the next item we
    /// expect, the GPU sent the items in between (they never come here); continue at the
    /// turn and emit what was parked there.
    fn catch_up(
        c: &mut ConnOut,
        t: &TxTable,
        ti: u32,
        stats: &mut ReplyStats,
        metrics: Option<&RequestMetrics>,
    ) {
        if c.phase != Phase::Open || c.holds_turn || c.inflight.is_some() || !c.out.is_empty() {
            return;
        }
        let s = t.next_seq(ti);
        if !seq_after(s, c.next_seq) {
            return;
        }
        stats.gpu_sent_skipped += u64::from(s.wrapping_sub(c.next_seq));
        c.next_seq = s;
        c.http_started = false;
        // Items the GPU sent never reach us, so nothing can be parked behind the turn; if
        // something is, it can no longer be sent in order.
        let mut dropped = 0;
        c.parked.retain(|&k, frames| {
            let behind = seq_after(s, k);
            stats.behind_turn += u64::from(behind);
            if behind {
                dropped += frames
                    .iter()
                    .map(|p| HEADER_LEN + 4 * p.words.len())
                    .sum::<usize>();
            }
            !behind
        });
        c.parked_bytes -= dropped;
        Self::drain_parked(c, stats, metrics);
    }

    /// Encode one frame of the front item (or handle a marker in its turn).
    ///
    /// A final frame of a request (not a marker, not a framer rejection: `op` is not
    /// [`OP_REJECT`], as the native transport does not count rejected input either) is
    /// counted in `metrics` with the request's op and the frame's status, and the time since
    /// its `publish_ns` (BPF stamps it when it publishes the request, or its busy answer).
    fn emit(
        c: &mut ConnOut,
        p: FrameRef<'_>,
        stats: &mut ReplyStats,
        metrics: Option<&RequestMetrics>,
    ) {
        if c.phase != Phase::Open {
            return;
        }
        if p.route & route::EOF != 0 {
            stats.eof += 1;
            c.eof = true;
            c.phase = Phase::Closing;
            return;
        }
        if p.route & route::RESET != 0 {
            // In order (registered connections only): everything before it is sent or in
            // flight; the peer is gone, so drop what is unsent and close.
            stats.resets += 1;
            c.out.clear();
            c.clear_parked();
            c.eof = true;
            c.phase = Phase::Closing;
            return;
        }
        let was_empty = c.out.is_empty();
        let framing = if p.route & route::HTTP != 0 {
            Framing::Http {
                keep_alive: p.route & route::CLOSE == 0,
            }
        } else {
            Framing::Binary
        };
        let status = Status::from_u16(p.status).unwrap_or(Status::Internal);
        let http_code = (p.route >> route::HTTP_STATUS_SHIFT) & route::HTTP_STATUS_MASK;
        if p.route & route::NO_FRAME != 0 || (http_code != 0 && framing != Framing::Binary) {
            // A rejection whose HTTP status is not derived from the frame status.
            let reject = Reject {
                request_id: p.request_id,
                status: (p.route & route::NO_FRAME == 0).then_some(status),
                http_status: Some(if http_code != 0 {
                    http_code as u16
                } else {
                    status.http_status()
                }),
                close: p.route & route::CLOSE != 0,
            };
            encode_reject(&mut c.out, &reject);
        } else {
            let f = FrameOut {
                status,
                final_: p.final_,
                stream_seq: p.stream_seq,
                request_id: p.request_id,
                words: p.words,
            };
            encode_frame(&mut c.out, framing, &mut c.http_started, &f);
        }
        stats.frames += 1;
        if was_empty && !c.out.is_empty() {
            c.out_first = c.next_seq;
        }
        if p.final_ {
            if let Some(m) = metrics
                && p.op != u32::from(OP_REJECT)
            {
                // Ops are u16 on the wire; anything wider is counted as an unnamed op.
                let op = u16::try_from(p.op).unwrap_or(u16::MAX);
                m.observe(op, status, monotonic_ns().saturating_sub(p.publish_ns));
            }
            c.next_seq = c.next_seq.wrapping_add(1);
            c.http_started = false;
            if p.route & route::CLOSE != 0 {
                c.phase = Phase::Closing;
            }
        }
    }

    /// An io_uring completion for one of this stage's operations.
    pub fn on_cqe(&mut self, user_data: u64, res: i32) {
        let kind = user_data >> 56;
        let idx = ((user_data >> 32) & 0xff_ffff) as usize;
        let generation = user_data as u32;
        let Some(c) = self.conns.get_mut(idx) else {
            return;
        };
        if c.generation != generation {
            return;
        }
        match kind {
            KIND_SEND => {
                let Some(inf) = c.inflight.as_mut() else {
                    return;
                };
                inf.issued = false;
                if res < 0 {
                    // EPIPE, ECONNRESET: the peer is gone; nothing more can be delivered. A
                    // registered connection keeps the turn: nobody sends on it again.
                    self.stats.send_errors += 1;
                    c.inflight = None;
                    c.out.clear();
                    c.clear_parked();
                    c.eof = true;
                    c.phase = Phase::Closing;
                    c.owe_cancel(&mut self.cancels_due);
                } else {
                    self.stats.bytes_sent += res as u64;
                    inf.sent += res as usize;
                    if inf.sent < inf.buf.len() {
                        self.stats.short_sends += 1;
                    } else if let Some(Inflight { mut buf, .. }) = c.inflight.take() {
                        if let (Some(t), Some(ti)) = (&self.turns, c.tx)
                            && c.phase == Phase::Open
                        {
                            // Everything up to `inflight_end` is on the wire: the next reply
                            // may go out from whoever holds it. A connection that is ending
                            // keeps the turn. A SEND of a stream's frames that did not carry
                            // its final one leaves the turn where it is (at that item, which
                            // only this stage holds).
                            if t.next_seq(ti) != c.inflight_end {
                                t.pass_turn(ti, c.inflight_end);
                                self.stats.turn_passes += 1;
                            }
                            c.holds_turn = false;
                        }
                        buf.clear();
                        if c.out.is_empty() && c.out.capacity() == 0 {
                            c.out = buf;
                        } else if self.spare.len() < SPARE_BUFFERS {
                            self.spare.push(buf);
                        }
                    }
                }
                self.dirty.push(idx);
            }
            KIND_SHUTDOWN => {
                c.linger_until = Some(Instant::now() + LINGER);
                self.dirty.push(idx);
            }
            KIND_CLOSE => {
                let cookie = c.cookie;
                let mut gone = self.remove_conn(idx);
                let due = &mut self.acks_due;
                gone.withheld.release_all(|st, n| due.push((st, n)));
                self.recycle(gone);
                self.stats.closed += 1;
                self.recently_closed.insert(cookie);
                self.recently_closed_order.push_back(cookie);
                if self.recently_closed_order.len() > RECENTLY_CLOSED
                    && let Some(old) = self.recently_closed_order.pop_front()
                {
                    self.recently_closed.remove(&old);
                }
            }
            _ => {}
        }
    }

    /// Keep a closed connection's buffers for reuse.
    fn recycle(&mut self, c: ConnOut) {
        let ConnOut { out, inflight, .. } = c;
        for mut buf in [Some(out), inflight.map(|i| i.buf)].into_iter().flatten() {
            if buf.capacity() > 0 && self.spare.len() < SPARE_BUFFERS {
                buf.clear();
                self.spare.push(buf);
            }
        }
    }

    /// Issue the operations the state calls for: sends, shutdowns, closes.
    pub fn flush(&mut self, io: &mut dyn ReplyIo) {
        std::mem::swap(&mut self.dirty, &mut self.flushing);
        self.flushing.sort_unstable();
        self.flushing.dedup();
        for i in 0..self.flushing.len() {
            let idx = self.flushing[i];
            if !self.flush_one(idx, io) || self.conns.get(idx).is_some_and(ConnOut::waits_for_turn)
            {
                // No room in the queue, or replies wait for the GPU to pass the turn: look
                // again at the next flush.
                self.dirty.push(idx);
            }
            self.refresh_busy(idx);
            if let Some(c) = self.conns.get_mut(idx)
                && !c.withheld.is_empty()
            {
                // SENDs completed or items finished since they were held back.
                let mut w = std::mem::take(&mut c.withheld);
                let (limits, due) = (&self.limits, &mut self.acks_due);
                w.release(|seq| c.may_ack(limits, seq), |st, n| due.push((st, n)));
                c.withheld = w;
            }
        }
        self.flushing.clear();
        for (stream, n) in self.acks_due.drain(..) {
            io.ack_stream(stream, n);
            self.stats.acks += u64::from(n);
        }
        self.publish_cancels(io);
    }

    /// Returns false when the queue was full and the connection needs another flush.
    fn flush_one(&mut self, idx: usize, io: &mut dyn ReplyIo) -> bool {
        let Some(c) = self.conns.get_mut(idx) else {
            return true;
        };
        let Some(fd) = c.fd else {
            // Not accepted yet: replies wait (bounded by `sweep`).
            return true;
        };
        if c.phase == Phase::Closed {
            return true;
        }
        if c.abort {
            if !io.shutdown(fd, user_data(KIND_SHUTDOWN, idx, c.generation)) {
                return false;
            }
            c.abort = false;
        }
        let turns = self.turns.as_deref();
        if let (Some(t), Some(ti)) = (turns, c.tx) {
            Self::catch_up(c, t, ti, &mut self.stats, self.metrics.as_deref());
        }
        let ud_send = user_data(KIND_SEND, idx, c.generation);
        if let Some(inf) = c.inflight.as_mut() {
            if !inf.issued && inf.sent < inf.buf.len() {
                // The rest of a short send.
                let rest = &inf.buf[inf.sent..];
                if !io.send(fd, rest.as_ptr(), rest.len(), ud_send) {
                    return false;
                }
                inf.issued = true;
                self.stats.sends += 1;
            }
            return true;
        }
        if !c.out.is_empty() {
            if let (Some(t), Some(ti)) = (turns, c.tx)
                && !c.holds_turn
                && t.next_seq(ti) != c.out_first
            {
                // Not our turn: the GPU still sends replies before these.
                self.stats.turn_waits += 1;
                return true;
            }
            let fresh = self.spare.pop().unwrap_or_default();
            let buf = std::mem::replace(&mut c.out, fresh);
            if !io.send(fd, buf.as_ptr(), buf.len(), ud_send) {
                let fresh = std::mem::replace(&mut c.out, buf);
                self.spare.push(fresh);
                return false;
            }
            self.stats.sends += 1;
            c.inflight_end = c.next_seq;
            c.holds_turn = c.tx.is_some();
            // Moving the Vec moves only its header: the heap buffer the SEND points at stays
            // where it is, untouched, until the CQE.
            c.inflight = Some(Inflight {
                buf,
                sent: 0,
                issued: true,
            });
            return true;
        }
        match c.phase {
            Phase::Closing if c.eof => {
                c.owe_cancel(&mut self.cancels_due);
                Self::unregister(c, turns);
                if !io.close(fd, c.cookie, user_data(KIND_CLOSE, idx, c.generation)) {
                    return false;
                }
                c.phase = Phase::Closed;
            }
            Phase::Closing => {
                if !io.shutdown(fd, user_data(KIND_SHUTDOWN, idx, c.generation)) {
                    return false;
                }
                c.phase = Phase::Lingering;
            }
            Phase::Lingering if c.eof || c.linger_until.is_some_and(|t| t <= Instant::now()) => {
                c.owe_cancel(&mut self.cancels_due);
                Self::unregister(c, turns);
                if !io.close(fd, c.cookie, user_data(KIND_CLOSE, idx, c.generation)) {
                    return false;
                }
                c.phase = Phase::Closed;
            }
            _ => {}
        }
        true
    }

    /// Before closing a registered connection's descriptor: tombstone its entry, so that the
    /// GPU's lookups fail from now on (the turn, which this stage keeps, already stops it from
    /// sending).
    fn unregister(c: &mut ConnOut, turns: Option<&TxTable>) {
        if let (Some(t), Some(ti)) = (turns, c.tx.take()) {
            t.remove(ti);
        }
    }

    /// Timers: lingering connections past their deadline, replies for connections that were
    /// never accepted, and (send table) resets whose turn never comes. Call every few
    /// milliseconds.
    pub fn sweep(&mut self, now: Instant) {
        let mut drop_idx = Vec::new();
        for (idx, c) in self.conns.iter_mut() {
            if c.phase == Phase::Lingering && c.linger_until.is_some_and(|t| t <= now) {
                self.dirty.push(idx);
            }
            if let (Some(t), Some(ti), Some((seen, since))) = (&self.turns, c.tx, c.reset_wait)
                && c.phase == Phase::Open
                && c.inflight.is_none()
                && c.out.is_empty()
            {
                let turn = t.next_seq(ti);
                if turn != seen {
                    c.reset_wait = Some((turn, now));
                } else if now.saturating_duration_since(since) > RESET_GRACE {
                    // The turn has stood still at a reply nobody holds: BPF lost it (both
                    // rings full) and published the reset after it. The GPU holds nothing
                    // for this connection (it would have passed the turn), so unregister it
                    // and close, as a reset without a send table does at once.
                    t.remove(ti);
                    c.tx = None;
                    c.out.clear();
                    c.clear_parked();
                    c.eof = true;
                    c.phase = Phase::Closing;
                    self.stats.resets += 1;
                    self.stats.resets_forced += 1;
                    self.dirty.push(idx);
                }
            }
            if c.fd.is_none() && now.duration_since(c.created) > ACCEPT_GRACE {
                drop_idx.push(idx);
            }
        }
        for idx in drop_idx {
            let mut c = self.remove_conn(idx);
            self.stats.never_accepted += 1;
            // Its requests may still run in the executor.
            c.owe_cancel(&mut self.cancels_due);
            let due = &mut self.acks_due;
            c.withheld.release_all(|st, n| due.push((st, n)));
            self.recycle(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bgs_protocol::ReplyHeader;

    #[derive(Default)]
    struct Recorder {
        /// (fd, bytes, user_data) of sends.
        sends: Vec<(RawFd, Vec<u8>, u64)>,
        shutdowns: Vec<(RawFd, u64)>,
        closes: Vec<(RawFd, u64)>,
        full: bool,
        /// (fd, reply id) in the order replies went on the wire, from the stage and from the
        /// fake GPU.
        wire: Vec<(RawFd, u32)>,
        /// Host sends whose completion the test has delivered.
        acked: usize,
        /// With a send table: cookies that were still registered when their CLOSE was issued
        /// (must stay empty: tombstone first).
        turns: Option<Arc<TxTable>>,
        closed_registered: Vec<u64>,
        /// (stream, n) acknowledgements given.
        acks: Vec<(u32, u32)>,
        /// Cancel markers published (cookies).
        cancels: Vec<u64>,
        /// The request ring is full: cancel markers fail.
        requests_full: bool,
    }

    impl Recorder {
        /// Acknowledgements given to `stream`.
        fn acked(&self, stream: u32) -> u32 {
            self.acks
                .iter()
                .filter(|a| a.0 == stream)
                .map(|a| a.1)
                .sum()
        }
    }

    impl ReplyIo for Recorder {
        fn send(&mut self, fd: RawFd, ptr: *const u8, len: usize, ud: u64) -> bool {
            if self.full {
                return false;
            }
            // SAFETY: the stage guarantees the buffer is live until the CQE; we copy it now.
            let bytes = unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec();
            for id in ids(&bytes) {
                self.wire.push((fd, id));
            }
            self.sends.push((fd, bytes, ud));
            true
        }
        fn shutdown(&mut self, fd: RawFd, ud: u64) -> bool {
            self.shutdowns.push((fd, ud));
            true
        }
        fn close(&mut self, fd: RawFd, cookie: u64, ud: u64) -> bool {
            if let Some(t) = &self.turns
                && t.lookup(cookie).is_some()
            {
                self.closed_registered.push(cookie);
            }
            self.closes.push((fd, ud));
            true
        }
        fn ack_stream(&mut self, stream: u32, n: u32) {
            self.acks.push((stream, n));
        }
        fn cancel(&mut self, cookie: u64) -> bool {
            if self.requests_full {
                return false;
            }
            self.cancels.push(cookie);
            true
        }
    }

    fn completion(
        cookie: u64,
        seq: u32,
        id: u32,
        route_bits: u32,
        status: Status,
    ) -> CompletionEntry {
        let mut e = CompletionEntry::default();
        e.conn = cookie;
        e.conn_seq = seq;
        e.status = status as u16;
        e.final_ = 1;
        e.request_id = id;
        e.words = 1;
        e.payload[0] = id;
        e.route = route_bits;
        e
    }

    fn ids(bytes: &[u8]) -> Vec<u32> {
        let mut out = Vec::new();
        let mut off = 0;
        while off + 24 <= bytes.len() {
            let h = ReplyHeader::decode(&bytes[off..]);
            out.push(h.request_id);
            off += 24 + h.words as usize * 4;
        }
        out
    }

    impl ReplyStage {
        /// The O(n) definition that `busy_conns` must agree with.
        fn busy_slow(&self) -> bool {
            self.conns.iter().any(|(_, c)| c.busy()) || self.cancels_blocked
        }
    }

    #[test]
    fn busy_count_tracks_the_connections() {
        let mut st = ReplyStage::new();
        let mut io = Recorder::default();
        let check = |st: &ReplyStage| assert_eq!(st.busy(), st.busy_slow());
        st.on_completion(&completion(1, 0, 1, 0, Status::Ok));
        st.flush(&mut io);
        check(&st);
        assert!(st.busy(), "waiting for the accept");
        st.on_accept(5, 1);
        st.flush(&mut io);
        check(&st);
        assert!(st.busy(), "send in flight");
        let (_, bytes, ud) = io.sends[0].clone();
        st.on_cqe(ud, bytes.len() as i32);
        st.flush(&mut io);
        check(&st);
        assert!(!st.busy());
        let mut eof = completion(1, 1, 0, route::EOF, Status::Ok);
        eof.words = 0;
        st.on_completion(&eof);
        st.flush(&mut io);
        check(&st);
        st.on_cqe(io.closes[0].1, 0);
        check(&st);
        assert!(!st.busy());
        st.on_completion(&completion(2, 0, 1, 0, Status::Ok));
        st.flush(&mut io);
        st.sweep(Instant::now() + ACCEPT_GRACE + Duration::from_secs(1));
        check(&st);
        assert!(!st.busy());
    }

    #[test]
    fn final_frames_of_requests_are_counted_by_op_and_publish_time() {
        let m = Arc::new(RequestMetrics::default());
        let mut st = ReplyStage::new();
        st.set_metrics(m.clone());
        let mut io = Recorder::default();
        let now = monotonic_ns();
        // Out of order: the parked one is counted when it is emitted, not when it arrives.
        let mut gemm = completion(3, 1, 11, 0, Status::Ok);
        (gemm.op, gemm.publish_ns) = (bgs_protocol::Op::Gemm8 as u32, now - 2_000_000);
        st.on_completion(&gemm);
        assert!(m.snapshot().answered.is_empty(), "parked, not yet emitted");
        let mut busy = completion(3, 0, 10, 0, Status::Busy);
        (busy.op, busy.publish_ns) = (bgs_protocol::Op::Echo as u32, now);
        st.on_completion(&busy);
        // A stream: only its final frame counts.
        let mut token = completion(3, 2, 12, 0, Status::Token);
        token.final_ = 0;
        (token.op, token.publish_ns) = (bgs_protocol::Op::Generate as u32, now);
        st.on_completion(&token);
        let mut end = token.clone();
        (end.final_, end.status) = (1, Status::EndOfStream as u16);
        st.on_completion(&end);
        // A rejection the framer found and a marker: not requests.
        let mut reject = completion(3, 3, 13, 0, Status::BadParam);
        reject.op = u32::from(OP_REJECT);
        st.on_completion(&reject);
        let mut eof = completion(3, 4, 0, route::EOF, Status::Ok);
        eof.words = 0;
        st.on_completion(&eof);
        st.on_accept(9, 3);
        st.flush(&mut io);
        let snap = m.snapshot();
        let mut answered = snap.answered.clone();
        answered.sort();
        assert_eq!(
            answered,
            vec![
                (Some(0), Status::Busy as u16, 1),
                (Some(1), Status::Ok as u16, 1),
                (Some(3), Status::EndOfStream as u16, 1),
            ]
        );
        assert_eq!(snap.buckets.iter().sum::<u64>(), 3);
        assert!(snap.sum_ns >= 2_000_000, "{}", snap.sum_ns);
    }

    #[test]
    fn orders_replies_and_waits_for_accept() {
        let mut st = ReplyStage::new();
        let mut io = Recorder::default();
        for (seq, id) in [(2, 12), (0, 10), (1, 11)] {
            st.on_completion(&completion(7, seq, id, 0, Status::Ok));
        }
        st.flush(&mut io);
        assert!(io.sends.is_empty(), "no fd yet");
        st.on_accept(33, 7);
        st.flush(&mut io);
        assert_eq!(io.sends.len(), 1);
        assert_eq!(io.sends[0].0, 33);
        assert_eq!(ids(&io.sends[0].1), vec![10, 11, 12]);
        // While the send is in flight, more replies accumulate and go out after it.
        st.on_completion(&completion(7, 3, 13, 0, Status::Ok));
        st.flush(&mut io);
        assert_eq!(io.sends.len(), 1);
        let (_, bytes, ud) = io.sends[0].clone();
        st.on_cqe(ud, bytes.len() as i32);
        st.flush(&mut io);
        assert_eq!(ids(&io.sends[1].1), vec![13]);
    }

    #[test]
    fn short_send_is_continued() {
        let mut st = ReplyStage::new();
        let mut io = Recorder::default();
        st.on_accept(5, 1);
        st.on_completion(&completion(1, 0, 1, 0, Status::Ok));
        st.flush(&mut io);
        let (_, bytes, ud) = io.sends[0].clone();
        st.on_cqe(ud, 10);
        st.flush(&mut io);
        assert_eq!(io.sends[1].1, bytes[10..].to_vec());
        let ud2 = io.sends[1].2;
        st.on_cqe(ud2, (bytes.len() - 10) as i32);
        st.flush(&mut io);
        assert_eq!(io.sends.len(), 2);
        assert_eq!(st.stats().short_sends, 1);
    }

    #[test]
    fn eof_closes_after_everything_is_sent() {
        let mut st = ReplyStage::new();
        let mut io = Recorder::default();
        st.on_accept(5, 1);
        st.on_completion(&completion(1, 0, 1, 0, Status::Ok));
        let mut eof = completion(1, 1, 0, route::EOF, Status::Ok);
        eof.words = 0;
        st.on_completion(&eof);
        st.flush(&mut io);
        assert!(io.closes.is_empty(), "reply still in flight");
        let (_, bytes, ud) = io.sends[0].clone();
        st.on_cqe(ud, bytes.len() as i32);
        st.flush(&mut io);
        assert_eq!(io.closes.len(), 1);
        st.on_cqe(io.closes[0].1, 0);
        assert_eq!(st.connections(), 0);
        assert_eq!(st.stats().closed, 1);
        assert!(!st.busy());
    }

    #[test]
    fn closing_reply_shuts_down_then_closes_on_eof() {
        let mut st = ReplyStage::new();
        let mut io = Recorder::default();
        st.on_accept(5, 1);
        let bits = route::HTTP | route::CLOSE | route::NO_FRAME | (431 << route::HTTP_STATUS_SHIFT);
        let mut rej = completion(1, 0, 0, bits, Status::Ok);
        rej.words = 0;
        st.on_completion(&rej);
        st.flush(&mut io);
        let text = String::from_utf8(io.sends[0].1.clone()).unwrap();
        assert!(text.starts_with("HTTP/1.1 431 "), "{text}");
        assert!(text.contains("Content-Length: 0"));
        assert!(text.contains("Connection: close"));
        st.on_cqe(io.sends[0].2, io.sends[0].1.len() as i32);
        st.flush(&mut io);
        assert_eq!(io.shutdowns.len(), 1);
        st.on_cqe(io.shutdowns[0].1, 0);
        let mut eof = completion(1, 1, 0, route::EOF, Status::Ok);
        eof.words = 0;
        st.on_completion(&eof);
        st.flush(&mut io);
        assert_eq!(io.closes.len(), 1);
    }

    #[test]
    fn reset_drops_and_closes() {
        let mut st = ReplyStage::new();
        let mut io = Recorder::default();
        st.on_accept(5, 1);
        st.on_completion(&completion(1, 1, 2, 0, Status::Ok));
        st.on_completion(&completion(1, 5, 0, route::RESET, Status::Ok));
        st.flush(&mut io);
        assert!(io.sends.is_empty());
        assert_eq!(io.closes.len(), 1);
    }

    #[test]
    fn eof_before_accept_closes_once_accepted_and_late_markers_are_ignored() {
        let mut st = ReplyStage::new();
        let mut io = Recorder::default();
        let mut eof = completion(4, 0, 0, route::EOF, Status::Ok);
        eof.words = 0;
        st.on_completion(&eof);
        st.flush(&mut io);
        assert!(io.closes.is_empty());
        st.on_accept(8, 4);
        st.flush(&mut io);
        assert_eq!(io.closes.len(), 1);
        st.on_cqe(io.closes[0].1, 0);
        assert_eq!(st.connections(), 0);
        // The kernel's later reset marker for the same socket does not resurrect it.
        st.on_completion(&completion(4, 1, 0, route::RESET, Status::Ok));
        assert_eq!(st.connections(), 0);
    }

    #[test]
    fn full_queue_is_retried() {
        let mut st = ReplyStage::new();
        let mut io = Recorder {
            full: true,
            ..Default::default()
        };
        st.on_accept(5, 1);
        st.on_completion(&completion(1, 0, 1, 0, Status::Ok));
        st.flush(&mut io);
        assert!(io.sends.is_empty());
        io.full = false;
        st.flush(&mut io);
        assert_eq!(io.sends.len(), 1);
    }

    #[test]
    fn never_accepted_connections_are_dropped() {
        let mut st = ReplyStage::new();
        st.on_completion(&completion(9, 0, 1, 0, Status::Ok));
        st.sweep(Instant::now() + ACCEPT_GRACE + Duration::from_secs(1));
        assert_eq!(st.connections(), 0);
        assert_eq!(st.stats().never_accepted, 1);
    }

    /// A streamed frame: token `k` of stream `stream` for item `seq` (status token), or the
    /// final end-of-stream frame after `k` tokens.
    fn token(cookie: u64, seq: u32, stream: u32, k: u32, final_: bool) -> CompletionEntry {
        let mut e = completion(cookie, seq, 100 + seq, 0, Status::Token);
        e.final_ = u16::from(final_);
        if final_ {
            e.status = Status::EndOfStream as u16;
        }
        e.stream_seq = k;
        e.stream = stream;
        e.payload[0] = k;
        e
    }

    /// (request id, stream_seq) of every frame in `bytes`.
    fn seqs(bytes: &[u8]) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        let mut off = 0;
        while off + 24 <= bytes.len() {
            let h = ReplyHeader::decode(&bytes[off..]);
            out.push((h.request_id, h.seq));
            off += 24 + h.words as usize * 4;
        }
        out
    }

    fn small_limits() -> ConnLimits {
        ConnLimits {
            max_inflight: 4,
            max_unsent: 100,
        }
    }

    #[test]
    fn stream_acks_are_withheld_over_the_limit_and_released_as_sends_complete() {
        let mut st = ReplyStage::new();
        st.set_limits(small_limits());
        let mut io = Recorder::default();
        st.on_accept(5, 1);
        // Token frames are 28 bytes: 0 goes out at once; 1 and 2 stay within 100 bytes
        // unsent (SEND in flight + queued); 3 and 4 are over.
        st.on_completion(&token(1, 0, 7, 0, false));
        st.flush(&mut io);
        assert_eq!(io.sends.len(), 1);
        for k in 1..5 {
            st.on_completion(&token(1, 0, 7, k, false));
        }
        st.flush(&mut io);
        assert_eq!(io.acked(7), 3);
        assert_eq!(st.stats().acks_withheld, 2);
        // What reached the wire: the completed part of each SEND.
        let mut wire = Vec::new();
        let mut complete = |st: &mut ReplyStage, io: &mut Recorder, i: usize, short: usize| {
            let (_, b, ud) = io.sends[i].clone();
            wire.extend_from_slice(&b[..b.len() - short]);
            st.on_cqe(ud, (b.len() - short) as i32);
            st.flush(io);
        };
        // The first SEND completes: 4 frames (112 bytes) still queued, still over.
        complete(&mut st, &mut io, 0, 0);
        assert_eq!(io.acked(7), 3);
        assert_eq!(io.sends.len(), 2);
        // A short send leaves 56 bytes: within the limit again.
        complete(&mut st, &mut io, 1, 56);
        assert_eq!(io.acked(7), 5);
        // The final frame is acknowledged at once, whatever is unsent.
        st.on_completion(&token(1, 0, 7, 5, true));
        st.flush(&mut io);
        assert_eq!(io.acked(7), 6);
        complete(&mut st, &mut io, 2, 0);
        complete(&mut st, &mut io, 3, 0);
        assert_eq!(io.sends.len(), 4);
        assert_eq!(seqs(&wire), (0..6).map(|k| (100, k)).collect::<Vec<_>>());
        assert_eq!(st.stats().acks, 6);
        assert!(io.cancels.is_empty(), "the connection is still open");
    }

    #[test]
    fn a_later_stream_is_held_within_the_limits_while_the_front_streams() {
        let mut st = ReplyStage::new();
        st.set_limits(small_limits());
        let mut io = Recorder::default();
        st.on_accept(5, 1);
        // Item 1 streams while item 0 is still running: its frames are parked and
        // acknowledged while the connection's bytes stay within the limit.
        for k in 0..5 {
            st.on_completion(&token(1, 1, 8, k, false));
        }
        st.flush(&mut io);
        assert!(io.sends.is_empty());
        assert_eq!(
            io.acked(8),
            3,
            "3 × 28 bytes parked fit in 100, the 4th does not"
        );
        // The front item still gets its credit: it is judged by the bytes queued for the wire.
        st.on_completion(&token(1, 0, 7, 0, false));
        st.flush(&mut io);
        assert_eq!(io.acked(7), 1);
        assert_eq!(io.acked(8), 3);
        // Items 4 or more ahead get no credit at all.
        st.on_completion(&token(1, 4, 9, 0, false));
        st.flush(&mut io);
        assert_eq!(io.acked(9), 0);
        // Item 0 ends: 1 becomes the front, its parked frames join the queue behind the SEND.
        st.on_completion(&token(1, 0, 7, 1, true));
        let (_, b, ud) = io.sends[0].clone();
        st.on_cqe(ud, b.len() as i32);
        st.flush(&mut io);
        let (_, b, ud) = io.sends[1].clone();
        st.on_cqe(ud, b.len() as i32);
        st.flush(&mut io);
        assert_eq!(io.acked(8), 5, "written out: released");
        assert_eq!(io.acked(9), 1, "item 4 is 3 ahead of the front now");
        // Item 5 is 4 ahead: held back until the connection resets.
        st.on_completion(&token(1, 5, 10, 0, false));
        st.flush(&mut io);
        assert_eq!(io.acked(10), 0);
        let wire: Vec<(u32, u32)> = io.sends.iter().flat_map(|s| seqs(&s.1)).collect();
        let mut want = vec![(100, 0), (100, 1)];
        want.extend((0..5).map(|k| (101, k)));
        assert_eq!(wire, want);
        // The connection resets: everything held back is given, and one cancel goes out.
        st.on_completion(&marker_at(1, 9, route::RESET));
        st.flush(&mut io);
        assert_eq!(io.acked(10), 1);
        assert_eq!(io.cancels, vec![1]);
        let acks: u32 = io.acks.iter().map(|a| a.1).sum();
        assert_eq!(
            acks,
            2 + 5 + 1 + 1,
            "every streamed completion acknowledged once"
        );
        assert_eq!(st.stats().acks, 9);
    }

    fn marker_at(cookie: u64, seq: u32, bits: u32) -> CompletionEntry {
        let mut e = completion(cookie, seq, 0, bits, Status::Ok);
        e.words = 0;
        e
    }

    #[test]
    fn eof_cancels_at_once_and_the_stream_still_ends_in_order() {
        let mut st = ReplyStage::new();
        let mut io = Recorder::default();
        st.on_accept(5, 1);
        st.on_completion(&token(1, 0, 3, 0, false));
        // The peer's FIN: the marker takes conn_seq 1, behind the running stream, but the
        // cancel goes out now (the stream would otherwise run to its end).
        st.on_completion(&marker_at(1, 1, route::EOF));
        st.flush(&mut io);
        assert_eq!(io.cancels, vec![1]);
        assert!(io.closes.is_empty());
        // The executor ends the stream with a cancelled final frame; then the connection
        // closes, without a second marker.
        let mut fin = token(1, 0, 3, 1, true);
        fin.status = Status::Cancelled as u16;
        st.on_completion(&fin);
        st.flush(&mut io);
        let mut i = 0;
        while i < io.sends.len() {
            let (_, b, ud) = io.sends[i].clone();
            st.on_cqe(ud, b.len() as i32);
            st.flush(&mut io);
            i += 1;
        }
        let wire: Vec<(u32, u32)> = io.sends.iter().flat_map(|s| seqs(&s.1)).collect();
        assert_eq!(wire, vec![(100, 0), (100, 1)]);
        assert_eq!(io.closes.len(), 1);
        st.on_cqe(io.closes[0].1, 0);
        st.flush(&mut io);
        assert_eq!(io.cancels, vec![1]);
        assert_eq!(io.acked(3), 2);
        // A late completion for the closed connection is dropped and acknowledged.
        st.on_completion(&token(1, 0, 3, 2, false));
        st.flush(&mut io);
        assert_eq!(io.acked(3), 3);
        assert_eq!(io.cancels, vec![1]);
    }

    #[test]
    fn every_way_a_connection_ends_publishes_one_cancel() {
        let mut st = ReplyStage::new();
        let mut io = Recorder::default();
        // 1: reset before anything; 2: a send error; 3: a closing reply; 4: never accepted.
        st.on_accept(5, 1);
        st.on_completion(&marker_at(1, 0, route::RESET));
        st.on_accept(6, 2);
        st.on_completion(&completion(2, 0, 1, 0, Status::Ok));
        st.on_accept(7, 3);
        st.on_completion(&completion(3, 0, 1, route::CLOSE, Status::BadMagic));
        st.on_completion(&token(4, 0, 9, 0, false));
        st.flush(&mut io);
        let sends = io.sends.clone();
        for (fd, b, ud) in sends {
            st.on_cqe(ud, if fd == 6 { -32 } else { b.len() as i32 });
        }
        st.flush(&mut io);
        st.on_cqe(io.shutdowns[0].1, 0);
        st.on_completion(&marker_at(3, 1, route::EOF));
        st.flush(&mut io);
        st.sweep(Instant::now() + ACCEPT_GRACE + Duration::from_secs(1));
        st.flush(&mut io);
        for &(_, ud) in &io.closes.clone() {
            st.on_cqe(ud, 0);
        }
        st.on_completion(&marker_at(2, 1, route::RESET));
        st.flush(&mut io);
        let mut cancels = io.cancels.clone();
        cancels.sort_unstable();
        assert_eq!(cancels, vec![1, 2, 3, 4]);
        assert_eq!(
            io.acked(9),
            1,
            "the unaccepted connection's frame was dropped"
        );
        assert_eq!(st.stats().cancels, 4);
    }

    #[test]
    fn a_connection_far_over_its_limits_is_aborted() {
        let mut st = ReplyStage::new();
        let limits = ConnLimits {
            max_inflight: 2,
            max_unsent: 100,
        };
        st.set_limits(limits);
        let mut io = Recorder::default();
        st.on_accept(5, 1);
        // One-shot replies of 824 bytes, in order, while the client reads nothing: the first
        // SEND never completes and the rest queue behind it.
        let big = |seq: u32| {
            let mut e = completion(1, seq, seq, 0, Status::Ok);
            e.words = 200;
            e
        };
        let mut seq = 0;
        while st.stats().overflow_aborts == 0 {
            st.on_completion(&big(seq));
            st.flush(&mut io);
            seq += 1;
            assert!(seq < 10, "never aborted");
        }
        assert_eq!(seq as usize, overflow_bound(&limits) / 824 + 1);
        assert_eq!(io.sends.len(), 1);
        assert_eq!(io.shutdowns.len(), 1, "shut down to fail the stalled SEND");
        assert_eq!(io.cancels, vec![1]);
        // Later replies are dropped; the failed SEND lets the connection close.
        st.on_completion(&big(seq));
        st.on_cqe(io.sends[0].2, -32);
        st.flush(&mut io);
        assert_eq!(io.closes.len(), 1);
        assert_eq!(io.sends.len(), 1);
        st.on_cqe(io.shutdowns[0].1, 0);
        st.on_cqe(io.closes[0].1, 0);
        assert_eq!(st.connections(), 0);
        assert_eq!(io.cancels, vec![1]);
    }

    #[test]
    fn cancel_markers_can_be_turned_off() {
        let mut st = ReplyStage::new();
        st.set_cancel_markers(false);
        let mut io = Recorder {
            requests_full: true,
            ..Default::default()
        };
        st.on_accept(5, 1);
        st.on_completion(&marker_at(1, 0, route::EOF));
        st.flush(&mut io);
        assert_eq!(io.closes.len(), 1);
        st.on_cqe(io.closes[0].1, 0);
        st.flush(&mut io);
        assert!(
            !st.busy(),
            "nothing owed, although the request ring is full"
        );
        io.requests_full = false;
        st.flush(&mut io);
        assert!(io.cancels.is_empty());
        assert_eq!(st.stats().cancels, 0);
    }

    #[test]
    fn a_full_request_ring_defers_the_cancel() {
        let mut st = ReplyStage::new();
        let mut io = Recorder {
            requests_full: true,
            ..Default::default()
        };
        st.on_accept(5, 1);
        st.on_completion(&marker_at(1, 0, route::EOF));
        st.flush(&mut io);
        assert!(io.cancels.is_empty());
        assert!(st.busy(), "owes a cancel: poll soon");
        st.flush(&mut io);
        io.requests_full = false;
        st.flush(&mut io);
        assert_eq!(io.cancels, vec![1]);
        assert!(st.stats().cancels_deferred >= 1);
        assert_eq!(st.stats().cancels, 1);
        for &(_, ud) in &io.closes.clone() {
            st.on_cqe(ud, 0);
        }
        st.flush(&mut io);
        assert!(!st.busy());
        assert_eq!(io.cancels, vec![1]);
    }

    /// The send table and a test standing in for the GPU (crates/ring/src/tx.rs, and the
    /// GPU's rules in docs/kernel.md): it sends a finished reply itself when the connection
    /// is registered, the reply is a plain binary one, and the turn names it; otherwise it
    /// hands the completion to the stage. Its reaper passes the turn when a SEND completes.
    mod turns {
        use super::*;
        use bgs_ring::tx::{TX_ENTRY_BYTES, TX_HEADER_BYTES, TxEntry, tx_probe};

        struct FakeGpu {
            t: Arc<TxTable>,
            /// (entry, conn_seq) of SENDs queued and not reaped yet.
            inflight: Vec<(u32, u32)>,
            sent: usize,
        }

        impl FakeGpu {
            fn new(t: &Arc<TxTable>) -> Self {
                FakeGpu {
                    t: t.clone(),
                    inflight: Vec::new(),
                    sent: 0,
                }
            }

            /// The GPU finished request `seq` of `cookie`: send the reply (id `id`) or give
            /// the stage its completion.
            fn finish(
                &mut self,
                st: &mut ReplyStage,
                io: &mut Recorder,
                cookie: u64,
                seq: u32,
                id: u32,
                route_bits: u32,
            ) {
                let host_only =
                    route::HTTP | route::CLOSE | route::NO_FRAME | route::EOF | route::RESET;
                if route_bits & host_only == 0
                    && let Some(i) = self.t.lookup(cookie)
                    && self.t.next_seq(i) == seq
                {
                    let fd = entry_fd(&self.t, i);
                    assert!(
                        !io.closes.iter().any(|&(f, _)| f == fd),
                        "the GPU found a closed descriptor"
                    );
                    io.wire.push((fd, id));
                    self.inflight.push((i, seq));
                    self.sent += 1;
                } else {
                    st.on_completion(&completion(cookie, seq, id, route_bits, Status::Ok));
                }
            }

            /// The reaper: every queued SEND completed; pass each turn on.
            fn reap(&mut self) {
                for (i, seq) in self.inflight.drain(..) {
                    self.t.pass_turn(i, seq.wrapping_add(1));
                }
            }
        }

        fn entry_fd(t: &TxTable, i: u32) -> RawFd {
            assert!(i < t.capacity());
            let off = TX_HEADER_BYTES + i as usize * TX_ENTRY_BYTES;
            // SAFETY: entry `i` lies inside the table's mapping; this thread is the only one
            // that writes the table.
            unsafe {
                std::ptr::read_volatile(&raw const (*t.as_ptr().add(off).cast::<TxEntry>()).fd)
            }
        }

        fn setup() -> (Arc<TxTable>, ReplyStage, Recorder, FakeGpu) {
            let t = Arc::new(TxTable::new(16).unwrap());
            let st = ReplyStage::with_turns(t.clone());
            let io = Recorder {
                turns: Some(t.clone()),
                ..Default::default()
            };
            let gpu = FakeGpu::new(&t);
            (t, st, io, gpu)
        }

        /// Flush and check the busy count against its definition.
        fn flush(st: &mut ReplyStage, io: &mut Recorder) {
            st.flush(io);
            assert_eq!(st.busy(), st.busy_slow());
        }

        /// Deliver the completions of every host SEND issued so far (all bytes sent).
        fn ack(st: &mut ReplyStage, io: &mut Recorder) {
            while io.acked < io.sends.len() {
                let (_, bytes, ud) = io.sends[io.acked].clone();
                io.acked += 1;
                st.on_cqe(ud, bytes.len() as i32);
            }
        }

        fn wire(io: &Recorder, fd: RawFd) -> Vec<u32> {
            io.wire
                .iter()
                .filter(|&&(f, _)| f == fd)
                .map(|&(_, id)| id)
                .collect()
        }

        fn marker(cookie: u64, seq: u32, bits: u32) -> CompletionEntry {
            let mut e = completion(cookie, seq, 0, bits, Status::Ok);
            e.words = 0;
            e
        }

        #[test]
        fn gpu_and_host_sends_interleave_in_order() {
            let (t, mut st, mut io, mut gpu) = setup();
            st.on_accept(5, 1);
            flush(&mut st, &mut io);
            let i = t.lookup(1).expect("registered at accept");
            assert_eq!(t.next_seq(i), 0);
            assert_eq!(entry_fd(&t, i), 5);
            // 0: the GPU holds the turn and sends.
            gpu.finish(&mut st, &mut io, 1, 0, 100, 0);
            // 2 finishes while the GPU's SEND of 0 is in flight: not its turn, so the host
            // gets it and must hold it.
            gpu.finish(&mut st, &mut io, 1, 2, 102, 0);
            flush(&mut st, &mut io);
            assert!(io.sends.is_empty(), "the host holds 2 until 1 is sent");
            assert!(st.busy(), "waiting for the GPU to pass the turn");
            gpu.reap();
            // 1 is a busy answer from BPF (the side ring): the host's.
            st.on_completion(&completion(1, 1, 101, 0, Status::Busy));
            flush(&mut st, &mut io);
            assert_eq!(io.sends.len(), 1);
            assert_eq!(ids(&io.sends[0].1), vec![101, 102]);
            assert_eq!(st.stats().gpu_sent_skipped, 1);
            // 3 finishes while the host's SEND is in flight: the host holds the turn.
            gpu.finish(&mut st, &mut io, 1, 3, 103, 0);
            flush(&mut st, &mut io);
            assert_eq!(io.sends.len(), 1, "one SEND in flight per connection");
            ack(&mut st, &mut io);
            assert_eq!(t.next_seq(i), 3, "the host passed the turn after 2");
            flush(&mut st, &mut io);
            assert_eq!(ids(&io.sends[1].1), vec![103]);
            ack(&mut st, &mut io);
            assert_eq!(t.next_seq(i), 4);
            flush(&mut st, &mut io);
            assert!(!st.busy());
            // 4 and 5: the GPU again; then 6 while its SEND of 5 is in flight: the host's.
            gpu.finish(&mut st, &mut io, 1, 4, 104, 0);
            gpu.reap();
            gpu.finish(&mut st, &mut io, 1, 5, 105, 0);
            gpu.finish(&mut st, &mut io, 1, 6, 106, 0);
            flush(&mut st, &mut io);
            assert_eq!(io.sends.len(), 2, "6 waits for the GPU's 5");
            gpu.reap();
            flush(&mut st, &mut io);
            assert_eq!(ids(&io.sends[2].1), vec![106]);
            ack(&mut st, &mut io);
            flush(&mut st, &mut io);
            assert_eq!(wire(&io, 5), (100..=106).collect::<Vec<_>>());
            assert_eq!(gpu.sent, 3);
            assert_eq!(st.stats().gpu_sent_skipped, 3);
            assert_eq!(st.stats().turn_passes, 3);
            assert_eq!(st.stats().behind_turn, 0);
            assert_eq!(t.next_seq(i), 7);
            assert!(!st.busy());
        }

        #[test]
        fn backlog_before_accept_registers_the_first_unsent_reply() {
            let (t, mut st, mut io, mut gpu) = setup();
            // Not registered yet: the GPU's lookup fails and the host gets everything.
            gpu.finish(&mut st, &mut io, 1, 0, 100, 0);
            gpu.finish(&mut st, &mut io, 1, 1, 101, 0);
            flush(&mut st, &mut io);
            assert_eq!(gpu.sent, 0);
            st.on_accept(5, 1);
            let i = t.lookup(1).unwrap();
            assert_eq!(t.next_seq(i), 0, "0 and 1 are unsent: the turn starts at 0");
            // 2 finishes before the host sent its backlog: not the GPU's turn.
            gpu.finish(&mut st, &mut io, 1, 2, 102, 0);
            flush(&mut st, &mut io);
            assert_eq!(ids(&io.sends[0].1), vec![100, 101, 102]);
            ack(&mut st, &mut io);
            assert_eq!(t.next_seq(i), 3);
            gpu.finish(&mut st, &mut io, 1, 3, 103, 0);
            assert_eq!(gpu.sent, 1);
            assert_eq!(wire(&io, 5), vec![100, 101, 102, 103]);

            // A backlog with a gap: only 1 arrived before the accept, so the turn starts at 0
            // and the GPU may send 0 itself.
            st.on_completion(&completion(2, 1, 201, 0, Status::Busy));
            flush(&mut st, &mut io);
            st.on_accept(6, 2);
            let j = t.lookup(2).unwrap();
            assert_eq!(t.next_seq(j), 0);
            flush(&mut st, &mut io);
            gpu.finish(&mut st, &mut io, 2, 0, 200, 0);
            flush(&mut st, &mut io);
            assert!(wire(&io, 6) == vec![200], "1 waits for the GPU's 0");
            gpu.reap();
            flush(&mut st, &mut io);
            assert_eq!(wire(&io, 6), vec![200, 201]);
        }

        #[test]
        fn eof_after_gpu_sends_closes_when_the_turn_reaches_it() {
            let (t, mut st, mut io, mut gpu) = setup();
            st.on_accept(5, 1);
            gpu.finish(&mut st, &mut io, 1, 0, 100, 0);
            gpu.reap();
            gpu.finish(&mut st, &mut io, 1, 1, 101, 0);
            // The peer's FIN: BPF's marker takes the next conn_seq.
            st.on_completion(&marker(1, 2, route::EOF));
            flush(&mut st, &mut io);
            assert!(
                io.closes.is_empty(),
                "the GPU's SEND of 1 is still in flight"
            );
            assert!(t.lookup(1).is_some());
            assert!(st.busy());
            gpu.reap();
            flush(&mut st, &mut io);
            assert_eq!(io.closes.len(), 1);
            assert!(
                io.closed_registered.is_empty(),
                "tombstoned before the CLOSE"
            );
            assert_eq!(t.lookup(1), None);
            st.on_cqe(io.closes[0].1, 0);
            assert_eq!(st.connections(), 0);
            assert_eq!(st.stats().eof, 1);
            assert_eq!(wire(&io, 5), vec![100, 101]);
            assert!(io.sends.is_empty());
            assert!(!st.busy());
        }

        #[test]
        fn reset_waits_while_the_gpu_holds_earlier_replies() {
            let (t, mut st, mut io, mut gpu) = setup();
            st.on_accept(5, 1);
            gpu.finish(&mut st, &mut io, 1, 0, 100, 0);
            // 1 is the host's (busy), 2 the reset marker.
            st.on_completion(&completion(1, 1, 101, 0, Status::Busy));
            st.on_completion(&marker(1, 2, route::RESET));
            for _ in 0..3 {
                flush(&mut st, &mut io);
            }
            assert!(
                io.closes.is_empty(),
                "the GPU may still write a SEND on fd 5"
            );
            assert!(io.sends.is_empty());
            assert_eq!(st.stats().resets, 0, "not handled before its turn");
            assert!(t.lookup(1).is_some());
            // A reset that arrives before its turn does not drop the connection's state.
            assert_eq!(st.connections(), 1);
            gpu.reap();
            flush(&mut st, &mut io);
            assert_eq!(io.closes.len(), 1);
            assert!(io.closed_registered.is_empty());
            assert!(io.sends.is_empty(), "the peer is gone: 1 is dropped");
            assert_eq!(st.stats().resets, 1);
            st.on_cqe(io.closes[0].1, 0);
            assert_eq!(st.connections(), 0);
            // A late reply finds no entry and is stale.
            gpu.finish(&mut st, &mut io, 1, 3, 103, 0);
            assert_eq!(gpu.sent, 1);
        }

        #[test]
        fn reset_waits_for_the_host_send_in_flight() {
            let (t, mut st, mut io, _gpu) = setup();
            st.on_accept(5, 1);
            st.on_completion(&completion(1, 0, 100, 0, Status::Busy));
            flush(&mut st, &mut io);
            assert_eq!(io.sends.len(), 1);
            st.on_completion(&marker(1, 1, route::RESET));
            flush(&mut st, &mut io);
            assert!(io.closes.is_empty(), "the host's SEND is still in flight");
            ack(&mut st, &mut io);
            flush(&mut st, &mut io);
            assert_eq!(io.closes.len(), 1);
            assert!(io.closed_registered.is_empty());
            let _ = t;
        }

        #[test]
        fn send_error_keeps_the_turn_and_closes() {
            let (t, mut st, mut io, mut gpu) = setup();
            st.on_accept(5, 1);
            let i = t.lookup(1).unwrap();
            st.on_completion(&completion(1, 0, 100, 0, Status::Busy));
            flush(&mut st, &mut io);
            // 1 finishes on the GPU while the host's SEND of 0 is in flight.
            gpu.finish(&mut st, &mut io, 1, 1, 101, 0);
            st.on_cqe(io.sends[0].2, -32); // EPIPE
            assert_eq!(t.next_seq(i), 0, "the turn stays with the host");
            gpu.finish(&mut st, &mut io, 1, 2, 102, 0);
            assert_eq!(gpu.sent, 0);
            flush(&mut st, &mut io);
            assert_eq!(io.closes.len(), 1);
            assert!(io.closed_registered.is_empty());
            assert_eq!(t.next_seq(i), 0);
            assert_eq!(st.stats().turn_passes, 0);
            st.on_cqe(io.closes[0].1, 0);
            gpu.finish(&mut st, &mut io, 1, 3, 103, 0);
            assert_eq!(gpu.sent, 0);
            assert_eq!(io.sends.len(), 1);
        }

        #[test]
        fn closing_reply_keeps_the_turn() {
            let (t, mut st, mut io, mut gpu) = setup();
            st.on_accept(5, 1);
            let i = t.lookup(1).unwrap();
            gpu.finish(&mut st, &mut io, 1, 0, 100, 0);
            gpu.reap();
            // An HTTP request with `Connection: close`: the GPU hands it to the host.
            gpu.finish(&mut st, &mut io, 1, 1, 101, route::HTTP | route::CLOSE);
            flush(&mut st, &mut io);
            assert_eq!(io.sends.len(), 1);
            ack(&mut st, &mut io);
            assert_eq!(
                t.next_seq(i),
                1,
                "the closing reply's SEND does not pass the turn"
            );
            flush(&mut st, &mut io);
            assert_eq!(io.shutdowns.len(), 1);
            st.on_cqe(io.shutdowns[0].1, 0);
            // Nothing can take the turn: a (hypothetical) later reply is handed over.
            gpu.finish(&mut st, &mut io, 1, 2, 102, 0);
            assert_eq!(gpu.sent, 1);
            st.on_completion(&marker(1, 3, route::EOF));
            flush(&mut st, &mut io);
            assert_eq!(io.closes.len(), 1);
            assert!(io.closed_registered.is_empty());
            assert_eq!(st.stats().turn_passes, 0);
        }

        #[test]
        fn closing_item_behind_a_send_in_flight_is_sent_without_passing_the_turn() {
            let (t, mut st, mut io, _gpu) = setup();
            st.on_accept(5, 1);
            let i = t.lookup(1).unwrap();
            st.on_completion(&completion(1, 0, 100, 0, Status::Busy));
            flush(&mut st, &mut io);
            // A closing error reply while 0 is in flight.
            st.on_completion(&completion(1, 1, 101, route::CLOSE, Status::Busy));
            flush(&mut st, &mut io);
            ack(&mut st, &mut io);
            assert_eq!(t.next_seq(i), 0, "ending: the turn stays with the host");
            flush(&mut st, &mut io);
            assert_eq!(
                io.sends.len(),
                2,
                "the host still holds the turn and sends 1"
            );
            assert_eq!(ids(&io.sends[1].1), vec![101]);
            ack(&mut st, &mut io);
            flush(&mut st, &mut io);
            assert_eq!(t.next_seq(i), 0);
            assert_eq!(io.shutdowns.len(), 1);
        }

        #[test]
        fn refused_insert_leaves_a_host_only_connection() {
            let (t, mut st, mut io, mut gpu) = setup();
            // Fill the cookie's probe window with other connections.
            let log2 = t.capacity().trailing_zeros();
            let home = tx_probe(1, log2, 0);
            let others: Vec<u64> = (2u64..)
                .filter(|&c| tx_probe(c, log2, 0) == home)
                .take(bgs_ring::tx::TX_PROBES as usize)
                .collect();
            for &c in &others {
                t.insert(c, 99, 0).unwrap();
            }
            st.on_accept(5, 1);
            assert_eq!(st.stats().tx_refused, 1);
            assert_eq!(t.lookup(1), None);
            gpu.finish(&mut st, &mut io, 1, 0, 100, 0);
            gpu.finish(&mut st, &mut io, 1, 1, 101, 0);
            flush(&mut st, &mut io);
            assert_eq!(gpu.sent, 0);
            assert_eq!(ids(&io.sends[0].1), vec![100, 101]);
            ack(&mut st, &mut io);
            flush(&mut st, &mut io);
            assert!(!st.busy());
            // A reset is handled at once, as without a send table.
            gpu.finish(&mut st, &mut io, 1, 2, 102, 0);
            st.on_completion(&marker(1, 9, route::RESET));
            flush(&mut st, &mut io);
            assert_eq!(io.closes.len(), 1);
            assert_eq!(io.sends.len(), 1);
            assert_eq!(st.stats().turn_passes, 0);
            for &c in &others {
                assert_eq!(
                    t.next_seq(t.lookup(c).unwrap()),
                    0,
                    "other entries untouched"
                );
            }
        }

        #[test]
        fn reset_whose_turn_never_comes_is_forced_after_the_grace() {
            let (t, mut st, mut io, mut gpu) = setup();
            st.on_accept(5, 1);
            gpu.finish(&mut st, &mut io, 1, 0, 100, 0);
            gpu.reap();
            // BPF lost 1 (both rings full), then published the reset as 2.
            st.on_completion(&marker(1, 2, route::RESET));
            flush(&mut st, &mut io);
            let t0 = Instant::now();
            st.sweep(t0 + Duration::from_secs(1));
            flush(&mut st, &mut io);
            assert!(io.closes.is_empty());
            st.sweep(t0 + RESET_GRACE + Duration::from_secs(2));
            flush(&mut st, &mut io);
            assert_eq!(io.closes.len(), 1);
            assert!(io.closed_registered.is_empty());
            assert_eq!(st.stats().resets_forced, 1);
            assert_eq!(t.lookup(1), None);
        }

        #[test]
        fn a_moving_turn_restarts_the_reset_grace() {
            let (_t, mut st, mut io, mut gpu) = setup();
            st.on_accept(5, 1);
            gpu.finish(&mut st, &mut io, 1, 0, 100, 0);
            st.on_completion(&marker(1, 2, route::RESET));
            flush(&mut st, &mut io);
            let t0 = Instant::now();
            gpu.reap(); // the turn moves to 1 (the GPU is computing 1)
            st.sweep(t0 + RESET_GRACE + Duration::from_secs(1));
            flush(&mut st, &mut io);
            assert!(io.closes.is_empty(), "the turn moved: not lost");
            gpu.finish(&mut st, &mut io, 1, 1, 101, 0);
            gpu.reap();
            flush(&mut st, &mut io);
            assert_eq!(io.closes.len(), 1);
            assert_eq!(st.stats().resets_forced, 0);
            assert_eq!(wire(&io, 5), vec![100, 101]);
        }

        #[test]
        fn parked_items_behind_the_turn_are_counted_and_dropped() {
            let (t, mut st, mut io, _gpu) = setup();
            st.on_accept(5, 1);
            let i = t.lookup(1).unwrap();
            st.on_completion(&completion(1, 1, 101, 0, Status::Busy));
            flush(&mut st, &mut io);
            // A broken GPU that skips past an item the host holds.
            t.pass_turn(i, 3);
            st.on_completion(&completion(1, 3, 103, 0, Status::Busy));
            flush(&mut st, &mut io);
            assert_eq!(st.stats().behind_turn, 1);
            assert_eq!(wire(&io, 5), vec![103]);
        }

        #[test]
        fn host_does_not_send_without_the_turn() {
            // Defensive check: the turn names an earlier reply (only a misbehaving GPU could
            // leave it there while the host holds later ones); the host waits.
            let (t, mut st, mut io, _gpu) = setup();
            st.on_completion(&completion(1, 0, 100, 0, Status::Busy));
            st.on_accept(5, 1);
            let i = t.lookup(1).unwrap();
            t.pass_turn(i, u32::MAX);
            flush(&mut st, &mut io);
            flush(&mut st, &mut io);
            assert!(io.sends.is_empty());
            assert!(st.stats().turn_waits >= 2);
            assert!(st.busy());
            t.pass_turn(i, 0);
            flush(&mut st, &mut io);
            assert_eq!(wire(&io, 5), vec![100]);
        }

        #[test]
        fn streams_are_host_sent_and_keep_the_turn_until_their_final_frame() {
            let (t, mut st, mut io, mut gpu) = setup();
            st.on_accept(5, 1);
            let i = t.lookup(1).unwrap();
            // 0 is a one-shot reply the GPU sends; 1 streams (the GPU hands every frame
            // over, `stream != 0`), and 2 finishes on the GPU while 1 streams.
            gpu.finish(&mut st, &mut io, 1, 0, 100, 0);
            st.on_completion(&token(1, 1, 4, 0, false));
            flush(&mut st, &mut io);
            assert!(io.sends.is_empty(), "the GPU's SEND of 0 is in flight");
            gpu.reap();
            flush(&mut st, &mut io);
            assert_eq!(io.sends.len(), 1);
            ack(&mut st, &mut io);
            assert_eq!(
                t.next_seq(i),
                1,
                "a SEND without the final frame keeps the turn at 1"
            );
            gpu.finish(&mut st, &mut io, 1, 2, 102, 0);
            assert_eq!(gpu.sent, 1, "not the GPU's turn: 2 goes to the stage");
            st.on_completion(&token(1, 1, 4, 1, false));
            st.on_completion(&token(1, 1, 4, 2, true));
            flush(&mut st, &mut io);
            ack(&mut st, &mut io);
            assert_eq!(t.next_seq(i), 3, "passed after the final frame and 2");
            gpu.finish(&mut st, &mut io, 1, 3, 103, 0);
            assert_eq!(gpu.sent, 2, "3 is the GPU's again");
            gpu.reap();
            flush(&mut st, &mut io);
            let host: Vec<(u32, u32)> = io.sends.iter().flat_map(|s| seqs(&s.1)).collect();
            assert_eq!(host, vec![(101, 0), (101, 1), (101, 2), (102, 0)]);
            assert_eq!(wire(&io, 5), vec![100, 101, 101, 101, 102, 103]);
            assert_eq!(io.acked(4), 3);
            assert_eq!(st.stats().behind_turn, 0);
            assert!(!st.busy());
        }

        #[test]
        fn without_a_table_nothing_changes() {
            // The same sequence on a host-only stage: a reset closes at once.
            let mut st = ReplyStage::new();
            let mut io = Recorder::default();
            st.on_accept(5, 1);
            st.on_completion(&completion(1, 1, 101, 0, Status::Busy));
            st.on_completion(&marker(1, 2, route::RESET));
            st.flush(&mut io);
            assert_eq!(io.closes.len(), 1);
            assert_eq!(st.stats().tx_registered, 0);
        }

        #[test]
        fn a_connection_that_ended_before_its_accept_is_never_registered() {
            // BPF's reset marker overtakes the accept (a client that resets at once): the
            // stage answers and closes it alone and counts it, so that registered + ended
            // first + refused covers every accepted connection.
            let (t, mut st, mut io, _gpu) = setup();
            st.on_completion(&completion(1, 0, 100, 0, Status::Busy));
            st.on_completion(&marker(1, 1, route::RESET));
            st.on_accept(5, 1);
            flush(&mut st, &mut io);
            assert_eq!(t.lookup(1), None, "no turn for an ended connection");
            let s = st.stats();
            assert_eq!((s.tx_registered, s.tx_ended_first, s.tx_refused), (0, 1, 0));
            assert_eq!(io.closes.len(), 1);
            st.on_accept(6, 2);
            assert_eq!(st.stats().tx_registered, 1, "an open one still registers");
        }
    }
}
