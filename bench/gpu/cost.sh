#!/usr/bin/env bash
# Where a small request's CPU goes with the GPU executor (issue 12): server CPU per request
# (process and per thread), whole-host CPU per request, p50/p99, at 1,000 and 10,000 req/s
# (gemm8 x1, 128 connections), and one request at a time on one connection (p50), for:
#   floor            native transport answering echo itself (--floor): the cost of TCP
#   native-paced     native + GPU, paced polling (the default)
#   native-poll      native + GPU, transport polls its 100 us timer while requests are out
#   native-int       native + GPU, the GPU executor's completion notifier wakes it
#   kloop-paced      kernel --reply loop + GPU, BPF's completion watch wakes the loop (default)
#   kloop-poll       kernel --reply loop + GPU, loop polls its 60 us timer
#   kloop-int        kernel --reply loop + GPU, notifier wakes the loop
#   ksqe             kernel --reply executor-sqe + GPU, adaptive (default): the GPU's own SENDs
#                    paused below --sqpoll-above (50,000/s), the stage sends, BPF's watch wakes it
#   ksqe-sqpoll      the same with --sqpoll-above 0: the GPU sends every reply it may, SQPOLL spins
# A strict correctness pass over every GPU condition comes first. Short runs (5 s, 2 rounds
# rotated) so that the whole script fits one 8-minute device call.
# Runs ON the GPU machine from the repo root, like bench/gpu/verify.sh.
# Usage: bash bench/gpu/cost.sh BIN_DIR OUT_DIR   (BIN_DIR holds bgs; ROUNDS=2 CONDS="..." CHECK=0
# override)
# Output: OUT_DIR/summary.json (date, host, command, revision, checks, per-run rows with the
# per-thread breakdown), steps.log, logs.tgz with every server log and load report.
set -uo pipefail
argv="$*"
bin=$(cd "$1" && pwd); out=$2
mkdir -p "$out"
bgs="$bin/bgs"
export XDG_CACHE_HOME=/tmp/bgs-cache
ncpu=$(nproc)
# Server on CPUs 0-3, load generator on the rest (SERVER_CPUS / CLIENT_CPUS override them for
# a dry run on a small machine).
server_cpus=${SERVER_CPUS:-0-3}; client_cpus=${CLIENT_CPUS:-4-$((ncpu - 1))}
# The kernel transport attaches its BPF programs to a cgroup2 hierarchy.
mount | grep -q cgroup2 || { mkdir -p /tmp/cg2 && mount -t cgroup2 none /tmp/cg2; }
t0=$(date +%s)
(cd "$bin" && cat REVISION 2>/dev/null) > "$out/revision.txt"
port=7940
start() { # name args...
  local name=$1; shift
  port=$((port + 1))
  "$bgs" serve --listen 127.0.0.1:$port --cpus "$server_cpus" "$@" >"$out/$name.server.log" 2>&1 &
  spid=$!
  for _ in $(seq 300); do grep -q listening "$out/$name.server.log" 2>/dev/null && return 0; sleep 0.1; done
  echo "server $name did not start" | tee -a "$out/steps.log"; tee -a "$out/steps.log" < "$out/$name.server.log"
  kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
  return 1
}
stop() { kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null; }
declare -A conds=(
  [floor]="--transport native --floor"
  [native-paced]="--transport native --executor gpu --gpu-completion-wake paced"
  [native-poll]="--transport native --executor gpu --gpu-completion-wake poll"
  [native-int]="--transport native --executor gpu --gpu-completion-wake interrupt"
  [kloop-paced]="--transport kernel --reply loop --executor gpu --gpu-completion-wake paced"
  [kloop-poll]="--transport kernel --reply loop --executor gpu --gpu-completion-wake poll"
  [kloop-int]="--transport kernel --reply loop --executor gpu --gpu-completion-wake interrupt"
  [ksqe]="--transport kernel --reply executor-sqe --executor gpu"
  [ksqe-sqpoll]="--transport kernel --reply executor-sqe --executor gpu --sqpoll-above 0"
)
order=(${CONDS:-floor native-poll native-int kloop-poll kloop-int})
# (1) strict correctness over TCP: every op (floor: echo only), a repeat chain, HTTP, pipelined.
# CHECK=0 skips it (when bench/gpu/verify.sh has just checked the same binaries).
checked=("${order[@]}"); [ "${CHECK:-1}" = 0 ] && checked=()
for c in "${checked[@]}"; do
  # shellcheck disable=SC2086
  start "check-$c" ${conds[$c]} || continue
  specs=("gemm8 1" "gemm8 16" "gemm8 3" "fft32 1" "fft32 256" "echo 1")
  [ "$c" = floor ] && specs=("echo 1")
  for spec in "${specs[@]}"; do
    set -- $spec
    https=("" "--http"); [ "$c" = floor ] && https=("")
    for http in "${https[@]}"; do
      rep=(--repeat "$2"); [ "$1" = echo ] && rep=()
      timeout 60 "$bgs" load --target 127.0.0.1:$port --op "$1" "${rep[@]}" --rate 5000 \
        --requests 2000 --warmup 0.2 --connections 64 --strict $http --cpus "$client_cpus" \
        >"$out/check-$c-$1-$2${http:+-http}.txt" 2>&1
      echo "check $c $1 r=$2 $http rc=$?" | tee -a "$out/steps.log"
    done
  done
  op=gemm8; [ "$c" = floor ] && op=echo
  timeout 60 "$bgs" load --target 127.0.0.1:$port --op $op --rate 20000 --requests 10000 \
    --warmup 0.2 --connections 16 --pipeline 8 --strict --cpus "$client_cpus" \
    >"$out/check-$c-pipelined.txt" 2>&1
  echo "check $c $op pipelined rc=$?" | tee -a "$out/steps.log"
  stop; tail -6 "$out/check-$c.server.log" >> "$out/steps.log"
