#!/usr/bin/env bash
# Build here (no Rust on the GPU machine) and stage the binaries in .gpu-carry/ (git-ignored
# through .git/info/exclude), which the device tool's `carry` sends along.
# Usage: bash bench/gpu/prepare.sh ; then on the device: bash bench/gpu/inprocess.sh .gpu-carry "$OUT"
# and .gpu-carry/bgs lab run experiments/gpu-e2e.toml --out "$OUT/e2e" (and the other gpu-*.toml)
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu-carry/' .git/info/exclude 2>/dev/null || echo '/.gpu-carry/' >> .git/info/exclude
cargo build --release -p bgs -p bgs-executor-gpu -p bgs-model-gpu --bins
mkdir -p .gpu-carry
cp target/release/bgs target/release/bgs-gpu-bench target/release/bgs-llm-gpu .gpu-carry/
strip .gpu-carry/bgs .gpu-carry/bgs-gpu-bench .gpu-carry/bgs-llm-gpu
# Qwen's tokenizer for the synthetic Qwen2.5-0.5B checkpoints (generate.sh, step-loop.sh).
eval "$(bash scripts/fetch-models.sh target/models)"
cp "$BGS_QWEN_TOKENIZER" .gpu-carry/qwen-tokenizer.json
git rev-parse HEAD > .gpu-carry/REVISION
git status --porcelain -- crates bench/gpu include | sed 's/^/dirty: /' >> .gpu-carry/REVISION
ls -la .gpu-carry
