#!/usr/bin/env bash
# One device call for issue 4's remaining parts: in-process v3 (checks, replay, round trips,
# throughput by slots and schedulers), then over TCP with the kernel transport and
# GPU-written SENDs (--reply executor-sqe): strict checks of every op and repeat count (binary,
# HTTP, pipelined), a million requests, system calls per request, and CPU/latency beside
# native + GPU and kernel loop + GPU. Runs ON the GPU machine from the repo root.
# Usage: bash bench/gpu/run-final.sh BIN_DIR OUT_DIR   (BIN_DIR: bgs and bgs-gpu-bench)
# Only summaries and two tarballs are written to OUT_DIR (the device tool returns few files).
set -uo pipefail
bin=$(cd "$1" && pwd); out=$2; work=/tmp/bgs-final
rm -rf "$work"; mkdir -p "$out" "$work"
(cd "$bin" && cat REVISION 2>/dev/null) > "$out/revision.txt"
timeout 200 bash bench/gpu/run-v3.sh "$bin" "$work/v3" > "$work/v3.log" 2>&1
cp "$work/v3/results.json" "$out/v3-results.json" 2>/dev/null
CHECK="${CHECK-ksqe-gpu}" BIG="${BIG-ksqe-gpu}" SYSCALLS="${SYSCALLS-ksqe-gpu kloop-gpu}" \
  PERF="${PERF-native-gpu kloop-gpu ksqe-gpu ksqe-gpu-idle1}" ROUNDS="${ROUNDS-2}" \
  timeout 420 bash bench/kernel_gpu.sh "$bin" "$work/k" > "$work/k.log" 2>&1
cp "$work/k/summary.json" "$out/tcp-summary.json" 2>/dev/null
cp "$work/k/steps.log" "$out/tcp-steps.log" 2>/dev/null
tar czf "$out/logs.tgz" -C "$work" . 2>/dev/null
echo "final: done"
