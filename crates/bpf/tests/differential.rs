//! Differential tests: the BPF framer and `bgs_protocol::Framer` must give the same items for
//! every byte stream, however it is split into segments (docs/bpf.md, "Testing").

mod common;

use std::time::Duration;

use bgs_bpf::KernelRxConfig;
use bgs_protocol::{Op, RequestHeader, encode_request};
use common::{Harness, Item, reference, root_or_skip};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config as PtConfig, TestRunner};

fn frame(op: u16, id: u32, words: u32, param: u32) -> Vec<u8> {
    let mut h = RequestHeader::new(Op::Echo, id, words, param);
    h.op = op;
    let payload: Vec<u32> = (0..words)
        .map(|i| i.wrapping_mul(0x0101_0101) ^ id)
        .collect();
    let mut out = Vec::new();
    encode_request(&mut out, &h, &payload);
    out
}

fn frame_flags(op: u16, id: u32, words: u32, param: u32, flags: u32) -> Vec<u8> {
    let mut f = frame(op, id, words, param);
    f[20..24].copy_from_slice(&flags.to_le_bytes());
    f
}

fn frame_with(f: impl FnOnce(&mut RequestHeader), words: u32) -> Vec<u8> {
    let mut h = RequestHeader::new(Op::Echo, 7, words, 0);
    f(&mut h);
    let payload: Vec<u32> = (0..words).collect();
    let mut out = Vec::new();
    encode_request(&mut out, &h, &payload);
    out
}

fn http(head: &str, body: &[u8]) -> Vec<u8> {
    let mut v = head.as_bytes().to_vec();
    v.extend_from_slice(body);
    v
}

fn post(body: &[u8], extra: &str) -> Vec<u8> {
    http(
        &format!(
            "POST /v1/submit HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n{extra}\r\n",
            body.len()
        ),
        body,
    )
}

