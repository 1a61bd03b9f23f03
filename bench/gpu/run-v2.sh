#!/usr/bin/env bash
# GPU executor v2 (fused work graphs, batched warp scheduler): the budgeted run. Correctness
# first, then timings; every step under `timeout`. Runs ON the GPU machine from the repo root.
# Usage: bash bench/gpu/run-v2.sh BIN_DIR OUT_DIR   (BIN_DIR from bench/gpu/prepare.sh)
# About 2.5 minutes. Writes OUT_DIR/results.json and OUT_DIR/logs.tgz.
set -uo pipefail
bin=$(cd "$1" && pwd); out=$2
mkdir -p "$out"; logs="$out/logs"; mkdir -p "$logs"
bgs="$bin/bgs"; bench="$bin/bgs-gpu-bench"
export XDG_CACHE_HOME=/tmp/bgs-cache RUST_LOG=${RUST_LOG:-info}
ncpu=$(nproc); server_cpus="0-3"; client_cpus="4-$((ncpu - 1))"
summary="$out/results.jsonl"; : > "$summary"
OLD_DIGEST=532ef5896256f241 # bench/results/20261129-gpu (v1), all 4 processes
note() { echo "== $* ($(date +%T))" | tee -a "$logs/steps.log"; }
rec() { # name json-file
  local j; j=$(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$2" 2>/dev/null)
  printf '{"step":"%s","result":%s}\n' "$1" "${j:-null}" >> "$summary"
}

note "machine"; { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; uname -a; nproc; } > "$logs/machine.txt" 2>&1
note "probe"; timeout 60 "$bench" probe > "$logs/probe.json" 2> "$logs/probe.err"; rec probe "$logs/probe.json"

# ---- (1) correctness in process (vs the CPU executor) and exact replay across processes
for spec in "device 1 16" "device 2 16" "device-lanes 3 16" "device 4 1" "host 1 16"; do
  set -- $spec; d=${1%-lanes}; env=(); [ "$1" = device-lanes ] && env=(BGS_GPU_LAUNCH_LANES=1)
  note "check $1 run $2 slots $3"
  env "${env[@]}" timeout 60 "$bench" check --dispatcher $d --slots $3 --digest "$logs/digest-$1-$2" \
    > "$logs/check-$1-$2.json" 2> "$logs/check-$1-$2.err"; echo "rc=$?" >> "$logs/steps.log"
  rec "check-$1-$2-s$3" "$logs/check-$1-$2.json"
done
distinct=$( (cat "$logs"/digest-* 2>/dev/null; echo $OLD_DIGEST) | sort -u | wc -l)
printf '{"step":"replay-digests","result":{"distinct_including_v1":%s,"files":%s,"v1":"%s","v2":"%s"}}\n' \
  "$distinct" "$(ls "$logs"/digest-* 2>/dev/null | wc -l)" $OLD_DIGEST "$(cat "$logs"/digest-* 2>/dev/null | sort -u | tr '\n' ' ')" >> "$summary"

# ---- (1b) over TCP: bgs serve --executor gpu + bgs load --strict; then 1k req/s and saturation
port=7900
start_server() {
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
note "tcp device"
if start_server --dispatcher device --slots 16; then
  for op in gemm8 fft32; do for r in 1 3 16 256; do
    load "tcp-device-$op-r$r" 30 --op $op --repeat $r --rate 4000 --connections 16 --requests 4000 --warmup 0.2 --strict
  done; done
  load "tcp-device-echo" 30 --op echo --words 64 --rate 4000 --connections 16 --requests 4000 --warmup 0.2 --strict
  load "e2e-device-gemm8-1k" 30 --op gemm8 --repeat 1 --rate 1000 --connections 128 --duration 5 --warmup 1
  load "e2e-device-gemm8-sat" 30 --op gemm8 --repeat 1 --rate 400000 --connections 128 --pipeline 64 --threads 4 --duration 5 --warmup 1
  stop_server
fi

# ---- (2) in-process timings: one-slot round trip, throughput by slots
note "rtt"
for d in device host; do
  for spec in "gemm8 1" "gemm8 16" "gemm8 256" "fft32 1" "echo 1"; do
    set -- $spec
    n=20000; [ "$2" = 256 ] && n=3000
    [ $d = host ] && [ "$1$2" != gemm81 ] && continue
    timeout 45 "$bench" rtt --dispatcher $d --slots 1 --op $1 --repeat $2 --n $n > "$logs/rtt-$d-$1-$2.json" 2> "$logs/rtt-$d-$1-$2.err"
    rec "rtt-$d-$1-r$2" "$logs/rtt-$d-$1-$2.json"
  done
done
note "throughput"
for spec in "device 1 1" "device 1 16" "device 16 1" "device 16 16" "device 32 1" "device 32 16" \
            "device-lanes 16 1" "device-lanes 32 1" "device-lanes 32 16" "host 16 1" "host 16 16"; do
  set -- $spec; d=${1%-lanes}; env=(); [ "$1" = device-lanes ] && env=(BGS_GPU_LAUNCH_LANES=1)
  env "${env[@]}" timeout 30 "$bench" throughput --dispatcher $d --slots $2 --op gemm8 --repeat $3 --seconds 1.5 --outstanding 1024 \
    > "$logs/tput-$1-s$2-r$3.json" 2> "$logs/tput-$1-s$2-r$3.err"
  rec "tput-$1-s$2-gemm8-r$3" "$logs/tput-$1-s$2-r$3.json"
done

note "done"
python3 - "$summary" "$out/results.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
res = {r["step"]: r["result"] for r in rows}
json.dump(res, open(sys.argv[2], "w"), indent=1)
def g(k, f):
    try: return f(res[k])
    except Exception: return None
for k, v in res.items():
    if v is None: print(k, "MISSING"); continue
    if k.startswith("check"): print(k, "ok", v.get("ok"), "failures", v.get("failures"), "answered", v.get("answered"), "max_rel", v.get("max_rel_err_vs_cpu"), "digest", v.get("digest"), "shutdown", json.dumps(v.get("shutdown"))[:160])
    elif k.startswith("rtt"): print(k, "p50 %.1f p99 %.1f lost %s" % (v["p50_us"], v["p99_us"], v.get("lost")), json.dumps(v.get("shutdown"))[:120])
    elif k.startswith("tput"):
        sd = v["shutdown"] if isinstance(v.get("shutdown"), dict) else {"error": v.get("shutdown")}
        print(k, "%.0f/s bad %s claims %s disp %s retries %s %s" % (v["completed_per_s"], v.get("bad_status"), sd.get("claims"), sd.get("dispatched"), sd.get("launch_retries"), sd.get("error", "")))
    elif k.startswith("tcp") or k.startswith("e2e"):
        r = v.get("report", {}); lat = r.get("latency", {}); c = r.get("counts", {})
        print(k, "achieved %.0f/s failures %s p50 %s p99 %s counts %s" % (r.get("achieved_rate", 0), r.get("failures"), lat.get("p50_us"), lat.get("p99_us"), json.dumps(c)[:120]))
    else: print(k, json.dumps(v)[:300])
PY
tar czf "$out/logs.tgz" -C "$out" logs
