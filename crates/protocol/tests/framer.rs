//! Framer properties: split/coalesce invariance, documented errors, no panics.

use bgs_protocol::reply::{encode_http_request, encode_request};
use bgs_protocol::{Decoded, Framer, FramerConfig, Framing, Op, RequestHeader, Status};
use proptest::prelude::*;

/// An owned copy of one framer result.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Item {
    Req {
        header: RequestHeader,
        payload: Vec<u8>,
        framing: Framing,
    },
    Rej {
        request_id: u32,
        status: Option<Status>,
        http: Option<u16>,
        close: bool,
    },
}

/// Feed `stream` in the given chunk sizes, draining the framer after each chunk.
fn run(cfg: FramerConfig, stream: &[u8], chunks: &[usize]) -> Vec<Item> {
    let mut framer = Framer::new(cfg);
    let mut buf: Vec<u8> = Vec::new();
    let mut out = Vec::new();
    let mut pos = 0;
    let mut sizes = chunks.iter().copied().cycle();
    while pos < stream.len() {
        let n = sizes
            .next()
            .unwrap_or(stream.len())
            .max(1)
            .min(stream.len() - pos);
        buf.extend_from_slice(&stream[pos..pos + n]);
        pos += n;
        loop {
            match framer.decode(&buf) {
                Decoded::NeedMore => break,
                Decoded::Request { consumed, request } => {
                    out.push(Item::Req {
                        header: request.header,
                        payload: request.payload.to_vec(),
                        framing: request.framing,
                    });
                    buf.drain(..consumed);
                }
                Decoded::Reject { consumed, reject } => {
                    out.push(Item::Rej {
                        request_id: reject.request_id,
                        status: reject.status,
                        http: reject.http_status,
                        close: reject.close,
                    });
                    buf.drain(..consumed);
                }
            }
        }
        if framer.is_closed() {
            break;
        }
    }
    out
}

fn whole(cfg: FramerConfig, stream: &[u8]) -> Vec<Item> {
    run(cfg, stream, &[stream.len().max(1)])
}

fn frame(op: u16, id: u32, param: u32, words: &[u32]) -> Vec<u8> {
    let mut h = RequestHeader::new(Op::Echo, id, words.len() as u32, param);
    h.op = op;
    let mut v = Vec::new();
    encode_request(&mut v, &h, words);
    v
}

fn http(frame: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    encode_http_request(&mut v, "localhost", frame);
    v
}

fn cfg() -> FramerConfig {
    FramerConfig::default()
}

fn rej(id: u32, status: Option<Status>, http: Option<u16>, close: bool) -> Item {
    Item::Rej {
        request_id: id,
        status,
        http,
        close,
    }
}

#[test]
fn valid_frames_of_each_op() {
    let w: Vec<u32> = (0..64).collect();
    let mut s = frame(0, 1, 0, &[1, 2, 3]);
    s.extend(frame(1, 2, 0, &w));
    s.extend(frame(2, 3, 256, &w));
    s.extend(frame(0, 4, 9, &[]));
    let items = whole(cfg(), &s);
    assert_eq!(items.len(), 4);
    for (i, it) in items.iter().enumerate() {
        let Item::Req {
            header, framing, ..
        } = it
        else {
            panic!("{it:?}")
        };
        assert_eq!(header.request_id, i as u32 + 1);
        assert_eq!(*framing, Framing::Binary);
    }
}

#[test]
fn framing_errors_close_and_report() {
    let good = frame(0, 5, 0, &[7]);
    // Bad magic: detected on the first byte, id unknown.
    let mut s = good.clone();
    s.extend(b"XGS1garbage-garbage-garbage");
    let items = whole(cfg(), &s);
    assert_eq!(items.len(), 2);
    assert_eq!(items[1], rej(0, Some(Status::BadMagic), None, true));
    // Bad version.
    let mut bad = frame(0, 6, 0, &[7]);
    bad[4] = 2;
    assert_eq!(
        whole(cfg(), &bad),
        vec![rej(0, Some(Status::BadVersion), None, true)]
    );
    // Too many words: detected from the header alone, id known.
    let big = frame(0, 7, 0, &[0; 65]);
    assert_eq!(
        whole(cfg(), &big[..16]),
        vec![rej(7, Some(Status::PayloadTooLarge), None, true)]
    );
    // Nonzero flags.
    let mut f = frame(0, 8, 0, &[1]);
    f[20] = 1;
    assert_eq!(
        whole(cfg(), &f),
        vec![rej(8, Some(Status::BadFlags), None, true)]
    );
}

