#!/usr/bin/env bash
# The tensor-core GEMM for small buckets (bgs_gemm_tc, docs/gpu-model.md), one device call:
# correctness first (bgs-llm-gpu check against the CPU oracle: the tiny models, the
# Qwen2.5-0.5B and SmolLM2-135M shapes, with the GEMM for the default buckets and for every
# bucket, in each warp shape), then decode step times by batch against cuBLAS, with per-kernel
# times, for each warp shape (BGS_TC_MTILES: 16-row tiles a warp) and weight depth
# (BGS_TC_UNROLL: chunks of weights in flight a warp).
# Runs ON the GPU machine from the repo root. Usage: bash bench/gpu/tc-gemm.sh BIN_DIR OUT_DIR
# (BIN_DIR: bgs, bgs-llm-gpu, REVISION). MTILES (default "1 2") and UNROLLS (default "default
# 2 8") pick the variants.
set -uo pipefail
bin=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd); work=/tmp/bgs-tc
rm -rf "$work"; mkdir -p "$work"
export XDG_CACHE_HOME=/tmp/bgs-cache
log() { echo "$*" | tee -a "$out/steps.log"; }
step() {
  local name=$1 t=$2; shift 2
  local t0; t0=$(date +%s)
  timeout "$t" "$@" >"$work/$name.txt" 2>&1
  log "$name rc=$? $(( $(date +%s) - t0 ))s | $(tail -1 "$work/$name.txt")"
}
for a in tiny-qwen2 tiny-llama qwen2.5-0.5b smollm2-135m; do
  step "synth-$a" 120 "$bin/bgs" model synth --arch "$a" --seed 7 --dtype bf16 --out "$work/$a"
done
for mt in ${MTILES:-1 2}; do
  export BGS_TC_MTILES=$mt
  step "check-m$mt-tiny-qwen2-bf16" 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-qwen2" --dtype bf16 --json "$work/check-m$mt-tiny-qwen2-bf16.json"
  step "check-m$mt-tiny-llama-f16" 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-llama" --dtype f16 --json "$work/check-m$mt-tiny-llama-f16.json"
  step "check-m$mt-qwen-bf16" 240 "$bin/bgs-llm-gpu" check --model "$work/qwen2.5-0.5b" --dtype bf16 --steps 8 --json "$work/check-m$mt-qwen-bf16.json"
  step "check-m$mt-qwen-bf16-tcall" 240 "$bin/bgs-llm-gpu" check --model "$work/qwen2.5-0.5b" --dtype bf16 --steps 8 --tc-gemm-max-tokens 512 --json "$work/check-m$mt-qwen-bf16-tcall.json"
  step "check-m$mt-smollm2-bf16-tcall" 240 "$bin/bgs-llm-gpu" check --model "$work/smollm2-135m" --dtype bf16 --steps 16 --tc-gemm-max-tokens 512 --json "$work/check-m$mt-smollm2-bf16-tcall.json"
done
unset BGS_TC_MTILES
b=1,2,4,8,16,32,64,128
for m in qwen2.5-0.5b smollm2-135m; do
  step "bench-$m-cublas" 240 "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 --batches $b \
    --context 128 --tc-gemm-max-tokens 0 --per-op --json "$work/bench-$m-cublas.json"
  for mt in ${MTILES:-1 2}; do
    for un in ${UNROLLS:-default 2 8}; do
      defs=; [ "$un" = default ] || defs="BGS_TC_UNROLL=$un"
      BGS_TC_MTILES=$mt BGS_LLM_KERNEL_DEFINES=$defs step "bench-$m-m$mt-u$un" 240 \
        "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 --batches $b --context 128 \
        --tc-gemm-max-tokens 512 --per-op --json "$work/bench-$m-m$mt-u$un.json"
    done
  done
done
BIN=$bin python3 - "$work" "$out" <<'PY' >"$out/summary.json"
import glob, json, os, platform, sys, datetime, subprocess
work, out = sys.argv[1], sys.argv[2]
def load(p):
    try:
        return json.load(open(p))
    except Exception as e:
        return {"error": str(e)}
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
print(json.dumps({
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "machine": f"{platform.node()} ({os.cpu_count()} CPUs), GPU: {gpu}",
    "command": "bash bench/gpu/tc-gemm.sh .gpu-carry $OUT",
    "revision": open(os.environ["BIN"] + "/REVISION").read().strip(),
    "steps": open(out + "/steps.log").read().splitlines(),
    "runs": {os.path.basename(p)[:-5]: load(p) for p in sorted(glob.glob(f"{work}/*.json"))},
}, indent=1))
PY
echo "tc-gemm.sh: done"
