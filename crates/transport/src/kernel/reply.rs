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

use std::collections::{BTreeMap, HashMap};
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use bgs_protocol::{Framing, Reject, Status};
use bgs_ring::{CompletionEntry, route};
use serde::Serialize;
use slab::Slab;

use crate::conn::{FrameOut, encode_frame, encode_reject};

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
}

/// A completion's fields as the stage needs them, borrowing the payload from the ring slot.
#[derive(Debug, Clone, Copy)]
struct FrameRef<'a> {
    status: u16,
    final_: bool,
    stream_seq: u32,
    request_id: u32,
    route: u32,
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
}

impl ConnOut {
    /// Waiting on something that will need a timely look: a SEND in flight, a shutdown or
    /// linger, or an accept that has not been reaped yet.
    fn busy(&self) -> bool {
        self.inflight.is_some() || self.phase != Phase::Open || self.fd.is_none()
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
    stats: ReplyStats,
}

impl ReplyStage {
    /// An empty stage.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counters.
    pub fn stats(&self) -> &ReplyStats {
        &self.stats
    }

    /// Connections currently tracked.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// True when a SEND, SHUTDOWN or linger is outstanding, or an accept is awaited (the
    /// caller should poll soon). Exact after [`Self::flush`].
    pub fn busy(&self) -> bool {
        self.busy_conns > 0
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
        });
        self.by_cookie.insert(cookie, idx);
        idx
    }

    /// The transport accepted connection `fd` whose socket cookie is `cookie`.
    pub fn on_accept(&mut self, fd: RawFd, cookie: u64) {
        let idx = self.conn_for(cookie);
        self.conns[idx].fd = Some(fd);
        self.stats.accepted += 1;
        self.dirty.push(idx);
    }

    /// Consume one completion-ring entry.
    pub fn on_completion(&mut self, e: &CompletionEntry) {
        self.stats.completions += 1;
        if self.recently_closed.contains(&e.conn) {
            // Markers (or late replies) for a connection this stage already closed.
            self.stats.stale += 1;
            return;
        }
        // An unknown cookie is a connection whose accept has not been reaped yet: keep what
        // arrives for it (markers included) until the accept brings its descriptor.
        let idx = self.conn_for(e.conn);
        if e.route & route::RESET != 0 {
            self.stats.resets += 1;
            let c = &mut self.conns[idx];
            c.out.clear();
            c.parked.clear();
            c.phase = Phase::Closing;
            c.eof = true;
            self.dirty.push(idx);
            return;
        }
        let c = &mut self.conns[idx];
        if c.phase != Phase::Open {
            // The server already ended this connection; only the peer's EOF still matters.
            if e.route & route::EOF != 0 {
                c.eof = true;
                self.dirty.push(idx);
            } else {
                self.stats.stale += 1;
            }
            return;
        }
        let frame = FrameRef {
            status: e.status,
            final_: e.final_ != 0,
            stream_seq: e.stream_seq,
            request_id: e.request_id,
            route: e.route,
            words: &e.payload[..(e.words as usize).min(e.payload.len())],
        };
        if e.conn_seq == c.next_seq {
            Self::emit(c, frame, &mut self.stats);
            // Items that were waiting behind this one.
            while c.phase == Phase::Open && !c.parked.is_empty() {
                let Some(frames) = c.parked.remove(&c.next_seq) else {
                    break;
                };
                for p in &frames {
                    Self::emit(c, p.as_ref(), &mut self.stats);
                }
            }
        } else {
            c.parked.entry(e.conn_seq).or_default().push(Parked {
                status: frame.status,
                final_: frame.final_,
                stream_seq: frame.stream_seq,
                request_id: frame.request_id,
                route: frame.route,
                words: frame.words.to_vec(),
            });
        }
        self.dirty.push(idx);
    }

    /// Encode one frame of the front item (or handle a marker in its turn).
    fn emit(c: &mut ConnOut, p: FrameRef<'_>, stats: &mut ReplyStats) {
        if c.phase != Phase::Open {
            return;
        }
        if p.route & route::EOF != 0 {
            stats.eof += 1;
            c.eof = true;
            c.phase = Phase::Closing;
            return;
        }
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
        if p.final_ {
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
                    // EPIPE, ECONNRESET: the peer is gone; nothing more can be delivered.
                    self.stats.send_errors += 1;
                    c.inflight = None;
                    c.out.clear();
                    c.parked.clear();
                    c.eof = true;
                    c.phase = Phase::Closing;
                } else {
                    self.stats.bytes_sent += res as u64;
                    inf.sent += res as usize;
                    if inf.sent < inf.buf.len() {
                        self.stats.short_sends += 1;
                    } else if let Some(Inflight { mut buf, .. }) = c.inflight.take() {
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
                let gone = self.remove_conn(idx);
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
            if !self.flush_one(idx, io) {
                // No room in the queue: try again at the next flush.
                self.dirty.push(idx);
            }
            self.refresh_busy(idx);
        }
        self.flushing.clear();
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
            let fresh = self.spare.pop().unwrap_or_default();
            let buf = std::mem::replace(&mut c.out, fresh);
            if !io.send(fd, buf.as_ptr(), buf.len(), ud_send) {
                let fresh = std::mem::replace(&mut c.out, buf);
                self.spare.push(fresh);
                return false;
            }
            self.stats.sends += 1;
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
                if !io.close(fd, c.cookie, user_data(KIND_CLOSE, idx, c.generation)) {
                    return false;
                }
                c.phase = Phase::Closed;
            }
            _ => {}
        }
        true
    }

    /// Timers: lingering connections past their deadline, and replies for connections that
    /// were never accepted. Call every few milliseconds.
    pub fn sweep(&mut self, now: Instant) {
        let mut drop_idx = Vec::new();
        for (idx, c) in self.conns.iter_mut() {
            if c.phase == Phase::Lingering && c.linger_until.is_some_and(|t| t <= now) {
                self.dirty.push(idx);
            }
            if c.fd.is_none() && now.duration_since(c.created) > ACCEPT_GRACE {
                drop_idx.push(idx);
            }
        }
        for idx in drop_idx {
            let c = self.remove_conn(idx);
            self.stats.never_accepted += 1;
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
    }

    impl ReplyIo for Recorder {
        fn send(&mut self, fd: RawFd, ptr: *const u8, len: usize, ud: u64) -> bool {
            if self.full {
                return false;
            }
            // SAFETY: the stage guarantees the buffer is live until the CQE; we copy it now.
            let bytes = unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec();
            self.sends.push((fd, bytes, ud));
            true
        }
        fn shutdown(&mut self, fd: RawFd, ud: u64) -> bool {
            self.shutdowns.push((fd, ud));
            true
        }
        fn close(&mut self, fd: RawFd, _cookie: u64, ud: u64) -> bool {
            self.closes.push((fd, ud));
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
            self.conns.iter().any(|(_, c)| c.busy())
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
}
