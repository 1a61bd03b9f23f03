set -u; b=$PWD/.gpu-carry; w=/tmp/w; o=/tmp/o; mkdir -p $w $o; export XDG_CACHE_HOME=/tmp/c
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
$b/bgs model synth --arch tiny-qwen2 --seed 7 --dtype bf16 --out $w/tq >/dev/null
$b/bgs model synth --arch qwen2.5-0.5b --seed 7 --dtype bf16 --out $w/q >/dev/null
$b/bgs model synth --arch smollm2-135m --seed 7 --dtype bf16 --out $w/s >/dev/null
s() { n=$1; shift; local t0=$(date +%s); timeout 150 "$@" > $o/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s)-t0 ))s | $(tail -1 $o/$n.txt | cut -c1-150)"; }
L=$b/bgs-llm-gpu
# correctness first: split k-blocks (default 32 chunks) against the CPU oracle, small vs wide, fold on/off
s check-q-inv $L check --model $w/q --dtype bf16 --steps 8 --invariant-gemm --json $o/check-q-inv.json
s check-s-inv $L check --model $w/s --dtype bf16 --steps 16 --invariant-gemm --json $o/check-s-inv.json
s check-q-inv-fold8 $L check --model $w/q --dtype bf16 --steps 8 --invariant-gemm --tc-fold-max-tokens 8 --json $o/check-q-inv-fold8.json
s check-tq-inv $L check --model $w/tq --dtype bf16 --invariant-gemm --tc-split-chunks 1 --json $o/check-tq-inv-split1.json
grep -h "small tiles vs\|epilogues folded\|FAIL\|invariance\|tolerance" $o/check-*.txt | cut -c1-140 | sort | uniq -c
# timings
B=1,2,4,8,16,64,256
bq() { n=$1; shift; s bench-$n $L bench --dtype bf16 --batches $B --json $o/bench-$n.json "$@"; }
bq q-inv --arch qwen2.5-0.5b --invariant-gemm
bq q-inv-split0 --arch qwen2.5-0.5b --invariant-gemm --tc-split-chunks 0
bq q-inv-split64 --arch qwen2.5-0.5b --invariant-gemm --tc-split-chunks 64
bq q-inv-split16 --arch qwen2.5-0.5b --invariant-gemm --tc-split-chunks 16
bq s-inv --arch smollm2-135m --invariant-gemm
bq s-inv-split0 --arch smollm2-135m --invariant-gemm --tc-split-chunks 0
bq q-inv-again --arch qwen2.5-0.5b --invariant-gemm
s perop-q-inv $L bench --dtype bf16 --arch qwen2.5-0.5b --invariant-gemm --batches 1 --per-op --json $o/perop-q-inv.json
for f in $o/bench-*.txt; do echo "== $(basename $f)"; grep "^| [0-9]" $f | awk -F'|' '{printf "%s:%s ", $2, $3}'; echo; done
grep -h -A14 "per operation at batch 1 " $o/perop-*.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $o/gpu.txt; cat .gpu-carry/REVISION > $o/revision.txt
cp .gpu-carry/dev.sh $o/commands.sh
cd /tmp && tar czf $OUT/r.tgz o
