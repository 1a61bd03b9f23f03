//! The open-loop engine: one epoll loop per I/O thread, each owning a fixed set of connections.
//!
//! Request k is due at `t0 + k/rate` on connection `k % C`; connection c belongs to thread
//! `c % T`. Every thread therefore knows its whole schedule in advance and needs nothing from
//! the others: no locks or shared queues in the hot path, only a relaxed progress counter.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};

use bgs_cpuacct::monotonic_ns;
use bgs_protocol::{HEADER_LEN, REPLY_MAGIC, ReplyHeader, Status, VERSION};
use hdrhistogram::Histogram;
use rustix::event::epoll;
use rustix::time::{
    Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec, timerfd_create,
    timerfd_settime,
};
use serde::Serialize;

use crate::client::MAX_REPLY_WORDS;
use crate::generate::{GoldenStream, status_name};
use crate::http::{BodyKind, parse_chunk, parse_head, parse_response};

/// How long before a send is due the thread stops sleeping and polls instead, at first. The
/// margin then adapts to the measured timer wake-up lateness (deep idle states in a VM can add
/// 100 µs), between these bounds: spinning costs CPU only for the margin before each send.
const SPIN_NS: u64 = 50_000;
const SPIN_MIN_NS: u64 = 20_000;
const SPIN_MAX_NS: u64 = 150_000;
/// Timeouts are swept at this period; finer would only cost time.
const SWEEP_NS: u64 = 1_000_000;
/// At most this many failure descriptions are kept per thread.
const MAX_SAMPLES: usize = 10;
/// epoll data value of the timerfd (connections use their local index).
const TIMER_TOKEN: u64 = u64::MAX;

/// Everything the threads share, read-only.
#[derive(Debug)]
pub(crate) struct Plan {
    pub connections: usize,
    pub threads: usize,
    pub pipeline: usize,
    pub http: bool,
    pub period_ns: f64,
    /// Requests `k < warmup_end` are warm-up.
    pub warmup_end: u64,
    /// Requests `k < end` are scheduled.
    pub end: u64,
    pub timeout_ns: u64,
    /// CLOCK_MONOTONIC time of request 0.
    pub t0_ns: u64,
    /// Encoded request (bare frame or HTTP POST) per payload, with request id 0.
    pub requests: Vec<Vec<u8>>,
    /// Offset of the request id inside each encoded request.
    pub id_offset: usize,
    /// Golden reply payload bytes per payload (one-shot ops).
    pub golden: Vec<Vec<u8>>,
    /// Generation streams (op generate): replies are streams checked token by token.
    pub streams: Option<GenPlan>,
}

/// What the threads need for generation streams.
#[derive(Debug)]
pub(crate) struct GenPlan {
    /// The golden stream per prompt.
    pub golden: Vec<GoldenStream>,
    /// Measured requests scheduled before this time make up the first window.
    pub first_window_end_ns: u64,
    /// Measured requests scheduled at or after this time make up the last window.
    pub last_window_start_ns: u64,
}

/// Final statuses are counted per wire value below this; the last slot takes the rest.
pub(crate) const STATUS_SLOTS: usize = 32;

/// Generation measurements of one thread (measured requests only).
#[derive(Debug)]
pub(crate) struct GenStats {
    /// Time to first token, ns from the scheduled send time.
    pub ttft: Histogram<u64>,
    /// Gaps between consecutive token frames of a stream, ns.
    pub gap: Histogram<u64>,
    /// Time to first token of requests in the first window.
    pub ttft_first: Histogram<u64>,
    /// Time to first token of requests in the last window.
    pub ttft_last: Histogram<u64>,
    /// Token frames received.
    pub tokens: u64,
    /// Final frames by status (index = wire status, the last slot: any larger value).
    pub final_status: [u64; STATUS_SLOTS],
}

impl GenStats {
    pub(crate) fn new() -> io::Result<GenStats> {
        Ok(GenStats {
            ttft: new_histogram()?,
            gap: new_histogram()?,
            ttft_first: new_histogram()?,
            ttft_last: new_histogram()?,
            tokens: 0,
            final_status: [0; STATUS_SLOTS],
        })
    }

    pub(crate) fn add(&mut self, o: &GenStats) -> Result<(), hdrhistogram::AdditionError> {
        self.ttft.add(&o.ttft)?;
        self.gap.add(&o.gap)?;
        self.ttft_first.add(&o.ttft_first)?;
        self.ttft_last.add(&o.ttft_last)?;
        self.tokens += o.tokens;
        for (a, b) in self.final_status.iter_mut().zip(o.final_status) {
            *a += b;
        }
        Ok(())
    }
}

impl Plan {
    pub(crate) fn sched_ns(&self, k: u64) -> u64 {
        self.t0_ns + (k as f64 * self.period_ns) as u64
    }
}

/// How a scheduled request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Ok,
    Busy,
    Wrong,
    Error,
    TimedOut,
    ConnFailed,
    Cancelled,
}

