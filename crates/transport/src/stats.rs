//! Transport counters, printed at shutdown, and the few a scrape reads while it runs.

use std::sync::atomic::{AtomicU64, Ordering};

use bgs_protocol::Status;
use serde::Serialize;

/// Counters of one transport thread.
#[derive(Debug, Default, Clone, Serialize)]
pub struct TransportStats {
    /// Connections accepted.
    pub conns_accepted: u64,
    /// Connections closed (for any reason).
    pub conns_closed: u64,
    /// Connections refused because the connection limit was reached.
    pub conns_refused: u64,
    /// Valid requests framed.
    pub requests: u64,
    /// Requests published into the request ring.
    pub published: u64,
    /// Requests refused with busy because the ring was full.
    pub busy: u64,
    /// Error replies by frame status (index = status value) for rejected input.
    pub rejects: [u64; 32],
    /// HTTP-level rejections (no frame status), by code: 400, 404, 405, 411, 431.
    pub http_rejects: [u64; 5],
    /// Completions reaped from the completion ring.
    pub completions: u64,
    /// Completions for connections that had already closed (dropped).
    pub stale_completions: u64,
    /// Reply frames written (including error frames).
    pub replies: u64,
    /// Bytes read and written.
    pub bytes_in: u64,
    /// Bytes written.
    pub bytes_out: u64,
    /// epoll_wait calls.
    pub epoll_waits: u64,
    /// With an executor that wakes the transport on every completion (`wake_timeout` set):
    /// waits that ended at that safety timeout while requests were outstanding. Near zero
    /// when the wakes work; each one is a completion found late or a slow request.
    pub wake_timeouts: u64,
    /// Connections closed by a read or write error (reset, broken pipe).
    pub io_errors: u64,
    /// Cancel markers (`OP_CANCEL`) published for ended connections.
    pub cancels: u64,
    /// Cancel markers that found the request ring full and waited in the owed queue.
    pub cancels_deferred: u64,
    /// Credit acknowledgements given for streamed completions.
    pub acks: u64,
    /// Of those, acknowledgements held back while their connection was over its limit.
    pub acks_withheld: u64,
    /// Write system calls that sent reply bytes (native transport).
    pub writes: u64,
    /// Times a connection's token frames were held back to go out with later ones
    /// (`NativeConfig::stream_coalesce`).
    pub writes_held: u64,
}

impl TransportStats {
    /// Count an HTTP-level rejection.
    pub fn http_reject(&mut self, code: u16) {
        let i = match code {
            400 => 0,
            404 => 1,
            405 => 2,
            411 => 3,
            _ => 4,
        };
        self.http_rejects[i] += 1;
    }
}

impl std::fmt::Display for TransportStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "connections: {} accepted, {} closed, {} refused, {} io errors",
            self.conns_accepted, self.conns_closed, self.conns_refused, self.io_errors
        )?;
        writeln!(
            f,
            "requests: {} framed, {} published, {} busy, {} completions ({} stale), {} replies",
            self.requests,
            self.published,
            self.busy,
            self.completions,
            self.stale_completions,
            self.replies
        )?;
        let rejects: Vec<String> = self
            .rejects
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(s, n)| format!("status {s}: {n}"))
            .collect();
        let http = ["400", "404", "405", "411", "431"];
        let http: Vec<String> = self
            .http_rejects
            .iter()
            .zip(http)
            .filter(|(n, _)| **n > 0)
            .map(|(n, c)| format!("http {c}: {n}"))
            .collect();
        writeln!(
            f,
            "rejected input: [{}] [{}]",
            rejects.join(", "),
            http.join(", ")
        )?;
        writeln!(
            f,
            "streams: {} acks ({} withheld first), {} cancel markers ({} waited for room); \
             writes: {} ({} times frames were held to coalesce)",
            self.acks,
            self.acks_withheld,
            self.cancels,
            self.cancels_deferred,
            self.writes,
            self.writes_held
        )?;
        write!(
            f,
            "bytes: {} in, {} out; epoll waits: {} ({} ended at the completion-wake safety timeout)",
            self.bytes_in, self.bytes_out, self.epoll_waits, self.wake_timeouts
        )
    }
}

