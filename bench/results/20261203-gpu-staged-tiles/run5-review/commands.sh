set -u; b=$PWD/.gpu-carry; o=/tmp/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
L=$b/bgs-llm-gpu; w=/tmp/w; mkdir -p $w
for a in tiny-qwen2 qwen2.5-0.5b; do $b/bgs model synth --arch $a --seed 7 --dtype bf16 --out $w/$a > $o/synth-$a.txt 2>&1 || echo "synth $a failed"; done
ck() { n=$1; shift; timeout 200 $L check "$@" --json $o/check-$n.json > $o/check-$n.txt 2>&1; echo "check $n rc=$? pass=$(grep -c '^\[PASS\]' $o/check-$n.txt) fail=$(grep -c '^\[FAIL\]' $o/check-$n.txt)"; grep -h "INFO" $o/check-$n.txt | cut -c1-170; }
ck tiny-f32 --model $w/tiny-qwen2 --dtype f32
ck q-inv --model $w/qwen2.5-0.5b --dtype bf16 --steps 8 --invariant-gemm
timeout 60 $L bench --dtype bf16 --batches 1,16 --arch qwen2.5-0.5b --invariant-gemm --json $o/bench-q-inv.json > $o/bench-q-inv.txt 2>&1; grep "^| [0-9]" $o/bench-q-inv.txt
cat .gpu-carry/REVISION > $o/revision.txt; cp .gpu-carry/dev.sh $o/commands.sh
cd /tmp && tar czf $OUT/r.tgz o
