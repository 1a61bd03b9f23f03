//! A sans-I/O framer: bytes in, requests and rejections out.
//!
//! The caller owns the connection's receive buffer. It calls [`Framer::decode`] with all
//! unconsumed bytes; the framer answers [`Decoded::NeedMore`] (consumes nothing), a
//! [`Decoded::Request`] or a [`Decoded::Reject`], each with the number of bytes consumed. The
//! caller drops that many bytes from the front and calls again. After a rejection with
//! `close == true` the framer only answers `NeedMore`: the connection must be closed once the
//! replies owed before the rejection and the rejection itself have been sent.
//!
//! Every check fires as soon as the bytes that decide it have arrived, and checks run in wire
//! order, so any split or coalescing of a stream yields the same sequence of results. The rules
//! are listed in `docs/protocol.md` ("Framing rules"); the BPF framer implements the same list.

use crate::ops;
use crate::wire::{HEADER_LEN, REQUEST_MAGIC, RequestHeader, Status, VERSION};

/// Limits and switches of a framer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FramerConfig {
    /// Largest payload (in 32-bit words) a request may carry.
    pub max_words: u32,
    /// Largest HTTP request head (request line, headers and the blank line), in bytes.
    pub max_http_head: usize,
}

impl Default for FramerConfig {
    fn default() -> Self {
        FramerConfig {
            max_words: crate::wire::DEFAULT_MAX_WORDS,
            max_http_head: 8192,
        }
    }
}

/// How a request arrived, which decides how its reply is framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Framing {
    /// A bare binary frame: the reply is bare reply frames.
    Binary,
    /// An HTTP POST: the reply is an HTTP response whose body is the reply frame(s).
    Http {
        /// Whether the connection stays open after this exchange.
        keep_alive: bool,
    },
}

/// One well-formed, valid request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request<'a> {
    /// The validated header.
    pub header: RequestHeader,
    /// The payload: `header.words * 4` bytes, little-endian words.
    pub payload: &'a [u8],
    /// How the request arrived.
    pub framing: Framing,
}

/// A request the server refuses, with what to send back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Reject {
    /// Request id for the error frame (0 when the error came before the id was known).
    pub request_id: u32,
    /// The error frame to send (the body in HTTP mode), where one applies.
    pub status: Option<Status>,
    /// The HTTP status code, in HTTP mode.
    pub http_status: Option<u16>,
    /// Close the connection after this reply.
    pub close: bool,
}

impl Reject {
    fn frame(framing: Mode, status: Status, request_id: u32, close_http: bool) -> Reject {
        match framing {
            Mode::Binary => Reject {
                request_id,
                status: Some(status),
                http_status: None,
                close: status.closes_connection(),
            },
            Mode::Http => Reject {
                request_id,
                status: Some(status),
                http_status: Some(status.http_status()),
                close: status.closes_connection() || close_http,
            },
        }
    }

    fn http(code: u16, close: bool) -> Reject {
        Reject {
            request_id: 0,
            status: None,
            http_status: Some(code),
            close,
        }
    }
}

/// Result of one [`Framer::decode`] call.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// More bytes are needed; nothing was consumed.
    NeedMore,
    /// A valid request.
    Request {
        /// Bytes to drop from the front of the buffer.
        consumed: usize,
        /// The request (borrows the buffer).
        request: Request<'a>,
    },
    /// A refused request or malformed input.
    Reject {
        /// Bytes to drop from the front of the buffer.
        consumed: usize,
        /// What to answer.
        reject: Reject,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Binary,
    Http,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Submit,
    NotFound,
    MethodNotAllowed,
}

/// A parsed HTTP head whose body has not fully arrived yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HttpHead {
    head_len: usize,
    body_len: usize,
    keep_alive: bool,
    route: Route,
}

/// Per-connection framing state.
#[derive(Clone, Debug)]
pub struct Framer {
    cfg: FramerConfig,
    mode: Option<Mode>,
    head: Option<HttpHead>,
    closed: bool,
}

