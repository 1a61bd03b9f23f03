#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit/property/end-to-end tests, loom model checks.
# End-to-end tests bind loopback sockets; run as root in CI (later kernel-transport tests need it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --locked --workspace --all-targets -- -D warnings
cargo test --locked --workspace --release
# Model checks of the lock-free rings (own target dir: a different cfg rebuilds everything).
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
  cargo test --locked -p bgs-ring --release --test loom
echo "all tests passed"