/// Hand-written cases: every rule and error of docs/protocol.md.
fn hand_cases() -> Vec<(&'static str, Vec<u8>)> {
    let echo = frame(0, 1, 3, 0);
    let gemm = frame(1, 2, 64, 1);
    let mut cases: Vec<(&'static str, Vec<u8>)> = vec![
        ("echo", echo.clone()),
        ("echo 0 words", frame(0, 9, 0, 0)),
        ("echo max words", frame(0, 9, 64, 0)),
        ("gemm8", gemm.clone()),
        ("fft32 repeat 256", frame(2, 3, 64, 256)),
        ("pipelined", [echo.clone(), gemm.clone(), frame(0, 5, 0, 0)].concat()),
        ("bad magic", b"XGS1aaaaaaaaaaaaaaaaaaaa".to_vec()),
        ("bad magic byte 3", b"BGSx".to_vec()),
        ("bad magic after a frame", [echo.clone(), b"Bx".to_vec()].concat()),
        ("lower-case first byte", b"post /v1/submit".to_vec()),
        ("binary byte", vec![0u8; 30]),
        ("bad version", frame_with(|h| h.version = 2, 0)),
        ("payload too large", frame(0, 4, 65, 0)),
        ("payload too large header only", frame(0, 4, 1000, 0)[..16].to_vec()),
        ("bad flags", frame_with(|h| h.flags = 1, 0)),
        ("unknown op", [frame(9, 5, 2, 0), echo.clone()].concat()),
        ("generate", [frame(3, 6, 1, 10), echo.clone()].concat()),
        ("generate ignore eos", [frame_flags(3, 6, 64, 4096, 1), echo.clone()].concat()),
        ("generate no prompt", [frame(3, 6, 0, 10), echo.clone()].concat()),
        ("generate 0 new tokens", [frame(3, 6, 2, 0), echo.clone()].concat()),
        ("generate 4097 new tokens", [frame(3, 6, 2, 4097), echo.clone()].concat()),
        ("generate flag bit 1", [frame_flags(3, 6, 2, 5, 2), echo.clone()].concat()),
        ("generate flags before param", frame_flags(3, 6, 0, 0, 3)),
        ("echo flag bit 0", [frame_flags(0, 6, 2, 5, 1), echo.clone()].concat()),
        ("gemm8 flag bit 0", frame_flags(1, 6, 64, 1, 1)),
        ("unknown op flag bit 0", frame_flags(9, 6, 1, 1, 1)),
        ("http generate", [post(&frame_flags(3, 6, 3, 7, 1), ""), post(&echo, "")].concat()),
        ("http generate bad param", [post(&frame(3, 6, 3, 0), ""), post(&echo, "")].concat()),
        ("http generate bad flags", post(&frame_flags(3, 6, 3, 7, 8), "")),
        ("gemm8 wrong words", [frame(1, 7, 63, 1), echo.clone()].concat()),
        ("gemm8 repeat 257", [frame(1, 8, 64, 257), echo.clone()].concat()),
        ("partial frame at EOF", [echo.clone(), frame(0, 3, 10, 0)[..30].to_vec()].concat()),
        ("partial header at EOF", echo[..10].to_vec()),
        // HTTP
        ("http ok", post(&echo, "")),
        ("http keep-alive pipelined", [post(&echo, ""), post(&gemm, "")].concat()),
        ("http connection close", [post(&echo, "Connection: close\r\n"), post(&gemm, "")].concat()),
        ("http 1.0", http(&format!("POST /v1/submit HTTP/1.0\r\nContent-Length: {}\r\n\r\n", echo.len()), &echo)),
        ("http 1.0 keep-alive", [http(&format!("POST /v1/submit HTTP/1.0\r\nConnection: Keep-Alive\r\nContent-Length: {}\r\n\r\n", echo.len()), &echo), post(&echo, "")].concat()),
        ("http connection tokens", [post(&echo, "Connection: foo, CLOSE \r\n"), post(&echo, "")].concat()),
        ("http connection close then keep-alive", [post(&echo, "Connection: close,keep-alive\r\n"), post(&echo, "")].concat()),
        ("http connection 'clo se'", [post(&echo, "Connection: clo se\r\n"), post(&echo, "")].concat()),
        ("http header case", http(&format!("POST /v1/submit HTTP/1.1\r\ncOnTeNt-LeNgTh:\t{} \t\r\n\r\n", echo.len()), &echo)),
        ("http 404", [http("GET /x HTTP/1.1\r\n\r\n", b""), post(&echo, "")].concat()),
        ("http 404 with body", [http("POST /nope HTTP/1.1\r\nContent-Length: 5\r\n\r\n", b"hello"), post(&echo, "")].concat()),
        ("http 404 body too large", http("POST /nope HTTP/1.1\r\nContent-Length: 2000\r\n\r\n", b"x")),
        ("http 405", [http("GET /v1/submit HTTP/1.1\r\n\r\n", b""), post(&echo, "")].concat()),
        ("http 405 close", [http("PUT /v1/submit HTTP/1.1\r\nConnection: close\r\nContent-Length: 2\r\n\r\n", b"ab"), post(&echo, "")].concat()),
        ("http 405 body too large", http("PUT /v1/submit HTTP/1.1\r\nContent-Length: 99999\r\n\r\n", b"")),
        ("http 411 no length", http("POST /v1/submit HTTP/1.1\r\n\r\n", b"")),
        ("http 411 chunked", http("POST /v1/submit HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n", b"")),
        ("http 411 chunked on 404", http("GET /a HTTP/1.1\r\nTransfer-Encoding: x\r\n\r\n", b"")),
        ("http 413", http("POST /v1/submit HTTP/1.1\r\nContent-Length: 281\r\n\r\n", b"")),
        ("http 413 ten digits", http("POST /v1/submit HTTP/1.1\r\nContent-Length: 9999999999\r\n\r\n", b"")),
        ("http 400 eleven digits", http("POST /v1/submit HTTP/1.1\r\nContent-Length: 12345678901\r\n\r\n", b"")),
        ("http 400 cl not digits", http("POST /v1/submit HTTP/1.1\r\nContent-Length: 1a\r\n\r\n", b"")),
        ("http 400 cl empty", http("POST /v1/submit HTTP/1.1\r\nContent-Length: \r\n\r\n", b"")),
        ("http 400 cl inner space", http("POST /v1/submit HTTP/1.1\r\nContent-Length: 1 2\r\n\r\n", b"")),
        ("http cl repeated same", http(&format!("POST /v1/submit HTTP/1.1\r\nContent-Length: {0}\r\nContent-Length: {0}\r\n\r\n", echo.len()), &echo)),
        ("http 400 cl repeated different", http("POST /v1/submit HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", b"")),
        ("http 400 bare lf", http("POST /v1/submit HTTP/1.1\nContent-Length: 3\r\n\r\n", b"")),
        ("http 400 bare lf header", http("POST /v1/submit HTTP/1.1\r\nA: b\nContent-Length: 3\r\n\r\n", b"")),
        ("http 400 no colon", http("POST /v1/submit HTTP/1.1\r\nNoColon\r\n\r\n", b"")),
        ("http 400 empty name", http("POST /v1/submit HTTP/1.1\r\n: x\r\n\r\n", b"")),
        ("http 400 space in name", http("POST /v1/submit HTTP/1.1\r\nA b: x\r\n\r\n", b"")),
        ("http 400 version", http("POST /v1/submit HTTP/2.0\r\nContent-Length: 0\r\n\r\n", b"")),
        ("http 400 version long", http("POST /v1/submit HTTP/1.10\r\nContent-Length: 0\r\n\r\n", b"")),
        ("http 400 two parts", http("POST /v1/submit\r\n\r\n", b"")),
        ("http 400 four parts", http("POST /v1/submit HTTP/1.1 x\r\n\r\n", b"")),
        ("http 400 double space", http("POST  /v1/submit HTTP/1.1\r\n\r\n", b"")),
        ("http 400 method lower", http("PoST /v1/submit HTTP/1.1\r\n\r\n", b"")),
        ("http cr inside line", http("POST /v1/submit HTTP/1.1\r\nX: a\rb\r\nContent-Length: 0\r\n\r\n", b"")),
        ("http cr cr lf", http("POST /v1/submit HTTP/1.1\r\nX: a\r\r\nContent-Length: 0\r\n\r\n", b"")),
        ("http 431", http(&format!("POST /v1/submit HTTP/1.1\r\nX: {}\r\n", "a".repeat(9000)), b"")),
        ("http head exactly at limit", http(&format!("POST /v1/submit HTTP/1.1\r\nContent-Length: 0\r\nX: {}\r\n\r\n", "a".repeat(8192 - 52)), b"")),
        ("http head one over limit", http(&format!("POST /v1/submit HTTP/1.1\r\nContent-Length: 0\r\nX: {}\r\n\r\n", "a".repeat(8192 - 51)), b"")),
        ("http 400 empty body", post(b"", "")),
        ("http 400 short body", post(&echo[..20], "")),
        ("http 400 long body", post(&[echo.clone(), vec![0; 4]].concat(), "")),
        ("http bad magic body", post(b"XXXXXXXXXXXXXXXXXXXXXXXX", "")),
        ("http bad version body", post(&frame_with(|h| h.version = 3, 0), "")),
        ("http bad flags body", post(&frame_with(|h| h.flags = 5, 0), "")),
        ("http too large body frame", post(&frame(0, 1, 65, 0)[..24], "")),
        ("http unknown op body", [post(&frame(77, 1, 0, 0), ""), post(&echo, "")].concat()),
        ("http bad param body long", [post(&[frame(1, 1, 63, 0), vec![1; 8]].concat(), ""), post(&echo, "")].concat()),
        ("http bad param close", [post(&frame(2, 1, 64, 999), "Connection: close\r\n"), post(&echo, "")].concat()),
        ("http leading crlf second request", [post(&echo, ""), b"\r\n\r\n".to_vec()].concat()),
        ("http body starts B in http mode", [post(&echo, ""), echo.clone()].concat()),
        ("http partial body at EOF", post(&echo, "")[..60].to_vec()),
    ];
    // Every op value a little beyond the defined ones.
    for op in 0..6u16 {
        cases.push(("op sweep", frame(op, u32::from(op), 64, 2)));
    }
    cases
}