impl Framer {
    /// A framer for a new connection.
    pub fn new(cfg: FramerConfig) -> Self {
        Framer {
            cfg,
            mode: None,
            head: None,
            closed: false,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &FramerConfig {
        &self.cfg
    }

    /// True once a closing rejection has been returned.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// True if the connection speaks HTTP (decided by its first byte).
    pub fn is_http(&self) -> bool {
        self.mode == Some(Mode::Http)
    }

    /// Decode the next request from `buf`, which holds all unconsumed bytes of the connection.
    pub fn decode<'a>(&mut self, buf: &'a [u8]) -> Decoded<'a> {
        if self.closed || buf.is_empty() {
            return Decoded::NeedMore;
        }
        let mode = *self.mode.get_or_insert(match buf[0] {
            // `B` starts the binary magic; any other upper-case letter starts an HTTP method.
            b'B' => Mode::Binary,
            b'A'..=b'Z' => Mode::Http,
            _ => Mode::Binary,
        });
        let out = match mode {
            Mode::Binary => self.decode_binary(buf),
            Mode::Http => self.decode_http(buf),
        };
        if let Decoded::Reject { reject, .. } = &out
            && reject.close
        {
            self.closed = true;
        }
        out
    }

    fn decode_binary<'a>(&self, buf: &'a [u8]) -> Decoded<'a> {
        match check_frame(&self.cfg, buf, Mode::Binary, false) {
            FrameCheck::NeedMore => Decoded::NeedMore,
            FrameCheck::Reject(consumed, reject) => Decoded::Reject { consumed, reject },
            FrameCheck::Request(header, len) => Decoded::Request {
                consumed: len,
                request: Request {
                    header,
                    payload: &buf[HEADER_LEN..len],
                    framing: Framing::Binary,
                },
            },
        }
    }

    fn decode_http<'a>(&mut self, buf: &'a [u8]) -> Decoded<'a> {
        let head = match self.head {
            Some(h) => h,
            None => match parse_http_head(&self.cfg, buf) {
                HeadParse::NeedMore => return Decoded::NeedMore,
                HeadParse::Reject(r) => {
                    return Decoded::Reject {
                        consumed: buf.len(),
                        reject: r,
                    };
                }
                HeadParse::Head(h) => {
                    self.head = Some(h);
                    h
                }
            },
        };
        let total = head.head_len + head.body_len;
        if buf.len() < total {
            return Decoded::NeedMore;
        }
        self.head = None;
        let close = !head.keep_alive;
        match head.route {
            Route::NotFound => Decoded::Reject {
                consumed: total,
                reject: Reject::http(404, close),
            },
            Route::MethodNotAllowed => Decoded::Reject {
                consumed: total,
                reject: Reject::http(405, close),
            },
            Route::Submit => {
                let body = &buf[head.head_len..total];
                match check_frame(&self.cfg, body, Mode::Http, close) {
                    // The body is complete, so a frame that still wants bytes is shorter than
                    // its header says: a malformed body.
                    FrameCheck::NeedMore => Decoded::Reject {
                        consumed: total,
                        reject: Reject::http(400, close),
                    },
                    FrameCheck::Reject(_, reject) => Decoded::Reject {
                        consumed: total,
                        reject,
                    },
                    FrameCheck::Request(header, len) if len == body.len() => Decoded::Request {
                        consumed: total,
                        request: Request {
                            header,
                            payload: &body[HEADER_LEN..len],
                            framing: Framing::Http {
                                keep_alive: head.keep_alive,
                            },
                        },
                    },
                    // A body longer than one frame.
                    FrameCheck::Request(..) => Decoded::Reject {
                        consumed: total,
                        reject: Reject::http(400, close),
                    },
                }
            }
        }
    }
}

enum FrameCheck {
    NeedMore,
    Reject(usize, Reject),
    Request(RequestHeader, usize),
}

/// Validate a binary frame at the front of `b`, checking each field as soon as it is present.
fn check_frame(cfg: &FramerConfig, b: &[u8], mode: Mode, close_http: bool) -> FrameCheck {
    let reject = |status: Status, id: u32| {
        // Framing errors close the connection: consume everything.
        FrameCheck::Reject(b.len(), Reject::frame(mode, status, id, close_http))
    };
    let magic = REQUEST_MAGIC.to_le_bytes();
    let n = b.len().min(4);
    if b[..n] != magic[..n] {
        return reject(Status::BadMagic, 0);
    }
    if b.len() < 6 {
        return FrameCheck::NeedMore;
    }
    if u16::from_le_bytes([b[4], b[5]]) != VERSION {
        return reject(Status::BadVersion, 0);
    }
    if b.len() < 16 {
        return FrameCheck::NeedMore;
    }
    let request_id = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    let words = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
    if words > cfg.max_words {
        return reject(Status::PayloadTooLarge, request_id);
    }
    if b.len() < HEADER_LEN {
        return FrameCheck::NeedMore;
    }
    let h = RequestHeader::decode(b);
    // The op (bytes 6..8) is known by now, so "flags this op allows" is a wire-order check.
    if h.flags & !ops::allowed_flags(h.op) != 0 {
        return reject(Status::BadFlags, request_id);
    }
    let len = HEADER_LEN + words as usize * 4;
    if b.len() < len {
        return FrameCheck::NeedMore;
    }
    // Semantic checks (the op table): the frame is consumed and the connection stays open.
    match ops::check_request(h.op, words, h.param, h.flags) {
        Ok(_) => FrameCheck::Request(h, len),
        Err(status) => FrameCheck::Reject(len, Reject::frame(mode, status, request_id, close_http)),
    }
}

