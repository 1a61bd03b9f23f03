#!/usr/bin/env bash
# GPU executor: correctness first, then timings. Runs ON the GPU machine from the repo root.
# Usage: bash bench/gpu/run.sh BIN_DIR OUT_DIR [quick]
#   BIN_DIR holds bgs and bgs-gpu-bench (bench/gpu/prepare.sh stages them in .gpu-carry/).
# Writes OUT_DIR/results.json (summary of everything) plus logs. Every step has a timeout so a
# hang costs at most that step.
set -uo pipefail
bin=$(cd "$1" && pwd); out=$2; quick=${3:-}
mkdir -p "$out"; logs="$out/logs"; mkdir -p "$logs"
bgs="$bin/bgs"; bench="$bin/bgs-gpu-bench"
export XDG_CACHE_HOME=/tmp/bgs-cache RUST_LOG=${RUST_LOG:-info}
ncpu=$(nproc); server_cpus="0-3"; client_cpus="4-$((ncpu - 1))"
summary="$out/results.jsonl"; : > "$summary"
note() { echo "== $*" | tee -a "$logs/steps.log"; }
rec() { # name json-file-or-string
  local name=$1 f=$2
  local j; j=$(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$f" 2>/dev/null)
  if [ -n "$j" ]; then printf '{"step":"%s","result":%s}\n' "$name" "$j" >> "$summary"
  else printf '{"step":"%s","result":null}\n' "$name" >> "$summary"; fi
}

note "machine"; { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; uname -a; nproc; } > "$logs/machine.txt" 2>&1
note "probe"; timeout 60 "$bench" probe > "$logs/probe.json" 2> "$logs/probe.err"; rec probe "$logs/probe.json"

# ---- (1) correctness, in process: every op and repeat count vs the CPU executor; replay digest
for d in device host; do
  for run in 1 2; do
    note "check $d run $run"
    timeout 60 "$bench" check --dispatcher $d --slots 16 --digest "$logs/digest-$d-$run" \
      > "$logs/check-$d-$run.json" 2> "$logs/check-$d-$run.err"; echo "rc=$?" >> "$logs/steps.log"
    rec "check-$d-$run" "$logs/check-$d-$run.json"
  done
done
same=$(cat "$logs"/digest-* 2>/dev/null | sort -u | wc -l)
printf '{"step":"replay-digests","result":{"distinct":%s,"files":%s}}\n' "$same" "$(ls "$logs"/digest-* 2>/dev/null | wc -l)" >> "$summary"

# ---- (1b) correctness over TCP: bgs serve --executor gpu + bgs load --strict
port=7800
start_server() { # args...
  port=$((port + 1))
  "$bgs" serve --listen 127.0.0.1:$port --executor gpu --cpus "$server_cpus" --poll-us 20 "$@" > "$logs/server-$port.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 600); do grep -q listening "$logs/server-$port.log" 2>/dev/null && return 0; kill -0 $server_pid 2>/dev/null || break; sleep 0.1; done
  echo "server did not start" | tee -a "$logs/steps.log"; cat "$logs/server-$port.log" >> "$logs/steps.log"; return 1
}
stop_server() { kill -TERM "$server_pid" 2>/dev/null; timeout 20 tail --pid="$server_pid" -f /dev/null; kill -KILL "$server_pid" 2>/dev/null; wait "$server_pid" 2>/dev/null; echo "server exit $?" >> "$logs/steps.log"; }
load() { # name timeout args...
  local name=$1 t=$2; shift 2
  timeout "$t" "$bgs" load --target 127.0.0.1:$port --cpus "$client_cpus" --server-pid "$server_pid" \
    --json "$logs/$name.json" "$@" > "$logs/$name.txt" 2>&1; echo "$name rc=$?" >> "$logs/steps.log"
  rec "$name" "$logs/$name.json"
}
for d in device host; do
  note "tcp correctness $d"
  if start_server --dispatcher $d --slots 16; then
    for op in gemm8 fft32; do for r in 1 16 256; do
      load "tcp-$d-$op-r$r" 60 --op $op --repeat $r --rate 2000 --connections 16 --requests 4000 --warmup 0.5 --strict
    done; done
    load "tcp-$d-echo" 60 --op echo --words 64 --rate 2000 --connections 16 --requests 4000 --warmup 0.5 --strict
    stop_server
  fi
done

# ---- (2) in-process timings: one-slot round trip, throughput by slots
note "rtt"
for d in device host; do
  for spec in "gemm8 1" "gemm8 16" "gemm8 256" "fft32 1" "echo 1"; do
    set -- $spec
    n=20000; [ "$2" = 256 ] && n=3000; [ -n "$quick" ] && n=2000
    timeout 45 "$bench" rtt --dispatcher $d --slots 1 --op $1 --repeat $2 --n $n > "$logs/rtt-$d-$1-$2.json" 2> "$logs/rtt-$d-$1-$2.err"
    rec "rtt-$d-$1-r$2" "$logs/rtt-$d-$1-$2.json"
  done
done
note "throughput"
for d in device host; do
  for s in 1 16 32; do
    for r in 1 16; do
      [ -n "$quick" ] && [ $r = 16 ] && continue
      timeout 40 "$bench" throughput --dispatcher $d --slots $s --op gemm8 --repeat $r --seconds 2 --outstanding 1024 \
        > "$logs/tput-$d-s$s-r$r.json" 2> "$logs/tput-$d-s$s-r$r.err"
      rec "tput-$d-s$s-gemm8-r$r" "$logs/tput-$d-s$s-r$r.json"
    done
  done
done

# ---- (3) end to end over TCP (native transport): 1k req/s, saturation, 1M requests
for d in device host; do
  [ -n "$quick" ] && break
  note "tcp timings $d"
  if start_server --dispatcher $d --slots 16; then
    load "e2e-$d-gemm8-1k" 60 --op gemm8 --repeat 1 --rate 1000 --connections 128 --duration 10 --warmup 2
    load "e2e-$d-gemm8-sat" 60 --op gemm8 --repeat 1 --rate 200000 --connections 128 --pipeline 64 --threads 4 --duration 10 --warmup 2
    load "e2e-$d-fft32-1k" 60 --op fft32 --repeat 1 --rate 1000 --connections 128 --duration 10 --warmup 2
    if [ "$d" = device ] && [ -z "$quick" ]; then
      load "e2e-device-gemm8-1M" 120 --op gemm8 --repeat 1 --rate 50000 --connections 128 --threads 4 --requests 1000000 --warmup 1 --strict
    fi
    stop_server
  fi
done

note "done"
python3 - "$summary" "$out/results.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
json.dump({r["step"]: r["result"] for r in rows}, open(sys.argv[2], "w"), indent=1)
PY
