//! Transport counters, printed at shutdown.

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
            "streams: {} acks ({} withheld first), {} cancel markers ({} waited for room)",
            self.acks, self.acks_withheld, self.cancels, self.cancels_deferred
        )?;
        write!(
            f,
            "bytes: {} in, {} out; epoll waits: {}",
            self.bytes_in, self.bytes_out, self.epoll_waits
        )
    }
}