/// Upper bounds (nanoseconds) of the request-duration histogram's buckets; a last bucket
/// (+Inf) takes everything above. 10 us to 10 s: a one-shot request on the CPU executor takes
/// tens of microseconds, a long generation seconds.
pub const DURATION_BOUNDS_NS: [u64; 19] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// Op slots of [`RequestMetrics`]: every known op by its wire value, then one for op numbers
/// without a name.
pub const OP_SLOTS: usize = 5;
/// Status slots of [`RequestMetrics`] (wire statuses are below 32).
pub const STATUS_SLOTS: usize = 32;

/// Counters a scrape reads while the transport runs: answered requests by op and status, the
/// time from a request's arrival to its final reply being queued, and open connections.
///
/// Everything else in [`TransportStats`] belongs to the transport thread and is printed at
/// shutdown; these are atomics because another thread reads them. The transport adds one
/// [`observe`](Self::observe) per answered request (three relaxed atomic adds on lines no
/// other thread writes) and one add per connection opened or closed.
#[derive(Debug)]
pub struct RequestMetrics {
    /// `[op slot][status]`: requests answered (final reply queued).
    answered: [[AtomicU64; STATUS_SLOTS]; OP_SLOTS],
    /// Per bucket (not cumulative): `DURATION_BOUNDS_NS.len() + 1` with the +Inf bucket.
    buckets: [AtomicU64; DURATION_BOUNDS_NS.len() + 1],
    /// Sum of the observed durations in nanoseconds.
    sum_ns: AtomicU64,
    conns_opened: AtomicU64,
    conns_closed: AtomicU64,
}

impl Default for RequestMetrics {
    fn default() -> Self {
        RequestMetrics {
            answered: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
            conns_opened: AtomicU64::new(0),
            conns_closed: AtomicU64::new(0),
        }
    }
}

/// A consistent-enough copy of [`RequestMetrics`] for one scrape (each value is read once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestSnapshot {
    /// `(op, status, count)` for every pair with a non-zero count; `op` is the wire value, or
    /// `None` for op numbers without a name.
    pub answered: Vec<(Option<u16>, u16, u64)>,
    /// Per-bucket counts (not cumulative), the last one being +Inf.
    pub buckets: Vec<u64>,
    /// Sum of durations, nanoseconds.
    pub sum_ns: u64,
    /// Connections open now.
    pub conns_open: u64,
}

impl RequestMetrics {
    /// A request of wire op `op` got its final reply, `elapsed_ns` after it arrived.
    #[inline]
    pub fn observe(&self, op: u16, status: Status, elapsed_ns: u64) {
        // Known ops are 0..OP_SLOTS-1 by wire value.
        let o = bgs_protocol::Op::from_u16(op).map_or(OP_SLOTS - 1, |o| o as usize);
        let s = (status as usize).min(STATUS_SLOTS - 1);
        self.answered[o][s].fetch_add(1, Ordering::Relaxed);
        let b = DURATION_BOUNDS_NS.partition_point(|&bound| bound < elapsed_ns);
        self.buckets[b].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(elapsed_ns, Ordering::Relaxed);
    }

