//! The native transport: one thread, timed epoll, nonblocking reads and writes.
//!
//! Each loop iteration: wait in `epoll_wait` (indefinitely when no request is outstanding;
//! otherwise at most `poll_interval`, and the executor can cut the wait short through an
//! eventfd when it sees the transport asleep), read readable connections and publish the
//! requests they frame, notify the executor once per batch, reap the completion ring, and
//! write replies. A GPU executor cannot write an eventfd itself: either the timed wait bounds
//! its completion latency, or its completion notifier calls [`NativeTransport::waker`] like
//! the CPU executor does, and `wake_timeout` replaces `poll_interval` as a safety net.
//!
//! Streams ([`crate::credit`]): every streamed completion is acknowledged once it is encoded
//! (or dropped), but held back while its connection is over `max_unsent`, and released as
//! writes drain. When a connection ends (EOF, an error or reset, or closed by the server) this
//! thread publishes its `OP_CANCEL` marker; a marker that finds the request ring full waits in
//! a queue that every loop iteration retries.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bgs_protocol::{FramerConfig, Request, Status};
use bgs_ring::{RingRegion, SLOT_WORDS};
use rustix::event::epoll;
use rustix::event::{EventfdFlags, Timespec, eventfd};
use rustix::net::SocketFlags;
use slab::Slab;

use crate::conn::{ConnLimits, ConnState, RequestSink, Submit};
use crate::credit::{Withheld, ack, publish_cancel};
use crate::pace::CompletionPacer;
use crate::stats::{RequestMetrics, TransportStats};

const LISTENER: u64 = u64::MAX;
const DOORBELL: u64 = u64::MAX - 1;
const SHUTDOWN: u64 = u64::MAX - 2;

/// Settings of the native transport.
#[derive(Debug, Clone)]
pub struct NativeConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Most connections open at once; further connections are accepted and closed.
    pub max_connections: usize,
    /// Per-connection limits (in-flight requests, unsent reply bytes).
    pub limits: ConnLimits,
    /// Framing limits.
    pub framer: FramerConfig,
    /// Longest epoll wait while requests are outstanding.
    pub poll_interval: Duration,
    /// The executor rings [`NativeTransport::waker`] for every completion it publishes while
    /// this transport sleeps (the CPU executor, or the GPU executor's completion notifier):
    /// wait at most this long while requests are outstanding instead of `poll_interval`. A
    /// safety net only; [`TransportStats::wake_timeouts`] counts how often it ends a wait.
    pub wake_timeout: Option<Duration>,
    /// Floor mode: answer echo directly, without ring or executor.
    pub floor: bool,
    /// How long shutdown waits for outstanding replies.
    pub drain_timeout: Duration,
    /// Print the counters to stderr this often (None: only at shutdown).
    pub stats_every: Option<Duration>,
    /// Publish an `OP_CANCEL` marker when a connection ends. Only for executors that consume
    /// them: one that does not know the op answers it like a request (the GPU executor, which
    /// has no streams to cancel, does so today).
    pub cancel_markers: bool,
    /// Hold a connection's streamed token frames up to this long, so that the frames of
    /// several steps leave in one write (zero: write at once, the default). A stream's first
    /// token, the frame that ends it, a one-shot reply and an error are never held, and they
    /// flush what waits before them. Trades token latency (at most this much) for the
    /// per-write cost of TCP, which on loopback includes the client's receive processing
    /// (docs/cost.md, "Streams").
    pub stream_coalesce: Duration,
    /// The executor cannot wake the transport (the one-shot GPU executor in poll mode): while
    /// requests are outstanding, look for completions when each is expected, learned from the
    /// completions, instead of every `poll_interval` (`crate::pace`). `poll_interval` stays
    /// the longest wait.
    pub pace_completions: bool,
}

impl Default for NativeConfig {
    fn default() -> Self {
        NativeConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7700)),
            max_connections: 4096,
            limits: ConnLimits::default(),
            framer: FramerConfig::default(),
            poll_interval: Duration::from_micros(100),
            wake_timeout: None,
            floor: false,
            drain_timeout: Duration::from_secs(2),
            stats_every: None,
            cancel_markers: true,
            stream_coalesce: Duration::ZERO,
            pace_completions: false,
        }
    }
}

