set -u; b=$PWD/.gpu-carry; o=/tmp/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
cat .gpu-carry/REVISION > $o/revision.txt; cp .gpu-carry/dev.sh $o/commands.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $o/gpu.txt
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
L=$b/bgs-llm-gpu; w=/tmp/w; mkdir -p $w
for a in tiny-qwen2 qwen2.5-0.5b smollm2-135m; do $b/bgs model synth --arch $a --seed 7 --dtype bf16 --out $w/$a > $o/synth-$a.txt 2>&1 || echo "synth $a failed"; done
bn() { n=$1; d=$2; shift 2; timeout 100 env BGS_LLM_KERNEL_DEFINES="$d" $L bench --dtype bf16 "$@" --json $o/bench-$n.json > $o/bench-$n.txt 2>&1; echo "$n rc=$? $(grep '^| [0-9]' $o/bench-$n.txt | awk -F'|' '{printf "%s:%s ", $2, $3}')"; (cd /tmp && tar czf $OUT/r.tgz o); }
ck() { n=$1; shift; timeout 150 $L check "$@" --json $o/check-$n.json > $o/check-$n.txt 2>&1; echo "check $n rc=$? pass=$(grep -c '^\[PASS\]' $o/check-$n.txt) fail=$(grep -c '^\[FAIL\]' $o/check-$n.txt)"; grep -h "FAIL" $o/check-$n.txt | cut -c1-200 | head -5; (cd /tmp && tar czf $OUT/r.tgz o); }
N0=BGS_TC_PREFETCH_NEXT=0
ck s-inv --model $w/smollm2-135m --dtype bf16 --steps 16 --invariant-gemm
ck q-inv --model $w/qwen2.5-0.5b --dtype bf16 --steps 8 --invariant-gemm
for r in 1 2; do
  bn s-inv-default-$r "" --arch smollm2-135m --invariant-gemm --batches 1,16 --iters 100
  bn s-inv-nopf-$r $N0 --arch smollm2-135m --invariant-gemm --batches 1,16 --iters 100
  bn q-inv-default-$r "" --arch qwen2.5-0.5b --invariant-gemm --batches 1,16 --iters 100
  bn q-inv-nopf-$r $N0 --arch qwen2.5-0.5b --invariant-gemm --batches 1,16 --iters 100
done
ck tq-bf16-inv --model $w/tiny-qwen2 --dtype bf16 --invariant-gemm
bn s-default "" --arch smollm2-135m --batches 1,16,64,256 --iters 100
cd /tmp && tar czf $OUT/r.tgz o