#[test]
fn semantic_errors_keep_connection() {
    let w = vec![0u32; 64];
    let mut s = frame(9, 1, 0, &[1]);
    s.extend(frame(3, 2, 4, &[1])); // generate: valid at the framer (the executor may say 18)
    s.extend(frame(1, 3, 257, &w)); // repeat over the limit
    s.extend(frame(1, 4, 0, &[1, 2])); // gemm8 needs 64 words
    s.extend(frame(2, 5, 0, &w)); // repeat 0 means 1: valid
    s.extend(frame(3, 6, 0, &[1])); // generate: max new tokens 0
    s.extend(frame(3, 7, 4097, &[1])); // generate: max new tokens over 4096
    s.extend(frame(3, 8, 1, &[])); // generate: an empty prompt
    let items = whole(cfg(), &s);
    assert_eq!(items[0], rej(1, Some(Status::UnknownOp), None, false));
    assert!(matches!(items[1], Item::Req { .. }));
    assert_eq!(items[2], rej(3, Some(Status::BadParam), None, false));
    assert_eq!(items[3], rej(4, Some(Status::BadParam), None, false));
    assert!(matches!(items[4], Item::Req { .. }));
    assert_eq!(items[5], rej(6, Some(Status::BadParam), None, false));
    assert_eq!(items[6], rej(7, Some(Status::BadParam), None, false));
    assert_eq!(items[7], rej(8, Some(Status::BadParam), None, false));
    assert_eq!(items.len(), 8);
}

fn frame_flags(op: u16, id: u32, param: u32, flags: u32, words: &[u32]) -> Vec<u8> {
    let mut f = frame(op, id, param, words);
    f[20..24].copy_from_slice(&flags.to_le_bytes());
    f
}

/// What the framer answers for one frame, fed byte by byte (so every check runs as soon as its
/// bytes arrive), as a status (0 for a request) and whether the connection closes.
fn verdict(f: &[u8]) -> (u16, bool) {
    let a = whole(cfg(), f);
    assert_eq!(a, run(cfg(), f, &[1]), "split changed the verdict");
    match a.as_slice() {
        [Item::Req { .. }] => (0, false),
        [Item::Rej { status, close, .. }] => (status.map_or(0, |s| s as u16), *close),
        other => panic!("one item expected, got {other:?}"),
    }
}