/// Stops a running transport from another thread or a signal handler.
#[derive(Debug, Clone)]
pub struct ShutdownHandle(Arc<UnixStream>);

impl ShutdownHandle {
    /// A handle writing to `tx` (the other end is watched by a transport).
    pub fn from_stream(tx: UnixStream) -> Self {
        ShutdownHandle(Arc::new(tx))
    }

    /// Ask the transport to stop (idempotent).
    pub fn shutdown(&self) {
        let _ = (&*self.0).write(&[1]);
    }

    /// A new descriptor for the same pipe, for a signal handler that writes one byte
    /// (`signal_hook::low_level::pipe::register`).
    pub fn signal_pipe(&self) -> io::Result<UnixStream> {
        self.0.try_clone()
    }
}

struct Conn {
    stream: TcpStream,
    generation: u32,
    state: ConnState,
    /// Bytes received but not yet consumed by the framer.
    rbuf: Vec<u8>,
    /// The epoll interest registered: (EPOLLIN, EPOLLOUT, EPOLLRDHUP).
    registered: (bool, bool, bool),
    /// The peer ended its byte stream (a read returned 0). Input ends (`ConnState::on_eof`)
    /// once the whole frames still in `rbuf` are decoded, which the limits may delay.
    eof: bool,
    /// The peer's FIN was seen (EPOLLRDHUP or a read of 0): EPOLLRDHUP is level-triggered, so
    /// it leaves the interest set, or a connection that does not read would spin the loop.
    rdhup: bool,
    /// The connection's cancel marker is published or owed.
    cancelled: bool,
    /// Acknowledgements of streamed frames held back while over `max_unsent`.
    withheld: Withheld,
    /// Lingering close: our side is shut down for writing after an error reply, and input
    /// is discarded until the peer closes or this deadline passes. Closing at once with
    /// unread input would make the kernel send a reset that can destroy the error reply
    /// before the client reads it.
    linger_until: Option<Instant>,
    /// When the oldest unsent token frame held for coalescing arrived (`stream_coalesce`).
    hold_since: Option<Instant>,
    /// Something that must not wait (a final frame, a one-shot reply) is in the unsent bytes,
    /// or a write was partial: write at once, whatever `hold_since` says.
    flush_now: bool,
    /// Listed in `NativeTransport::held`.
    held: bool,
}

/// How long a connection closed by the server waits for the peer to finish sending.
const LINGER: Duration = Duration::from_secs(2);

/// The native transport, bound and ready to [`run`](NativeTransport::run).
pub struct NativeTransport {
    cfg: NativeConfig,
    listener: Option<TcpListener>,
    local_addr: SocketAddr,
    epoll: OwnedFd,
    doorbell: Arc<OwnedFd>,
    shutdown_rx: UnixStream,
    shutdown_tx: ShutdownHandle,
    region: Option<Arc<RingRegion>>,
    conns: Slab<Conn>,
    next_gen: u32,
    outstanding: usize,
    lingering: usize,
    last_sweep: Instant,
    stats: TransportStats,
    /// Set by [`NativeTransport::enable_metrics`]; without it nothing is measured.
    metrics: Option<Arc<RequestMetrics>>,
    scratch: Vec<u8>,
    /// Tokens of ended connections whose cancel marker found the request ring full.
    owed_cancels: VecDeque<u64>,
    /// Connections whose token frames are held for coalescing (`Conn::held`); an index can
    /// be stale (closed, or reused by a connection that is not held) and is then dropped.
    held: Vec<usize>,
    /// With `pace_completions`: when to look for completions.
    pacer: Option<CompletionPacer>,
}

impl std::fmt::Debug for NativeTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeTransport")
            .field("local_addr", &self.local_addr)
            .field("conns", &self.conns.len())
            .finish()
    }
}

fn token_of(generation: u32, idx: usize) -> u64 {
    (u64::from(generation) << 32) | idx as u64
}

