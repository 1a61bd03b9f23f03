//! An incremental HTTP/1.1 response parser for pipelined keep-alive connections.
//!
//! Stateless by design: the caller keeps all unconsumed bytes and calls [`parse_response`]
//! again when more arrive. Re-parsing a partial response from its start costs little because
//! responses here are a few hundred bytes, and it makes "split anywhere, coalesced with the next
//! response" correct by construction.

/// Longest response head accepted; a server sending more is broken, not slow.
pub(crate) const MAX_HEAD: usize = 16 * 1024;
/// Largest body accepted (a reply frame is a few hundred bytes; streams stay far below this).
pub(crate) const MAX_BODY: usize = 16 * 1024 * 1024;

/// A complete response at the front of the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Parsed {
    /// Bytes of the whole response (head and body, chunk framing included).
    pub consumed: usize,
    /// Bytes of the head including the blank line.
    pub head_len: usize,
    /// Status code.
    pub status: u16,
    /// The server will close the connection after this response.
    pub close: bool,
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn trim(s: &[u8]) -> &[u8] {
    s.trim_ascii()
}

/// How the body of a response is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BodyKind {
    /// `Content-Length` (0 when the response has neither length nor chunking).
    Length(usize),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

/// A complete response head at the front of the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Head {
    /// Bytes of the head including the blank line.
    pub head_len: usize,
    /// Status code.
    pub status: u16,
    /// The server will close the connection after this response.
    pub close: bool,
    /// How the body is delimited.
    pub body: BodyKind,
}

/// Parse the head of the response at the front of `buf`. `Ok(None)`: incomplete.
pub(crate) fn parse_head(buf: &[u8]) -> Result<Option<Head>, String> {
    let window = &buf[..buf.len().min(MAX_HEAD)];
    let Some(end) = find(window, b"\r\n\r\n") else {
        if buf.len() >= MAX_HEAD {
            return Err("HTTP response head too long".into());
        }
        // Reject garbage early instead of waiting for a blank line that never comes.
        let n = buf.len().min(5);
        if buf[..n] != b"HTTP/"[..n] {
            return Err("response does not start with HTTP/".into());
        }
        return Ok(None);
    };
    let head_len = end + 4;
    let head = &buf[..end];
    let mut lines = head
        .split(|&c| c == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, |&c| c == b' ');
    let version = parts.next().unwrap_or_default();
    let mut close = match version {
        b"HTTP/1.1" => false,
        b"HTTP/1.0" => true,
        _ => return Err("bad HTTP status line".into()),
    };
    let code = parts.next().unwrap_or_default();
    if code.len() != 3 || !code.iter().all(u8::is_ascii_digit) {
        return Err("bad HTTP status code".into());
    }
    let status = code.iter().fold(0u16, |a, d| a * 10 + u16::from(d - b'0'));
    let mut content_length: Option<usize> = None;
    let mut chunked = false;
    for line in lines {
        let Some(colon) = line.iter().position(|&c| c == b':') else {
            return Err("HTTP header line without ':'".into());
        };
        let (name, value) = (trim(&line[..colon]), trim(&line[colon + 1..]));
        if name.eq_ignore_ascii_case(b"content-length") {
            if value.is_empty() || value.len() > 12 || !value.iter().all(u8::is_ascii_digit) {
                return Err("bad Content-Length".into());
            }
            let v = value
                .iter()
                .fold(0usize, |a, d| a * 10 + usize::from(d - b'0'));
            if content_length.is_some_and(|c| c != v) {
                return Err("conflicting Content-Length headers".into());
            }
            content_length = Some(v);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            chunked = value
                .split(|&c| c == b',')
                .any(|t| trim(t).eq_ignore_ascii_case(b"chunked"));
        } else if name.eq_ignore_ascii_case(b"connection") {
            for t in value.split(|&c| c == b',').map(trim) {
                if t.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if t.eq_ignore_ascii_case(b"keep-alive") {
                    close = false;
                }
            }
        }
    }
    let body = if chunked {
        BodyKind::Chunked
    } else {
        // No length at all: only bodiless responses are possible on a pipelined connection.
        let len = content_length.unwrap_or(0);
        if len > MAX_BODY {
            return Err("HTTP body too large".into());
        }
        BodyKind::Length(len)
    };
    Ok(Some(Head {
        head_len,
        status,
        close,
        body,
    }))
}

