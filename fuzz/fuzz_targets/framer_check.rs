//! The framer's invariants, checked on one fuzz input. Shared by the fuzz target
//! (`fuzz_targets/framer.rs`) and the smoke test that runs in CI without a nightly toolchain
//! (`crates/protocol/tests/fuzz_smoke.rs`, which includes this file by path), so the corpus and
//! the generated inputs there go through exactly what the fuzzer runs.
//!
//! Input format: byte 0 picks the framer and the segmenting (low 7 bits: segment size, at
//! least 1; high bit: default limits instead of small ones, which reach the limits sooner);
//! the rest is the byte stream of one connection.

use bgs_protocol::{Decoded, Framer, FramerConfig, Framing, encode_request};

/// One decoded item with the exact bytes it consumed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Item {
    /// A request: its header fields (encoded), payload, framing, and raw bytes.
    Request {
        header: [u8; 24],
        payload: Vec<u8>,
        http: Option<bool>,
        raw: Vec<u8>,
    },
    /// A rejection: its fields and raw bytes.
    Reject {
        status: Option<u16>,
        request_id: u32,
        http_status: Option<u16>,
        close: bool,
        raw: Vec<u8>,
    },
}

/// The framer configuration byte 0 selects.
pub fn config(selector: u8) -> FramerConfig {
    if selector & 0x80 != 0 {
        FramerConfig::default()
    } else {
        FramerConfig {
            max_words: 16,
            max_http_head: 512,
        }
    }
}

/// Feed `stream` in segments of `chunk` bytes, decoding after each. Returns the items, the
/// bytes left buffered or unfed, and whether the framer closed the connection.
pub fn feed(cfg: FramerConfig, stream: &[u8], chunk: usize) -> (Vec<Item>, usize, bool) {
    let mut framer = Framer::new(cfg);
    let mut buf = Vec::new();
    let mut items = Vec::new();
    let mut fed = 0;
    let mut consumed_total = 0;
    for piece in stream.chunks(chunk.max(1)) {
        if framer.is_closed() {
            break;
        }
        buf.extend_from_slice(piece);
        fed += piece.len();
        loop {
            match framer.decode(&buf) {
                Decoded::NeedMore => break,
                Decoded::Request { consumed, request } => {
                    assert!(
                        consumed > 0 && consumed <= buf.len(),
                        "request consumed {consumed} of {}",
                        buf.len()
                    );
                    let h = request.header;
                    assert!(h.words <= cfg.max_words, "words {} over the limit", h.words);
                    assert_eq!(
                        request.payload.len(),
                        h.words as usize * 4,
                        "payload length"
                    );
                    let raw = buf[..consumed].to_vec();
                    // The decoded frame re-encodes to the bytes it came from (binary), or to
                    // the body that ends the HTTP request.
                    let words: Vec<u32> = request
                        .payload
                        .chunks_exact(4)
                        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                    let mut enc = Vec::new();
                    encode_request(&mut enc, &h, &words);
                    let http = match request.framing {
                        Framing::Binary => {
                            assert_eq!(enc, raw, "binary frame does not re-encode to its bytes");
                            None
                        }
                        Framing::Http { keep_alive } => {
                            assert!(raw.ends_with(&enc), "HTTP body is not the re-encoded frame");
                            assert!(raw.starts_with(b"POST "), "HTTP request is not a POST");
                            Some(keep_alive)
                        }
                    };
                    items.push(Item::Request {
                        header: h.encode(),
                        payload: request.payload.to_vec(),
                        http,
                        raw,
                    });
                    buf.drain(..consumed);
                    consumed_total += consumed;
                }
                Decoded::Reject { consumed, reject } => {
                    assert!(
                        consumed > 0 && consumed <= buf.len(),
                        "reject consumed {consumed} of {}",
                        buf.len()
                    );
                    items.push(Item::Reject {
                        status: reject.status.map(|s| s as u16),
                        request_id: reject.request_id,
                        http_status: reject.http_status,
                        close: reject.close,
                        raw: buf[..consumed].to_vec(),
                    });
                    buf.drain(..consumed);
                    consumed_total += consumed;
                    if reject.close {
                        assert!(
                            framer.is_closed(),
                            "a closing reject leaves the framer open"
                        );
                    }
                }
            }
        }
    }
    let left = buf.len() + (stream.len() - fed);
    // Every byte is accounted for: consumed by an item, still buffered, or never fed.
    assert_eq!(
        consumed_total + left,
        stream.len(),
        "bytes lost or invented"
    );
    let raw_total: usize = items
        .iter()
        .map(|i| match i {
            Item::Request { raw, .. } | Item::Reject { raw, .. } => raw.len(),
        })
        .sum();
    assert_eq!(raw_total, consumed_total);
    (items, left, framer.is_closed())
}

/// Run every invariant on one fuzz input.
pub fn check(data: &[u8]) {
    let Some((&sel, stream)) = data.split_first() else {
        return;
    };
    let cfg = config(sel);
    let chunk = usize::from(sel & 0x7f).max(1);
    let segmented = feed(cfg, stream, chunk);
    // Segmenting changes nothing: the same items as with the whole stream in one piece, and
    // as byte by byte. Except in one documented respect: a closing (framing) reject consumes
    // whatever is buffered, so its bytes depend on the segmenting; compare those without.
    let whole = feed(cfg, stream, stream.len().max(1));
    assert_eq!(
        normalized(&segmented),
        normalized(&whole),
        "segments of {chunk} bytes decode differently"
    );
    if stream.len() <= 4096 {
        assert_eq!(
            normalized(&feed(cfg, stream, 1)),
            normalized(&whole),
            "byte-by-byte decodes differently"
        );
    }
    // The items are the stream's prefix, in order.
    let (items, left, closed) = whole;
    let mut pos = 0;
    for i in &items {
        let (Item::Request { raw, .. } | Item::Reject { raw, .. }) = i;
        assert_eq!(
            &stream[pos..pos + raw.len()],
            &raw[..],
            "item bytes out of place"
        );
        pos += raw.len();
    }
    assert_eq!(pos + left, stream.len());
    if closed {
        assert!(
            matches!(items.last(), Some(Item::Reject { close: true, .. })),
            "closed without a closing item"
        );
    }
}

/// Items and the closed flag, with the bytes of a closing reject left out (see `check`).
fn normalized(r: &(Vec<Item>, usize, bool)) -> (Vec<Item>, bool) {
    let items =
        r.0.iter()
            .map(|i| match i {
                Item::Reject { close: true, .. } => {
                    let mut i = i.clone();
                    if let Item::Reject { raw, .. } = &mut i {
                        raw.clear();
                    }
                    i
                }
                other => other.clone(),
            })
            .collect();
    (items, r.2)
}
