#!/usr/bin/env bash
# Soak and connection churn (issue 11), CPU executor, for each transport configuration
# (native; kernel --reply loop; kernel --reply executor-sqe):
#  soak:  `bgs load --strict` sends REQUESTS gemm8 x1 requests (exact replay: every reply is
#         compared bit for bit with a golden reply) at RATE req/s over 128 connections;
#  churn: the churn example (crates/load/examples/churn.rs) runs CYCLES connect / one gemm8
#         request / close cycles, each reply replayed exactly.
# Each run gets a fresh server. After it, the server's open descriptors must be back to the
# baseline taken before it and no socket of its port may still hold connection state
# (CLOSE_WAIT, ESTABLISHED, FIN_WAIT...); the kernel transport must then report empty BPF maps
# at shutdown ("bpf maps at stop: sockhash 0 entries, 0 connection states"). Anything else is
# printed as FAIL and the script exits 1 (after writing the summary).
# Server pinned to CPU 0, clients to CPU 1 (the other CPUs with more than two). Needs root
# (kernel transport). Writes logs, load JSON and summary.json under
# bench/results/<date>-soak/ (or $OUT).
# Usage: sudo bash bench/soak.sh [requests] [rate] [churn_cycles] [transports]
#   defaults: 3400000 25000 100000 "native kernel-loop kernel-sqe"
set -euo pipefail
cd "$(dirname "$0")/.."
requests=${1:-3400000}
rate=${2:-25000}
cycles=${3:-100000}
conds=(${4:-native kernel-loop kernel-sqe})
cargo build --release --locked -p bgs >/dev/null
cargo build --release --locked -p bgs-load --example churn >/dev/null
bgs=./target/release/bgs
churn=./target/release/examples/churn
ncpu=$(nproc)
client_cpus="1-$((ncpu - 1))"
out=${OUT:-bench/results/$(date -u +%Y%m%d)-soak}
mkdir -p "$out"
rev=$(git rev-parse --short=12 HEAD)
records=$out/records.tsv
: >"$records"
failed=0

args_for() {
  case $1 in
    native) echo "--transport native" ;;
    kernel-loop) echo "--transport kernel --reply loop" ;;
    kernel-sqe) echo "--transport kernel --reply executor-sqe" ;;
    *) echo "unknown transport configuration '$1' (native, kernel-loop, kernel-sqe)" >&2; exit 2 ;;
  esac
}

fd_count() { ls "/proc/$1/fd" | wc -l; }
# Sockets of the port in a state other than LISTEN (0A) and TIME_WAIT (06): the ones that still
# hold connection state (the BPF program drops its state when a socket reaches TCP_CLOSE).
conn_sockets() {
  local hex; hex=$(printf ':%04X' "$1")
  awk -v p="$hex" 'NR > 1 && substr($2, length($2) - 4) == p && $4 != "0A" && $4 != "06"' \
    /proc/net/tcp | wc -l
}
# Wait up to 30 s for descriptors <= baseline and no connection sockets.
settle() { # pid port baseline
  for _ in $(seq 300); do
    if [ "$(fd_count "$1")" -le "$3" ] && [ "$(conn_sockets "$2")" -eq 0 ]; then return 0; fi
    sleep 0.1
  done
  return 1
}
fail() { echo "FAIL: $*" >&2; failed=1; }

port=7860
run_one() { # cond kind(soak|churn)
  local cond=$1 kind=$2 name="$1-$2" log="$out/$1-$2.server.log"
  port=$((port + 1))
  rm -f "$log" # the wait below must not see an earlier server's line
  # shellcheck disable=SC2046
  "$bgs" serve --listen 127.0.0.1:$port --cpus 0 --slots 1 $(args_for "$cond") >"$log" 2>&1 &
  local spid=$!
  for _ in $(seq 100); do grep -q listening "$log" 2>/dev/null && break; sleep 0.1; done
  grep -q listening "$log" || { cat "$log" >&2; echo "server did not start" >&2; exit 1; }
  # One short churn run first (it also fetches its golden replies), so that descriptors the
  # server creates lazily exist before the baseline is taken.
  taskset -c "$client_cpus" "$churn" 127.0.0.1:$port 16 1 >/dev/null
  settle "$spid" "$port" 1000000 || true
  sleep 0.2
  local base; base=$(fd_count "$spid")
  local t0 rc=0; t0=$(date +%s.%N)
  if [ "$kind" = soak ]; then
    "$bgs" load --target 127.0.0.1:$port --op gemm8 --repeat 1 --rate "$rate" --connections 128 \
      --requests "$requests" --warmup 1 --cpus "$client_cpus" --server-pid "$spid" --strict \
      --json "$out/$name.json" >"$out/$name.txt" 2>&1 || rc=$?
  else
    taskset -c "$client_cpus" "$churn" 127.0.0.1:$port "$cycles" 4 >"$out/$name.json" \
      2>"$out/$name.txt" || rc=$?
  fi
  local t1; t1=$(date +%s.%N)
  [ "$rc" -eq 0 ] || fail "$name: client exited $rc (see $out/$name.txt / .json)"
  local settled=1
  settle "$spid" "$port" "$base" || settled=0
  local fds conns; fds=$(fd_count "$spid"); conns=$(conn_sockets "$port")
  [ "$settled" = 1 ] || fail "$name: server fds $fds (baseline $base), $conns sockets with connection state"
  kill -TERM "$spid"
  local src=0; wait "$spid" || src=$?
  [ "$src" -eq 0 ] || fail "$name: server exited $src"
  local maps; maps=$(grep -o 'sockhash [0-9]* entries, [0-9]* connection states' "$log" || true)
  local sockhash=null states=null
  if [ -n "$maps" ]; then
    sockhash=$(echo "$maps" | awk '{print $2}'); states=$(echo "$maps" | awk '{print $4}')
    [ "$sockhash" = 0 ] && [ "$states" = 0 ] || fail "$name: bpf maps at stop: $maps"
  elif [ "$cond" != native ]; then
    fail "$name: no 'bpf maps at stop' line in $log"
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$cond" "$kind" "$rc" "$src" "$base" \
    "$fds" "$conns" "$sockhash" "$states" "$t0" "$t1" >>"$records"
  echo "$name: client rc $rc, server rc $src, fds $fds (baseline $base), conn sockets $conns, sockhash $sockhash, states $states, $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b - a}') s" >&2
}

for cond in "${conds[@]}"; do
  args_for "$cond" >/dev/null
  run_one "$cond" soak
  run_one "$cond" churn
done

cmd="bash bench/soak.sh $requests $rate $cycles \"${conds[*]}\""
python3 bench/summarize_soak.py "$out" "$rev" "$cmd" "$requests" "$rate" "$cycles" >"$out/summary.json"
cat "$out/summary.json"
[ "$failed" = 0 ] || { echo "soak: FAILED (see FAIL lines above)" >&2; exit 1; }
echo "soak: all runs passed, no leaks" >&2
