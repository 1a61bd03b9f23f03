set -u; b=$PWD/.gpu-carry; o=/tmp/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
s() { n=$1; shift; local t0=$(date +%s); timeout 250 "$@" > $o/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s)-t0 ))s | $(tail -1 $o/$n.txt | cut -c1-150)"; }
L=$b/bgs-llm-gpu
# served with this revision's defaults (small tiles to 16 tokens, fold to 4), exact replay of every stream
SECS=12 SLOTS="16 32" LOOPS=device COALESCE= SAT_SLOTS= SERVE_FLAGS=--batch-invariant timeout 300 bash bench/gpu/step-loop.sh .gpu-carry $o/served-invariant > $o/served.log 2>&1; echo "served rc=$?"
grep -h "rc=" $o/served-invariant/steps.log | cut -c1-200 | head -30
s bench-q-inv-default $L bench --dtype bf16 --arch qwen2.5-0.5b --invariant-gemm --batches 1,2,4,8,16,32,64,128,256,512 --json $o/bench-q-inv-default.json
s bench-s-inv-default $L bench --dtype bf16 --arch smollm2-135m --invariant-gemm --batches 1,2,4,8,16,32,64,128,256,512 --json $o/bench-s-inv-default.json
for f in $o/bench-*.txt; do echo "== $(basename $f)"; grep "^| [0-9]" $f | awk -F'|' '{printf "%s:%s ", $2, $3}'; echo; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $o/gpu.txt; cat .gpu-carry/REVISION > $o/revision.txt
cp .gpu-carry/dev.sh $o/commands.sh
cd $o && tar czf $OUT/r.tgz . && cd - >/dev/null