impl NativeTransport {
    /// Bind the listening socket. `region` is the shared rings (None only in floor mode).
    pub fn bind(cfg: NativeConfig, region: Option<Arc<RingRegion>>) -> io::Result<Self> {
        if cfg.framer.max_words as usize > SLOT_WORDS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "max words per request {} exceeds the ring's slot capacity {SLOT_WORDS}",
                    cfg.framer.max_words
                ),
            ));
        }
        if region.is_none() && !cfg.floor {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the native transport needs a ring region unless it runs in floor mode",
            ));
        }
        let pacer = (cfg.pace_completions && region.is_some() && !cfg.floor)
            .then(|| CompletionPacer::new(cfg.poll_interval));
        let listener = TcpListener::bind(cfg.listen)?;
        listener.set_nonblocking(true)?;
        let local_addr = listener.local_addr()?;
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let doorbell = Arc::new(eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?);
        let (shutdown_rx, tx) = UnixStream::pair()?;
        shutdown_rx.set_nonblocking(true)?;
        tx.set_nonblocking(true)?;
        let ev = epoll::EventFlags::IN;
        epoll::add(&epoll, &listener, epoll::EventData::new_u64(LISTENER), ev)?;
        epoll::add(&epoll, &*doorbell, epoll::EventData::new_u64(DOORBELL), ev)?;
        epoll::add(
            &epoll,
            &shutdown_rx,
            epoll::EventData::new_u64(SHUTDOWN),
            ev,
        )?;
        Ok(NativeTransport {
            scratch: vec![0u8; 64 * 1024],
            cfg,
            listener: Some(listener),
            local_addr,
            epoll,
            doorbell,
            shutdown_rx,
            shutdown_tx: ShutdownHandle(Arc::new(tx)),
            region,
            conns: Slab::new(),
            next_gen: 1,
            outstanding: 0,
            lingering: 0,
            last_sweep: Instant::now(),
            stats: TransportStats::default(),
            owed_cancels: VecDeque::new(),
            metrics: None,
            held: Vec::new(),
            pacer,
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Measure answered requests, their durations and open connections into counters that
    /// another thread can read while the transport runs (call before [`run`](Self::run)).
    pub fn enable_metrics(&mut self) -> Arc<RequestMetrics> {
        self.metrics.get_or_insert_default().clone()
    }

    /// A handle that stops [`run`](Self::run).
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown_tx.clone()
    }

    /// The function an executor calls when it publishes a completion while this transport
    /// sleeps: it writes the transport's eventfd.
    pub fn waker(&self) -> Arc<dyn Fn() + Send + Sync> {
        let fd = self.doorbell.clone();
        Arc::new(move || {
            let _ = rustix::io::write(&*fd, &1u64.to_ne_bytes());
        })
    }

    /// Serve until shut down; then drain outstanding replies (bounded) and close everything.
    pub fn run(mut self) -> io::Result<TransportStats> {
        if self.pacer.is_some() {
            // Paced looks are microseconds apart; the default 50 us timer slack would add up
            // to 50 us to each (it applies to this thread's epoll timeouts).
            if let Err(e) =
                rustix::thread::set_current_timer_slack(std::num::NonZeroU64::new(1_000))
            {
                tracing::debug!(error = %e, "native transport: timer slack left at its default");
            }
        }
        let mut events = Vec::with_capacity(256);
        let mut dirty: Vec<usize> = Vec::new();
        let mut next_stats = self.cfg.stats_every.map(|d| Instant::now() + d);
        loop {
            if !self.owed_cancels.is_empty() {
                self.publish_owed_cancels();
            }
            self.reap(&mut dirty);
            self.release_due_holds(&mut dirty);
            self.flush_dirty(&mut dirty);
            // The wait: the shortest of the transport's own timeout, the earliest hold's end
            // and the next stats print (None: until something happens).
            let mut timeout = shortest(self.wait_timeout(), self.next_hold_deadline());
            if let Some(at) = next_stats {
                let now = Instant::now();
                if now >= at {
                    eprintln!("bgs: stats\n{}", self.stats);
                    next_stats = self.cfg.stats_every.map(|d| now + d);
                }
                // Wake for the next print even when idle.
                let left = next_stats.map_or(Duration::ZERO, |t| t.saturating_duration_since(now));
                timeout = shortest(timeout, Some(left));
            }
            // Announce the sleep before waiting, so that an executor publishing after our
            // last reap writes the doorbell; if something arrived in between, don't sleep.
            let guard = self.region.as_ref().map(|r| r.completions().sleep_guard());
            let timeout = match &self.region {
                Some(r) if !r.completions().is_empty() => Some(Duration::ZERO),
                _ => timeout,
            };
            events.clear();
            self.stats.epoll_waits += 1;
            // Did this wait rely on the executor's wake-up (so a timeout is worth counting)?
            let wake_wait = self.cfg.wake_timeout.is_some_and(|w| {
                self.outstanding > 0 && self.owed_cancels.is_empty() && timeout >= Some(w)
            });
            let timeout = timeout.map(|d| Timespec {
                tv_sec: d.as_secs() as _,
                tv_nsec: d.subsec_nanos() as _,
            });
            match epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(&mut events),
                timeout.as_ref(),
            ) {
                Ok(0) if wake_wait => self.stats.wake_timeouts += 1,
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            drop(guard);
            let mut published = false;
            let mut stop = false;
            for ev in &events {
                match ev.data.u64() {
                    LISTENER => self.accept_all(),
                    DOORBELL => {
                        let mut b = [0u8; 8];
                        let _ = rustix::io::read(&*self.doorbell, &mut b);
                    }
                    SHUTDOWN => stop = true,
                    idx => {
                        let idx = idx as usize;
                        if self.on_ready(idx, ev.flags) {
                            published = true;
                        }
                        dirty.push(idx);
                    }
                }
            }
            if published && let Some(r) = &self.region {
                r.requests().notify();
            }
            self.flush_dirty(&mut dirty);
            if stop {
                break;
            }
            if self.lingering > 0 {
                self.sweep_lingering();
            }
        }
        self.drain();
        Ok(self.stats)
    }

    fn wait_timeout(&mut self) -> Option<Duration> {
        let paced = match &mut self.pacer {
            Some(p) => p.wait(Instant::now(), self.outstanding),
            None => None,
        };
        Some(match (self.outstanding, self.lingering) {
            // Owed cancel markers wait for room in the request ring: retry soon.
            _ if !self.owed_cancels.is_empty() => self.cfg.poll_interval,
            (0, 0) => return None,
            (0, _) => Duration::from_millis(250),
            _ => paced.unwrap_or(self.cfg.wake_timeout.unwrap_or(self.cfg.poll_interval)),
        })
    }

    fn accept_all(&mut self) {
        let Some(listener) = &self.listener else {
            return;
        };
        loop {
            let fd = match rustix::net::accept_with(
                listener,
                SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
            ) {
                Ok(fd) => fd,
                Err(rustix::io::Errno::AGAIN) => return,
                Err(rustix::io::Errno::INTR | rustix::io::Errno::CONNABORTED) => continue,
                Err(e) => {
                    // EMFILE/ENFILE/ENOBUFS: leave the rest in the backlog for now.
                    tracing::warn!("accept failed: {e}");
                    return;
                }
            };
            let stream = TcpStream::from(fd);
            if self.conns.len() >= self.cfg.max_connections {
                self.stats.conns_refused += 1;
                drop(stream);
                continue;
            }
            // Small replies must not wait for delayed ACKs (the paper's 40 ms token gaps).
            if let Err(e) = stream.set_nodelay(true) {
                tracing::warn!("TCP_NODELAY failed: {e}");
            }
            let generation = self.next_gen;
            self.next_gen = self.next_gen.wrapping_add(1).max(1);
            let entry = self.conns.vacant_entry();
            let idx = entry.key();
            if epoll::add(
                &self.epoll,
                &stream,
                epoll::EventData::new_u64(idx as u64),
                epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
            )
            .is_err()
            {
                continue;
            }
            let mut state =
                ConnState::new(token_of(generation, idx), self.cfg.framer, self.cfg.limits);
            if let Some(m) = &self.metrics {
                state.set_metrics(m.clone());
                m.conn_opened();
            }
            entry.insert(Conn {
                stream,
                generation,
                state,
                rbuf: Vec::new(),
                registered: (true, false, true),
                eof: false,
                rdhup: false,
                cancelled: false,
                withheld: Withheld::default(),
                linger_until: None,
                hold_since: None,
                flush_now: false,
                held: false,
            });
            self.stats.conns_accepted += 1;
        }
    }

    /// Handle readiness of connection `idx`; returns true if requests were published.
    fn on_ready(&mut self, idx: usize, flags: epoll::EventFlags) -> bool {
        let Some(conn) = self.conns.get_mut(idx) else {
            return false;
        };
        if flags.contains(epoll::EventFlags::OUT) {
            write_out(conn, &mut self.stats);
        }
        if conn.linger_until.is_some() {
            match (&conn.stream).read(&mut self.scratch) {
                Ok(0) => self.close(idx),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => self.close(idx),
            }
            return false;
        }
        if !conn.state.wants_input() {
            // Not reading (limits, or input already ended), so a read cannot report how the
            // connection ended: the events must.
            if flags.intersects(epoll::EventFlags::HUP | epoll::EventFlags::ERR) {
                // Reset or fully closed: nothing more can be delivered.
                self.stats.io_errors += 1;
                self.close(idx);
            } else if flags.contains(epoll::EventFlags::RDHUP) {
                // The peer's FIN, with input perhaps still unread (read when the limits
                // allow). Its streams are cancelled now, not when the rest is read.
                conn.rdhup = true;
                self.cancel(idx);
            }
            return false;
        }
        if !(flags.intersects(
            epoll::EventFlags::IN
                | epoll::EventFlags::RDHUP
                | epoll::EventFlags::HUP
                | epoll::EventFlags::ERR,
        )) {
            return false;
        }
        let before = conn.state.queued();
        let n = match (&conn.stream).read(&mut self.scratch) {
            Ok(0) => {
                conn.eof = true;
                conn.rdhup = true;
                self.cancel(idx);
                // Whole frames read earlier but held back by the limits are still owed an
                // answer: input ends only once they are in (`ingest_held`).
                return self.ingest_held(idx, &mut None) > 0;
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return false,
            Err(_) => {
                self.stats.io_errors += 1;
                self.close(idx);
                return false;
            }
        };
        self.stats.bytes_in += n as u64;
        let mut sink = RingSink {
            region: self.region.as_deref(),
            floor: self.cfg.floor,
            now_ns: bgs_ring::monotonic_ns(),
        };
        let conn = &mut self.conns[idx];
        if conn.rbuf.is_empty() {
            // Common case: decode straight from the scratch buffer, keep only a partial tail.
            let used = conn
                .state
                .ingest(&self.scratch[..n], &mut sink, &mut self.stats);
            conn.rbuf.extend_from_slice(&self.scratch[used..n]);
        } else {
            conn.rbuf.extend_from_slice(&self.scratch[..n]);
            let used = conn.state.ingest(&conn.rbuf, &mut sink, &mut self.stats);
            conn.rbuf.drain(..used);
        }
        if conn.state.read_closed() {
            conn.rbuf = Vec::new();
        }
        let added = conn.state.queued() - before;
        self.outstanding += added;
        if let Some(p) = &mut self.pacer {
            p.published(added, Instant::now);
        }
        added > 0
    }

    /// Decode what connection `idx` read earlier but held back (its limits were reached) as
    /// far as its limits now allow; returns how many requests were published. Once the peer
    /// has ended its stream and every whole frame is in, input ends here (a trailing partial
    /// frame is dropped): a read of end-of-stream must not discard whole frames still held.
    fn ingest_held(&mut self, idx: usize, now: &mut Option<Instant>) -> usize {
        let Some(conn) = self.conns.get_mut(idx) else {
            return 0;
        };
        let mut added = 0;
        if !conn.rbuf.is_empty() && conn.state.wants_input() {
            let mut sink = RingSink {
                region: self.region.as_deref(),
                floor: self.cfg.floor,
                now_ns: bgs_ring::monotonic_ns(),
            };
            let before = conn.state.queued();
            let used = conn.state.ingest(&conn.rbuf, &mut sink, &mut self.stats);
            conn.rbuf.drain(..used);
            added = conn.state.queued() - before;
            self.outstanding += added;
            if let Some(p) = &mut self.pacer {
                p.published(added, || *now.get_or_insert_with(Instant::now));
            }
        }
        // Still wanting input after the decode: what is left is at most a partial frame.
        if conn.eof && conn.state.wants_input() {
            conn.state.on_eof();
            conn.rbuf = Vec::new();
        }
        added
    }

    /// Reap every completion in the ring and hand it to its connection.
    fn reap(&mut self, dirty: &mut Vec<usize>) {
        let Some(region) = self.region.clone() else {
            return;
        };
        let mut buf = [0u32; SLOT_WORDS];
        let coalesce = !self.cfg.stream_coalesce.is_zero();
        let mut now = None;
        let mut reaped_ns = None;
        loop {
            let c = region.completions().try_pop(|e| {
                let n = (e.words as usize).min(SLOT_WORDS);
                buf[..n].copy_from_slice(&e.payload[..n]);
                (
                    e.conn,
                    e.conn_seq,
                    e.status,
                    e.final_ != 0,
                    e.stream_seq,
                    e.request_id,
                    n,
                    e.stream,
                    e.publish_ns,
                )
            });
            let Some((token, seq, status, final_, stream_seq, request_id, n, stream, published)) =
                c
            else {
                break;
            };
            self.stats.completions += 1;
            if let Some(p) = &mut self.pacer
                && published != 0
            {
                let now_ns = *reaped_ns.get_or_insert_with(bgs_ring::monotonic_ns);
                p.completed(Duration::from_nanos(now_ns.saturating_sub(published)));
            }
            let idx = (token & 0xffff_ffff) as usize;
            let generation = (token >> 32) as u32;
            let status = Status::from_u16(status).unwrap_or(Status::Internal);
            match self.conns.get_mut(idx) {
                Some(conn) if conn.generation == generation => {
                    let before = conn.state.queued();
                    let taken =
                        conn.state
                            .complete(seq, status, final_, stream_seq, request_id, &buf[..n]);
                    if taken {
                        self.stats.replies += 1;
                        // The first token (time to first token) and the final frame
                        // never wait.
                        if coalesce && stream != 0 && !final_ && stream_seq != 0 {
                            if conn.hold_since.is_none() {
                                conn.hold_since = Some(*now.get_or_insert_with(Instant::now));
                            }
                        } else {
                            conn.flush_now = true;
                        }
                    }
                    self.outstanding -= before - conn.state.queued();
                    if stream != 0 {
                        if final_ {
                            // The stream is over: nothing more to hold back (credit::Withheld).
                            self.stats.acks += conn
                                .withheld
                                .release_stream(stream, |s, k| ack(&region, s, k));
                        }
                        if !taken || final_ || conn.state.may_ack(seq) {
                            ack(&region, stream, 1);
                            self.stats.acks += 1;
                        } else {
                            conn.withheld.push(seq, stream);
                            self.stats.acks_withheld += 1;
                        }
                    }
                    dirty.push(idx);
                }
                // Its connection closed; `close` already stopped counting it as outstanding.
                _ => {
                    self.stats.stale_completions += 1;
                    if stream != 0 {
                        ack(&region, stream, 1);
                        self.stats.acks += 1;
                    }
                }
            }
        }
    }

    /// Write what is ready, resume reading where limits allowed it again, update epoll
    /// interest, and close finished connections.
    fn flush_dirty(&mut self, dirty: &mut Vec<usize>) {
        dirty.sort_unstable();
        dirty.dedup();
        let coalesce = self.cfg.stream_coalesce;
        let mut now = None;
        for idx in dirty.drain(..) {
            // Input held back by the limits may now fit.
            if self.ingest_held(idx, &mut now) > 0
                && let Some(r) = &self.region
            {
                r.requests().notify();
            }
            let Some(conn) = self.conns.get_mut(idx) else {
                continue;
            };
            // Token frames wait (unregistered for EPOLLOUT) until their hold ends, unless
            // something behind them must go now.
            let hold = match conn.hold_since {
                Some(since) if !conn.flush_now && !conn.state.unsent().is_empty() => {
                    *now.get_or_insert_with(Instant::now) < since + coalesce
                }
                _ => false,
            };
            if hold {
                if !conn.held {
                    conn.held = true;
                    self.held.push(idx);
                    self.stats.writes_held += 1;
                }
            } else if !conn.state.unsent().is_empty() {
                if !write_out(conn, &mut self.stats) {
                    self.stats.io_errors += 1;
                    self.close(idx);
                    continue;
                }
                if conn.state.unsent().is_empty() {
                    conn.hold_since = None;
                    conn.flush_now = false;
                } else {
                    // The socket is full: EPOLLOUT takes over; nothing is held any more.
                    conn.flush_now = true;
                }
            } else {
                conn.hold_since = None;
                conn.flush_now = false;
            }
            if !conn.withheld.is_empty()
                && let Some(region) = &self.region
            {
                // Writes drained, or items ahead finished: give back what the limit allows.
                let state = &conn.state;
                self.stats.acks += conn
                    .withheld
                    .release(|seq| state.may_ack(seq), |s, k| ack(region, s, k));
            }
            if conn.linger_until.is_some() {
                continue;
            }
            if conn.state.finished() {
                if conn.eof {
                    self.close(idx);
                } else {
                    self.start_linger(idx);
                }
                continue;
            }
            let want = (
                conn.state.wants_input(),
                !conn.state.unsent().is_empty() && !hold,
                !conn.rdhup,
            );
            if want != conn.registered {
                // EPOLLHUP and EPOLLERR are reported regardless of the interest set.
                let mut fl = epoll::EventFlags::empty();
                if want.0 {
                    fl |= epoll::EventFlags::IN;
                }
                if want.1 {
                    fl |= epoll::EventFlags::OUT;
                }
                if want.2 {
                    fl |= epoll::EventFlags::RDHUP;
                }
                let _ = epoll::modify(
                    &self.epoll,
                    &conn.stream,
                    epoll::EventData::new_u64(idx as u64),
                    fl,
                );
                conn.registered = want;
            }
        }
    }

    /// When the earliest hold has ended, every held connection goes back into `dirty` (and
    /// out of `held`): one wake-up per hold period writes them all, instead of one per
    /// connection (a frame then waits between zero and `stream_coalesce`).
    fn release_due_holds(&mut self, dirty: &mut Vec<usize>) {
        if self.next_hold_deadline() != Some(Duration::ZERO) {
            return;
        }
        for idx in self.held.drain(..) {
            if let Some(c) = self.conns.get_mut(idx).filter(|c| c.held) {
                c.held = false;
                c.flush_now = true;
                dirty.push(idx);
            }
        }
    }

    /// How long until the earliest held connection must be written.
    fn next_hold_deadline(&self) -> Option<Duration> {
        if self.held.is_empty() {
            return None;
        }
        let now = Instant::now();
        self.held
            .iter()
            .filter_map(|&i| self.conns.get(i).filter(|c| c.held)?.hold_since)
            .map(|t| (t + self.cfg.stream_coalesce).saturating_duration_since(now))
            .min()
    }

    /// Everything owed has been written and the server ends the connection (an error that
    /// closes, `Connection: close`, shutdown): send FIN and discard input until the peer
    /// closes too.
    fn start_linger(&mut self, idx: usize) {
        // The connection ends here (nothing is pending any more, so no stream runs for it).
        self.cancel(idx);
        let conn = &mut self.conns[idx];
        if conn.stream.shutdown(std::net::Shutdown::Write).is_err() {
            self.close(idx);
            return;
        }
        conn.rbuf = Vec::new();
        conn.linger_until = Some(Instant::now() + LINGER);
        let _ = epoll::modify(
            &self.epoll,
            &conn.stream,
            epoll::EventData::new_u64(idx as u64),
            epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
        );
        conn.registered = (true, false, true);
        self.lingering += 1;
    }

    fn sweep_lingering(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_sweep) < Duration::from_millis(100) {
            return;
        }
        self.last_sweep = now;
        let expired: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| c.linger_until.is_some_and(|t| t <= now))
            .map(|(i, _)| i)
            .collect();
        for idx in expired {
            self.close(idx);
        }
    }

    /// Connection `idx` ends (or stops sending): publish its cancel marker once, or owe it
    /// when the request ring is full. Markers go out in the order connections ended.
    fn cancel(&mut self, idx: usize) {
        let Some(region) = &self.region else {
            return;
        };
        if !self.cfg.cancel_markers {
            return;
        }
        let Some(conn) = self.conns.get_mut(idx) else {
            return;
        };
        if conn.cancelled {
            return;
        }
        conn.cancelled = true;
        let token = conn.state.token();
        if self.owed_cancels.is_empty() && publish_cancel(region, token) {
            self.stats.cancels += 1;
            region.requests().notify();
        } else {
            self.stats.cancels_deferred += 1;
            self.owed_cancels.push_back(token);
        }
    }

    /// Retry the owed cancel markers, oldest first, until the request ring is full again.
    fn publish_owed_cancels(&mut self) {
        let Some(region) = &self.region else {
            return;
        };
        let mut published = false;
        while let Some(&token) = self.owed_cancels.front() {
            if !publish_cancel(region, token) {
                break;
            }
            self.owed_cancels.pop_front();
            self.stats.cancels += 1;
            published = true;
        }
        if published {
            region.requests().notify();
        }
    }

    fn close(&mut self, idx: usize) {
        self.cancel(idx);
        if let Some(mut conn) = self.conns.try_remove(idx) {
            // Whatever it still held back is dropped with it.
            if let Some(region) = &self.region {
                self.stats.acks += conn.withheld.release_all(|s, k| ack(region, s, k));
            }
            if conn.linger_until.is_some() {
                self.lingering -= 1;
            }
            // Requests still in the executor will complete into a stale token; they no longer
            // count as outstanding for this loop's wait decisions.
            self.outstanding -= conn.state.queued();
            let _ = epoll::delete(&self.epoll, &conn.stream);
            self.stats.conns_closed += 1;
            if let Some(m) = &self.metrics {
                m.conn_closed();
            }
            drop(conn);
        }
    }

    /// Stop accepting and reading; give outstanding requests `drain_timeout` to complete.
    fn drain(&mut self) {
        self.listener = None;
        // Nothing waits any more: held frames go out with everything else.
        self.cfg.stream_coalesce = Duration::ZERO;
        for (_, c) in self.conns.iter_mut() {
            c.flush_now = true;
            c.held = false;
        }
        self.held.clear();
        let mut b = [0u8; 64];
        let _ = (&self.shutdown_rx).read(&mut b);
        let deadline = Instant::now() + self.cfg.drain_timeout;
        let mut dirty: Vec<usize> = self.conns.iter().map(|(i, _)| i).collect();
        for (_, c) in self.conns.iter_mut() {
            c.state.on_eof();
        }
        // Shutdown ends every connection: their streams are cancelled rather than waited
        // for (each still ends with a final frame, which the drain below delivers).
        for &idx in &dirty {
            self.cancel(idx);
        }
        self.flush_dirty(&mut dirty);
        while (self.outstanding > 0 || !self.owed_cancels.is_empty()) && Instant::now() < deadline {
            self.publish_owed_cancels();
            self.reap(&mut dirty);
            self.flush_dirty(&mut dirty);
            std::thread::sleep(Duration::from_micros(200));
        }
        let idxs: Vec<usize> = self.conns.iter().map(|(i, _)| i).collect();
        for idx in idxs {
            self.close(idx);
        }
    }
}