/// Requests by outcome.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Status ok and bit-identical to the golden reply.
    pub ok: u64,
    /// Refused by admission (status 21 / HTTP 503): a valid answer under overload.
    pub busy: u64,
    /// A reply that differs from the golden one, arrived out of order, or was malformed.
    pub wrong: u64,
    /// Any other status, or an HTTP error.
    pub error: u64,
    /// No reply within the timeout.
    pub timed_out: u64,
    /// The connection broke before the reply.
    pub conn_failed: u64,
    /// A generation stream ended with status 24 (cancelled) although its connection was open.
    pub cancelled: u64,
}

impl Counts {
    /// wrong + error + timed_out + conn_failed + cancelled.
    pub fn failures(&self) -> u64 {
        self.wrong + self.error + self.timed_out + self.conn_failed + self.cancelled
    }

    /// Every classified request.
    pub fn total(&self) -> u64 {
        self.ok + self.busy + self.failures()
    }

    fn bump(&mut self, c: Class) {
        match c {
            Class::Ok => self.ok += 1,
            Class::Busy => self.busy += 1,
            Class::Wrong => self.wrong += 1,
            Class::Error => self.error += 1,
            Class::TimedOut => self.timed_out += 1,
            Class::ConnFailed => self.conn_failed += 1,
            Class::Cancelled => self.cancelled += 1,
        }
    }

    pub(crate) fn add(&mut self, o: &Counts) {
        self.ok += o.ok;
        self.busy += o.busy;
        self.wrong += o.wrong;
        self.error += o.error;
        self.timed_out += o.timed_out;
        self.conn_failed += o.conn_failed;
        self.cancelled += o.cancelled;
    }
}

/// What one thread measured.
#[derive(Debug)]
pub(crate) struct ThreadResult {
    pub measured: Counts,
    pub warmup: Counts,
    /// Latency of measured ok replies, ns from the scheduled send time.
    pub hist: Histogram<u64>,
    /// How late measured requests were handed to the socket, ns after their scheduled time
    /// (the client's own lag: wake-up latency, a full pipeline, or a saturated thread).
    pub send_lag: Histogram<u64>,
    pub request_bytes: u64,
    pub reply_bytes: u64,
    /// Last time a measured request was written (0: none).
    pub last_send_ns: u64,
    /// Last time a measured request was classified (0: none).
    pub last_done_ns: u64,
    /// Replies that arrived after their request had timed out.
    pub late_replies: u64,
    /// Descriptions of the first failures.
    pub samples: Vec<String>,
    /// Generation measurements (op generate).
    pub streams: Option<GenStats>,
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    k: u64,
    sched_ns: u64,
    id: u32,
    payload: u32,
    /// Already classified as timed out; the reply may still come and is then skipped.
    timed_out: bool,
    /// Generation: token frames received so far.
    tokens: u32,
    /// Generation: arrival time of the last token frame.
    last_ns: u64,
    /// Generation: the first way the stream departed from its golden stream.
    fault: Fault,
}

/// The first departure of a stream from its golden stream; the stream is judged wrong at its
/// end-of-stream frame (kept small and `Copy` so the token path never allocates).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// A token frame with other than one word.
    TokenWords {
        seq: u32,
        words: u32,
    },
    /// A token frame out of sequence.
    Seq {
        got: u32,
        want: u32,
    },
    /// A token that differs from the golden one (`want` None: past the golden stream's end).
    Token {
        seq: u32,
        got: u32,
        want: Option<u32>,
    },
}

impl Fault {
    fn describe(self, prompt: u32) -> String {
        match self {
            Fault::None => "no fault".into(),
            Fault::TokenWords { seq, words } => format!("token frame {seq} carries {words} words"),
            Fault::Seq { got, want } => format!("token frame seq {got} where {want} was due"),
            Fault::Token {
                seq,
                got,
                want: Some(w),
            } => format!("token {seq} is {got}, the golden stream of prompt {prompt} has {w}"),
            Fault::Token {
                seq,
                got,
                want: None,
            } => format!(
                "token {seq} ({got}) is past the end of the golden stream of prompt {prompt}"
            ),
        }
    }
}

/// Counters and histogram of a thread (kept apart from the connections for borrowing).
struct Stats<'a> {
    plan: &'a Plan,
    r: ThreadResult,
    outstanding: u64,
    completed: u64,
    progress: &'a AtomicU64,
}

impl Stats<'_> {
    fn classify(
        &mut self,
        p: &Pending,
        class: Class,
        now: u64,
        conn: usize,
        why: impl FnOnce() -> String,
    ) {
        let measured = p.k >= self.plan.warmup_end;
        if measured {
            self.r.measured.bump(class);
            self.r.last_done_ns = self.r.last_done_ns.max(now);
            if class == Class::Ok {
                self.r
                    .hist
                    .saturating_record(now.saturating_sub(p.sched_ns).max(1));
            }
        } else {
            self.r.warmup.bump(class);
        }
        if !matches!(class, Class::Ok | Class::Busy) && self.r.samples.len() < MAX_SAMPLES {
            let phase = if measured { "" } else { " (warm-up)" };
            self.r.samples.push(format!(
                "request {}{phase} on connection {conn}: {:?}: {}",
                p.k,
                class,
                why()
            ));
        }
        self.outstanding -= 1;
        self.completed += 1;
        self.progress.store(self.completed, Ordering::Relaxed);
    }
}

