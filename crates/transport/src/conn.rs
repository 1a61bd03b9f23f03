//! Per-connection protocol state shared by all transports: framing, admission, reply order,
//! and reply encoding (bare frames or HTTP). No I/O happens here.
//!
//! Every framed item (a request, or input the framer rejected) takes the next `conn_seq` and a
//! place in `pending`. Replies are emitted strictly in `conn_seq` order: output for the oldest
//! pending item goes straight to the write buffer; output for later items waits in their own
//! buffer until everything before them is done. Nothing is ever dropped: each item ends with
//! exactly one final frame (its result, an error frame, or busy).

use std::collections::VecDeque;
use std::sync::Arc;

use bgs_protocol::reply::{encode_reply, http_response_head};
use bgs_protocol::{Decoded, Framer, FramerConfig, Framing, HEADER_LEN, Reject, Request, Status};

use crate::stats::{RequestMetrics, TransportStats};

/// What the executor side did with a framed request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submit {
    /// Published; a completion with this `conn_seq` will follow.
    Queued,
    /// Refused: the ring is full. Answered with a busy frame.
    Busy,
    /// Floor mode: answer with the payload now (echo without the ring).
    EchoNow,
    /// Floor mode: this op is not served.
    Unsupported,
}

/// Where framed requests go.
pub trait RequestSink {
    /// Offer one request of connection `token` with sequence `conn_seq`.
    fn submit(&mut self, token: u64, conn_seq: u32, request: &Request<'_>) -> Submit;

    /// CLOCK_MONOTONIC ns at which the requests being offered arrived (request-duration
    /// metrics; only asked for when the connection has them).
    fn arrival_ns(&self) -> u64 {
        bgs_ring::monotonic_ns()
    }
}

/// Per-connection limits.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Items (requests and error replies) not yet fully answered; reading stops at this many.
    pub max_inflight: usize,
    /// Reply bytes not yet written to the socket, counting the buffered frames of later
    /// pipelined items; reading stops at this many, and streamed frames beyond it are not
    /// acknowledged (their stream runs out of credit) until writes drain.
    pub max_unsent: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_inflight: 64,
            max_unsent: 256 * 1024,
        }
    }
}

// The reply encoders live in the protocol crate (the kernel transport and the executors
// share them); re-exported here so existing `conn::` paths keep working.
pub use bgs_protocol::reply::{FrameOut, encode_frame, encode_reject};

#[derive(Debug)]
struct Pending {
    framing: Framing,
    /// Output produced while older items were still pending.
    buf: Vec<u8>,
    /// For HTTP: the response head has been written (a chunked stream is open).
    http_started: bool,
    done: bool,
    /// Wire op and arrival time (ns), for [`RequestMetrics::observe`] at the final frame.
    op: u16,
    arrival_ns: u64,
}

/// The state of one connection.
#[derive(Debug)]
pub struct ConnState {
    token: u64,
    framer: Framer,
    limits: ConnLimits,
    pending: VecDeque<Pending>,
    /// `conn_seq` of `pending[0]`.
    base_seq: u32,
    wbuf: Vec<u8>,
    wpos: usize,
    /// Bytes in the `buf` of pending items other than the front one (frames of later
    /// pipelined items waiting for their turn).
    parked_bytes: usize,
    /// No more input is decoded (EOF, a closing error, or `Connection: close`).
    read_closed: bool,
    /// Requests published and not yet finally completed.
    queued: usize,
    /// Where answered requests are counted (`None`: not measured).
    metrics: Option<Arc<RequestMetrics>>,
}

impl ConnState {
    /// State for a new connection identified by `token` in completions.
    pub fn new(token: u64, framer: FramerConfig, limits: ConnLimits) -> Self {
        ConnState {
            token,
            framer: Framer::new(framer),
            limits,
            pending: VecDeque::new(),
            base_seq: 0,
            wbuf: Vec::new(),
            wpos: 0,
            parked_bytes: 0,
            read_closed: false,
            queued: 0,
            metrics: None,
        }
    }