/// Every op's rules from the table, at and around each bound, through the framer.
#[test]
fn every_op_rule_through_the_framer() {
    use bgs_protocol::ops::{KNOWN_FLAGS, OPS, Reply, WORDS_SERVER_LIMIT};
    let max_words = cfg().max_words;
    let ok = (0, false);
    let bad_param = (Status::BadParam as u16, false);
    let bad_flags = (Status::BadFlags as u16, true);
    for spec in &OPS {
        let op = spec.wire();
        let wmax = if spec.words.max == WORDS_SERVER_LIMIT {
            max_words
        } else {
            spec.words.max
        };
        let pmin = spec.param.min;
        let payload = |n: u32| vec![5u32; n as usize];
        let name = spec.name;
        // Payload words: min and max pass, one outside either bound is status 20.
        for (n, want) in [(spec.words.min, ok), (wmax, ok)] {
            assert_eq!(
                verdict(&frame(op, 1, pmin, &payload(n))),
                want,
                "{name} words {n}"
            );
        }
        if spec.words.min > 0 {
            let n = spec.words.min - 1;
            assert_eq!(
                verdict(&frame(op, 1, pmin, &payload(n))),
                bad_param,
                "{name} words {n}"
            );
        }
        if wmax < max_words {
            let n = wmax + 1;
            assert_eq!(
                verdict(&frame(op, 1, pmin, &payload(n))),
                bad_param,
                "{name} words {n}"
            );
        }
        // Param: min and max pass, one outside either bound is status 20.
        let w = payload(spec.words.min.max(1).min(wmax));
        for p in [spec.param.min, spec.param.max] {
            assert_eq!(verdict(&frame(op, 2, p, &w)), ok, "{name} param {p}");
        }
        if spec.param.min > 0 {
            let p = spec.param.min - 1;
            assert_eq!(verdict(&frame(op, 2, p, &w)), bad_param, "{name} param {p}");
        }
        if spec.param.max < u32::MAX {
            let p = spec.param.max + 1;
            assert_eq!(verdict(&frame(op, 2, p, &w)), bad_param, "{name} param {p}");
        }
        // Flags: each allowed bit passes; every other bit closes with 23, also on a frame
        // whose payload and param would be rejected later (flags come first on the wire).
        for bit in 0..32 {
            let flag = 1u32 << bit;
            let want = if spec.flags & flag != 0 {
                ok
            } else {
                bad_flags
            };
            assert_eq!(
                verdict(&frame_flags(op, 3, pmin, flag, &w)),
                want,
                "{name} flag bit {bit}"
            );
        }
        assert_eq!(
            verdict(&frame_flags(op, 3, pmin, spec.flags, &w)),
            ok,
            "{name} all flags"
        );
        assert_eq!(
            verdict(&frame_flags(op, 3, u32::MAX, !spec.flags, &[])),
            bad_flags,
            "{name} flags before param"
        );
        // The table's reply shape is one of the documented ones.
        match spec.reply {
            Reply::Fixed(n) => assert_eq!(n, 64),
            Reply::AsRequest => assert_eq!(spec.op, Op::Echo),
            Reply::Stream {
                token_words,
                final_words,
            } => assert_eq!((token_words, final_words), (1, 2)),
        }
    }
    // An unknown op allows no flag; with flags 0 it is status 18 (connection stays open).
    assert_eq!(
        verdict(&frame(OPS.len() as u16, 4, 0, &[1])),
        (Status::UnknownOp as u16, false)
    );
    assert_eq!(
        verdict(&frame_flags(OPS.len() as u16, 4, 0, KNOWN_FLAGS, &[1])),
        bad_flags
    );
    // The decisions, spelled out: generate takes 1..=max words, 1..=4096 new tokens and flag 1.
    let gen_ok = frame_flags(3, 9, 4096, bgs_protocol::FLAG_IGNORE_EOS, &[1; 64]);
    assert_eq!(verdict(&gen_ok), ok);
    assert_eq!(verdict(&frame_flags(1, 9, 1, 1, &[0; 64])), bad_flags);
}

#[test]
fn truncated_frame_waits() {
    let f = frame(0, 1, 0, &[1, 2, 3]);
    assert!(whole(cfg(), &f[..f.len() - 1]).is_empty());
    assert!(whole(cfg(), &f[..3]).is_empty());
}

