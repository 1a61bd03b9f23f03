#!/usr/bin/env bash
# The main job: build, then run `bgs demo` (a CPU-executor server on loopback under a short load).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --locked -p bgs
exec ./target/release/bgs demo "$@"
