set -u; b=$PWD/.gpu-carry; o=/tmp/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
cat .gpu-carry/REVISION > $o/revision.txt; cp .gpu-carry/dev.sh $o/commands.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $o/gpu.txt
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
L=$b/bgs-llm-gpu; w=/tmp/w; mkdir -p $w
for a in qwen2.5-0.5b smollm2-135m; do $b/bgs model synth --arch $a --seed 7 --dtype bf16 --out $w/$a > $o/synth-$a.txt 2>&1 || echo "synth $a failed"; done
bn() { n=$1; shift; timeout 100 $L bench --dtype bf16 "$@" --json $o/bench-$n.json > $o/bench-$n.txt 2>&1; echo "$n rc=$? $(grep '^| [0-9]' $o/bench-$n.txt | awk -F'|' '{printf "%s:%s ", $2, $3}') $(grep -o 'count to [0-9]* of [0-9]*' $o/bench-$n.txt | head -2 | tr '\n' ' ')"; (cd /tmp && tar czf $OUT/r.tgz o); }
ck() { n=$1; shift; timeout 150 $L check "$@" --json $o/check-$n.json > $o/check-$n.txt 2>&1; echo "check $n rc=$? pass=$(grep -c '^\[PASS\]' $o/check-$n.txt) fail=$(grep -c '^\[FAIL\]' $o/check-$n.txt)"; grep -h "FAIL" $o/check-$n.txt | cut -c1-200 | head -5; (cd /tmp && tar czf $OUT/r.tgz o); }
Q="--arch qwen2.5-0.5b --invariant-gemm --batches 1,16 --iters 100"
S="--arch smollm2-135m --invariant-gemm --batches 1,16 --iters 100"
ck q-side --model $w/qwen2.5-0.5b --dtype bf16 --steps 8 --invariant-gemm --l2-side-blocks 32
for r in 1 2; do
  bn q-off-$r $Q
  bn q-s32-$r $Q --l2-side-blocks 32
  bn q-s16-$r $Q --l2-side-blocks 16
  bn q-s32b12-$r $Q --l2-side-blocks 32 --l2-side-budget-mib 12
  bn q-s64b36-$r $Q --l2-side-blocks 64 --l2-side-budget-mib 36
  bn s-off-$r $S
  bn s-s32-$r $S --l2-side-blocks 32
done
bn qc-off --arch qwen2.5-0.5b --batches 1,16,64 --iters 100
bn qc-s32 --arch qwen2.5-0.5b --batches 1,16,64 --iters 100 --l2-side-blocks 32
ck s-side --model $w/smollm2-135m --dtype bf16 --steps 16 --invariant-gemm --l2-side-blocks 32
cd /tmp && tar czf $OUT/r.tgz o