    /// Count this connection's answered requests and their durations in `metrics`.
    pub fn set_metrics(&mut self, metrics: Arc<RequestMetrics>) {
        self.metrics = Some(metrics);
    }

    /// The token completions carry for this connection.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// True while more input may be decoded and the limits leave room for it.
    pub fn wants_input(&self) -> bool {
        !self.read_closed
            && self.pending.len() < self.limits.max_inflight
            && self.buffered() < self.limits.max_unsent
    }

    /// Reply bytes held for this connection: the write buffer's unsent part plus the frames
    /// of later pipelined items waiting for their turn.
    pub fn buffered(&self) -> usize {
        self.unsent().len() + self.parked_bytes
    }

    /// Whether a streamed frame of item `conn_seq`, already encoded, may be acknowledged to
    /// the executor now (the stream gets its credit back). The front item's frames go to the
    /// write buffer, so they are acknowledged while the write buffer is within `max_unsent`;
    /// a later item's frames while everything buffered is. Judging the front by the write
    /// buffer alone keeps it moving when later items have filled the budget (they only drain
    /// once the front is done); an item that is no longer pending (done, or the frame was
    /// dropped) holds nothing back.
    pub fn may_ack(&self, conn_seq: u32) -> bool {
        let idx = conn_seq.wrapping_sub(self.base_seq) as usize;
        if idx >= self.pending.len() {
            true
        } else if idx == 0 {
            self.unsent().len() <= self.limits.max_unsent
        } else {
            idx < self.limits.max_inflight && self.buffered() <= self.limits.max_unsent
        }
    }

    /// True once no more input will be decoded.
    pub fn read_closed(&self) -> bool {
        self.read_closed
    }

    /// The peer ended its byte stream: nothing more will be decoded (a trailing partial frame
    /// is discarded), but replies owed are still sent.
    pub fn on_eof(&mut self) {
        self.read_closed = true;
    }

    /// Requests waiting for the executor.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// Items not yet fully answered.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// True when the connection has nothing more to do and can be closed.
    pub fn finished(&self) -> bool {
        self.read_closed && self.pending.is_empty() && self.unsent().is_empty()
    }

    /// Reply bytes ready to write.
    pub fn unsent(&self) -> &[u8] {
        &self.wbuf[self.wpos..]
    }

    /// `n` bytes of [`Self::unsent`] were written.
    pub fn advance(&mut self, n: usize) {
        self.wpos += n;
        if self.wpos >= self.wbuf.len() {
            self.wbuf.clear();
            self.wpos = 0;
        }
    }

    /// Decode as many items from `data` as the limits allow; returns the bytes consumed.
    pub fn ingest(
        &mut self,
        data: &[u8],
        sink: &mut dyn RequestSink,
        stats: &mut TransportStats,
    ) -> usize {
        let mut off = 0;
        while self.wants_input() {
            match self.framer.decode(&data[off..]) {
                Decoded::NeedMore => break,
                Decoded::Request { consumed, request } => {
                    off += consumed;
                    stats.requests += 1;
                    let seq = self.base_seq.wrapping_add(self.pending.len() as u32);
                    self.pending.push_back(Pending {
                        framing: request.framing,
                        buf: Vec::new(),
                        http_started: false,
                        done: false,
                        op: request.header.op,
                        arrival_ns: if self.metrics.is_some() {
                            sink.arrival_ns()
                        } else {
                            0
                        },
                    });
                    let id = request.header.request_id;
                    match sink.submit(self.token, seq, &request) {
                        Submit::Queued => {
                            stats.published += 1;
                            self.queued += 1;
                        }
                        Submit::Busy => {
                            stats.busy += 1;
                            self.emit(seq, Status::Busy, true, 0, id, &[]);
                        }
                        Submit::EchoNow => {
                            // On the stack: floor mode measures TCP, not the allocator.
                            let mut words = [0u32; bgs_ring::SLOT_WORDS];
                            let n = (request.payload.len() / 4).min(words.len());
                            bgs_protocol::wire::words_from_le(request.payload, &mut words[..n]);
                            self.emit(seq, Status::Ok, true, 0, id, &words[..n]);
                        }
                        Submit::Unsupported => {
                            stats.rejects[Status::UnknownOp as usize] += 1;
                            self.emit(seq, Status::UnknownOp, true, 0, id, &[]);
                        }
                    }
                    if let Framing::Http { keep_alive: false } = request.framing {
                        self.read_closed = true;
                    }
                }
                Decoded::Reject { consumed, reject } => {
                    off += consumed;
                    self.reject(reject, stats);
                }
            }
        }
        off
    }