done
echo "correctness done at +$(( $(date +%s) - t0 )) s" | tee -a "$out/steps.log"
# (2) CPU per request and latency: rounds rotate the condition order; one server per
# condition and round serves 1,000 then 10,000 req/s, then (round 1) one request at a time.
rounds=${ROUNDS:-2}
for round in $(seq "$rounds"); do
  n=${#order[@]}; shift_by=$(( (round - 1) % n ))
  rot=("${order[@]:$shift_by}" "${order[@]:0:$shift_by}")
  for c in "${rot[@]}"; do
    # shellcheck disable=SC2086
    start "perf-$c-r$round" ${conds[$c]} || continue
    op=(--op gemm8 --repeat 1); [ "$c" = floor ] && op=(--op echo)
    for rate in 1000 10000; do
      timeout 60 "$bgs" load --target 127.0.0.1:$port "${op[@]}" --rate $rate --duration 5 \
        --warmup 1 --connections 128 --cpus "$client_cpus" --server-pid "$spid" \
        --json "$out/perf-$c-$rate-r$round.json" >"$out/perf-$c-$rate-r$round.txt" 2>&1
      echo "perf $c $rate r$round rc=$? $(grep -E '^  (server|threads|host) ' "$out/perf-$c-$rate-r$round.txt" | tr -s ' ' | tr '\n' ';')" | tee -a "$out/steps.log"
    done
    if [ "$round" = 1 ]; then
      timeout 30 "$bgs" load --target 127.0.0.1:$port "${op[@]}" --closed-loop --duration 3 \
        --warmup 0.5 --connections 1 --cpus "$client_cpus" --server-pid "$spid" \
        --json "$out/one-$c.json" >"$out/one-$c.txt" 2>&1
      echo "one-at-a-time $c rc=$? $(grep -E 'p50' "$out/one-$c.txt" | head -1 | tr -s ' ')" | tee -a "$out/steps.log"
    fi
    stop; grep -E "notifier|wake-ups|epoll waits|gpu sends|adaptive" "$out/perf-$c-r$round.server.log" | sed "s/^/  $c r$round: /" >> "$out/steps.log"
  done
done
echo "perf done at +$(( $(date +%s) - t0 )) s" | tee -a "$out/steps.log"
tar czf "$out/logs.tgz" -C "$out" --exclude logs.tgz . 2>/dev/null
python3 - "$out" "$argv" <<'PY' > "$out/summary.json"
import glob, json, os, re, socket, sys, datetime
out, args = sys.argv[1], sys.argv[2]
def row(d):
    r = d["report"]
    s = (r.get("server_cpu") or {}).get("per_request", {})
    h = (r.get("host_cpu") or {}).get("per_request", {})
    l = r.get("latency") or {}
    return {"achieved": r["achieved_rate"], "failures": r["failures"] + r["warmup_failures"],
            "busy": r["counts"]["busy"], "p50_us": l.get("p50_us"), "p99_us": l.get("p99_us"),
            "server_schedstat_us": s.get("run_us"), "server_user_us": s.get("user_us"),
            "server_sys_us": s.get("system_us"), "host_busy_us": h.get("busy_us"),
            "host_softirq_us": h.get("softirq_us"),
            "server_threads": [{"name": t["name"], "threads": t.get("threads"),
                                "per_request_us": t["per_request_us"]}
                               for t in r.get("server_threads", [])][:8]}
perf, one, meta = [], [], {}
for p in sorted(glob.glob(os.path.join(out, "perf-*.json"))):
    m = re.match(r"perf-(.+)-(\d+)-r(\d+)\.json$", os.path.basename(p))
    d = json.load(open(p))
    meta = {k: d.get(k) for k in ("git_revision", "machine", "date_utc")}
    perf.append({"condition": m.group(1), "rate": int(m.group(2)), "round": int(m.group(3)), **row(d)})
for p in sorted(glob.glob(os.path.join(out, "one-*.json"))):
    d = json.load(open(p))
    one.append({"condition": os.path.basename(p)[4:-5], **row(d)})
checks = [l.strip() for l in open(os.path.join(out, "steps.log")) if l.startswith("check ")]
print(json.dumps({
    "benchmark": "bench/gpu/cost.sh",
    "command": "bash bench/gpu/cost.sh " + args,
    "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "host": socket.gethostname(),
    "revision": open(os.path.join(out, "revision.txt")).read().strip() or meta.get("git_revision"),
    "load_meta": meta,
    "checks_failed": [c for c in checks if not c.endswith("rc=0")],
    "checks": checks,
    "perf": perf,
    "one_at_a_time": one,
}, indent=1))
PY
echo "cost: done at +$(( $(date +%s) - t0 )) s"