/// Parse one response from the front of `buf`. `Ok(None)`: incomplete. On `Ok(Some)`, `body`
/// holds the body (chunks concatenated); otherwise its contents are unspecified.
pub(crate) fn parse_response(buf: &[u8], body: &mut Vec<u8>) -> Result<Option<Parsed>, String> {
    let Some(head) = parse_head(buf)? else {
        return Ok(None);
    };
    let head_len = head.head_len;
    body.clear();
    let consumed = match head.body {
        BodyKind::Chunked => {
            let mut pos = head_len;
            loop {
                let Some(c) = parse_chunk(&buf[pos..])? else {
                    return Ok(None);
                };
                if c.last {
                    break pos + c.consumed;
                }
                if body.len() + c.data.len() > MAX_BODY {
                    return Err("HTTP body too large".into());
                }
                body.extend_from_slice(&buf[pos + c.data.start..pos + c.data.end]);
                pos += c.consumed;
            }
        }
        BodyKind::Length(len) => {
            if buf.len() < head_len + len {
                return Ok(None);
            }
            body.extend_from_slice(&buf[head_len..head_len + len]);
            head_len + len
        }
    };
    Ok(Some(Parsed {
        consumed,
        head_len,
        status: head.status,
        close: head.close,
    }))
}

/// One chunk of a chunked body, complete at the front of a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// Bytes of the chunk: size line, data and CRLF (for the last chunk: the trailers too).
    pub consumed: usize,
    /// Where the data lies, relative to the front of the buffer (empty for the last chunk).
    pub data: std::ops::Range<usize>,
    /// The last (zero-size) chunk: the body, trailers included, is complete.
    pub last: bool,
}

/// Parse the chunk at the front of `b` (a chunked body after the head, or after the chunks
/// already consumed). `Ok(None)`: incomplete.
pub(crate) fn parse_chunk(b: &[u8]) -> Result<Option<Chunk>, String> {
    let Some(eol) = find(b, b"\r\n") else {
        if b.len() > 64 {
            return Err("chunk size line too long".into());
        }
        return Ok(None);
    };
    let line = &b[..eol];
    // Chunk extensions (";name=value") are allowed and ignored.
    let size_hex = trim(line.split(|&c| c == b';').next().unwrap_or_default());
    if size_hex.is_empty() || size_hex.len() > 8 || !size_hex.iter().all(u8::is_ascii_hexdigit) {
        return Err("bad chunk size".into());
    }
    let size = size_hex.iter().fold(0usize, |a, &d| {
        a * 16 + (d as char).to_digit(16).unwrap_or(0) as usize
    });
    let mut pos = eol + 2;
    if size == 0 {
        // Trailer fields, then an empty line.
        loop {
            let Some(eol) = find(&b[pos..], b"\r\n") else {
                return Ok(None);
            };
            pos += eol + 2;
            if eol == 0 {
                return Ok(Some(Chunk {
                    consumed: pos,
                    data: pos..pos,
                    last: true,
                }));
            }
        }
    }
    if size > MAX_BODY {
        return Err("HTTP body too large".into());
    }
    if b.len() < pos + size + 2 {
        return Ok(None);
    }
    if &b[pos + size..pos + size + 2] != b"\r\n" {
        return Err("chunk data not followed by CRLF".into());
    }
    let data = pos..pos + size;
    pos += size + 2;
    Ok(Some(Chunk {
        consumed: pos,
        data,
        last: false,
    }))
}

