//! Encoders for reply frames, request frames (clients) and HTTP responses, and the reply
//! encoders every transport uses ([`encode_frame`], [`encode_reject`]).
//!
//! They append to a caller's buffer and never allocate on their own (integers are formatted
//! with `write!` into the buffer), so a server can encode replies without per-reply heap
//! traffic.

use std::io::Write as _;

use crate::framer::{Framing, Reject};
use crate::wire::{HEADER_LEN, ReplyHeader, RequestHeader, Status};

/// Append one reply frame (header + words) to `out`.
pub fn encode_reply(out: &mut Vec<u8>, status: Status, request_id: u32, seq: u32, words: &[u32]) {
    let h = ReplyHeader::new(status, request_id, words.len() as u32, seq);
    out.reserve(HEADER_LEN + words.len() * 4);
    out.extend_from_slice(&h.encode());
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

/// Append one request frame to `out`. `header.words` is written as given, so tests can build
/// frames whose header disagrees with the payload.
pub fn encode_request(out: &mut Vec<u8>, header: &RequestHeader, words: &[u32]) {
    out.reserve(HEADER_LEN + words.len() * 4);
    out.extend_from_slice(&header.encode());
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

/// Append an HTTP POST carrying one request frame, as the load generator sends it.
pub fn encode_http_request(out: &mut Vec<u8>, host: &str, frame: &[u8]) {
    out.extend_from_slice(b"POST /v1/submit HTTP/1.1\r\nHost: ");
    out.extend_from_slice(host.as_bytes());
    let _ = write!(
        out,
        "\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\n\r\n",
        frame.len()
    );
    out.extend_from_slice(frame);
}

/// The reason phrase of the HTTP statuses this server sends.
pub fn http_reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        411 => "Length Required",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        499 => "Client Closed Request",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// Append an HTTP/1.1 response head. `body_len` `None` selects `Transfer-Encoding: chunked`
/// (streamed replies, one chunk per frame; see [`http_chunk`]).
pub fn http_response_head(out: &mut Vec<u8>, code: u16, body_len: Option<usize>, close: bool) {
    let _ = write!(out, "HTTP/1.1 {code} ");
    out.extend_from_slice(http_reason(code).as_bytes());
    out.extend_from_slice(b"\r\nContent-Type: application/octet-stream\r\n");
    match body_len {
        Some(n) => {
            let _ = write!(out, "Content-Length: {n}\r\n");
        }
        None => out.extend_from_slice(b"Transfer-Encoding: chunked\r\n"),
    }
    if close {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Append one chunk of a chunked body.
pub fn http_chunk(out: &mut Vec<u8>, data: &[u8]) {
    http_chunk_head(out, data.len());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// Append the size line of a chunk of `len` bytes (the data and its CRLF follow).
pub fn http_chunk_head(out: &mut Vec<u8>, len: usize) {
    let _ = write!(out, "{len:x}\r\n");
}

/// Append the last (empty) chunk of a chunked body.
pub fn http_last_chunk(out: &mut Vec<u8>) {
    out.extend_from_slice(b"0\r\n\r\n");
}

/// One reply frame to encode.
#[derive(Debug, Clone, Copy)]
pub struct FrameOut<'a> {
    /// Frame status.
    pub status: Status,
    /// Whether this frame ends its request.
    pub final_: bool,
    /// Token index (streamed frames), else 0.
    pub stream_seq: u32,
    /// The request's id.
    pub request_id: u32,
    /// Payload words.
    pub words: &'a [u32],
}

/// Append one reply frame for an item that arrived with `framing`. In HTTP mode a lone final
/// frame becomes a Content-Length response; a stream opens a chunked response at its first
/// frame (`http_started` records that) and closes it at its final frame.
pub fn encode_frame(
    out: &mut Vec<u8>,
    framing: Framing,
    http_started: &mut bool,
    f: &FrameOut<'_>,
) {
    match framing {
        Framing::Binary => encode_reply(out, f.status, f.request_id, f.stream_seq, f.words),
        Framing::Http { keep_alive } => {
            // The frame goes straight into `out` after its HTTP framing, whose length fields
            // are known in advance: no temporary buffer per reply.
            let close = !keep_alive;
            let frame_len = HEADER_LEN + f.words.len() * 4;
            if f.final_ && !*http_started {
                http_response_head(out, f.status.http_status(), Some(frame_len), close);
                encode_reply(out, f.status, f.request_id, f.stream_seq, f.words);
            } else {
                if !*http_started {
                    http_response_head(out, 200, None, close);
                }
                http_chunk_head(out, frame_len);
                encode_reply(out, f.status, f.request_id, f.stream_seq, f.words);
                out.extend_from_slice(b"\r\n");
                if f.final_ {
                    http_last_chunk(out);
                }
            }
            *http_started = true;
        }
    }
}

/// Append the reply to a rejected item: a bare error frame, or an HTTP error response whose
/// body is the error frame where a frame status applies.
pub fn encode_reject(out: &mut Vec<u8>, reject: &Reject) {
    match reject.http_status {
        None => {
            let status = reject.status.unwrap_or(Status::Internal);
            encode_reply(out, status, reject.request_id, 0, &[]);
        }
        Some(code) => {
            let body = if reject.status.is_some() {
                HEADER_LEN
            } else {
                0
            };
            http_response_head(out, code, Some(body), reject.close);
            if let Some(status) = reject.status {
                encode_reply(out, status, reject.request_id, 0, &[]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_head_has_length_or_chunked() {
        let mut v = Vec::new();
        http_response_head(&mut v, 200, Some(280), false);
        let s = String::from_utf8(v).unwrap();
        assert!(s.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(s.contains("Content-Length: 280\r\n"));
        assert!(s.ends_with("\r\n\r\n"));
        let mut v = Vec::new();
        http_response_head(&mut v, 503, None, true);
        let s = String::from_utf8(v).unwrap();
        assert!(s.contains("Transfer-Encoding: chunked\r\n"));
        assert!(s.contains("Connection: close\r\n"));
    }

    #[test]
    fn reply_frame_layout() {
        let mut v = Vec::new();
        encode_reply(&mut v, Status::Ok, 7, 0, &[1, 2]);
        assert_eq!(v.len(), 32);
        assert_eq!(&v[0..4], b"BGR1");
        assert_eq!(u32::from_le_bytes(v[24..28].try_into().unwrap()), 1);
    }

    #[test]
    fn http_stream_is_chunked_and_lone_final_frames_are_not() {
        let tok = FrameOut {
            status: Status::Token,
            final_: false,
            stream_seq: 0,
            request_id: 5,
            words: &[42],
        };
        let end = FrameOut {
            status: Status::EndOfStream,
            final_: true,
            stream_seq: 1,
            request_id: 5,
            words: &[1, 1],
        };
        let mut v = Vec::new();
        let mut started = false;
        let http = Framing::Http { keep_alive: true };
        encode_frame(&mut v, http, &mut started, &tok);
        encode_frame(&mut v, http, &mut started, &end);
        let s = String::from_utf8_lossy(&v);
        assert!(s.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(s.contains("Transfer-Encoding: chunked\r\n"));
        assert!(s.contains("\r\n1c\r\n"), "token chunk of 28 bytes");
        assert!(s.ends_with("0\r\n\r\n"));
        let mut v = Vec::new();
        let mut started = false;
        encode_frame(&mut v, Framing::Binary, &mut started, &end);
        assert_eq!(ReplyHeader::decode(&v).seq, 1);
        assert_eq!(v.len(), HEADER_LEN + 8);
        let mut v = Vec::new();
        let r = Reject {
            request_id: 3,
            status: Some(Status::BadFlags),
            http_status: Some(400),
            close: true,
        };
        encode_reject(&mut v, &r);
        let s = String::from_utf8_lossy(&v);
        assert!(s.starts_with("HTTP/1.1 400 Bad Request\r\n"));
        assert!(s.contains("Connection: close\r\n"));
        assert!(s.contains("Content-Length: 24\r\n"));
    }
}