/// The shorter of two optional waits (None: no limit).
fn shortest(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Write as much as the socket takes. Returns false on a fatal write error.
fn write_out(conn: &mut Conn, stats: &mut TransportStats) -> bool {
    while !conn.state.unsent().is_empty() {
        match (&conn.stream).write(conn.state.unsent()) {
            Ok(0) => return false,
            Ok(n) => {
                stats.bytes_out += n as u64;
                stats.writes += 1;
                conn.state.advance(n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return false,
        }
    }
    true
}

/// Publishes framed requests into the request ring (or answers them in floor mode).
struct RingSink<'a> {
    region: Option<&'a RingRegion>,
    floor: bool,
    now_ns: u64,
}

impl RequestSink for RingSink<'_> {
    fn submit(&mut self, token: u64, conn_seq: u32, r: &Request<'_>) -> Submit {
        if self.floor {
            return if r.header.op == bgs_protocol::Op::Echo as u16 {
                Submit::EchoNow
            } else {
                Submit::Unsupported
            };
        }
        let Some(region) = self.region else {
            return Submit::Busy;
        };
        let h = &r.header;
        let pushed = region.requests().try_push(|e| {
            e.conn = token;
            e.conn_seq = conn_seq;
            e.op = h.op;
            e.version = h.version;
            e.request_id = h.request_id;
            e.words = h.words;
            e.param = h.param;
            e.flags = h.flags;
            e.publish_ns = self.now_ns;
            // The native transport keeps each item's framing in its ConnState; the route bits
            // are informational here.
            e.route = match r.framing {
                bgs_protocol::Framing::Binary => 0,
                bgs_protocol::Framing::Http { keep_alive } => {
                    bgs_ring::route::HTTP
                        | if keep_alive {
                            0
                        } else {
                            bgs_ring::route::CLOSE
                        }
                }
            };
            bgs_protocol::wire::words_from_le(r.payload, &mut e.payload[..h.words as usize]);
        });
        match pushed {
            Ok(()) => Submit::Queued,
            Err(_) => Submit::Busy,
        }
    }

    fn arrival_ns(&self) -> u64 {
        self.now_ns
    }
}
