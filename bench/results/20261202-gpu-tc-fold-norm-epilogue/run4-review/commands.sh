set -u; b=$PWD/.gpu-carry; w=/tmp/w; o=/tmp/o; mkdir -p $w $o; export XDG_CACHE_HOME=/tmp/c
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
$b/bgs model synth --arch tiny-qwen2 --seed 7 --dtype bf16 --out $w/tq >/dev/null
$b/bgs model synth --arch qwen2.5-0.5b --seed 7 --dtype bf16 --out $w/q >/dev/null
s() { n=$1; shift; local t0=$(date +%s); timeout 200 "$@" > $o/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s)-t0 ))s | $(tail -1 $o/$n.txt | cut -c1-150)"; }
L=$b/bgs-llm-gpu
s check-tq-inv-fold $L check --model $w/tq --dtype bf16 --invariant-gemm --tc-fold-max-tokens 512 --json $o/check-tq-inv-fold.json
s check-q-inv $L check --model $w/q --dtype bf16 --steps 8 --invariant-gemm --json $o/check-q-inv.json
s check-tq-inv-persistent $L check --model $w/tq --dtype bf16 --invariant-gemm --persistent-max-tokens 64 --json $o/check-tq-inv-persistent.json
grep -h "small tiles vs\|epilogues folded\|persistent form vs\|FAIL\|invariance" $o/check-*.txt | cut -c1-120 | sort | uniq -c
s bench-q-inv $L bench --dtype bf16 --arch qwen2.5-0.5b --invariant-gemm --batches 1,4,16,64,256 --json $o/bench-q-inv.json
for f in $o/bench-*.txt; do echo "== $(basename $f)"; grep "^| [0-9]" $f | awk -F'|' '{printf "%s:%s ", $2, $3}'; echo; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $o/gpu.txt; cat .gpu-carry/REVISION > $o/revision.txt
cp .gpu-carry/dev.sh $o/commands.sh
cd $o && tar czf $OUT/r.tgz . && cd - >/dev/null