/// Judge a reply frame for request `p`.
fn judge(plan: &Plan, p: &Pending, h: &ReplyHeader, payload: &[u8]) -> (Class, Option<String>) {
    match Status::from_u16(h.status) {
        Some(Status::Busy) => (Class::Busy, None),
        Some(Status::Ok) => {
            if h.seq != 0 || h.reserved != 0 {
                (
                    Class::Wrong,
                    Some(format!("seq {} / reserved {} not zero", h.seq, h.reserved)),
                )
            } else if payload == plan.golden[p.payload as usize].as_slice() {
                (Class::Ok, None)
            } else {
                (
                    Class::Wrong,
                    Some(format!(
                        "reply payload ({} bytes) differs from the golden reply of payload {}",
                        payload.len(),
                        p.payload
                    )),
                )
            }
        }
        _ => (Class::Error, Some(format!("status {}", h.status))),
    }
}

/// Send/receive buffers of a connection.
struct Io {
    stream: Option<TcpStream>,
    out: Vec<u8>,
    out_pos: usize,
    inb: Vec<u8>,
    in_start: usize,
    in_end: usize,
    /// HTTP body scratch, reused.
    body: Vec<u8>,
    /// Where an HTTP generation stream's parser stands.
    rx: HttpRx,
    writable: bool,
    dirty: bool,
}

/// Incremental HTTP parsing of streamed responses: each chunk is handled as it arrives, so
/// token frames are timed on arrival rather than at the end of the response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HttpRx {
    /// Waiting for a response head.
    Head,
    /// Inside a chunked body.
    Chunks {
        status: u16,
        close: bool,
        /// The final frame of the response's request has been handled.
        final_seen: bool,
    },
}

/// Request queues of a connection, all ordered by scheduled time.
#[derive(Default)]
struct Queues {
    /// Sent, reply not yet seen.
    inflight: VecDeque<Pending>,
    /// Passed over by a reply to a later request: answered out of order or never.
    overdue: VecDeque<Pending>,
    /// Due but waiting for a pipeline slot.
    backlog: VecDeque<Pending>,
}

struct Conn {
    /// Global connection index.
    index: usize,
    io: Io,
    q: Queues,
}

impl Queues {
    /// A binary reply frame. `Err` means the stream can no longer be trusted.
    fn on_frame(
        &mut self,
        stats: &mut Stats<'_>,
        h: &ReplyHeader,
        payload: &[u8],
        now: u64,
        conn: usize,
    ) -> Result<(), String> {
        let id = h.request_id;
        if let Some(j) = self.inflight.iter().position(|p| p.id == id) {
            // Requests before j were skipped by the server: they stay unclassified until their
            // reply comes out of order (wrong) or their timeout passes (timed out).
            for p in self.inflight.drain(..j) {
                if !p.timed_out {
                    self.overdue.push_back(p);
                }
            }
            let p = self.inflight.pop_front().expect("position found");
            if p.timed_out {
                stats.r.late_replies += 1;
                return Ok(());
            }
            let (class, why) = judge(stats.plan, &p, h, payload);
            stats.classify(&p, class, now, conn, || why.unwrap_or_default());
            Ok(())
        } else if let Some(j) = self.overdue.iter().position(|p| p.id == id) {
            let p = self.overdue.remove(j).expect("position found");
            stats.classify(&p, Class::Wrong, now, conn, || {
                "reply arrived after the reply to a later request".into()
            });
            Ok(())
        } else {
            Err(format!("reply with unexpected request id {id}"))
        }
    }

    /// A complete HTTP response: it answers the oldest request in flight.
    fn on_http(
        &mut self,
        stats: &mut Stats<'_>,
        status: u16,
        body: &[u8],
        now: u64,
        conn: usize,
    ) -> Result<(), String> {
        let Some(p) = self.inflight.pop_front() else {
            return Err(format!(
                "HTTP {status} response with no request outstanding"
            ));
        };
        if p.timed_out {
            stats.r.late_replies += 1;
            return Ok(());
        }
        let (class, why) = match status {
            200 => {
                if body.len() < HEADER_LEN {
                    (
                        Class::Wrong,
                        Some(format!("HTTP 200 body of {} bytes", body.len())),
                    )
                } else {
                    let h = ReplyHeader::decode(body);
                    if h.magic != REPLY_MAGIC || h.version != VERSION {
                        (Class::Wrong, Some("HTTP body is not a reply frame".into()))
                    } else if HEADER_LEN + h.words as usize * 4 != body.len() {
                        (
                            Class::Wrong,
                            Some(format!(
                                "HTTP body of {} bytes holds other than one frame of {} words",
                                body.len(),
                                h.words
                            )),
                        )
                    } else if h.request_id != p.id {
                        (
                            Class::Wrong,
                            Some(format!(
                                "reply for request id {} (expected {})",
                                h.request_id, p.id
                            )),
                        )
                    } else {
                        judge(stats.plan, &p, &h, &body[HEADER_LEN..])
                    }
                }
            }
            503 => (Class::Busy, None),
            s => (Class::Error, Some(format!("HTTP status {s}"))),
        };
        stats.classify(&p, class, now, conn, || why.unwrap_or_default());
        Ok(())
    }

