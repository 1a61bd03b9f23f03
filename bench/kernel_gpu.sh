#!/usr/bin/env bash
# Kernel transport with the GPU executor (issue 4, part 6, --reply loop) and the kernel
# transport's reply paths on a many-core machine. Runs ON the GPU machine from the repo root.
# Usage: bash bench/kernel_gpu.sh BIN_DIR OUT_DIR
#   CHECK="kloop-gpu native-gpu" PERF="native-gpu kloop-gpu ..." ROUNDS=2 select conditions;
#   BIG="ksqe-gpu" also sends 1,000,000 requests (50k req/s, 128 connections) through those;
#   SYSCALLS="ksqe-gpu kloop-gpu" counts the server's system calls per request at 1k req/s
#   (perf, when installed); SAT="native-gpu ..." offers 400,000 req/s pipelined (saturation).
# Correctness first (bgs load --strict over every op and repeat count, each condition), then
# CPU per request and latency at 1,000 req/s and near saturation. Server on CPUs 0-3, client
# on 4-15 (SQPOLL, where used, on CPU 3).
set -uo pipefail
bin=$(cd "$1" && pwd); out=$2
mkdir -p "$out"
bgs="$bin/bgs"
export XDG_CACHE_HOME=/tmp/bgs-cache
ncpu=$(nproc); client_cpus="4-$((ncpu - 1))"
mount | grep -q cgroup2 || { mkdir -p /tmp/cg2 && mount -t cgroup2 none /tmp/cg2; }
port=7900
start() { # name args...
  local name=$1; shift
  port=$((port + 1))
  "$bgs" serve --listen 127.0.0.1:$port --cpus 0-3 "$@" >"$out/$name.server.log" 2>&1 &
  spid=$!
  for _ in $(seq 100); do grep -q listening "$out/$name.server.log" 2>/dev/null && return 0; sleep 0.1; done
  echo "server $name did not start" | tee -a "$out/steps.log"; cat "$out/$name.server.log" | tee -a "$out/steps.log"
  return 1
}
stop() { kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null; }
declare -A conds=(
  [native-gpu]="--transport native --executor gpu --poll-us 20"
  [kloop-gpu]="--transport kernel --reply loop --executor gpu --reply-timer-us 20"
  [kloop-cpu]="--transport kernel --reply loop --executor cpu --slots 2"
  [ksqe-cpu]="--transport kernel --reply executor-sqe --executor cpu --slots 2 --sqpoll-cpu 3"
  [native-cpu]="--transport native --executor cpu --slots 2"
  [ksqe-gpu]="--transport kernel --reply executor-sqe --executor gpu --sqpoll-cpu 3"
  [ksqe-gpu-idle1]="--transport kernel --reply executor-sqe --executor gpu --sqpoll-cpu 3 --sqpoll-idle-ms 1"
)
# (1) correctness over TCP, every op and repeat count
for c in ${CHECK-kloop-gpu native-gpu}; do
  # shellcheck disable=SC2086
  start "check-$c" ${conds[$c]} || continue
  for spec in "gemm8 1" "gemm8 16" "gemm8 256" "fft32 1" "fft32 16" "fft32 256" "echo 1"; do
    set -- $spec
    for http in "" "--http"; do
      # --repeat is refused with echo (it does nothing there).
      rep=(--repeat "$2"); [ "$1" = echo ] && rep=()
      timeout 120 "$bgs" load --target 127.0.0.1:$port --op "$1" "${rep[@]}" --rate 5000 \
        --requests 5000 --warmup 0.5 --connections 64 --strict $http --cpus "$client_cpus" \
        >"$out/check-$c-$1-$2${http:+-http}.txt" 2>&1
      echo "check $c $1 r=$2 $http rc=$?" | tee -a "$out/steps.log"
    done
  done
  # pipelined connections: replies that are not their connection's turn go to the host stage
  timeout 120 "$bgs" load --target 127.0.0.1:$port --op gemm8 --repeat 1 --rate 20000 \
    --requests 20000 --warmup 0.5 --connections 16 --pipeline 8 --strict --cpus "$client_cpus" \
    >"$out/check-$c-pipelined.txt" 2>&1
  echo "check $c gemm8 r=1 pipelined rc=$?" | tee -a "$out/steps.log"
  stop; tail -12 "$out/check-$c.server.log" >> "$out/steps.log"
