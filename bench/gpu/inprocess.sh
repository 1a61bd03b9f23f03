#!/usr/bin/env bash
# GPU executor in process (no TCP): `bgs-gpu-bench` correctness checks against the CPU
# adapters with a replay digest, one-slot round trips, and throughput by slots and schedulers.
# Runs ON the GPU machine from the repo root. Everything over TCP is an experiment file now
# (experiments/gpu-*.toml, run with `bgs lab run`); this replaces the in-process parts of the
# retired bench/gpu/run.sh, run-v2.sh, run-v3.sh and run-final.sh (see git history).
# Usage: bash bench/gpu/inprocess.sh BIN_DIR OUT_DIR   (BIN_DIR from bench/gpu/prepare.sh)
# Exits non-zero if any step failed or timed out; every step's exit status is in steps.log.
set -uo pipefail
bin=$(cd "$1" && pwd); out=$2
mkdir -p "$out/logs"; logs="$out/logs"
bench="$bin/bgs-gpu-bench"
export XDG_CACHE_HOME=/tmp/bgs-cache RUST_LOG=${RUST_LOG:-info}
res="$out/results.jsonl"; : > "$res"
failed=0
OLD_DIGEST=532ef5896256f241 # v1, v2 and v3 (bench/results/20261129-gpu, -gpu-v2, -gpu-v3)
step() { # name timeout args...: run bgs-gpu-bench, record its JSON and exit status
  local name=$1 t=$2; shift 2
  timeout "$t" "$bench" "$@" > "$logs/$name.json" 2> "$logs/$name.err"
  local rc=$?
  echo "$name rc=$rc" | tee -a "$logs/steps.log"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  local j; j=$(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$logs/$name.json" 2>/dev/null)
  printf '{"step":"%s","rc":%s,"result":%s}\n' "$name" "$rc" "${j:-null}" >> "$res"
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv; uname -r; nproc; } > "$logs/machine.txt" 2>&1
step probe 60 probe
for spec in "device 1 16 1" "device 2 16 4" "device 3 1 1" "device 4 32 8" "host 5 16 1"; do
  set -- $spec
  step "check-$1-s$3-k$4" 60 check --dispatcher "$1" --slots "$3" --schedulers "$4" --digest "$logs/digest-$2"
done
distinct=$( (cat "$logs"/digest-* 2>/dev/null; echo $OLD_DIGEST) | sort -u | wc -l)
echo "replay digests: $distinct distinct including v1 (1 = every run replayed bit for bit)" | tee -a "$logs/steps.log"
[ "$distinct" -eq 1 ] || failed=$((failed + 1))
for spec in "device gemm8 1" "device gemm8 16" "device fft32 1" "device echo 1" "host gemm8 1"; do
  set -- $spec
  step "rtt-$1-$2-r$3" 45 rtt --dispatcher "$1" --slots 1 --op "$2" --repeat "$3" --n 20000
done
for spec in "1 1 1" "1 1 16" "16 1 1" "16 2 1" "16 4 1" "16 2 16" "32 2 1" "32 4 1" "32 2 16"; do
  set -- $spec
  step "tput-s$1-k$2-r$3" 30 throughput --dispatcher device --slots "$1" --schedulers "$2" --op gemm8 --repeat "$3" --seconds 1.5 --outstanding 1024
done
python3 - "$res" > "$out/results.json" <<'PY'
import json, sys
print(json.dumps({l["step"]: l for l in map(json.loads, open(sys.argv[1]))}, indent=1))
PY
tar czf "$out/logs.tgz" -C "$out" logs
echo "inprocess: $failed failed step(s)"
[ "$failed" -eq 0 ]
