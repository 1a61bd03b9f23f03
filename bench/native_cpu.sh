#!/usr/bin/env bash
# Benchmark for the native transport + CPU executor versus floor mode (issue 2):
#  (1) process CPU per request at 1,000 req/s with 128 connections, full path vs floor mode,
#      alternating conditions in one run;
#  (2) the highest offered rate sustained with zero failures and p99 under 1 ms.
# Server pinned to CPU 0, load generator to the other CPUs. Writes one JSON per run and a
# summary under bench/results/<date>-native-cpu/.
# Usage: bash bench/native_cpu.sh [seconds_per_run]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
cargo build --release --locked -p bgs >/dev/null
bgs=./target/release/bgs
ncpu=$(nproc)
client_cpus="1-$((ncpu - 1))"
out=bench/results/$(date -u +%Y%m%d)-native-cpu
mkdir -p "$out"
rev=$(git rev-parse --short=12 HEAD)

port=7790
start_server() { # args...
  port=$((port + 1))
  rm -f "$out/server.log" # the wait below must not see an earlier server's line
  "$bgs" serve --listen 127.0.0.1:$port --cpus 0 "$@" >"$out/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 50); do grep -q listening "$out/server.log" 2>/dev/null && return; sleep 0.1; done
  echo "server did not start" >&2; exit 1
}
# Failures are recorded, not hidden: every non-zero exit lands in failures.log and the script
# exits non-zero at the end (after the summary, so partial results are still written).
: >"$out/failures.log"
stop_server() {
  kill -TERM "$server_pid"
  wait "$server_pid" || echo "server on port $port: exit $?" >>"$out/failures.log"
}

run_load() { # name op rate extra...
  local name=$1 op=$2 rate=$3; shift 3
  local rep=(--repeat 1); [ "$op" = echo ] && rep=() # --repeat is refused with echo
  "$bgs" load --target 127.0.0.1:$port --op "$op" "${rep[@]}" --rate "$rate" --connections 128 \
    --duration "$secs" --warmup 2 --cpus "$client_cpus" --server-pid "$server_pid" \
    --json "$out/$name.json" "$@" >"$out/$name.txt" 2>&1 ||
    echo "$name: bgs load exit $? ($(tail -1 "$out/$name.txt"))" >>"$out/failures.log"
}

# (1) CPU per request at 1,000 req/s, alternating full / floor, two rounds.
for round in 1 2; do
  for op in gemm8 fft32; do
    start_server --slots 1; run_load "cpu1k-full-$op-r$round" "$op" 1000; stop_server
    start_server --floor;   run_load "cpu1k-floor-$op-r$round" echo 1000; stop_server
  done
done

# (2) Highest sustained rate with zero failures and p99 < 1 ms: every rate is tried (a tail can
#     be worse at a low rate, where each request pays wake-ups, than at a higher one).
rates="1000 2000 5000 10000 20000 30000 40000 60000"
for op in gemm8 fft32; do
  for path in full floor; do
    for rate in $rates; do
      if [ "$path" = full ]; then start_server --slots 1; lop=$op; else start_server --floor; lop=echo; fi
      run_load "sat-$path-$op-$rate" "$lop" "$rate"
      stop_server
    done
  done
done

python3 bench/summarize_native.py "$out" "$rev" >"$out/summary.json"
cat "$out/summary.json"
if [ -s "$out/failures.log" ]; then
  echo "failures:" >&2; cat "$out/failures.log" >&2; exit 1
fi
