#!/usr/bin/env bash
# GPU generation (issue 9), one device call: correctness first, timings second.
#  1. the GPU forward pass against the CPU oracle (bgs-llm-gpu check): tiny Qwen2/Llama in f32
#     (tokens must be equal) and bf16, the Qwen2.5-0.5B and SmolLM2-135M shapes in bf16;
#  2. against Hugging Face transformers on the same synthetic checkpoints (bench/gpu/hf_reference.py
#     writes transformers' logits and greedy tokens; bgs-llm-gpu hf compares);
#  3. decode step time at batch 1/16/64/256 against the memory floor (bgs-llm-gpu bench);
#  4. served over TCP: bgs serve --executor gpu --model (Qwen2.5-0.5B shape), the paper's
#     workload (64 output tokens, EOS ignored, 192 req/s, 128 connections, slots 16 and 32) with
#     exact replay against each prompt's stream alone (a mismatch under load = a batch-invariance
#     failure), HTTP, the OpenAI API, the kernel transport (--reply loop and executor-sqe).
# Runs ON the GPU machine from the repo root. Writes OUT_DIR/summary.json (date, machine,
# command, revision) and the logs.
# Usage: bash bench/gpu/generate.sh BIN_DIR OUT_DIR   (BIN_DIR: bgs, bgs-llm-gpu, REVISION)
# PARTS (default "check hf bench served openai"; also "persistent", "attribution", "tiles", "large") picks parts, STEP_LOOP (host|device) the step
# loop of the served parts; SECS (default 30) is the paper
# workload's duration per slot count.
set -uo pipefail
bin=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd); work=/tmp/bgs-gen
rm -rf "$work"; mkdir -p "$work"
export XDG_CACHE_HOME=/tmp/bgs-cache
# Qwen2.5's tokenizer for the synthetic Qwen2.5-0.5B checkpoint (carried beside the binaries).
export BGS_QWEN_TOKENIZER=${BGS_QWEN_TOKENIZER:-$bin/qwen-tokenizer.json}
SECS=${SECS:-30}
PARTS=${PARTS:-check hf bench served openai}
# STEP_LOOP (default host): where the served parts run the step loop (device: every path of
# issue 9 part 6 through the resident loop).
STEP_LOOP=${STEP_LOOP:-host}
want() { [[ " $PARTS " == *" $1 "* ]]; }
log() { echo "$*" | tee -a "$out/steps.log"; }
# step NAME TIMEOUT CMD...: run, keep the output, log rc and the last line.
step() {
  local name=$1 t=$2; shift 2
  local t0; t0=$(date +%s)
  timeout "$t" "$@" >"$work/$name.txt" 2>&1
  local rc=$?
  log "$name rc=$rc $(( $(date +%s) - t0 ))s | $(tail -1 "$work/$name.txt")"
  return $rc
}
cp "$bin/REVISION" "$out/revision.txt" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/gpu.txt" 2>&1
mount | grep -q cgroup2 || { mkdir -p /tmp/cg2 && mount -t cgroup2 none /tmp/cg2; }

# Checkpoints (synthetic weights with the real shapes; bf16 on disk like the published ones).
for a in tiny-qwen2 tiny-llama qwen2.5-0.5b smollm2-135m; do
  step "synth-$a" 120 "$bin/bgs" model synth --arch "$a" --seed 7 --dtype bf16 --out "$work/$a"
done