    /// A frame of the generation stream `inflight[j]`; true when it was the stream's final frame
    /// (the stream is then classified and removed). Allocation-free for token frames.
    fn on_stream_frame(
        &mut self,
        stats: &mut Stats<'_>,
        j: usize,
        h: &ReplyHeader,
        payload: &[u8],
        now: u64,
        conn: usize,
    ) -> bool {
        let plan = stats.plan;
        let gp = plan.streams.as_ref().expect("generation plan");
        if h.status == Status::Token as u16 {
            let p = &mut self.inflight[j];
            if p.timed_out {
                return false;
            }
            if p.fault == Fault::None {
                p.fault = if h.words != 1 {
                    Fault::TokenWords {
                        seq: h.seq,
                        words: h.words,
                    }
                } else if h.seq != p.tokens {
                    Fault::Seq {
                        got: h.seq,
                        want: p.tokens,
                    }
                } else {
                    let got = u32::from_le_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    match gp.golden[p.payload as usize].tokens.get(p.tokens as usize) {
                        Some(&w) if w == got => Fault::None,
                        want => Fault::Token {
                            seq: p.tokens,
                            got,
                            want: want.copied(),
                        },
                    }
                };
            }
            if p.k >= plan.warmup_end {
                let gs = stats.r.streams.as_mut().expect("generation stats");
                gs.tokens += 1;
                // Timing of streams that stay on their golden path only.
                if p.fault == Fault::None {
                    if p.tokens == 0 {
                        let ttft = now.saturating_sub(p.sched_ns).max(1);
                        gs.ttft.saturating_record(ttft);
                        if p.sched_ns < gp.first_window_end_ns {
                            gs.ttft_first.saturating_record(ttft);
                        }
                        if p.sched_ns >= gp.last_window_start_ns {
                            gs.ttft_last.saturating_record(ttft);
                        }
                    } else {
                        gs.gap
                            .saturating_record(now.saturating_sub(p.last_ns).max(1));
                    }
                }
            }
            p.tokens += 1;
            p.last_ns = now;
            return false;
        }
        let p = self.inflight.remove(j).expect("index in range");
        if p.timed_out {
            stats.r.late_replies += 1;
            return true;
        }
        if p.k >= plan.warmup_end {
            let gs = stats.r.streams.as_mut().expect("generation stats");
            gs.final_status[(h.status as usize).min(STATUS_SLOTS - 1)] += 1;
        }
        let g = &gp.golden[p.payload as usize];
        let (class, why) = match Status::from_u16(h.status) {
            Some(Status::EndOfStream) => {
                if p.fault != Fault::None {
                    (Class::Wrong, Some(p.fault.describe(p.payload)))
                } else if h.words != 2 || h.seq != p.tokens {
                    (
                        Class::Wrong,
                        Some(format!(
                            "end-of-stream frame with {} words and seq {} after {} tokens",
                            h.words, h.seq, p.tokens
                        )),
                    )
                } else if p.tokens as usize != g.tokens.len() || payload != g.final_bytes {
                    let got = [
                        u32::from_le_bytes([payload[0], payload[1], payload[2], payload[3]]),
                        u32::from_le_bytes([payload[4], payload[5], payload[6], payload[7]]),
                    ];
                    (
                        Class::Wrong,
                        Some(format!(
                            "stream ended after {} tokens with [finish_reason, generated] = \
                             {got:?}; the golden stream of prompt {} has {} tokens and {:?}",
                            p.tokens,
                            p.payload,
                            g.tokens.len(),
                            g.final_words()
                        )),
                    )
                } else {
                    (Class::Ok, None)
                }
            }
            Some(Status::Busy) if p.tokens == 0 => (Class::Busy, None),
            Some(Status::Cancelled) => (
                Class::Cancelled,
                Some(format!("cancelled after {} tokens", p.tokens)),
            ),
            Some(Status::Ok) => (
                Class::Wrong,
                Some("status ok (0) is not a generation stream frame".into()),
            ),
            _ => (
                Class::Error,
                Some(format!(
                    "status {} after {} tokens",
                    status_name(h.status),
                    p.tokens
                )),
            ),
        };
        stats.classify(&p, class, now, conn, || why.unwrap_or_default());
        true
    }

