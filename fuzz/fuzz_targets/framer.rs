//! Fuzz the framer: arbitrary bytes, fed in chunks whose size (and the framer's limits) come
//! from the input's first byte; the invariants are in `framer_check.rs`, which the CI smoke test
//! (`crates/protocol/tests/fuzz_smoke.rs`) also runs over the seed corpus in `corpus/framer/`.
//! Run with `cargo +nightly fuzz run framer corpus/framer` (or with `RUSTC_BOOTSTRAP=1`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "framer_check.rs"]
mod framer_check;

fuzz_target!(|data: &[u8]| framer_check::check(data));
