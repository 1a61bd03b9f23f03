#!/usr/bin/env bash
# GPU executor v3 (several device schedulers; sole-producer completion claims): in-process
# (run 2 of bench/results/20261130-gpu-v3 also compared a scheduler-side copy-in, since
# reverted; its script had extra "nocopy" rows)
# correctness first (vs the CPU executor, exact replay against v1/v2's digest), then one-slot
# round trips and throughput by slots and schedulers. Runs ON the GPU machine from the repo root.
# Usage: bash bench/gpu/run-v3.sh BIN_DIR OUT_DIR   (BIN_DIR holds bgs-gpu-bench)
set -uo pipefail
bin=$(cd "$1" && pwd); out=$2
mkdir -p "$out"; logs="$out/logs"; mkdir -p "$logs"
bench="$bin/bgs-gpu-bench"
export XDG_CACHE_HOME=/tmp/bgs-cache RUST_LOG=${RUST_LOG:-info}
summary="$out/results.jsonl"; : > "$summary"
OLD_DIGEST=532ef5896256f241 # v1 and v2 (bench/results/20261129-gpu, 20261130-gpu-v2)
note() { echo "== $* ($(date +%T))" | tee -a "$logs/steps.log"; }
rec() { local j; j=$(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$2" 2>/dev/null)
  printf '{"step":"%s","result":%s}\n' "$1" "${j:-null}" >> "$summary"; }
note "machine"; { nvidia-smi --query-gpu=name,driver_version --format=csv; uname -r; nproc; } > "$logs/machine.txt" 2>&1
for spec in "device 1 16 1" "device 2 16 4" "device 3 1 1" "device 4 32 8" "host 5 16 1"; do
  set -- $spec
  note "check $1 run $2 slots $3 schedulers $4"
  timeout 60 "$bench" check --dispatcher $1 --slots $3 --schedulers $4 --digest "$logs/digest-$2" \
    > "$logs/check-$2.json" 2> "$logs/check-$2.err"; echo "rc=$?" >> "$logs/steps.log"
  rec "check-$1-s$3-k$4" "$logs/check-$2.json"
done
distinct=$( (cat "$logs"/digest-* 2>/dev/null; echo $OLD_DIGEST) | sort -u | wc -l)
printf '{"step":"replay-digests","result":{"distinct_including_v1":%s,"files":%s}}\n' "$distinct" "$(ls "$logs"/digest-* | wc -l)" >> "$summary"
note "rtt"
for spec in "device gemm8 1" "device gemm8 16" "device fft32 1" "device echo 1" "host gemm8 1"; do
  set -- $spec; d=$1; env=()
  env "${env[@]}" timeout 45 "$bench" rtt --dispatcher $d --slots 1 --op $2 --repeat $3 --n 20000 > "$logs/rtt-$1-$2-$3.json" 2> "$logs/rtt-$1-$2-$3.err"
  rec "rtt-$1-$2-r$3" "$logs/rtt-$1-$2-$3.json"
done
note "throughput"
for spec in "1 1 1" "1 1 16" "16 1 1" "16 2 1" "16 3 1" "16 4 1" "16 1 16" "16 2 16" "32 1 1" "32 2 1" "32 4 1" "32 2 16" "1 1 1" "16 2 1"; do
  set -- $spec; env=(); tag=""; [ "${4:-}" = nocopy ] && { env=(BGS_GPU_COPY_IN=0); tag=-nocopy; }
  env "${env[@]}" timeout 30 "$bench" throughput --dispatcher device --slots $1 --schedulers $2 --op gemm8 --repeat $3 --seconds 1.5 --outstanding 1024 \
    > "$logs/tput-s$1-k$2-r$3$tag.json" 2> "$logs/tput-s$1-k$2-r$3$tag.err"
  rec "tput-s$1-k$2-gemm8-r$3$tag$([ -e "$logs/.seen-s$1-k$2-r$3" ] && echo -again)" "$logs/tput-s$1-k$2-r$3$tag.json"; touch "$logs/.seen-s$1-k$2-r$3"
done
note "done"
tar czf "$out/logs.tgz" -C "$out" logs 2>/dev/null
python3 - "$summary" > "$out/results.json" <<'PY'
import json, sys
print(json.dumps({l["step"]: l["result"] for l in map(json.loads, open(sys.argv[1]))}, indent=1))
PY