/// Split points exercising every header boundary, plus bytewise.
fn chunkings(len: usize) -> Vec<Vec<usize>> {
    vec![
        vec![],                     // all at once
        vec![1; len.min(400)],      // byte by byte (first 400 bytes)
        vec![3, 2, 1, 10, 4, 4, 7], // header field boundaries
        vec![23, 1, 5, 100],
    ]
}

#[test]
fn hand_written_cases_match_the_rust_framer() {
    if !root_or_skip("hand_written_cases_match_the_rust_framer") {
        return;
    }
    let mut h = Harness::new(KernelRxConfig::default());
    let mut failures = Vec::new();
    for (name, stream) in hand_cases() {
        let want = reference(h.framer, &stream);
        for (k, chunks) in chunkings(stream.len()).into_iter().enumerate() {
            let gap = if k == 2 {
                Duration::from_millis(1)
            } else {
                Duration::ZERO
            };
            let got = h.run_case(&stream, &chunks, gap);
            if got != want {
                failures.push(format!(
                    "{name} (chunking {k}):\n  bpf:  {got:?}\n  rust: {want:?}"
                ));
            }
        }
    }
    let c = h.rx.counters();
    eprintln!("{c}");
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(c.internal, 0);
    assert_eq!(c.busy, 0);
}

