#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit/property/end-to-end tests (every transport),
# loom model checks. The kernel-transport tests need root (BPF, cgroup attachment); CI is root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# CUDA 13.0 NVRTC/nvJitLink from PyPI wheels, so the GPU kernels are really compiled and
# linked in CI (no GPU needed). Optional: the test prints a notice without them.
wheels=target/cuda-wheels
if [ ! -f "$wheels/nvidia/cu13/lib/libnvrtc.so.13" ] && command -v python3 >/dev/null; then
  python3 -m pip install -q --disable-pip-version-check --target "$wheels" \
    'nvidia-cuda-nvrtc==13.0.*' 'nvidia-cuda-runtime==13.0.*' 'nvidia-nvjitlink==13.0.*' \
    || echo "test: CUDA wheels unavailable; the NVRTC check will be skipped" >&2
fi
if [ -f "$wheels/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  export BGS_CUDA_LIB_DIR="$PWD/$wheels/nvidia/cu13/lib"
fi
cargo fmt --all -- --check
cargo clippy --locked --workspace --all-targets -- -D warnings
cargo test --locked --workspace --release
# Model checks of the lock-free rings (own target dir: a different cfg rebuilds everything).
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
  cargo test --locked -p bgs-ring --release --test loom
echo "all tests passed"