    /// The frames of an HTTP chunk (or Content-Length body) of a generation stream: whole
    /// frames of the oldest request in flight. `Err` means the stream can no longer be trusted.
    fn http_frames(
        &mut self,
        stats: &mut Stats<'_>,
        mut rest: &[u8],
        final_seen: &mut bool,
        now: u64,
        conn: usize,
    ) -> Result<(), String> {
        while !rest.is_empty() {
            if rest.len() < HEADER_LEN {
                return Err("HTTP chunk or body holds a partial frame".into());
            }
            let h = ReplyHeader::decode(rest);
            if h.magic != REPLY_MAGIC || h.version != VERSION {
                return Err("HTTP chunk or body is not a reply frame".into());
            }
            if h.words > MAX_REPLY_WORDS {
                return Err(format!("reply header claims {} words", h.words));
            }
            let len = HEADER_LEN + h.words as usize * 4;
            if rest.len() < len {
                return Err("HTTP chunk or body holds a partial frame".into());
            }
            if *final_seen {
                return Err("frame after the final frame of an HTTP response".into());
            }
            let Some(front) = self.inflight.front() else {
                return Err("HTTP response frames with no request outstanding".into());
            };
            if front.id != h.request_id {
                return Err(format!(
                    "frame for request id {} in the response to request id {}",
                    h.request_id, front.id
                ));
            }
            if self.on_stream_frame(stats, 0, &h, &rest[HEADER_LEN..len], now, conn) {
                *final_seen = true;
            }
            rest = &rest[len..];
        }
        Ok(())
    }

    /// An HTTP response of a generation stream is complete. If no final frame came, its
    /// request is judged by the HTTP status alone.
    fn end_http(
        &mut self,
        stats: &mut Stats<'_>,
        status: u16,
        final_seen: bool,
        now: u64,
        conn: usize,
    ) -> Result<(), String> {
        if final_seen {
            return Ok(());
        }
        let Some(p) = self.inflight.pop_front() else {
            return Err(format!(
                "HTTP {status} response with no request outstanding"
            ));
        };
        if p.timed_out {
            stats.r.late_replies += 1;
            return Ok(());
        }
        let (class, why) = match status {
            503 if p.tokens == 0 => (Class::Busy, String::new()),
            200 => (
                Class::Wrong,
                format!(
                    "HTTP 200 response ended without a final frame after {} tokens",
                    p.tokens
                ),
            ),
            s => (
                Class::Error,
                format!("HTTP status {s} without a final frame"),
            ),
        };
        stats.classify(&p, class, now, conn, || why);
        Ok(())
    }

    /// Classify everything still owed on a broken connection. With `head_wrong`, the oldest
    /// request in flight is counted wrong (its reply slot held garbage), the rest conn_failed.
    fn fail_all(
        &mut self,
        stats: &mut Stats<'_>,
        now: u64,
        conn: usize,
        mut head_wrong: Option<String>,
        reason: &str,
    ) {
        for p in self.inflight.drain(..) {
            if p.timed_out {
                continue;
            }
            match head_wrong.take() {
                Some(why) => stats.classify(&p, Class::Wrong, now, conn, || why),
                None => stats.classify(&p, Class::ConnFailed, now, conn, || reason.to_string()),
            }
        }
        for p in self.overdue.drain(..).chain(self.backlog.drain(..)) {
            stats.classify(&p, Class::ConnFailed, now, conn, || reason.to_string());
        }
    }

    fn sweep(&mut self, stats: &mut Stats<'_>, now: u64, conn: usize) {
        let timeout = stats.plan.timeout_ns;
        let expired = |p: &Pending| p.sched_ns.saturating_add(timeout) <= now;
        for p in self.inflight.iter_mut() {
            if p.timed_out {
                continue;
            }
            if !expired(p) {
                break;
            }
            // It keeps its place: the server still owes the reply, which keeps the order.
            p.timed_out = true;
            stats.classify(p, Class::TimedOut, now, conn, || {
                "no reply within the timeout".into()
            });
        }
        while self.overdue.front().is_some_and(expired) {
            let p = self.overdue.pop_front().expect("front exists");
            stats.classify(&p, Class::TimedOut, now, conn, || {
                "never answered (later requests were)".into()
            });
        }
        while self.backlog.front().is_some_and(expired) {
            let p = self.backlog.pop_front().expect("front exists");
            stats.classify(&p, Class::TimedOut, now, conn, || {
                "never sent: the connection's pipeline stayed full".into()
            });
        }
    }
}

