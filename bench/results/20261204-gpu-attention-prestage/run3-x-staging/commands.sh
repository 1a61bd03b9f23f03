set -u; b=$PWD/.gpu-carry; o=/tmp/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
cat .gpu-carry/REVISION > $o/revision.txt; cp .gpu-carry/dev.sh $o/commands.sh
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
L=$b/bgs-llm-gpu; w=/tmp/w; mkdir -p $w
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $o/smi.txt 2>&1
for a in tiny-qwen2 qwen2.5-0.5b smollm2-135m; do $b/bgs model synth --arch $a --seed 7 --dtype bf16 --out $w/$a > $o/synth-$a.txt 2>&1 || echo "synth $a failed"; done
ck() { n=$1; d=$2; shift 2; timeout 200 env BGS_LLM_KERNEL_DEFINES="$d" $L check "$@" --json $o/check-$n.json > $o/check-$n.txt 2>&1; echo "check $n rc=$? pass=$(grep -c '^\[PASS\]' $o/check-$n.txt) fail=$(grep -c '^\[FAIL\]' $o/check-$n.txt)"; grep -h "FAIL" $o/check-$n.txt | cut -c1-200 | head -5; }
ck tq-f32 "" --model $w/tiny-qwen2 --dtype f32
ck tq-bf16-inv "" --model $w/tiny-qwen2 --dtype bf16 --invariant-gemm
ck q-inv "" --model $w/qwen2.5-0.5b --dtype bf16 --steps 8 --invariant-gemm
ck q-def "" --model $w/qwen2.5-0.5b --dtype bf16 --steps 8
ck q-inv-fold "" --model $w/qwen2.5-0.5b --dtype bf16 --steps 8 --invariant-gemm --tc-fold-max-tokens 512
ck s-inv "" --model $w/smollm2-135m --dtype bf16 --steps 16 --invariant-gemm
bn() { n=$1; d=$2; shift 2; timeout 150 env BGS_LLM_KERNEL_DEFINES="$d" $L bench --dtype bf16 "$@" --json $o/bench-$n.json > $o/bench-$n.txt 2>&1; echo "$n rc=$? $(grep '^| [0-9]' $o/bench-$n.txt | awk -F'|' '{printf "%s:%s ", $2, $3}')"; }
X0=BGS_TC_STAGE_X=0
for r in 1 2; do
  bn q-inv-x-$r "" --arch qwen2.5-0.5b --invariant-gemm --batches 1,2,4,8,16,64,256
  bn q-inv-nox-$r $X0 --arch qwen2.5-0.5b --invariant-gemm --batches 1,2,4,8,16,64,256
done
bn q-def-x "" --arch qwen2.5-0.5b --batches 1,16,256
bn q-def-nox $X0 --arch qwen2.5-0.5b --batches 1,16,256
bn s-inv-x "" --arch smollm2-135m --invariant-gemm --batches 1,16,64,256
bn q-inv-x-skip8 "BGS_TIME_SKIP=8" --arch qwen2.5-0.5b --invariant-gemm --batches 1,16
bn q-inv-nox-skip8 "$X0 BGS_TIME_SKIP=8" --arch qwen2.5-0.5b --invariant-gemm --batches 1,16
bn q-inv-x-skip1 "BGS_TIME_SKIP=1" --arch qwen2.5-0.5b --invariant-gemm --batches 1,16
cd /tmp && tar czf $OUT/r.tgz o