# 1. Against the CPU oracle.
if want check; then
step check-tiny-qwen2-f32 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-qwen2" --dtype f32 --json "$work/check-tiny-qwen2-f32.json"
step check-tiny-llama-f32 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-llama" --dtype f32 --json "$work/check-tiny-llama-f32.json"
step check-tiny-qwen2-bf16 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-qwen2" --dtype bf16 --json "$work/check-tiny-qwen2-bf16.json"
step check-tiny-llama-f16 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-llama" --dtype f16 --json "$work/check-tiny-llama-f16.json"
step check-qwen-bf16 240 "$bin/bgs-llm-gpu" check --model "$work/qwen2.5-0.5b" --dtype bf16 --steps 8 --json "$work/check-qwen-bf16.json"
step check-smollm2-bf16 240 "$bin/bgs-llm-gpu" check --model "$work/smollm2-135m" --dtype bf16 --steps 16 --json "$work/check-smollm2-bf16.json"
step check-tiny-qwen2-f32-nographs 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-qwen2" --dtype f32 --no-graphs --json "$work/check-tiny-qwen2-f32-nographs.json"
step check-tiny-qwen2-f32-fused2 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-qwen2" --dtype f32 --fused-max-tokens 2 --json "$work/check-tiny-qwen2-f32-fused2.json"
step check-tiny-llama-f32-fused 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-llama" --dtype f32 --fused-max-tokens 512 --json "$work/check-tiny-llama-f32-fused.json"
step check-qwen-f32-fused 240 "$bin/bgs-llm-gpu" check --model "$work/qwen2.5-0.5b" --dtype f32 --steps 8 --fused-max-tokens 512 --json "$work/check-qwen-f32-fused.json"
step check-tiny-qwen2-f32-nopdl 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-qwen2" --dtype f32 --no-pdl --json "$work/check-tiny-qwen2-f32-nopdl.json"
step check-tiny-qwen2-f32-invariant 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-qwen2" --dtype f32 --invariant-gemm --json "$work/check-tiny-qwen2-f32-invariant.json"
step check-qwen-bf16-invariant 240 "$bin/bgs-llm-gpu" check --model "$work/qwen2.5-0.5b" --dtype bf16 --steps 8 --invariant-gemm --json "$work/check-qwen-bf16-invariant.json"
step check-smollm2-bf16-invariant 240 "$bin/bgs-llm-gpu" check --model "$work/smollm2-135m" --dtype bf16 --steps 16 --invariant-gemm --json "$work/check-smollm2-bf16-invariant.json"
step check-qwen-bf16-tc4 240 "$bin/bgs-llm-gpu" check --model "$work/qwen2.5-0.5b" --dtype bf16 --steps 8 --tc-gemm-max-tokens 4 --json "$work/check-qwen-bf16-tc4.json"
step check-tiny-qwen2-bf16-invariant 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-qwen2" --dtype bf16 --invariant-gemm --json "$work/check-tiny-qwen2-bf16-invariant.json"
# The folded form at every bucket (check (g): bitwise equal to the launches apart).
step check-qwen-bf16-invariant-fold 240 "$bin/bgs-llm-gpu" check --model "$work/qwen2.5-0.5b" --dtype bf16 --steps 8 --invariant-gemm --tc-fold-max-tokens 512 --json "$work/check-qwen-bf16-invariant-fold.json"
fi

# 2. Against Hugging Face transformers (on the GPU, bf16 and f32).
if want hf; then
prompts='[[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16],[100,200,300,400,500,600,700,800,900,1000,1100,1200,1300,1400,1500,1600,1700,1800,1900,2000,2100,2200,2300,2400]]'
for m in qwen2.5-0.5b smollm2-135m; do
  for d in bf16 f32; do
    step "hfref-$m-$d" 180 python3 bench/gpu/hf_reference.py --model "$work/$m" --dtype "$d" --steps 32 \
      --prompts "$prompts" --out "$work/hfref-$m-$d.json"
    step "hf-$m-$d" 180 "$bin/bgs-llm-gpu" hf --model "$work/$m" --dtype "$d" \
      --reference "$work/hfref-$m-$d.json" --json "$work/hf-$m-$d.json"
  done
done
fi

