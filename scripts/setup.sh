#!/usr/bin/env bash
# Installs the system packages the build and tests need on Debian 12 / Ubuntu 24.04 (Rust
# itself is expected from rustup). Safe to run repeatedly; uses sudo when not root.
#   gcc g++ make pkg-config           C parts of dependencies (vendored libbpf); the C and
#                                     C++ layout checks of the generated ring headers
#   clang-19 llvm-19                  BPF programs of the kernel transport; CUDA syntax check
#   libelf-dev zlib1g-dev             vendored libbpf
#   python3 python3-pip               test.sh installs the CUDA 13.0 NVRTC wheels with pip
#   linux-perf (optional)             syscall counting in the steady-state test
set -euo pipefail
pkgs=(gcc g++ make pkg-config clang-19 llvm-19 libelf-dev zlib1g-dev python3 python3-pip)
optional=(linux-perf)
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
missing=()
for p in "${pkgs[@]}" "${optional[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  for p in "${pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || $sudo apt-get install -y -qq "$p"
  done
  for p in "${optional[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || $sudo apt-get install -y -qq "$p" \
      || echo "setup: optional package $p is not available here" >&2
  done
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust 1.95 or newer with rustup (https://rustup.rs)" >&2
  exit 1
fi