/// The header fields of a complete head (`head_len` bytes), for callers that want them.
pub(crate) fn header_fields(head: &[u8]) -> Vec<(String, String)> {
    let text = String::from_utf8_lossy(head);
    text.split("\r\n")
        .skip(1)
        .filter_map(|l| {
            let (n, v) = l.split_once(':')?;
            Some((n.trim().to_string(), v.trim().to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bgs_protocol::Status;
    use bgs_protocol::reply::{encode_reply, http_chunk, http_last_chunk, http_response_head};

    /// (status, close, body) of each response.
    type Responses = Vec<(u16, bool, Vec<u8>)>;

    fn stream() -> (Vec<u8>, Responses) {
        let mut out = Vec::new();
        let mut expect = Vec::new();
        // 1: Content-Length with one frame.
        let mut f = Vec::new();
        encode_reply(&mut f, Status::Ok, 1, 0, &[1, 2, 3]);
        http_response_head(&mut out, 200, Some(f.len()), false);
        out.extend_from_slice(&f);
        expect.push((200, false, f.clone()));
        // 2: chunked with two frames and a chunk extension.
        let mut f2 = Vec::new();
        encode_reply(&mut f2, Status::Token, 2, 0, &[7]);
        let mut f3 = Vec::new();
        encode_reply(&mut f3, Status::Ok, 2, 1, &[]);
        http_response_head(&mut out, 200, None, false);
        http_chunk(&mut out, &f2);
        out.extend_from_slice(format!("{:x};ext=1\r\n", f3.len()).as_bytes());
        out.extend_from_slice(&f3);
        out.extend_from_slice(b"\r\n");
        http_last_chunk(&mut out);
        expect.push((200, false, [f2, f3].concat()));
        // 3: 503 busy with a busy frame.
        let mut f4 = Vec::new();
        encode_reply(&mut f4, Status::Busy, 3, 0, &[]);
        http_response_head(&mut out, 503, Some(f4.len()), false);
        out.extend_from_slice(&f4);
        expect.push((503, false, f4));
        // 4: bodiless 404, then a closing 400.
        out.extend_from_slice(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
        expect.push((404, false, vec![]));
        out.extend_from_slice(
            b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\ncontent-length: 2\r\n\r\nhi",
        );
        expect.push((400, true, b"hi".to_vec()));
        (out, expect)
    }

    /// Feed `data` in pieces cut at `cuts`, parsing greedily like the load engine does.
    fn feed(data: &[u8], cuts: &[usize]) -> Responses {
        let mut got = Vec::new();
        let mut buf = Vec::new();
        let mut body = Vec::new();
        let mut prev = 0;
        for &c in cuts.iter().chain(std::iter::once(&data.len())) {
            buf.extend_from_slice(&data[prev..c]);
            prev = c;
            while let Some(p) = parse_response(&buf, &mut body).unwrap() {
                got.push((p.status, p.close, body.clone()));
                buf.drain(..p.consumed);
            }
        }
        assert!(buf.is_empty());
        got
    }

    #[test]
    fn parses_every_split_and_coalesced() {
        let (data, expect) = stream();
        assert_eq!(feed(&data, &[]), expect);
        for cut in 0..=data.len() {
            assert_eq!(feed(&data, &[cut]), expect, "cut at {cut}");
        }
        let all: Vec<usize> = (1..data.len()).collect();
        assert_eq!(feed(&data, &all), expect);
    }

    /// A chunked stream parsed chunk by chunk as bytes trickle in: every split gives the same
    /// chunks, each reported as soon as it is complete.
    #[test]
    fn chunks_parse_incrementally() {
        let mut body = Vec::new();
        let frames: Vec<Vec<u8>> = (0..3u32)
            .map(|i| {
                let mut f = Vec::new();
                encode_reply(&mut f, Status::Token, 9, i, &[100 + i]);
                f
            })
            .collect();
        for f in &frames {
            http_chunk(&mut body, f);
        }
        body.extend_from_slice(b"0\r\nX-Trailer: 1\r\n\r\n");
        for cut in 0..=body.len() {
            let mut got = Vec::new();
            let mut pos = 0;
            let mut last = false;
            for avail in [cut, body.len()] {
                while !last {
                    let Some(c) = parse_chunk(&body[pos..avail]).unwrap() else {
                        break;
                    };
                    assert!(pos + c.consumed <= avail);
                    if c.last {
                        last = true;
                    } else {
                        got.push(body[pos + c.data.start..pos + c.data.end].to_vec());
                    }
                    pos += c.consumed;
                }
            }
            assert!(last && pos == body.len(), "cut {cut}");
            assert_eq!(got, frames, "cut {cut}");
        }
        assert!(parse_chunk(b"g\r\n").is_err());
        assert!(parse_chunk(b"2\r\nabcd").is_err());
        assert_eq!(parse_chunk(b"2\r\nab"), Ok(None));
        let h = parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!((h.status, h.close, h.body), (200, false, BodyKind::Chunked));
        let h = parse_head(b"HTTP/1.1 503 X\r\nContent-Length: 24\r\nConnection: close\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(
            (h.status, h.close, h.body),
            (503, true, BodyKind::Length(24))
        );
    }

    #[test]
    fn rejects_garbage() {
        let mut b = Vec::new();
        assert!(parse_response(b"BGR1xxxx", &mut b).is_err());
        assert!(parse_response(b"HTTP/1.1 2x0 OK\r\n\r\n", &mut b).is_err());
        assert!(parse_response(b"HTTP/2 200 OK\r\n\r\n", &mut b).is_err());
        assert!(
            parse_response(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                &mut b
            )
            .is_err()
        );
        assert!(
            parse_response(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nabc\r\n",
                &mut b
            )
            .is_err()
        );
        assert_eq!(parse_response(b"HTT", &mut b), Ok(None));
        let h = header_fields(b"HTTP/1.1 200 OK\r\nA: b\r\nContent-Length:  3 ");
        assert_eq!(
            h,
            vec![
                ("A".into(), "b".into()),
                ("Content-Length".into(), "3".into())
            ]
        );
    }
}
