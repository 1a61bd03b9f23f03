set -u; b=$PWD/.gpu-carry; w=/tmp/w; o=/tmp/o; mkdir -p $w $o; export XDG_CACHE_HOME=/tmp/c
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
$b/bgs model synth --arch tiny-qwen2 --seed 7 --dtype bf16 --out $w/tq >/dev/null
$b/bgs model synth --arch qwen2.5-0.5b --seed 7 --dtype bf16 --out $w/q >/dev/null
$b/bgs model synth --arch smollm2-135m --seed 7 --dtype bf16 --out $w/s >/dev/null
s() { n=$1; shift; local t0=$(date +%s); timeout 200 "$@" > $o/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s)-t0 ))s | $(tail -1 $o/$n.txt | cut -c1-150)"; }
L=$b/bgs-llm-gpu
# correctness first: the folded form against the launches apart (check (g)), every shape
s check-tq-inv-fold $L check --model $w/tq --dtype bf16 --invariant-gemm --tc-fold-max-tokens 512 --json $o/check-tq-inv-fold.json
s check-q-inv-fold $L check --model $w/q --dtype bf16 --steps 8 --invariant-gemm --tc-fold-max-tokens 512 --json $o/check-q-inv-fold.json
s check-s-inv-fold $L check --model $w/s --dtype bf16 --steps 16 --invariant-gemm --tc-fold-max-tokens 512 --json $o/check-s-inv-fold.json
s check-q-inv-fold8 $L check --model $w/q --dtype bf16 --steps 8 --invariant-gemm --tc-fold-max-tokens 8 --json $o/check-q-inv-fold8.json
s check-tq-inv-persistent $L check --model $w/tq --dtype bf16 --invariant-gemm --persistent-max-tokens 64 --json $o/check-tq-inv-persistent.json
grep -h "small tiles vs\|epilogues folded\|persistent form vs\|FAIL\|invariance" $o/check-*.txt | cut -c1-140 | sort | uniq -c
# timings
B=1,2,4,8,16,64,256
bq() { n=$1; shift; s bench-$n $L bench --dtype bf16 --batches $B --json $o/bench-$n.json "$@"; }
bq q-inv --arch qwen2.5-0.5b --invariant-gemm
bq q-inv-fold8 --arch qwen2.5-0.5b --invariant-gemm --tc-fold-max-tokens 8
bq q-inv-fold512 --arch qwen2.5-0.5b --invariant-gemm --tc-fold-max-tokens 512
BGS_LLM_KERNEL_DEFINES=BGS_TC_SMALL_UNROLL=8 bq q-inv-u8 --arch qwen2.5-0.5b --invariant-gemm
bq q-inv-fold8-again --arch qwen2.5-0.5b --invariant-gemm --tc-fold-max-tokens 8
bq q-inv-again --arch qwen2.5-0.5b --invariant-gemm
bq s-inv --arch smollm2-135m --invariant-gemm
bq s-inv-fold8 --arch smollm2-135m --invariant-gemm --tc-fold-max-tokens 8
s perop-q-inv-fold8 $L bench --dtype bf16 --arch qwen2.5-0.5b --invariant-gemm --tc-fold-max-tokens 8 --batches 1 --per-op --json $o/perop-q-inv-fold8.json
for f in $o/bench-*.txt; do echo "== $(basename $f)"; grep "^| [0-9]" $f | awk -F'|' '{printf "%s:%s ", $2, $3}'; echo; done
grep -h -A14 "per operation at batch 1 " $o/perop-*.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $o/gpu.txt; cat .gpu-carry/REVISION > $o/revision.txt
cp .gpu-carry/dev.sh $o/commands.sh
cd $o && tar czf $OUT/r.tgz . && cd - >/dev/null
