#!/usr/bin/env bash
# The tensor-core GEMM (bgs_gemm_tc, docs/gpu-model.md "the tensor-core GEMM") as the
# batch-invariant form of every projection, one device call: correctness first (bgs-llm-gpu
# check against the CPU oracle with --invariant-gemm: the tiny Qwen2, the Qwen2.5-0.5B and
# SmolLM2-135M shapes; check (c) counts the sequences equal to their tokens alone), then decode
# step times by batch, for each warp shape (BGS_TC_MTILES: 16-row tiles a warp; MTILES,
# default "1 2"), against the cuBLAS default.
# Runs ON the GPU machine from the repo root. Usage: bash bench/gpu/tc-gemm.sh BIN_DIR OUT_DIR
# (BIN_DIR: bgs, bgs-llm-gpu, REVISION, qwen-tokenizer.json).
set -uo pipefail
bin=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd); work=/tmp/bgs-tc
rm -rf "$work"; mkdir -p "$work"
export XDG_CACHE_HOME=/tmp/bgs-cache
export BGS_QWEN_TOKENIZER=${BGS_QWEN_TOKENIZER:-$bin/qwen-tokenizer.json}
log() { echo "$*" | tee -a "$out/steps.log"; }
step() {
  local name=$1 t=$2; shift 2
  local t0; t0=$(date +%s)
  timeout "$t" "$@" >"$work/$name.txt" 2>&1
  log "$name rc=$? $(( $(date +%s) - t0 ))s | $(tail -1 "$work/$name.txt")"
}
for a in tiny-qwen2 qwen2.5-0.5b smollm2-135m; do
  step "synth-$a" 120 "$bin/bgs" model synth --arch "$a" --seed 7 --dtype bf16 --out "$work/$a"
done
b=1,2,4,8,16,32,64,128,256,512
for mt in ${MTILES:-1 2}; do
  export BGS_TC_MTILES=$mt
  step "check-m$mt-tiny-qwen2" 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-qwen2" --dtype bf16 --invariant-gemm --json "$work/check-m$mt-tiny-qwen2.json"
  step "check-m$mt-qwen" 240 "$bin/bgs-llm-gpu" check --model "$work/qwen2.5-0.5b" --dtype bf16 --steps 8 --invariant-gemm --json "$work/check-m$mt-qwen.json"
  step "check-m$mt-smollm2" 240 "$bin/bgs-llm-gpu" check --model "$work/smollm2-135m" --dtype bf16 --steps 16 --invariant-gemm --json "$work/check-m$mt-smollm2.json"
  for m in qwen2.5-0.5b smollm2-135m; do
    step "bench-m$mt-$m" 240 "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 --batches $b \
      --context 128 --invariant-gemm --json "$work/bench-m$mt-$m.json"
  done
done
unset BGS_TC_MTILES
for m in qwen2.5-0.5b smollm2-135m; do
  step "bench-cublas-$m" 240 "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 --batches $b \
    --context 128 --json "$work/bench-cublas-$m.json"
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