done
# (1b) a million requests through the full path
for c in ${BIG-}; do
  # shellcheck disable=SC2086
  start "big-$c" ${conds[$c]} || continue
  timeout 200 "$bgs" load --target 127.0.0.1:$port --op gemm8 --repeat 1 --rate 50000 \
    --requests 1000000 --warmup 0.5 --connections 128 --strict --cpus "$client_cpus" \
    --json "$out/big-$c.json" >"$out/big-$c.txt" 2>&1
  echo "big $c 1000000 rc=$? $(grep -E 'failures|completed' "$out/big-$c.txt" | tr '\n' ' ')" | tee -a "$out/steps.log"
  stop; tail -12 "$out/big-$c.server.log" >> "$out/steps.log"
done
# (1c) system calls per request of the whole server process at 1k req/s
for c in ${SYSCALLS-}; do
  command -v perf >/dev/null || { echo "syscalls: no perf here" | tee -a "$out/steps.log"; break; }
  # shellcheck disable=SC2086
  start "sys-$c" ${conds[$c]} || continue
  timeout 60 "$bgs" load --target 127.0.0.1:$port --op gemm8 --repeat 1 --rate 1000 \
    --duration 8 --warmup 1 --connections 128 --cpus "$client_cpus" >"$out/sys-$c.txt" 2>&1 &
  lp=$!; sleep 3
  perf stat -e raw_syscalls:sys_enter -p "$spid" -o "$out/sys-$c.perf" -- sleep 4 2>/dev/null
  wait $lp
  echo "syscalls $c $(grep -E 'raw_syscalls' "$out/sys-$c.perf" | awk '{print $1}') in 4 s at 1000 req/s" | tee -a "$out/steps.log"
  stop
done
# (2) CPU per request and latency, alternating conditions
for round in $(seq "${ROUNDS:-2}"); do
  for c in ${PERF-native-gpu kloop-gpu native-cpu kloop-cpu ksqe-cpu}; do
    for rate in 1000 50000; do
      # shellcheck disable=SC2086
      start "perf-$c-$rate-r$round" ${conds[$c]} || continue
      timeout 120 "$bgs" load --target 127.0.0.1:$port --op gemm8 --repeat 1 --rate $rate \
        --duration 6 --warmup 1 --connections 128 --cpus "$client_cpus" --server-pid "$spid" \
        --json "$out/perf-$c-$rate-r$round.json" >"$out/perf-$c-$rate-r$round.txt" 2>&1
      echo "perf $c $rate r$round rc=$?" | tee -a "$out/steps.log"
      stop
    done
  done
done
# (3) saturation: offered far above capacity, pipelined (SAT="native-gpu kloop-gpu ksqe-gpu")
for c in ${SAT-}; do
  # shellcheck disable=SC2086
  start "sat-$c" ${conds[$c]} || continue
  timeout 60 "$bgs" load --target 127.0.0.1:$port --op gemm8 --repeat 1 --rate 400000 \
    --pipeline 64 --threads 4 --duration 5 --warmup 1 --connections 128 --cpus "$client_cpus" \
    --server-pid "$spid" --json "$out/perf-$c-400000-r1.json" >"$out/perf-$c-400000-r1.txt" 2>&1
  echo "sat $c rc=$?" | tee -a "$out/steps.log"
  stop; tail -12 "$out/sat-$c.server.log" >> "$out/steps.log"
done
tar czf "$out/logs.tgz" -C "$out" --exclude logs.tgz . 2>/dev/null
python3 - "$out" <<'PY' > "$out/summary.json"
import glob, json, os, re, sys
out = sys.argv[1]
rows = []
for p in sorted(glob.glob(os.path.join(out, "perf-*.json"))):
    m = re.match(r"perf-(.+)-(\d+)-r(\d)\.json$", os.path.basename(p))
    d = json.load(open(p)); r = d["report"]
    s = (r.get("server_cpu") or {}).get("per_request", {}); h = (r.get("host_cpu") or {}).get("per_request", {})
    l = r.get("latency") or {}
    rows.append({"condition": m.group(1), "rate": int(m.group(2)), "round": int(m.group(3)),
                 "achieved": r["achieved_rate"], "failures": r["failures"] + r["warmup_failures"],
                 "busy": r["counts"]["busy"], "p50_us": l.get("p50_us"), "p99_us": l.get("p99_us"),
                 "server_user_us": s.get("user_us"), "server_sys_us": s.get("system_us"),
                 "server_schedstat_us": s.get("run_us"), "host_busy_us": h.get("busy_us"),
                 "host_softirq_us": h.get("softirq_us"), "git_revision": d.get("git_revision"),
                 "machine": d.get("machine"), "date_utc": d.get("date_utc")})
checks = [l.strip() for l in open(os.path.join(out, "steps.log")) if l.startswith("check ")]
print(json.dumps({"benchmark": "bench/kernel_gpu.sh", "checks": checks, "perf": rows}, indent=1))
PY
echo done
