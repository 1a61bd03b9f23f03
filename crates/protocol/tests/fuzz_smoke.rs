//! The fuzz target's smoke run, with no nightly toolchain: every file of the seed corpus
//! (`fuzz/seeds/framer/`) and a few thousand generated inputs go through the function the fuzz
//! target calls (`fuzz/fuzz_targets/framer_check.rs`): no panic, every byte accounted for,
//! decoded frames re-encode to their bytes, segmenting changes nothing.

#[path = "../../../fuzz/fuzz_targets/framer_check.rs"]
mod framer_check;

use std::path::PathBuf;

use bgs_protocol::{Op, RequestHeader, encode_request};
use proptest::prelude::*;

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/framer")
}

fn frame(op: u16, id: u32, words: u32, param: u32, flags: u32) -> Vec<u8> {
    let mut h = RequestHeader::new(Op::Echo, id, words, param);
    h.op = op;
    h.flags = flags;
    let payload: Vec<u32> = (0..words)
        .map(|i| i.wrapping_mul(0x0101_0101) ^ id)
        .collect();
    let mut out = Vec::new();
    encode_request(&mut out, &h, &payload);
    out
}

fn post(body: &[u8], extra: &str) -> Vec<u8> {
    let mut v = format!(
        "POST /v1/submit HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n{extra}\r\n",
        body.len()
    )
    .into_bytes();
    v.extend_from_slice(body);
    v
}

/// The seed corpus: (file name, selector byte, stream). Selector 0x80 | n: default limits,
/// segments of n bytes; without the high bit: small limits (16 words, 512-byte HTTP head).
fn seeds() -> Vec<(&'static str, u8, Vec<u8>)> {
    let echo = frame(0, 1, 3, 0, 0);
    let gemm = frame(1, 2, 64, 1, 0);
    let fft = frame(2, 3, 64, 256, 0);
    let generate = frame(3, 4, 5, 32, 0);
    let generate_eos = frame(3, 5, 2, 4096, 1);
    vec![
        ("bin-echo", 0x80, echo.clone()),
        ("bin-echo-empty", 0x81, frame(0, 9, 0, 0, 0)),
        ("bin-echo-max-small", 0x07, frame(0, 9, 16, 0, 0)),
        ("bin-echo-too-large-small", 0x05, frame(0, 9, 17, 0, 0)),
        ("bin-gemm8", 0x80, gemm.clone()),
        ("bin-fft32", 0x83, fft.clone()),
        ("bin-generate", 0x80, generate.clone()),
        ("bin-generate-ignore-eos", 0x80, generate_eos.clone()),
        (
            "bin-pipelined-every-op",
            0x8b,
            [
                echo.clone(),
                gemm.clone(),
                fft.clone(),
                generate.clone(),
                generate_eos.clone(),
            ]
            .concat(),
        ),
        (
            "bin-unknown-op-then-echo",
            0x80,
            [frame(9, 6, 2, 0, 0), echo.clone()].concat(),
        ),
        (
            "bin-bad-param-then-echo",
            0x80,
            [
                frame(1, 7, 64, 257, 0),
                frame(3, 8, 1, 0, 0),
                frame(3, 8, 1, 4097, 0),
                echo.clone(),
            ]
            .concat(),
        ),
        (
            "bin-gemm8-wrong-words",
            0x80,
            [frame(1, 7, 63, 1, 0), echo.clone()].concat(),
        ),
        (
            "bin-generate-no-prompt",
            0x80,
            [frame(3, 6, 0, 10, 0), echo.clone()].concat(),
        ),
        (
            "bin-bad-flags",
            0x80,
            [frame(0, 6, 2, 5, 1), echo.clone()].concat(),
        ),
        ("bin-generate-bad-flags", 0x80, frame(3, 6, 2, 5, 2)),
        ("bin-bad-magic", 0x80, b"XGS1aaaaaaaaaaaaaaaaaaaa".to_vec()),
        (
            "bin-bad-magic-after-frame",
            0x80,
            [echo.clone(), b"Bx".to_vec()].concat(),
        ),
        ("bin-bad-version", 0x80, {
            let mut f = echo.clone();
            f[4] = 2;
            f
        }),
        ("bin-too-large", 0x80, frame(0, 4, 65, 0, 0)),
        ("bin-partial-header", 0x80, echo[..10].to_vec()),
        (
            "bin-partial-payload",
            0x80,
            [echo.clone(), frame(0, 3, 10, 0, 0)[..30].to_vec()].concat(),
        ),
        ("bin-zero-bytes", 0x80, vec![0; 30]),
        ("http-echo", 0x80, post(&echo, "")),
        (
            "http-every-op-keep-alive",
            0x90,
            [
                post(&echo, ""),
                post(&gemm, "Connection: keep-alive\r\n"),
                post(&fft, ""),
                post(&generate, ""),
                post(&generate_eos, ""),
            ]
            .concat(),
        ),
        (
            "http-small-limits",
            0x11,
            [post(&echo, ""), post(&gemm, "")].concat(),
        ),
        (
            "http-close",
            0x80,
            [post(&echo, "Connection: close\r\n"), post(&echo, "")].concat(),
        ),
        (
            "http-1.0",
            0x80,
            [
                format!(
                    "POST /v1/submit HTTP/1.0\r\nContent-Length: {}\r\n\r\n",
                    echo.len()
                )
                .into_bytes(),
                echo.clone(),
            ]
            .concat(),
        ),
        (
            "http-404-then-echo",
            0x80,
            [
                b"GET /x HTTP/1.1\r\n\r\n".to_vec(),
                b"POST /nope HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
                post(&echo, ""),
            ]
            .concat(),
        ),
        (
            "http-405-then-echo",
            0x80,
            [
                b"GET /v1/submit HTTP/1.1\r\n\r\n".to_vec(),
                b"PUT /v1/submit HTTP/1.1\r\nContent-Length: 2\r\n\r\nab".to_vec(),
                post(&echo, ""),
            ]
            .concat(),
        ),
        (
            "http-unknown-op-body",
            0x80,
            [post(&frame(77, 1, 0, 0, 0), ""), post(&echo, "")].concat(),
        ),
        (
            "http-generate-bad-param",
            0x80,
            [post(&frame(3, 6, 3, 0, 0), ""), post(&echo, "")].concat(),
        ),
        (
            "http-411",
            0x80,
            b"POST /v1/submit HTTP/1.1\r\n\r\n".to_vec(),
        ),
        (
            "http-411-chunked",
            0x80,
            b"POST /v1/submit HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(),
        ),
        (
            "http-413",
            0x80,
            b"POST /v1/submit HTTP/1.1\r\nContent-Length: 281\r\n\r\n".to_vec(),
        ),
        (
            "http-400-bad-length",
            0x80,
            b"POST /v1/submit HTTP/1.1\r\nContent-Length: 1a\r\n\r\n".to_vec(),
        ),
        (
            "http-400-bare-lf",
            0x80,
            b"POST /v1/submit HTTP/1.1\nContent-Length: 3\r\n\r\n".to_vec(),
        ),
        (
            "http-400-version",
            0x80,
            b"POST /v1/submit HTTP/2.0\r\nContent-Length: 0\r\n\r\n".to_vec(),
        ),
        ("http-400-short-body", 0x80, post(&echo[..20], "")),
        (
            "http-431",
            0x02,
            format!("POST /v1/submit HTTP/1.1\r\nX: {}\r\n", "a".repeat(600)).into_bytes(),
        ),
        (
            "http-header-case",
            0x80,
            [
                format!(
                    "POST /v1/submit HTTP/1.1\r\ncOnTeNt-LeNgTh:\t{} \t\r\n\r\n",
                    echo.len()
                )
                .into_bytes(),
                echo.clone(),
            ]
            .concat(),
        ),
        (
            "http-binary-after-http",
            0x80,
            [post(&echo, ""), echo.clone()].concat(),
        ),
        ("http-partial-body", 0x80, post(&echo, "")[..60].to_vec()),
        ("empty-stream", 0x80, Vec::new()),
    ]
}

