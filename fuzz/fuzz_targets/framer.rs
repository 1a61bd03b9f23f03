//! Fuzz the framer: arbitrary bytes, fed in chunks whose size (and the framer's limits) come
//! from the input's first byte; the invariants are in `framer_check.rs`, which the CI smoke test
//! (`crates/protocol/tests/fuzz_smoke.rs`) also runs over the committed seed corpus in `seeds/framer/` (`corpus/` is the fuzzer's
//! working corpus, not committed).
//! Run with `cargo +nightly fuzz run framer corpus/framer seeds/framer` (or with `RUSTC_BOOTSTRAP=1`), or
//! on stable without cargo-fuzz (libFuzzer's coverage hooks through plain codegen flags; the
//! explicit `--target` keeps the flags off build scripts):
//! `RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4
//! -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table
//! -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions
//! -Coverflow-checks" cargo build --release --bin framer --target x86_64-unknown-linux-gnu`,
//! then `target/x86_64-unknown-linux-gnu/release/framer corpus/framer seeds/framer`.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "framer_check.rs"]
mod framer_check;

fuzz_target!(|data: &[u8]| framer_check::check(data));