# 3. Step times against the memory floor: the defaults (cuBLAS, programmatic dependent
#    launch, tensor-core attention) at batch 1..512 (384 and 512 are the buckets of a full
#    256-slot table with prefill riding along), with per-kernel times; every projection on the
#    tensor-core GEMM (--invariant-gemm: batch-invariant by construction; SiLU·up is the
#    gate/up GEMM's epilogue, and once more launched apart with --no-tc-epilogues, and in the
#    folded form with --tc-fold-max-tokens: norms, RoPE/KV and residual adds in the GEMMs), and
#    buckets of up to 2 tokens in the fused form (--fused-max-tokens 2). BENCH_FLAGS adds flags
#    to all.
if want bench; then
bf=${BENCH_FLAGS:-}
for m in qwen2.5-0.5b smollm2-135m; do
  step "bench-$m" 300 "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 $bf \
    --batches 1,2,4,8,16,32,64,128,256,384,512 --context 128 --per-op --json "$work/bench-$m.json"
  step "bench-$m-invariant" 240 "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 $bf \
    --batches 1,2,4,8,16,32,64,128,256,512 --context 128 --invariant-gemm --per-op --json "$work/bench-$m-invariant.json"
  step "bench-$m-fused2" 240 "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 $bf \
    --batches 1,2 --context 128 --fused-max-tokens 2 --json "$work/bench-$m-fused2.json"
  step "bench-$m-invariant-apart" 240 "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 $bf \
    --batches 1,2,4,8,16,32,64,128,256,512 --context 128 --invariant-gemm --no-tc-epilogues \
    --json "$work/bench-$m-invariant-apart.json"
  step "bench-$m-invariant-fold" 240 "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 $bf \
    --batches 1,2,4,8,16,32,64,128,256,512 --context 128 --invariant-gemm --tc-fold-max-tokens 512 \
    --per-op --json "$work/bench-$m-invariant-fold.json"
done
fi

# 3b. The persistent form (a bucket's ops in one cooperative launch, --persistent-max-tokens):
#     first the checks (bit for bit against the launched ops at every bucket that has it, and
#     the CPU oracle through it), then the decode step against the launched ops in the same
#     run (with where the persistent step's time goes, per kernel, and what its barriers cost
#     alone), for the invariant tensor-core form and the fused form (1-2 tokens, the LM head on
#     the tensor-core GEMM); then variants: kernel defines (BGS_LLM_KERNEL_DEFINES: the
#     register cap BGS_OP_MIN_BLOCKS) and flags (blocks per multiprocessor, L2 prefetch).
if want persistent; then
pm=${PERSIST_MAX:-64}
step check-tiny-qwen2-bf16-persistent 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-qwen2" --dtype bf16 \
  --invariant-gemm --persistent-max-tokens "$pm" --json "$work/check-tiny-qwen2-bf16-persistent.json"
step check-tiny-llama-f32-persistent 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-llama" --dtype f32 \
  --invariant-gemm --persistent-max-tokens "$pm" --json "$work/check-tiny-llama-f32-persistent.json"
step check-qwen-bf16-persistent 240 "$bin/bgs-llm-gpu" check --model "$work/qwen2.5-0.5b" --dtype bf16 --steps 8 \
  --invariant-gemm --persistent-max-tokens "$pm" --json "$work/check-qwen-bf16-persistent.json"
step check-qwen-bf16-persistent-fused 240 "$bin/bgs-llm-gpu" check --model "$work/qwen2.5-0.5b" --dtype bf16 --steps 8 \
  --fused-max-tokens 2 --tc-gemm-max-tokens 2 --persistent-max-tokens 2 --json "$work/check-qwen-bf16-persistent-fused.json"
for m in qwen2.5-0.5b smollm2-135m; do
  step "bench-$m-persistent" 300 "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 --invariant-gemm \
    --persistent-max-tokens "$pm" --batches 1,2,4,8,16,32,64 --context 128 --per-op --json "$work/bench-$m-persistent.json"
  step "bench-$m-persistent-fused" 240 "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 --fused-max-tokens 2 \
    --tc-gemm-max-tokens 2 --persistent-max-tokens 2 --batches 1,2 --context 128 --per-op --json "$work/bench-$m-persistent-fused.json"