impl Conn {
    /// Append request `p` to the output buffer and put it in flight.
    fn send(
        &mut self,
        stats: &mut Stats<'_>,
        p: Pending,
        dirty: &mut Vec<usize>,
        local: usize,
        now: u64,
    ) {
        let plan = stats.plan;
        let req = &plan.requests[p.payload as usize];
        let at = self.io.out.len();
        self.io.out.extend_from_slice(req);
        self.io.out[at + plan.id_offset..at + plan.id_offset + 4]
            .copy_from_slice(&p.id.to_le_bytes());
        stats.r.request_bytes += req.len() as u64;
        if p.k >= plan.warmup_end {
            stats.r.last_send_ns = stats.r.last_send_ns.max(now);
            stats
                .r
                .send_lag
                .saturating_record(now.saturating_sub(p.sched_ns).max(1));
        }
        self.q.inflight.push_back(p);
        if !self.io.dirty {
            self.io.dirty = true;
            dirty.push(local);
        }
    }

    /// Move requests from the backlog into free pipeline slots.
    fn refill(&mut self, stats: &mut Stats<'_>, dirty: &mut Vec<usize>, local: usize, now: u64) {
        while self.q.inflight.len() < stats.plan.pipeline {
            let Some(p) = self.q.backlog.pop_front() else {
                break;
            };
            self.send(stats, p, dirty, local, now);
        }
    }

    fn break_conn(
        &mut self,
        stats: &mut Stats<'_>,
        now: u64,
        head_wrong: Option<String>,
        reason: &str,
    ) {
        // Dropping the stream closes the fd, which also removes it from the epoll set.
        self.io.stream = None;
        self.io.out.clear();
        self.io.out_pos = 0;
        self.q.fail_all(stats, now, self.index, head_wrong, reason);
    }

    /// Write as much of the output buffer as the socket takes.
    fn flush(&mut self, stats: &mut Stats<'_>, now: u64) {
        while self.io.out_pos < self.io.out.len() {
            let Some(s) = self.io.stream.as_mut() else {
                return;
            };
            match s.write(&self.io.out[self.io.out_pos..]) {
                Ok(0) => return self.break_conn(stats, now, None, "write returned 0"),
                Ok(n) => self.io.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Edge-triggered: EPOLLOUT reports when there is room again.
                    self.io.writable = false;
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return self.break_conn(stats, now, None, &format!("write failed: {e}")),
            }
        }
        self.io.out.clear();
        self.io.out_pos = 0;
    }