/// A piece of a generated stream.
#[derive(Clone, Debug)]
enum Piece {
    /// One request frame: sent bare, or wrapped in an HTTP POST with header variant `http`.
    Frame {
        op: u16,
        id: u32,
        words: u32,
        param: u32,
        flags: u32,
        http: Option<u8>,
    },
    /// An HTTP request the framer answers without closing (404/405), or with a body it skips.
    HttpOther(u8),
    /// Bytes that are not a frame (a fatal reject, unless a flip or truncation hides them).
    Junk(Vec<u8>),
}

fn frame_piece() -> impl Strategy<Value = (u16, u32, u32, u32, u32)> {
    prop_oneof![
        // echo, every size.
        (0u32..=64, any::<u32>()).prop_map(|(w, id)| (0, id, w, 0, 0)),
        // gemm8 / fft32 at and around their fixed size and repeat bounds.
        (
            1u16..=2,
            any::<u32>(),
            prop_oneof![3 => Just(64u32), 1 => 60u32..=66],
            prop_oneof![0u32..=3, 250u32..=260]
        )
            .prop_map(|(op, id, words, param)| (op, id, words, param, 0)),
        // generate around its bounds, with the allowed flag, a forbidden one, or none.
        (
            any::<u32>(),
            0u32..=64,
            prop_oneof![0u32..=2, 4095u32..=4097, 1u32..4096],
            prop_oneof![4 => Just(0u32), 4 => Just(1u32), 1 => 0u32..=4, 1 => any::<u32>()]
        )
            .prop_map(|(id, words, param, flags)| (3, id, words, param, flags)),
        // Any op (unknown ones included), any param, mostly valid flags.
        (
            0u16..=12,
            any::<u32>(),
            0u32..=8,
            any::<u32>(),
            prop_oneof![8 => Just(0u32), 1 => any::<u32>()]
        ),
    ]
}

fn piece_strategy() -> impl Strategy<Value = Piece> {
    prop_oneof![
        16 => (frame_piece(), prop_oneof![Just(None), (0u8..8).prop_map(Some)]).prop_map(
            |((op, id, words, param, flags), http)| Piece::Frame {
                op,
                id,
                words,
                param,
                flags,
                http,
            }
        ),
        3 => (0u8..6).prop_map(Piece::HttpOther),
        1 => prop::collection::vec(any::<u8>(), 1..40).prop_map(Piece::Junk),
    ]
}

fn http_other(kind: u8) -> Vec<u8> {
    match kind {
        0 => http("GET /x HTTP/1.1\r\n\r\n", b""),
        1 => http("POST /nope HTTP/1.1\r\nContent-Length: 5\r\n\r\n", b"hello"),
        2 => http("GET /v1/submit HTTP/1.1\r\nHost: y\r\n\r\n", b""),
        3 => http(
            "PUT /v1/submit HTTP/1.1\r\nContent-Length: 2\r\n\r\n",
            b"ab",
        ),
        4 => http(
            "DELETE /v1/submit HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
            b"",
        ),
        _ => http("GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n", b""),
    }
}

/// What a generated case is: the stream, the segment sizes, whether to sleep between segments.
type Case = (Vec<u8>, Vec<usize>, bool);

fn stream_strategy() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(piece_strategy(), 1..8),
        // Mostly one framing per connection (the framer locks onto the first one), sometimes
        // each piece as generated (binary after HTTP, HTTP after binary).
        prop_oneof![2 => Just(0u8), 2 => Just(1u8), 1 => Just(2u8)],
        // Byte flips: none in half the cases (so streams run long past recoverable errors).
        prop_oneof![
            Just(Vec::new()),
            prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4)
        ],
        prop_oneof![3 => Just(None), 1 => any::<prop::sample::Index>().prop_map(Some)], // truncation
        prop::collection::vec(1usize..200, 0..12), // chunk sizes
        prop_oneof![3 => Just(false), 1 => Just(true)], // sleep between chunks
    )
        .prop_map(|(pieces, mode, flips, cut, chunks, sleep)| {
            let mut s = Vec::new();
            for p in pieces {
                match p {
                    Piece::Frame {
                        op,
                        id,
                        words,
                        param,
                        flags,
                        http,
                    } => {
                        let f = frame_flags(op, id, words, param, flags);
                        let http = match mode {
                            0 => None,
                            1 => Some(http.unwrap_or(0)),
                            _ => http,
                        };
                        match http {
                            None => s.extend(f),
                            Some(v) => {
                                let extra = match v {
                                    0 | 4 => "",
                                    1 => "Connection: keep-alive\r\n",
                                    2 => "X-Pad: \t y \r\n",
                                    3 => "Host: a\r\nUser-Agent: t\r\n",
                                    5 => "connection: foo, bar\r\n",
                                    6 => "CONTENT-TYPE: application/octet-stream\r\n",
                                    _ => "connection: close\r\n",
                                };
                                s.extend(post(&f, extra));
                            }
                        }
                    }
                    Piece::HttpOther(k) => {
                        if mode != 0 {
                            s.extend(http_other(k));
                        }
                    }
                    Piece::Junk(j) => s.extend(j),
                }
            }
            for (ix, b) in flips {
                if !s.is_empty() {
                    let i = ix.index(s.len());
                    s[i] ^= b | 1;
                }
            }
            if let Some(ix) = cut {
                let n = ix.index(s.len() + 1);
                s.truncate(n.max(1));
            }
            (s, chunks, sleep)
        })
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a non-negative integer"))
    })
}