/// Rewrite the committed corpus from [`seeds`]: `cargo test -p bgs-protocol --test fuzz_smoke
/// -- --ignored write_seed_corpus`.
#[test]
#[ignore = "writes fuzz/seeds/framer"]
fn write_seed_corpus() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).unwrap();
    for (name, sel, stream) in seeds() {
        let mut data = vec![sel];
        data.extend(stream);
        std::fs::write(dir.join(name), data).unwrap();
    }
}

#[test]
fn seed_corpus_passes_the_fuzz_checks() {
    let mut n = 0;
    for e in std::fs::read_dir(corpus_dir()).expect("fuzz/seeds/framer is committed") {
        let path = e.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let r = std::panic::catch_unwind(|| framer_check::check(&data));
        assert!(r.is_ok(), "{} fails the fuzz checks", path.display());
        n += 1;
    }
    // The corpus on disk is the one the seeds describe (a seed added here must be written).
    assert_eq!(
        n,
        seeds().len(),
        "corpus files vs seeds(): rerun write_seed_corpus"
    );
    for (name, sel, stream) in seeds() {
        let on_disk = std::fs::read(corpus_dir().join(name)).unwrap();
        assert_eq!(on_disk[0], sel, "{name}: selector");
        assert_eq!(&on_disk[1..], &stream[..], "{name}: stream");
    }
}

/// Inputs built from pieces the framer cares about, then mutated.
fn input_strategy() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        4 => (0u16..=5, any::<u32>(), prop_oneof![0u32..=3, 14u32..=18, 60u32..=66], prop_oneof![0u32..=3, 255u32..=257, 4095u32..=4097], prop_oneof![4 => Just(0u32), 1 => 0u32..=3])
            .prop_map(|(op, id, w, p, f)| frame(op, id, w, p, f)),
        2 => (0u16..=3, 0u32..=8, 0u8..4).prop_map(|(op, w, v)| {
            let extra = ["", "Connection: close\r\n", "connection: keep-alive\r\n", "X: y\r\n"][v as usize];
            post(&frame(op, 1, w, 1, 0), extra)
        }),
        1 => prop_oneof![
            Just(b"GET /x HTTP/1.1\r\n\r\n".to_vec()),
            Just(b"PUT /v1/submit HTTP/1.1\r\nContent-Length: 2\r\n\r\nab".to_vec()),
            Just(b"POST /v1/submit HTTP/1.1\r\nContent-Length: 99\r\n\r\n".to_vec()),
        ],
        1 => prop::collection::vec(any::<u8>(), 0..32),
    ];
    (
        any::<u8>(),
        prop::collection::vec(piece, 0..6),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
        prop::option::of(any::<prop::sample::Index>()),
    )
        .prop_map(|(sel, pieces, flips, cut)| {
            let mut s: Vec<u8> = pieces.concat();
            for (i, b) in flips {
                if !s.is_empty() {
                    let i = i.index(s.len());
                    s[i] ^= b | 1;
                }
            }
            if let Some(c) = cut {
                s.truncate(c.index(s.len() + 1));
            }
            let mut data = vec![sel];
            data.extend(s);
            data
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn generated_inputs_pass_the_fuzz_checks(data in input_strategy()) {
        framer_check::check(&data);
    }

    #[test]
    fn random_bytes_pass_the_fuzz_checks(data in prop::collection::vec(any::<u8>(), 0..200)) {
        framer_check::check(&data);
    }
}