    fn reject(&mut self, reject: Reject, stats: &mut TransportStats) {
        match (reject.status, reject.http_status) {
            (Some(s), _) => stats.rejects[s as usize] += 1,
            (None, Some(code)) => stats.http_reject(code),
            (None, None) => {}
        }
        let mut out = Vec::new();
        match reject.http_status {
            None => {
                let status = reject.status.unwrap_or(Status::Internal);
                encode_reply(&mut out, status, reject.request_id, 0, &[]);
            }
            Some(code) => {
                let body = if reject.status.is_some() {
                    HEADER_LEN
                } else {
                    0
                };
                http_response_head(&mut out, code, Some(body), reject.close);
                if let Some(status) = reject.status {
                    encode_reply(&mut out, status, reject.request_id, 0, &[]);
                }
            }
        }
        if reject.close {
            self.read_closed = true;
        }
        self.push_done(out);
    }

    fn push_done(&mut self, bytes: Vec<u8>) {
        if self.pending.is_empty() {
            self.wbuf.extend_from_slice(&bytes);
            return;
        }
        self.parked_bytes += bytes.len();
        self.pending.push_back(Pending {
            framing: Framing::Binary,
            buf: bytes,
            http_started: true,
            done: true,
            op: 0,
            arrival_ns: 0,
        });
    }

    /// Deliver one completion frame for item `conn_seq`. Returns false for a sequence number
    /// that is not pending (a stale or duplicate completion), which is ignored.
    pub fn complete(
        &mut self,
        conn_seq: u32,
        status: Status,
        final_: bool,
        stream_seq: u32,
        request_id: u32,
        words: &[u32],
    ) -> bool {
        let idx = conn_seq.wrapping_sub(self.base_seq) as usize;
        match self.pending.get(idx) {
            Some(p) if !p.done => {}
            _ => return false,
        }
        if final_ {
            self.queued = self.queued.saturating_sub(1);
        }
        self.emit(conn_seq, status, final_, stream_seq, request_id, words);
        true
    }

    fn emit(
        &mut self,
        conn_seq: u32,
        status: Status,
        final_: bool,
        stream_seq: u32,
        request_id: u32,
        words: &[u32],
    ) {
        let idx = conn_seq.wrapping_sub(self.base_seq) as usize;
        let p = &mut self.pending[idx];
        let out = if idx == 0 { &mut self.wbuf } else { &mut p.buf };
        let before = out.len();
        let frame = FrameOut {
            status,
            final_,
            stream_seq,
            request_id,
            words,
        };
        encode_frame(out, p.framing, &mut p.http_started, &frame);
        if idx != 0 {
            self.parked_bytes += out.len() - before;
        }
        if final_ {
            p.done = true;
            if let Some(m) = &self.metrics {
                let elapsed = bgs_ring::monotonic_ns().saturating_sub(p.arrival_ns);
                m.observe(p.op, status, elapsed);
            }
        }
        if idx == 0 {
            self.flush_front();
        }
    }

