set -u; b=$PWD/.gpu-carry; w=/tmp/w; o=/tmp/o; mkdir -p $w $o; export XDG_CACHE_HOME=/tmp/c
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
$b/bgs model synth --arch tiny-qwen2 --seed 7 --dtype bf16 --out $w/tq >/dev/null
$b/bgs model synth --arch qwen2.5-0.5b --seed 7 --dtype bf16 --out $w/q >/dev/null
$b/bgs model synth --arch smollm2-135m --seed 7 --dtype bf16 --out $w/s >/dev/null
s() { n=$1; shift; local t0=$(date +%s); timeout 200 "$@" > $o/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s)-t0 ))s | $(tail -1 $o/$n.txt | cut -c1-150)"; }
L=$b/bgs-llm-gpu
s check-tq-inv-small32 $L check --model $w/tq --dtype bf16 --invariant-gemm --tc-small-max-tokens 32 --tc-fold-max-tokens 32 --json $o/check-tq-inv-small32.json
s check-q-inv-small32 $L check --model $w/q --dtype bf16 --steps 8 --invariant-gemm --tc-small-max-tokens 32 --json $o/check-q-inv-small32.json
grep -h "small tiles vs\|epilogues folded\|FAIL\|invariance" $o/check-*.txt | cut -c1-140 | sort | uniq -c
B=1,4,8,16,32,64
bq() { n=$1; shift; s bench-$n $L bench --dtype bf16 --batches $B --json $o/bench-$n.json "$@"; }
bq q-inv --arch qwen2.5-0.5b --invariant-gemm
bq q-inv-small16 --arch qwen2.5-0.5b --invariant-gemm --tc-small-max-tokens 16
bq q-inv-small32 --arch qwen2.5-0.5b --invariant-gemm --tc-small-max-tokens 32
bq q-inv-small32-fold16 --arch qwen2.5-0.5b --invariant-gemm --tc-small-max-tokens 32 --tc-fold-max-tokens 16
bq q-inv-again --arch qwen2.5-0.5b --invariant-gemm
bq s-inv --arch smollm2-135m --invariant-gemm
bq s-inv-small32 --arch smollm2-135m --invariant-gemm --tc-small-max-tokens 32
for f in $o/bench-*.txt; do echo "== $(basename $f)"; grep "^| [0-9]" $f | awk -F'|' '{printf "%s:%s ", $2, $3}'; echo; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $o/gpu.txt; cat .gpu-carry/REVISION > $o/revision.txt
cp .gpu-carry/dev.sh $o/commands.sh
cd $o && tar czf $OUT/r.tgz . && cd - >/dev/null