done
# name | kernel defines | bench flags
variants=${PERSIST_VARIANTS-"regs128-b2|BGS_OP_MIN_BLOCKS=2|--persistent-blocks-per-sm 2
regs128-b1|BGS_OP_MIN_BLOCKS=2|--persistent-blocks-per-sm 1
regs85-b3|BGS_OP_MIN_BLOCKS=3|--persistent-blocks-per-sm 3
prefetch||--persistent-prefetch 1"}
while IFS='|' read -r name defs flags; do
  [ -n "$name" ] || continue
  # shellcheck disable=SC2086 # flags are words
  step "check-tiny-qwen2-bf16-persistent-$name" 120 env BGS_LLM_KERNEL_DEFINES="$defs" "$bin/bgs-llm-gpu" check \
    --model "$work/tiny-qwen2" --dtype bf16 --invariant-gemm --persistent-max-tokens 8 $flags \
    --json "$work/check-tiny-qwen2-bf16-persistent-$name.json"
  # shellcheck disable=SC2086
  step "bench-qwen2.5-0.5b-persistent-$name" 240 env BGS_LLM_KERNEL_DEFINES="$defs" "$bin/bgs-llm-gpu" bench \
    --arch qwen2.5-0.5b --dtype bf16 --invariant-gemm --persistent-max-tokens 8 $flags \
    --batches 1,8 --context 128 --per-op --json "$work/bench-qwen2.5-0.5b-persistent-$name.json"
done <<<"$variants"
fi

# 3c. Where the decode step's time goes inside the graph (PARTS=attribution, not in the default
#     parts): each kind of kernel skipped in turn (BGS_TIME_SKIP=k, a kernel define: its kernels
#     wait on the previous grid and return, so the values are wrong and the time is the step's
#     without them), Qwen2.5-0.5B shape, invariant form, batches 1 and 16. The full step against
#     each skipped one is that kind's cost with the overlap of programmatic launches included;
#     127 skips every kind (the launch chain alone). Bits: llm_kernels.cu, BGS_TIME_SKIP.
if want attribution; then
for k in 0 1 2 4 8 16 32 64 127; do
  step "bench-attr-skip$k" 240 env BGS_LLM_KERNEL_DEFINES="BGS_TIME_SKIP=$k" "$bin/bgs-llm-gpu" bench \
    --arch qwen2.5-0.5b --dtype bf16 --invariant-gemm --batches 1,16 --context 128 \
    --json "$work/bench-attr-skip$k.json"
done
fi

# 3d. The 16-token tensor-core tiles (`--tc-mid-max-tokens`: buckets of 9-16 tokens in one
#     16-token block instead of two 8-token ones; the served paper workload runs mostly the
#     16-token bucket). Checks first (mid tiles bitwise against small and wide), then the
#     invariant decode step with and without them, interleaved, twice, both shapes, and once
#     the 32-token bucket in two mid blocks (`--tc-mid-max-tokens 32`).
if want tiles; then
step check-tiny-qwen2-bf16-mid 120 "$bin/bgs-llm-gpu" check --model "$work/tiny-qwen2" --dtype bf16 \
  --invariant-gemm --tc-mid-max-tokens 16 --json "$work/check-tiny-qwen2-bf16-mid.json"
step check-qwen-bf16-mid 240 "$bin/bgs-llm-gpu" check --model "$work/qwen2.5-0.5b" --dtype bf16 --steps 8 \
  --invariant-gemm --tc-mid-max-tokens 16 --json "$work/check-qwen-bf16-mid.json"
step check-smollm2-bf16-mid 240 "$bin/bgs-llm-gpu" check --model "$work/smollm2-135m" --dtype bf16 --steps 16 \
  --invariant-gemm --tc-mid-max-tokens 16 --json "$work/check-smollm2-bf16-mid.json"
for r in 1 2; do
  for m in qwen2.5-0.5b smollm2-135m; do
    mids="0 16 32"; [ $r = 2 ] && mids="0 16"
    for mid in $mids; do
      step "bench-$m-mid$mid-$r" 240 "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 --invariant-gemm \
        --tc-mid-max-tokens $mid --batches 1,8,12,16,24,32 --context 128 --iters 100 \
        --json "$work/bench-$m-mid$mid-$r.json"
    done
  done
done
fi

# 3e. The large tensor-core tiles (`--tc-large-min-tokens`: buckets of at least that many
#     tokens run bgs_gemm_tc_large / bgs_gemm_tc_silu_large, blocks of 64 rows x 64 tokens
#     through shared memory, instead of 16 x 32 tiles from L2), and their split form
#     (`--tc-large-split G`: projections with fewer large tiles than multiprocessors, QKV, o
#     and down_proj on the Qwen2.5-0.5B shape, cut each tile's chunk classes over G blocks).
#     Checks first (large and split tiles bitwise against wide ones), then the invariant
#     decode step for each of LARGE_CONFIGS ("min-tokens:split" pairs, default "0:0 64:0
#     64:8"), interleaved, twice, both shapes, then once per operation at 64 and 256 tokens.
#     A geometry variant's binary (bgs-llm-gpu-<name> beside the others, built with other
#     plan::TC_LARGE_* constants) is benched once too where present, with --tc-large-split
#     VARIANT_SPLIT (default 0).
LARGE_CONFIGS=${LARGE_CONFIGS:-0:0 64:0 64:8}
# BENCH_BATCHES (default 32,64,128,256) and BENCH_RUNS (default 2) for the step times.
BENCH_BATCHES=${BENCH_BATCHES:-32,64,128,256}
if want large; then
for m in tiny-qwen2 qwen2.5-0.5b smollm2-135m; do
  step "check-$m-bf16-large" 240 "$bin/bgs-llm-gpu" check --model "$work/$m" --dtype bf16 --steps 8 \
    --invariant-gemm --tc-large-min-tokens 64 --json "$work/check-$m-bf16-large.json"
done
for r in $(seq "${BENCH_RUNS:-2}"); do
  for m in qwen2.5-0.5b smollm2-135m; do
    for c in $LARGE_CONFIGS; do
      lg=${c%%:*} sp=${c##*:}
      step "bench-$m-large$lg-split$sp-$r" 240 "$bin/bgs-llm-gpu" bench --arch "$m" --dtype bf16 \
        --invariant-gemm --tc-large-min-tokens $lg --tc-large-split $sp --batches "$BENCH_BATCHES" \
        --context 128 --iters 50 --json "$work/bench-$m-large$lg-split$sp-$r.json"
    done
  done
done
for c in $LARGE_CONFIGS; do
  lg=${c%%:*} sp=${c##*:}
  step "bench-qwen2.5-0.5b-large$lg-split$sp-perop" 240 "$bin/bgs-llm-gpu" bench --arch qwen2.5-0.5b \
    --dtype bf16 --invariant-gemm --tc-large-min-tokens $lg --tc-large-split $sp --batches 64,256 \
    --context 128 --iters 20 --per-op --json "$work/bench-qwen2.5-0.5b-large$lg-split$sp-perop.json"
done
for v in "$bin"/bgs-llm-gpu-*; do
  [ -x "$v" ] || continue
  name=${v##*/bgs-llm-gpu-}
  step "check-qwen-bf16-large-$name" 240 "$v" check --model "$work/qwen2.5-0.5b" --dtype bf16 --steps 8 \
    --invariant-gemm --tc-large-min-tokens 64 --json "$work/check-qwen-bf16-large-$name.json"
  for m in qwen2.5-0.5b smollm2-135m; do
    step "bench-$m-large64-$name" 240 "$v" bench --arch "$m" --dtype bf16 --invariant-gemm \
      --tc-large-min-tokens 64 --tc-large-split "${VARIANT_SPLIT:-0}" --batches 32,64,128,256 \
      --context 128 --iters 50 --json "$work/bench-$m-large64-$name.json"
  done
done
fi

# 4. Served over TCP.
port=7990
# start_server NAME SERVE-FLAGS...: serve on $port (the caller moves $port on first).
start_server() {
  local name=$1; shift
  rm -f "$work/$name.server.log"
  "$bin/bgs" serve --listen 127.0.0.1:$port --cpus 0-3 --executor gpu --gpu-step-loop "$STEP_LOOP" "$@" \
    >"$work/$name.server.log" 2>&1 &
  spid=$!
  for _ in $(seq 600); do grep -q listening "$work/$name.server.log" 2>/dev/null && return 0; sleep 0.1; done
  log "$name: server did not start: $(tail -3 "$work/$name.server.log")"; return 1
}
stop_server() { kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null; }
gen_load() { # name, then load flags
  local name=$1; shift
  step "$name" $((SECS + 120)) "$bin/bgs" load --target 127.0.0.1:$port --op generate \
    --prompt-tokens 24 --max-tokens 64 --ignore-eos --connections 128 --cpus 4-15 \
    --server-pid "$spid" --json "$work/$name.json" "$@"
}
if want served; then
for slots in 16 32; do
  port=$((port + 2))
  if start_server "native-s$slots" --model "$work/qwen2.5-0.5b" --slots $slots --api-listen 127.0.0.1:$((port + 1)); then
    gen_load "paper-native-s$slots" --rate 192 --duration "$SECS" --warmup 2 --prompts 64
    if [ $slots = 32 ]; then
      gen_load "http-native-s$slots" --rate 192 --duration 5 --http --prompts 16
      gen_load "saturation-native-s$slots" --rate 2000 --duration 10 --prompts 64
    fi
    stop_server
  fi
done
for reply in loop executor-sqe; do
  port=$((port + 2))
  if start_server "kernel-$reply" --transport kernel --reply "$reply" --model "$work/qwen2.5-0.5b" --slots 32 --api-listen off; then
    gen_load "paper-kernel-$reply" --rate 192 --duration 10 --warmup 2 --prompts 64
    gen_load "http-kernel-$reply" --rate 192 --duration 5 --http --prompts 16
    stop_server
  fi
done
fi

# 5. The OpenAI-compatible API over the GPU model: one completion by curl, then a load run
#    through the API (streamed, the same prompts as above).
if want openai; then
  port=$((port + 2))
  if start_server "openai" --model "$work/qwen2.5-0.5b" --slots 32 --api-listen 127.0.0.1:$((port + 1)); then
    step "openai-curl" 60 curl -sS --max-time 30 "http://127.0.0.1:$((port + 1))/v1/completions" \
      -H 'content-type: application/json' \
      -d '{"model":"qwen2.5-0.5b","prompt":"The capital of France is","max_tokens":16,"stream":false}'
    step "openai-load" 90 "$bin/bgs" load --openai "http://127.0.0.1:$((port + 1))/v1/completions" \
      --model qwen2.5-0.5b --op generate --prompt-tokens 24 --max-tokens 64 --ignore-eos \
      --connections 64 --cpus 4-15 --rate 96 --duration 10 --prompts 16 --server-pid "$spid" \
      --json "$work/openai-load.json"
    stop_server
  fi
fi

python3 - "$work" "$out" <<'PY' >"$out/summary.json"
import glob, json, os, platform, sys, datetime
work, out = sys.argv[1], sys.argv[2]
def load(p):
    try:
        return json.load(open(p))
    except Exception as e:
        return {"error": str(e)}
s = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "machine": f"{platform.node()} ({os.cpu_count()} CPUs), GPU: {open(out + '/gpu.txt').read().strip()}",
    "command": "bash bench/gpu/generate.sh .gpu-carry $OUT",
    "revision": open(out + "/revision.txt").read().strip() if os.path.exists(out + "/revision.txt") else None,
    "steps": open(out + "/steps.log").read().splitlines(),
}
for kind in ["check", "hf", "bench"]:
    s[kind] = {os.path.basename(p)[len(kind) + 1:-5]: load(p) for p in sorted(glob.glob(f"{work}/{kind}-*.json"))}
s["served"] = {}
for p in sorted(glob.glob(f"{work}/*.json")):
    n = os.path.basename(p)[:-5]
    if n.split("-")[0] in ("paper", "http", "saturation", "openai"):
        s["served"][n] = load(p)
print(json.dumps(s, indent=1))
PY
tar czf "$out/logs.tgz" -C "$work" --exclude='*.safetensors' --exclude='*.gguf' . 2>/dev/null
echo "generate.sh: done"