    /// A connection was accepted.
    pub fn conn_opened(&self) {
        self.conns_opened.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection was closed.
    pub fn conn_closed(&self) {
        self.conns_closed.fetch_add(1, Ordering::Relaxed);
    }

    /// Read everything once.
    pub fn snapshot(&self) -> RequestSnapshot {
        let mut answered = Vec::new();
        for (o, row) in self.answered.iter().enumerate() {
            for (s, n) in row.iter().enumerate() {
                let n = n.load(Ordering::Relaxed);
                if n > 0 {
                    let op = (o < OP_SLOTS - 1).then_some(o as u16);
                    answered.push((op, s as u16, n));
                }
            }
        }
        // Closed is read first: a connection opened and closed between the two reads then
        // cannot make the difference negative.
        let closed = self.conns_closed.load(Ordering::Relaxed);
        let opened = self.conns_opened.load(Ordering::Relaxed);
        RequestSnapshot {
            answered,
            buckets: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
            conns_open: opened.saturating_sub(closed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn observe_counts_by_op_status_and_bucket() {
        let m = RequestMetrics::default();
        m.observe(1, Status::Ok, 10_000); // exactly on the first bound: first bucket
        m.observe(1, Status::Ok, 10_001);
        m.observe(9, Status::UnknownOp, 20_000_000_000); // unnamed op, above every bound
        m.observe(2, Status::Busy, 0);
        let s = m.snapshot();
        assert_eq!(
            s.answered,
            vec![
                (Some(1), Status::Ok as u16, 2),
                (Some(2), Status::Busy as u16, 1),
                (None, Status::UnknownOp as u16, 1),
            ]
        );
        assert_eq!(s.buckets.len(), DURATION_BOUNDS_NS.len() + 1);
        assert_eq!(s.buckets[0], 2);
        assert_eq!(s.buckets[1], 1);
        assert_eq!(*s.buckets.last().unwrap(), 1);
        assert_eq!(s.buckets.iter().sum::<u64>(), 4);
        assert_eq!(s.sum_ns, 10_000 + 10_001 + 20_000_000_000);
    }

    /// Queues every request except echo ops with request id 3, which it refuses (busy).
    struct Sink;
    impl crate::conn::RequestSink for Sink {
        fn submit(
            &mut self,
            _token: u64,
            _seq: u32,
            r: &bgs_protocol::Request<'_>,
        ) -> crate::conn::Submit {
            if r.header.request_id == 3 {
                crate::conn::Submit::Busy
            } else {
                crate::conn::Submit::Queued
            }
        }
        fn arrival_ns(&self) -> u64 {
            // Long before now: every duration lands in the +Inf bucket.
            1
        }
    }

    #[test]
    fn only_final_frames_of_requests_are_counted() {
        use crate::conn::{ConnLimits, ConnState};
        use bgs_protocol::reply::encode_request;
        use bgs_protocol::{FramerConfig, Op, RequestHeader};
        let m = Arc::new(RequestMetrics::default());
        let mut c = ConnState::new(1, FramerConfig::default(), ConnLimits::default());
        c.set_metrics(m.clone());
        let mut input = Vec::new();
        encode_request(&mut input, &RequestHeader::new(Op::Generate, 1, 1, 4), &[1]);
        encode_request(&mut input, &RequestHeader::new(Op::Echo, 2, 1, 0), &[2]);
        encode_request(&mut input, &RequestHeader::new(Op::Echo, 3, 1, 0), &[3]);
        // An unknown op is rejected by the framer: input, not a request.
        let mut bad = RequestHeader::new(Op::Echo, 4, 0, 0);
        bad.op = 77;
        encode_request(&mut input, &bad, &[]);
        let mut st = TransportStats::default();
        assert_eq!(c.ingest(&input, &mut Sink, &mut st), input.len());
        // Busy was answered at once: counted.
        assert_eq!(
            m.snapshot().answered,
            vec![(Some(0), Status::Busy as u16, 1)]
        );
        // Streamed tokens are not final: not counted until the stream ends.
        assert!(c.complete(0, Status::Token, false, 0, 1, &[5]));
        assert!(c.complete(0, Status::Token, false, 1, 1, &[6]));
        assert!(c.complete(1, Status::Ok, true, 0, 2, &[2]));
        assert_eq!(m.snapshot().buckets.iter().sum::<u64>(), 2);
        assert!(c.complete(0, Status::EndOfStream, true, 2, 1, &[]));
        let s = m.snapshot();
        assert_eq!(
            s.answered,
            vec![
                (Some(0), Status::Ok as u16, 1),
                (Some(0), Status::Busy as u16, 1),
                (Some(3), Status::EndOfStream as u16, 1),
            ]
        );
        assert_eq!(s.buckets.iter().sum::<u64>(), 3);
        assert_eq!(*s.buckets.last().unwrap(), 3);
        assert!(s.sum_ns > 0);
    }

    #[test]
    fn open_connections() {
        let m = RequestMetrics::default();
        m.conn_opened();
        m.conn_opened();
        m.conn_closed();
        assert_eq!(m.snapshot().conns_open, 1);
    }
}
