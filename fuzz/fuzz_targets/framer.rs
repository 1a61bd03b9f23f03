//! Fuzz the framer: arbitrary bytes, fed in chunks whose sizes come from the input itself.
//! Run with `cargo +nightly fuzz run framer` (or `RUSTC_BOOTSTRAP=1 cargo fuzz run framer`).
#![no_main]

use bgs_protocol::{Decoded, Framer, FramerConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(split).max(1);
    let cfg = FramerConfig {
        max_words: 16,
        max_http_head: 512,
    };
    let mut framer = Framer::new(cfg);
    let mut buf = Vec::new();
    for piece in rest.chunks(chunk) {
        buf.extend_from_slice(piece);
        loop {
            match framer.decode(&buf) {
                Decoded::NeedMore => break,
                Decoded::Request { consumed, request } => {
                    assert!(consumed <= buf.len());
                    assert_eq!(request.payload.len(), request.header.words as usize * 4);
                    buf.drain(..consumed);
                }
                Decoded::Reject { consumed, .. } => {
                    assert!(consumed <= buf.len() && consumed > 0);
                    buf.drain(..consumed);
                }
            }
        }
    }
});
