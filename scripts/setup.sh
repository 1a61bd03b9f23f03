#!/usr/bin/env bash
# Installs the system packages the build needs on Debian 12 / Ubuntu 24.04 (Rust itself is
# expected from rustup). Safe to run repeatedly; uses sudo when not root.
set -euo pipefail
pkgs=(gcc make pkg-config)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq "${missing[@]}"
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust 1.95 or newer with rustup (https://rustup.rs)" >&2
  exit 1
fi