    /// Pop finished items from the front, moving the output of the new front item into the
    /// write buffer so that its later frames can go there directly.
    fn flush_front(&mut self) {
        while let Some(front) = self.pending.front_mut() {
            if !front.buf.is_empty() {
                self.parked_bytes -= front.buf.len();
                self.wbuf.extend_from_slice(&front.buf);
                front.buf = Vec::new();
            }
            if !front.done {
                break;
            }
            self.pending.pop_front();
            self.base_seq = self.base_seq.wrapping_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bgs_protocol::reply::{encode_http_request, encode_request};
    use bgs_protocol::{Op, ReplyHeader, RequestHeader};

    /// Queues everything and remembers the order, or refuses everything.
    struct Recorder {
        busy: bool,
        seen: Vec<(u32, u32)>,
    }
    impl RequestSink for Recorder {
        fn submit(&mut self, _token: u64, conn_seq: u32, r: &Request<'_>) -> Submit {
            self.seen.push((conn_seq, r.header.request_id));
            if self.busy {
                Submit::Busy
            } else {
                Submit::Queued
            }
        }
    }

    fn frames(bytes: &[u8]) -> Vec<ReplyHeader> {
        let mut out = Vec::new();
        let mut off = 0;
        while off + HEADER_LEN <= bytes.len() {
            let h = ReplyHeader::decode(&bytes[off..]);
            off += HEADER_LEN + h.words as usize * 4;
            out.push(h);
        }
        out
    }

    fn req(id: u32) -> Vec<u8> {
        let mut v = Vec::new();
        encode_request(&mut v, &RequestHeader::new(Op::Echo, id, 1, 0), &[id]);
        v
    }

    #[test]
    fn out_of_order_completions_are_sent_in_order() {
        let mut c = ConnState::new(1, FramerConfig::default(), ConnLimits::default());
        let mut sink = Recorder {
            busy: false,
            seen: vec![],
        };
        let mut st = TransportStats::default();
        let mut input: Vec<u8> = (10..15).flat_map(req).collect();
        // A semantic error in the middle takes its place in the order.
        let mut bad = RequestHeader::new(Op::Echo, 99, 0, 0);
        bad.op = 77;
        encode_request(&mut input, &bad, &[]);
        input.extend(req(15));
        let n = c.ingest(&input, &mut sink, &mut st);
        assert_eq!(n, input.len());
        assert_eq!(sink.seen.len(), 6);
        assert!(c.unsent().is_empty());
        // Complete in reverse.
        for &(seq, id) in sink.seen.iter().rev() {
            assert!(c.complete(seq, Status::Ok, true, 0, id, &[id]));
        }
        let ids: Vec<(u32, u16)> = frames(c.unsent())
            .iter()
            .map(|h| (h.request_id, h.status))
            .collect();
        assert_eq!(
            ids,
            vec![
                (10, 0),
                (11, 0),
                (12, 0),
                (13, 0),
                (14, 0),
                (99, 18),
                (15, 0)
            ]
        );
        assert_eq!(c.pending(), 0);
        // A duplicate completion is ignored.
        assert!(!c.complete(0, Status::Ok, true, 0, 10, &[]));
    }

    #[test]
    fn inflight_limit_stops_decoding() {
        let limits = ConnLimits {
            max_inflight: 3,
            max_unsent: 1 << 20,
        };
        let mut c = ConnState::new(1, FramerConfig::default(), limits);
        let mut sink = Recorder {
            busy: false,
            seen: vec![],
        };
        let mut st = TransportStats::default();
        let input: Vec<u8> = (0..5).flat_map(req).collect();
        let n = c.ingest(&input, &mut sink, &mut st);
        assert_eq!(n, 3 * 28);
        assert!(!c.wants_input());
        assert!(c.complete(0, Status::Ok, true, 0, 0, &[0]));
        assert!(c.wants_input());
        let m = c.ingest(&input[n..], &mut sink, &mut st);
        assert_eq!(m, 28);
    }

    #[test]
    fn busy_and_framing_error_then_close() {
        let mut c = ConnState::new(1, FramerConfig::default(), ConnLimits::default());
        let mut sink = Recorder {
            busy: true,
            seen: vec![],
        };
        let mut st = TransportStats::default();
        let mut input = req(1);
        input.extend(b"junk that is not a frame");
        input.extend(req(2));
        c.ingest(&input, &mut sink, &mut st);
        let hs = frames(c.unsent());
        assert_eq!(hs.len(), 2);
        assert_eq!(hs[0].status, Status::Busy as u16);
        assert_eq!(hs[1].status, Status::BadMagic as u16);
        assert!(c.read_closed());
        let n = c.unsent().len();
        c.advance(n);
        assert!(c.finished());
        assert_eq!(st.busy, 1);
    }

    #[test]
    fn later_items_frames_count_against_the_unsent_limit_and_credit() {
        let limits = ConnLimits {
            max_inflight: 8,
            max_unsent: 100,
        };
        let mut c = ConnState::new(1, FramerConfig::default(), limits);
        let mut sink = Recorder {
            busy: false,
            seen: vec![],
        };
        let mut st = TransportStats::default();
        let input: Vec<u8> = (0..3).flat_map(req).collect();
        c.ingest(&input, &mut sink, &mut st);
        // Item 1 streams while item 0 runs: its frames (28 bytes each) wait in its buffer.
        for k in 0..3 {
            assert!(c.complete(1, Status::Token, false, k, 1, &[k]));
            assert!(c.may_ack(1), "{} bytes buffered", c.buffered());
        }
        assert!(c.unsent().is_empty());
        assert_eq!(c.buffered(), 84);
        assert!(c.wants_input());
        assert!(c.complete(1, Status::Token, false, 3, 1, &[3]));
        assert_eq!(c.buffered(), 112);
        assert!(!c.may_ack(1), "over the limit: no credit for a later item");
        assert!(!c.may_ack(2));
        assert!(!c.wants_input(), "parked frames stop reading too");
        // The front item is judged by the write buffer alone, so it keeps its credit.
        assert!(c.complete(0, Status::Token, false, 0, 0, &[0]));
        assert!(c.may_ack(0));
        // Item 0 ends: item 1's frames move to the write buffer; 112 + 56 bytes unsent.
        assert!(c.complete(0, Status::EndOfStream, true, 1, 0, &[]));
        assert_eq!(c.unsent().len(), 28 + 24 + 112);
        assert_eq!(c.buffered(), c.unsent().len());
        assert!(!c.may_ack(1), "now the front, but its write buffer is over");
        assert!(c.may_ack(0), "done: nothing to hold back");
        c.advance(70);
        assert!(c.may_ack(1));
        assert!(c.wants_input());
    }

    #[test]
    fn http_replies_are_wrapped() {
        let mut c = ConnState::new(1, FramerConfig::default(), ConnLimits::default());
        let mut sink = Recorder {
            busy: false,
            seen: vec![],
        };
        let mut st = TransportStats::default();
        let mut input = Vec::new();
        encode_http_request(&mut input, "h", &req(5));
        encode_http_request(&mut input, "h", &req(6));
        c.ingest(&input, &mut sink, &mut st);
        assert!(c.complete(1, Status::Token, false, 0, 6, &[1]));
        assert!(c.complete(1, Status::Ok, true, 1, 6, &[2]));
        assert!(c.unsent().is_empty(), "second reply waits for the first");
        assert!(c.complete(0, Status::Ok, true, 0, 5, &[5]));
        let text = String::from_utf8_lossy(c.unsent()).to_string();
        let first = text.find("Content-Length: 28").unwrap();
        let second = text.find("Transfer-Encoding: chunked").unwrap();
        assert!(first < second);
        assert!(text.ends_with("0\r\n\r\n"));
    }
}
