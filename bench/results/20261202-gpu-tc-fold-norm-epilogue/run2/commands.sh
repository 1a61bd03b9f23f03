set -u; b=$PWD/.gpu-carry; o=/tmp/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
s() { n=$1; shift; local t0=$(date +%s); timeout 250 "$@" > $o/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s)-t0 ))s | $(tail -1 $o/$n.txt | cut -c1-150)"; }
L=$b/bgs-llm-gpu
# served first (correctness: exact replay of every stream), the invariant defaults: small tiles, fold to 4 tokens
SECS=12 SLOTS=32 LOOPS=device COALESCE= SAT_SLOTS= SERVE_FLAGS=--batch-invariant timeout 300 bash bench/gpu/step-loop.sh .gpu-carry $o/served-invariant > $o/served.log 2>&1; echo "served rc=$?"
grep -h "rc=\|wrong\|p99" $o/served-invariant/steps.log | cut -c1-220 | head -30
B=1,2,4,8,16,64,256
bq() { n=$1; shift; s bench-$n $L bench --dtype bf16 --batches $B --json $o/bench-$n.json "$@"; }
bq q-inv-default --arch qwen2.5-0.5b --invariant-gemm
bq q-inv-nofold --arch qwen2.5-0.5b --invariant-gemm --tc-fold-max-tokens 0
bq s-inv-default --arch smollm2-135m --invariant-gemm
for f in $o/bench-*.txt; do echo "== $(basename $f)"; grep "^| [0-9]" $f | awk -F'|' '{printf "%s:%s ", $2, $3}'; echo; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $o/gpu.txt; cat .gpu-carry/REVISION > $o/revision.txt
cp .gpu-carry/dev.sh $o/commands.sh
cd $o && tar czf $OUT/r.tgz . && cd - >/dev/null