#[test]
fn http_requests_and_errors() {
    let f = frame(0, 11, 0, &[1, 2]);
    let mut s = http(&f);
    s.extend(http(&f));
    let items = whole(cfg(), &s);
    assert_eq!(items.len(), 2);
    assert!(matches!(
        items[0],
        Item::Req {
            framing: Framing::Http { keep_alive: true },
            ..
        }
    ));

    let one = |raw: &[u8]| whole(cfg(), raw);
    assert_eq!(
        one(b"POST /v1/submit HTTP/1.1\r\nHost: x\r\n\r\n"),
        vec![rej(0, None, Some(411), true)]
    );
    assert_eq!(
        one(b"POST /v1/submit HTTP/1.1\r\nContent-Length: 281\r\n\r\n"),
        vec![rej(0, Some(Status::PayloadTooLarge), Some(413), true)]
    );
    assert_eq!(
        one(b"GET /v1/submit HTTP/1.1\r\n\r\n"),
        vec![rej(0, None, Some(405), false)]
    );
    assert_eq!(
        one(b"POST /other HTTP/1.1\r\nContent-Length: 2\r\n\r\nab"),
        vec![rej(0, None, Some(404), false)]
    );
    assert_eq!(
        one(b"POST /v1/submit HTTP/2\r\n\r\n"),
        vec![rej(0, None, Some(400), true)]
    );
    assert_eq!(
        one(b"POST /v1/submit HTTP/1.1\r\nbad header\r\n\r\n"),
        vec![rej(0, None, Some(400), true)]
    );
    assert_eq!(
        one(b"POST /v1/submit HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
        vec![rej(0, None, Some(411), true)]
    );
    let mut huge = b"POST /v1/submit HTTP/1.1\r\nX: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 9000));
    assert_eq!(one(&huge), vec![rej(0, None, Some(431), true)]);
    // A frame error inside the body: the error frame is the body of a 400.
    let mut bad = f.clone();
    bad[0] = b'X';
    assert_eq!(
        one(&http(&bad)),
        vec![rej(0, Some(Status::BadMagic), Some(400), true)]
    );
    // A semantic error keeps the connection.
    assert_eq!(
        one(&http(&frame(1, 3, 0, &[1]))),
        vec![rej(3, Some(Status::BadParam), Some(400), false)]
    );
    // Body length disagreeing with the frame header.
    let mut short = b"POST /v1/submit HTTP/1.1\r\nContent-Length: 30\r\n\r\n".to_vec();
    short.extend(&f[..24]);
    short.extend([0u8; 6]);
    assert_eq!(one(&short), vec![rej(0, None, Some(400), false)]);
    // Connection: close.
    let mut c =
        b"POST /v1/submit HTTP/1.1\r\nConnection: close\r\nContent-Length: 32\r\n\r\n".to_vec();
    c.extend(&f);
    assert!(matches!(
        one(&c)[0],
        Item::Req {
            framing: Framing::Http { keep_alive: false },
            ..
        }
    ));
}

fn arb_frame() -> impl Strategy<Value = Vec<u8>> {
    (
        0u16..5,
        any::<u32>(),
        prop_oneof![0u32..300, 4090u32..4100],
        prop::collection::vec(any::<u32>(), 0..70),
        any::<bool>(),
        prop_oneof![Just(0u32), 0u32..4],
    )
        .prop_map(|(op, id, param, mut words, one_shot, flags)| {
            if one_shot {
                words.resize(64, 7);
            }
            // Ops 0..=3 and an unknown one; flags mostly 0, sometimes bit 0 (generate only)
            // or a bit no op allows.
            let mut f = frame(op, id, param, &words);
            f[20..24].copy_from_slice(&flags.to_le_bytes());
            f
        })
}

fn arb_stream() -> impl Strategy<Value = Vec<u8>> {
    (prop::collection::vec(arb_frame(), 1..8), any::<bool>()).prop_map(|(frames, as_http)| {
        frames
            .iter()
            .flat_map(|f| if as_http { http(f) } else { f.clone() })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any split of a stream of (valid or semantically invalid) frames decodes identically.
    #[test]
    fn splits_do_not_matter(stream in arb_stream(), chunks in prop::collection::vec(1usize..40, 1..20)) {
        let a = whole(cfg(), &stream);
        let b = run(cfg(), &stream, &chunks);
        prop_assert_eq!(&a, &b);
        let c = run(cfg(), &stream, &[1]);
        prop_assert_eq!(&a, &c);
    }

    /// Corrupted streams: still split-invariant, and an error that closes is the last item.
    #[test]
    fn corrupted_streams_are_split_invariant(
        stream in arb_stream(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        chunks in prop::collection::vec(1usize..40, 1..20),
    ) {
        let mut s = stream;
        for (i, b) in flips {
            let k = i.index(s.len());
            s[k] = b;
        }
        let a = whole(cfg(), &s);
        let b = run(cfg(), &s, &chunks);
        prop_assert_eq!(&a, &b);
        for (i, it) in a.iter().enumerate() {
            if let Item::Rej { close: true, .. } = it {
                prop_assert_eq!(i, a.len() - 1);
            }
        }
    }

    /// Arbitrary bytes never panic and never consume more than they were given.
    #[test]
    fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..600), chunks in prop::collection::vec(1usize..64, 1..8)) {
        let _ = run(cfg(), &bytes, &chunks);
        let mut http_like = b"POST /v1/submit HTTP/1.1\r\n".to_vec();
        http_like.extend(&bytes);
        let _ = run(cfg(), &http_like, &chunks);
    }

    /// Valid streams decode to exactly the frames that were encoded.
    #[test]
    fn valid_frames_round_trip(ids in prop::collection::vec(any::<u32>(), 1..10), words in prop::collection::vec(any::<u32>(), 0..64)) {
        let mut s = Vec::new();
        for id in &ids {
            s.extend(frame(0, *id, 0, &words));
        }
        let items = whole(cfg(), &s);
        prop_assert_eq!(items.len(), ids.len());
        for (it, id) in items.iter().zip(&ids) {
            match it {
                Item::Req { header, payload, .. } => {
                    prop_assert_eq!(header.request_id, *id);
                    prop_assert_eq!(payload.len(), words.len() * 4);
                }
                other => prop_assert!(false, "unexpected {:?}", other),
            }
        }
    }
}
