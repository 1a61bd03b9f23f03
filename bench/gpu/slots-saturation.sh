#!/usr/bin/env bash
# Which slot and scheduler defaults let the GPU executor pass 500,000 gemm8 req/s over TCP
# (issue 12, goal 4)? In process first (`bgs-gpu-bench throughput`, no TCP: the executor's own
# ceiling), then over TCP with the saturation load of experiments/cost-saturation-gpu.toml
# (open loop 600,000 req/s offered, pipelined 8 over 128 connections, 8 load threads), one run
# per configuration. The paired comparison of the chosen default is the lab experiment.
# Runs ON the GPU machine from the repo root. Usage: bash bench/gpu/slots-saturation.sh BIN_DIR OUT_DIR
# CONFIGS overrides the "slots:schedulers" list; SECS (default 8) the TCP run's duration.
set -uo pipefail
bin=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd)
export XDG_CACHE_HOME=/tmp/bgs-cache
CONFIGS=${CONFIGS:-"16:0 32:0 32:4 64:0 64:4 64:8"}
SECS=${SECS:-8}
log() { echo "$*" | tee -a "$out/steps.log"; }
for c in $CONFIGS; do
  s=${c%%:*} k=${c##*:}
  timeout 30 "$bin/bgs-gpu-bench" throughput --dispatcher device --slots "$s" --schedulers "$k" \
    --op gemm8 --repeat 1 --seconds 1.5 --outstanding 2048 >"$out/inproc-s$s-k$k.json" 2>"$out/inproc-s$s-k$k.err"
  log "inproc slots=$s schedulers=$k rc=$? $(tr -d '\n ' <"$out/inproc-s$s-k$k.json" | head -c 300)"
done
cat >"$out/row.py" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["report"]
c = r["counts"]
print(f"ok/s {r['achieved_rate']:.0f} ok {c['ok']} busy {c['busy']} timed_out {c['timed_out']} "
      f"failures {r['failures']} p50 {r['latency']['p50_us']:.0f} us p99 {r['latency']['p99_us']:.0f} us "
      f"server {r['server_cpu']['per_request']['run_us']:.2f} us/req")
PY
port=7700
for c in $CONFIGS; do
  s=${c%%:*} k=${c##*:}
  port=$((port + 1))
  "$bin/bgs" serve --listen 127.0.0.1:$port --cpus 0-3 --transport native --executor gpu \
    --slots "$s" --gpu-schedulers "$k" >"$out/tcp-s$s-k$k.server.log" 2>&1 &
  spid=$!
  for _ in $(seq 300); do grep -q listening "$out/tcp-s$s-k$k.server.log" && break; sleep 0.1; done
  timeout $((SECS + 40)) "$bin/bgs" load --target 127.0.0.1:$port --op gemm8 --repeat 1 --connections 128 \
    --rate 600000 --warmup 2 --duration "$SECS" --pipeline 8 --threads 8 --cpus 4-15 --server-pid "$spid" \
    --json "$out/tcp-s$s-k$k.json" >"$out/tcp-s$s-k$k.txt" 2>&1
  rc=$?
  kill -TERM "$spid"; wait "$spid" 2>/dev/null
  log "tcp slots=$s schedulers=$k rc=$rc $(python3 "$out/row.py" "$out/tcp-s$s-k$k.json" 2>&1)"
done
tar czf "$out/logs.tgz" -C "$out" --exclude logs.tgz . 2>/dev/null
echo "slots-saturation: done"