enum HeadParse {
    NeedMore,
    Reject(Reject),
    Head(HttpHead),
}

fn find_head_end(b: &[u8]) -> Option<usize> {
    b.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4)
}

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

fn parse_http_head(cfg: &FramerConfig, buf: &[u8]) -> HeadParse {
    let window = &buf[..buf.len().min(cfg.max_http_head)];
    let Some(head_len) = find_head_end(window) else {
        return if buf.len() >= cfg.max_http_head {
            HeadParse::Reject(Reject::http(431, true))
        } else {
            HeadParse::NeedMore
        };
    };
    let bad = HeadParse::Reject(Reject::http(400, true));
    // Every line of the head, the last header line included, ends in CRLF; a bare LF is
    // malformed (`None` below).
    let head = &buf[..head_len - 2];
    let mut lines = head
        .strip_suffix(b"\n")
        .unwrap_or(head)
        .split(|&c| c == b'\n')
        .map(|l| l.strip_suffix(b"\r"));
    let Some(Some(request_line)) = lines.next() else {
        return bad;
    };
    let parts: Vec<&[u8]> = request_line.split(|&c| c == b' ').collect();
    let [method, target, version] = parts.as_slice() else {
        return bad;
    };
    if method.is_empty() || !method.iter().all(|c| c.is_ascii_uppercase()) || target.is_empty() {
        return bad;
    }
    let mut keep_alive = match *version {
        b"HTTP/1.1" => true,
        b"HTTP/1.0" => false,
        _ => return bad,
    };
    let mut content_length: Option<u64> = None;
    let mut chunked = false;
    for line in lines {
        let Some(line) = line else { return bad };
        let Some(colon) = line.iter().position(|&c| c == b':') else {
            return bad;
        };
        let name = &line[..colon];
        if name.is_empty() || name.iter().any(|c| !c.is_ascii_graphic()) {
            return bad;
        }
        let value = trim_ows(&line[colon + 1..]);
        if name.eq_ignore_ascii_case(b"content-length") {
            if value.is_empty() || value.len() > 10 || !value.iter().all(u8::is_ascii_digit) {
                return bad;
            }
            let v = value.iter().fold(0u64, |a, d| a * 10 + u64::from(d - b'0'));
            if content_length.is_some_and(|c| c != v) {
                return bad;
            }
            content_length = Some(v);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            chunked = true;
        } else if name.eq_ignore_ascii_case(b"connection") {
            for token in value.split(|&c| c == b',').map(trim_ows) {
                if token.eq_ignore_ascii_case(b"close") {
                    keep_alive = false;
                } else if token.eq_ignore_ascii_case(b"keep-alive") {
                    keep_alive = true;
                }
            }
        }
    }
    let route = if *target != b"/v1/submit" {
        Route::NotFound
    } else if *method != b"POST" {
        Route::MethodNotAllowed
    } else {
        Route::Submit
    };
    if chunked {
        // Request bodies must carry a Content-Length; chunked uploads are not accepted.
        return HeadParse::Reject(Reject::http(411, true));
    }
    let limit = (HEADER_LEN + cfg.max_words as usize * 4) as u64;
    let body_len = match (content_length, route) {
        (None, Route::Submit) => return HeadParse::Reject(Reject::http(411, true)),
        (None, _) => 0,
        (Some(n), Route::Submit) if n > limit => {
            return HeadParse::Reject(Reject::frame(Mode::Http, Status::PayloadTooLarge, 0, true));
        }
        // Other paths: skip a small body and answer; refuse to swallow a large one.
        (Some(n), _) if n > limit => {
            return HeadParse::Reject(Reject::http(
                if route == Route::NotFound { 404 } else { 405 },
                true,
            ));
        }
        (Some(n), _) => n as usize,
    };
    HeadParse::Head(HttpHead {
        head_len,
        body_len,
        keep_alive,
        route,
    })
}
