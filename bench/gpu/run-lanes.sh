#!/usr/bin/env bash
# Launch-rate experiment: throughput with lane 0 launching a claimed batch in order (default)
# against every lane launching its own request's graph (BGS_GPU_LAUNCH_LANES=1), by slots and
# schedulers; correctness check of the lanes mode first. Runs ON the GPU machine.
# Usage: bash bench/gpu/run-lanes.sh BIN_DIR OUT_DIR
set -uo pipefail
bin=$(cd "$1" && pwd); out=$2; mkdir -p "$out"; bench="$bin/bgs-gpu-bench"
export XDG_CACHE_HOME=/tmp/bgs-cache
res="$out/results.jsonl"; : > "$res"
one() { # name env... -- args...
  local name=$1; shift; local env=(); while [ "$1" != -- ]; do env+=("$1"); shift; done; shift
  local j; j=$(env "${env[@]}" timeout 40 "$bench" "$@" 2>>"$out/stderr.log")
  printf '{"step":"%s","result":%s}\n' "$name" "${j:-null}" >> "$res"
}
one check-lanes-s16-k2 BGS_GPU_LAUNCH_LANES=1 -- check --slots 16 --schedulers 2
for rep in 1 2; do
  for spec in "1 1" "16 1" "16 2" "32 2"; do
    set -- $spec
    for lanes in 0 1; do
      one "tput-s$1-k$2-lanes$lanes-rep$rep" BGS_GPU_LAUNCH_LANES=$lanes -- throughput --slots $1 --schedulers $2 --op gemm8 --repeat 1 --seconds 1.5 --outstanding 1024
    done
  done
done
one rtt-lanes-s1 BGS_GPU_LAUNCH_LANES=1 -- rtt --slots 1 --op gemm8 --repeat 1 --n 20000
python3 - "$res" > "$out/results.json" <<'PY'
import json, sys
print(json.dumps({l["step"]: l["result"] for l in map(json.loads, open(sys.argv[1]))}, indent=1))
PY