/// Generated streams through BPF and the Rust framer. CI runs a few hundred cases;
/// `BGS_DIFF_CASES=N` runs a long campaign (with `BGS_DIFF_SEED` to pick the stream and
/// `BGS_DIFF_SECONDS` to stop early at a time limit). Every case is checked (no early stop at
/// the first disagreement) so a campaign reports how many disagree; the first few are printed.
#[test]
fn generated_streams_match_the_rust_framer() {
    if !root_or_skip("generated_streams_match_the_rust_framer") {
        return;
    }
    let cases = env_u64("BGS_DIFF_CASES")
        .or_else(|| env_u64("BGS_BPF_PROPTEST_CASES"))
        .unwrap_or(400);
    let seed = env_u64("BGS_DIFF_SEED").unwrap_or(0x6267_7364_6966_6631);
    let deadline =
        env_u64("BGS_DIFF_SECONDS").map(|s| std::time::Instant::now() + Duration::from_secs(s));
    let progress = env_u64("BGS_DIFF_PROGRESS").unwrap_or(0);
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let rng = proptest::test_runner::TestRng::from_seed(
        proptest::test_runner::RngAlgorithm::ChaCha,
        &seed_bytes,
    );
    let mut runner = TestRunner::new_with_rng(PtConfig::default(), rng);
    let strategy = stream_strategy();
    let mut h = Harness::new(KernelRxConfig::default());
    let started = std::time::Instant::now();
    let (mut done, mut disagreements, mut items_seen, mut bytes) = (0u64, 0u64, 0u64, 0u64);
    // Cases where the framers had to keep agreeing after a recoverable reject.
    let mut continued = 0u64;
    let mut shown = Vec::new();
    while done < cases && deadline.is_none_or(|d| std::time::Instant::now() < d) {
        let (stream, chunks, sleep) = strategy.new_tree(&mut runner).unwrap().current();
        let want = reference(h.framer, &stream);
        let gap = if sleep {
            Duration::from_micros(300)
        } else {
            Duration::ZERO
        };
        // As generated (segments, maybe with gaps), then all at once (several frames in one
        // segment).
        for (k, (chunks, gap)) in [(&chunks[..], gap), (&[][..], Duration::ZERO)]
            .into_iter()
            .enumerate()
        {
            let got = h.run_case(&stream, chunks, gap);
            if got != want {
                disagreements += 1;
                if shown.len() < 5 {
                    shown.push(format!(
                        "case {done} run {k} stream {stream:02x?} chunks {chunks:?}:\n  bpf:  {got:?}\n  rust: {want:?}"
                    ));
                }
            }
        }
        let recovered = want
            .iter()
            .position(|i| matches!(i, Item::Reject { close: false, .. }));
        if recovered.is_some_and(|i| i + 1 < want.len()) {
            continued += 1;
        }
        items_seen += want.len() as u64;
        bytes += stream.len() as u64;
        done += 1;
        if progress > 0 && done.is_multiple_of(progress) {
            eprintln!(
                "differential: {done} cases, {disagreements} disagreements, {:.1}s",
                started.elapsed().as_secs_f64()
            );
        }
    }
    let c = h.rx.counters();
    eprintln!(
        "differential: seed {seed:#x}: {done} cases ({} connections), {items_seen} reference \
         items, {bytes} bytes, {continued} continued past a recoverable reject, \
         {disagreements} disagreements, {:.1}s\n{c}",
        done * 2,
        started.elapsed().as_secs_f64()
    );
    assert!(
        shown.is_empty(),
        "{disagreements} disagreements; first ones:\n{}",
        shown.join("\n")
    );
    assert_eq!(c.internal, 0);
}

#[test]
fn item_matches_shape() {
    // Pure check of the reference helper, runs without root.
    let v = reference(Default::default(), &frame(0, 1, 1, 0));
    assert!(matches!(v.as_slice(), [Item::Req { words: 1, .. }]));
}
