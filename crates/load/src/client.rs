//! Small blocking clients for end-to-end and bad-input tests.
//!
//! Everything here favours clear errors over speed: a reply that is not a well-formed frame is
//! an `InvalidData` error, a deadline that passes is `TimedOut`, and a connection the server
//! closed is `UnexpectedEof` (or the reset error).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use bgs_protocol::reply::encode_request;
use bgs_protocol::{HEADER_LEN, REPLY_MAGIC, ReplyHeader, RequestHeader};

use crate::http::{header_fields, parse_response};
pub use crate::payload::{golden_reference, make_payload};

/// Largest reply payload the clients accept (words); anything larger is a broken header.
pub const MAX_REPLY_WORDS: u32 = 1 << 22;

/// One reply frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// The frame header as received.
    pub header: ReplyHeader,
    /// The payload words.
    pub words: Vec<u32>,
}

impl Reply {
    /// The status, if it is a known one.
    pub fn status(&self) -> Option<bgs_protocol::Status> {
        bgs_protocol::Status::from_u16(self.header.status)
    }

    /// The payload as f32 values.
    pub fn floats(&self) -> Vec<f32> {
        self.words.iter().map(|&w| f32::from_bits(w)).collect()
    }
}

/// One HTTP response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Header fields in arrival order.
    pub headers: Vec<(String, String)>,
    /// The body (chunks concatenated when chunked).
    pub body: Vec<u8>,
    /// The reply frames decoded from the body, in order (empty when the body holds none;
    /// decoding stops at the first bytes that are not a complete frame).
    pub frames: Vec<Reply>,
}

impl HttpResponse {
    /// The first header with this name (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Decode the frame at the front of `b`: `Ok(None)` when more bytes are needed.
pub fn decode_reply(b: &[u8]) -> io::Result<Option<(Reply, usize)>> {
    if b.len() < HEADER_LEN {
        return Ok(None);
    }
    let header = ReplyHeader::decode(b);
    if header.magic != REPLY_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("reply magic {:#010x} is not BGR1", header.magic),
        ));
    }
    if header.words > MAX_REPLY_WORDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("reply claims {} words", header.words),
        ));
    }
    let len = HEADER_LEN + header.words as usize * 4;
    if b.len() < len {
        return Ok(None);
    }
    let mut words = vec![0u32; header.words as usize];
    bgs_protocol::wire::words_from_le(&b[HEADER_LEN..len], &mut words);
    Ok(Some((Reply { header, words }, len)))
}

/// Decode a body that holds whole frames back to back (partial trailing bytes are ignored).
pub fn decode_frames(mut body: &[u8]) -> Vec<Reply> {
    let mut out = Vec::new();
    while let Ok(Some((r, n))) = decode_reply(body) {
        out.push(r);
        body = &body[n..];
    }
    out
}

/// A blocking connection speaking frames or HTTP.
#[derive(Debug)]
pub struct FrameClient {
    stream: TcpStream,
    /// Received bytes not yet returned to the caller.
    buf: Vec<u8>,
}

/// Default wait of [`FrameClient::request`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

fn timed_out(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("timed out waiting for {what}"),
    )
}

impl FrameClient {
    /// Connect with `TCP_NODELAY` (a 5 s connect timeout).
    pub fn connect(addr: SocketAddr) -> io::Result<Self> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(DEFAULT_TIMEOUT))?;
        Ok(FrameClient {
            stream,
            buf: Vec::with_capacity(4096),
        })
    }

    /// Send bytes exactly as given.
    pub fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Send one request frame (`h.words` is sent as given, whatever `words.len()` is) and read
    /// one reply frame.
    pub fn request(&mut self, h: &RequestHeader, words: &[u32]) -> io::Result<Reply> {
        let mut out = Vec::with_capacity(HEADER_LEN + words.len() * 4);
        encode_request(&mut out, h, words);
        self.send_raw(&out)?;
        self.read_reply(DEFAULT_TIMEOUT)
    }

    /// Send one request as an HTTP POST to `/v1/submit` and read the response.
    pub fn http_request(&mut self, h: &RequestHeader, words: &[u32]) -> io::Result<HttpResponse> {
        let mut frame = Vec::with_capacity(HEADER_LEN + words.len() * 4);
        encode_request(&mut frame, h, words);
        let host = self.stream.peer_addr()?.to_string();
        let mut out = Vec::with_capacity(frame.len() + 128);
        bgs_protocol::reply::encode_http_request(&mut out, &host, &frame);
        self.send_raw(&out)?;
        self.read_http_response(DEFAULT_TIMEOUT)
    }

    /// Read one reply frame.
    pub fn read_reply(&mut self, timeout: Duration) -> io::Result<Reply> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((r, n)) = decode_reply(&self.buf)? {
                self.buf.drain(..n);
                return Ok(r);
            }
            self.fill(deadline, "a reply frame")?;
        }
    }

    /// Read one HTTP response and decode the frames in its body.
    pub fn read_http_response(&mut self, timeout: Duration) -> io::Result<HttpResponse> {
        let deadline = Instant::now() + timeout;
        let mut body = Vec::new();
        loop {
            match parse_response(&self.buf, &mut body) {
                Ok(Some(p)) => {
                    let headers = header_fields(&self.buf[..p.head_len - 4]);
                    self.buf.drain(..p.consumed);
                    let frames = decode_frames(&body);
                    return Ok(HttpResponse {
                        status: p.status,
                        headers,
                        body,
                        frames,
                    });
                }
                Ok(None) => {
                    self.fill(deadline, "an HTTP response")?;
                }
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            }
        }
    }

    /// Wait until the server closes the connection: `Ok` on EOF or reset, `TimedOut` if it
    /// stays open. Bytes that arrive first are kept (see [`FrameClient::buffered`]).
    pub fn expect_closed(&mut self, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.fill(deadline, "the server to close the connection") {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionReset
                            | io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::BrokenPipe
                    ) =>
                {
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Bytes received but not yet returned as a frame or response.
    pub fn buffered(&self) -> &[u8] {
        &self.buf
    }

    /// The socket, for tests that need to shut down, split writes or set options.
    pub fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// Read once, appending to `buf`; EOF is `UnexpectedEof`, a passed deadline `TimedOut`.
    fn fill(&mut self, deadline: Instant, what: &str) -> io::Result<usize> {
        let now = Instant::now();
        if now >= deadline {
            return Err(timed_out(what));
        }
        // A zero read timeout would mean "block forever": keep at least 1 ms.
        self.stream
            .set_read_timeout(Some((deadline - now).max(Duration::from_millis(1))))?;
        let mut tmp = [0u8; 16 * 1024];
        loop {
            match self.stream.read(&mut tmp) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("connection closed while waiting for {what}"),
                    ));
                }
                Ok(n) => {
                    self.buf.extend_from_slice(&tmp[..n]);
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(timed_out(what));
                }
                Err(e) => return Err(e),
            }
        }
    }
}
