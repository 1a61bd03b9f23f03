#!/usr/bin/env bash
# Kernel transport (each reply mode) versus native, CPU executor, gemm8 r=1, 128 connections,
# at 1,000 req/s and near saturation (issue 3). Conditions alternate within each round and the
# order rotates between rounds (counterbalanced). Server pinned to CPU 0, load generator to the
# other CPUs. Needs root (kernel transport). Writes JSON per run and a summary under
# bench/results/<date>-transport-compare/ (or $OUT).
# Usage: sudo bash bench/transport_compare.sh [seconds_per_run] [rounds] [high_rate]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
rounds=${2:-3}
high=${3:-20000}
cargo build --release --locked -p bgs >/dev/null
bgs=./target/release/bgs
ncpu=$(nproc)
client_cpus="1-$((ncpu - 1))"
out=${OUT:-bench/results/$(date -u +%Y%m%d)-transport-compare}
mkdir -p "$out"
rev=$(git rev-parse --short=12 HEAD)
conds=(native kernel-loop kernel-sqe)
args_for() {
  case $1 in
    native) echo "--transport native" ;;
    kernel-loop) echo "--transport kernel --reply loop" ;;
    kernel-sqe) echo "--transport kernel --reply executor-sqe" ;;
  esac
}
port=7800
# Failures are recorded, not hidden: the script exits non-zero at the end if any step failed.
: >"$out/failures.log"
for round in $(seq "$rounds"); do
  for i in 0 1 2; do
    cond=${conds[$(((i + round) % 3))]}
    for rate in 1000 "$high"; do
      port=$((port + 1))
      # shellcheck disable=SC2046
      "$bgs" serve --listen 127.0.0.1:$port --cpus 0 --slots 1 $(args_for "$cond") >"$out/server.log" 2>&1 &
      spid=$!
      for _ in $(seq 50); do grep -q listening "$out/server.log" 2>/dev/null && break; sleep 0.1; done
      "$bgs" load --target 127.0.0.1:$port --op gemm8 --repeat 1 --rate "$rate" --connections 128 \
        --duration "$secs" --warmup 2 --cpus "$client_cpus" --server-pid "$spid" \
        --json "$out/$cond-$rate-r$round.json" >"$out/$cond-$rate-r$round.txt" 2>&1 ||
        echo "$cond-$rate-r$round: bgs load exit $?" >>"$out/failures.log"
      kill -TERM "$spid"
      wait "$spid" || echo "$cond-$rate-r$round: server exit $?" >>"$out/failures.log"
    done
  done
done
python3 bench/summarize_compare.py "$out" "$rev" >"$out/summary.json"
cat "$out/summary.json"
if [ -s "$out/failures.log" ]; then
  echo "failures:" >&2; cat "$out/failures.log" >&2; exit 1
fi