    /// Read everything available and handle the replies in it.
    fn on_readable(&mut self, stats: &mut Stats<'_>, dirty: &mut Vec<usize>, local: usize) {
        loop {
            let io = &mut self.io;
            if io.in_end == io.inb.len() {
                if io.in_start > 0 {
                    io.inb.copy_within(io.in_start..io.in_end, 0);
                    io.in_end -= io.in_start;
                    io.in_start = 0;
                } else {
                    let n = io.inb.len() * 2;
                    io.inb.resize(n, 0);
                }
            }
            let Some(s) = io.stream.as_mut() else { return };
            let r = s.read(&mut io.inb[io.in_end..]);
            // The arrival time of everything in this read.
            let now = monotonic_ns();
            match r {
                Ok(0) => {
                    return self.break_conn(stats, now, None, "connection closed by the server");
                }
                Ok(n) => {
                    self.io.in_end += n;
                    stats.r.reply_bytes += n as u64;
                    if let Err(why) = self.parse(stats, now) {
                        return self.break_conn(stats, now, Some(why.clone()), &why);
                    }
                    if self.io.stream.is_none() {
                        return;
                    }
                    self.refill(stats, dirty, local, now);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return self.break_conn(stats, now, None, &format!("read failed: {e}")),
            }
        }
    }

    /// Handle every complete reply in the input buffer.
    fn parse(&mut self, stats: &mut Stats<'_>, now: u64) -> Result<(), String> {
        let Conn { index, io, q } = self;
        let conn = *index;
        loop {
            let avail = &io.inb[io.in_start..io.in_end];
            if stats.plan.http && stats.plan.streams.is_some() {
                match io.rx {
                    HttpRx::Head => {
                        let Some(head) = parse_head(avail)? else {
                            break;
                        };
                        match head.body {
                            BodyKind::Length(n) => {
                                let end = head.head_len + n;
                                if avail.len() < end {
                                    break;
                                }
                                let mut fin = false;
                                q.http_frames(
                                    stats,
                                    &avail[head.head_len..end],
                                    &mut fin,
                                    now,
                                    conn,
                                )?;
                                io.in_start += end;
                                q.end_http(stats, head.status, fin, now, conn)?;
                            }
                            BodyKind::Chunked => {
                                io.in_start += head.head_len;
                                io.rx = HttpRx::Chunks {
                                    status: head.status,
                                    close: head.close,
                                    final_seen: false,
                                };
                                continue;
                            }
                        }
                        if head.close {
                            io.in_start = io.in_end;
                            io.stream = None;
                            let why = "server closed the connection (Connection: close)";
                            q.fail_all(stats, now, conn, None, why);
                            break;
                        }
                    }
                    HttpRx::Chunks {
                        status,
                        close,
                        mut final_seen,
                    } => {
                        let Some(c) = parse_chunk(avail)? else {
                            break;
                        };
                        if !c.last {
                            q.http_frames(stats, &avail[c.data], &mut final_seen, now, conn)?;
                            io.in_start += c.consumed;
                            io.rx = HttpRx::Chunks {
                                status,
                                close,
                                final_seen,
                            };
                            continue;
                        }
                        io.in_start += c.consumed;
                        io.rx = HttpRx::Head;
                        q.end_http(stats, status, final_seen, now, conn)?;
                        if close {
                            io.in_start = io.in_end;
                            io.stream = None;
                            let why = "server closed the connection (Connection: close)";
                            q.fail_all(stats, now, conn, None, why);
                            break;
                        }
                    }
                }
            } else if stats.plan.http {
                let Some(r) = parse_response(avail, &mut io.body)? else {
                    break;
                };
                q.on_http(stats, r.status, &io.body, now, conn)?;
                io.in_start += r.consumed;
                if r.close {
                    io.in_start = io.in_end;
                    let why = "server closed the connection (Connection: close)";
                    // Not a desync: the remaining requests just lost their connection.
                    io.stream = None;
                    q.fail_all(stats, now, conn, None, why);
                    break;
                }
            } else {
                if avail.len() < HEADER_LEN {
                    break;
                }
                let h = ReplyHeader::decode(avail);
                if h.magic != REPLY_MAGIC || h.version != VERSION {
                    return Err(format!(
                        "malformed reply header (magic {:#010x}, version {})",
                        h.magic, h.version
                    ));
                }
                if h.words > MAX_REPLY_WORDS {
                    return Err(format!("reply header claims {} words", h.words));
                }
                let len = HEADER_LEN + h.words as usize * 4;
                if avail.len() < len {
                    break;
                }
                if stats.plan.streams.is_some() {
                    // Streams on one connection run concurrently: frames are matched by id.
                    let id = h.request_id;
                    let Some(j) = q.inflight.iter().position(|p| p.id == id) else {
                        return Err(format!("stream frame with unexpected request id {id}"));
                    };
                    q.on_stream_frame(stats, j, &h, &avail[HEADER_LEN..len], now, conn);
                } else {
                    q.on_frame(stats, &h, &avail[HEADER_LEN..len], now, conn)?;
                }
                io.in_start += len;
            }
        }
        if io.in_start == io.in_end {
            io.in_start = 0;
            io.in_end = 0;
        }
        Ok(())
    }
}

/// A nanosecond histogram from 1 ns to 1000 s with 3 significant digits.
pub(crate) fn new_histogram() -> io::Result<Histogram<u64>> {
    Histogram::new_with_bounds(1, 1_000_000_000_000, 3).map_err(|e| io::Error::other(e.to_string()))
}

/// Run one I/O thread over `streams` (global connection `local * T + thread`).
pub(crate) fn run_thread(
    plan: &Plan,
    thread: usize,
    streams: Vec<TcpStream>,
    progress: &AtomicU64,
) -> io::Result<ThreadResult> {
    let epfd = epoll::create(epoll::CreateFlags::CLOEXEC)?;
    let timer: OwnedFd = timerfd_create(
        TimerfdClockId::Monotonic,
        TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
    )?;
    epoll::add(
        &epfd,
        &timer,
        epoll::EventData::new_u64(TIMER_TOKEN),
        epoll::EventFlags::IN,
    )?;
    let mut conns = Vec::with_capacity(streams.len());
    for (local, s) in streams.into_iter().enumerate() {
        s.set_nonblocking(true)?;
        epoll::add(
            &epfd,
            &s,
            epoll::EventData::new_u64(local as u64),
            epoll::EventFlags::IN
                | epoll::EventFlags::OUT
                | epoll::EventFlags::RDHUP
                | epoll::EventFlags::ET,
        )?;
        conns.push(Conn {
            index: local * plan.threads + thread,
            io: Io {
                stream: Some(s),
                out: Vec::with_capacity(plan.requests[0].len() * plan.pipeline),
                out_pos: 0,
                inb: vec![0; 64 * 1024],
                in_start: 0,
                in_end: 0,
                body: Vec::with_capacity(1024),
                rx: HttpRx::Head,
                writable: true,
                dirty: false,
            },
            q: Queues::default(),
        });
    }
    let mut stats = Stats {
        plan,
        r: ThreadResult {
            measured: Counts::default(),
            warmup: Counts::default(),
            hist: new_histogram()?,
            send_lag: new_histogram()?,
            request_bytes: 0,
            reply_bytes: 0,
            last_send_ns: 0,
            last_done_ns: 0,
            late_replies: 0,
            samples: Vec::new(),
            streams: match plan.streams {
                Some(_) => Some(GenStats::new()?),
                None => None,
            },
        },
        outstanding: 0,
        completed: 0,
        progress,
    };
    let c = plan.connections as u64;
    let t = plan.threads as u64;
    // This thread's requests are those whose connection k % C is ≡ thread (mod T).
    let next_after = |k: u64| -> u64 {
        let cc = k % c;
        if cc + t < c {
            k + t
        } else {
            k - cc + c + thread as u64
        }
    };
    let mut next_k = thread as u64;
    let mut dirty: Vec<usize> = Vec::with_capacity(conns.len());
    let mut events: Vec<epoll::Event> = Vec::with_capacity(256);
    let mut last_sweep = 0u64;
    let mut armed = 0u64;
    // Smoothed lateness of timer wake-ups (ns), which sets the spin margin.
    let mut wake_late = SPIN_NS / 2;
    let mut spin = SPIN_NS;
    loop {
        let now = monotonic_ns();
        // 1. Put every due request on its connection (or in its backlog, or fail it).
        while next_k < plan.end {
            let sched = plan.sched_ns(next_k);
            if sched > now {
                break;
            }
            let k = next_k;
            next_k = next_after(k);
            let local = (k % c) as usize / plan.threads;
            let p = Pending {
                k,
                sched_ns: sched,
                id: k as u32,
                payload: (k % plan.requests.len() as u64) as u32,
                timed_out: false,
                tokens: 0,
                last_ns: 0,
                fault: Fault::None,
            };
            stats.outstanding += 1;
            let conn = &mut conns[local];
            if conn.io.stream.is_none() {
                let i = conn.index;
                stats.classify(&p, Class::ConnFailed, now, i, || {
                    "connection closed earlier".into()
                });
            } else if conn.q.inflight.len() < plan.pipeline && conn.q.backlog.is_empty() {
                conn.send(&mut stats, p, &mut dirty, local, now);
            } else {
                conn.q.backlog.push_back(p);
            }
        }
        // 2. Timeouts.
        if now >= last_sweep + SWEEP_NS {
            last_sweep = now;
            for conn in conns.iter_mut() {
                let i = conn.index;
                conn.q.sweep(&mut stats, now, i);
            }
        }
        // 3. Write what was queued.
        for local in dirty.drain(..) {
            let conn = &mut conns[local];
            conn.io.dirty = false;
            if conn.io.writable {
                conn.flush(&mut stats, now);
            }
        }
        if next_k >= plan.end && stats.outstanding == 0 {
            break;
        }
        // 4. Wait for replies or the next send, whichever comes first.
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let fallback = Timespec {
            tv_sec: 0,
            tv_nsec: 10_000_000,
        };
        let drain_wait = Timespec {
            tv_sec: 0,
            tv_nsec: SWEEP_NS as i64,
        };
        let timeout = if next_k < plan.end {
            let due = plan.sched_ns(next_k);
            if due <= monotonic_ns() + spin {
                // Due within the spin window: poll, so the send leaves on time.
                zero
            } else {
                // epoll_wait's own timeout has millisecond resolution; a timerfd is exact.
                let wake = due - spin;
                if armed != wake {
                    let ts = Timespec {
                        tv_sec: (wake / 1_000_000_000) as i64,
                        tv_nsec: (wake % 1_000_000_000) as i64,
                    };
                    timerfd_settime(
                        &timer,
                        TimerfdTimerFlags::ABSTIME,
                        &Itimerspec {
                            it_interval: zero,
                            it_value: ts,
                        },
                    )?;
                    armed = wake;
                }
                fallback
            }
        } else {
            drain_wait
        };
        events.clear();
        match epoll::wait(
            &epfd,
            rustix::buffer::spare_capacity(&mut events),
            Some(&timeout),
        ) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        for ev in events.iter() {
            let token = ev.data.u64();
            if token == TIMER_TOKEN {
                let mut b = [0u8; 8];
                // Only clears the readiness; the count of expirations does not matter.
                let _ = rustix::io::read(&timer, &mut b);
                if armed != 0 {
                    let late = monotonic_ns().saturating_sub(armed).min(SPIN_MAX_NS);
                    wake_late = (wake_late * 7 + late) / 8;
                    spin = (wake_late + 10_000).clamp(SPIN_MIN_NS, SPIN_MAX_NS);
                }
                armed = 0;
                continue;
            }
            let local = token as usize;
            let conn = &mut conns[local];
            if conn.io.stream.is_none() {
                continue;
            }
            let flags = ev.flags;
            if flags.intersects(
                epoll::EventFlags::IN
                    | epoll::EventFlags::ERR
                    | epoll::EventFlags::HUP
                    | epoll::EventFlags::RDHUP,
            ) {
                // Reading also surfaces errors and EOF (after any replies still buffered).
                conn.on_readable(&mut stats, &mut dirty, local);
            }
            if flags.contains(epoll::EventFlags::OUT) && conn.io.stream.is_some() {
                conn.io.writable = true;
                if !conn.io.dirty && conn.io.out_pos < conn.io.out.len() {
                    conn.io.dirty = true;
                    dirty.push(local);
                }
            }
        }
    }
    Ok(stats.r)
}
