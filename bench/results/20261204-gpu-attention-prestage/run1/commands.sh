set -u; b=$PWD/.gpu-carry; o=$OUT/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
cat .gpu-carry/REVISION > $OUT/revision.txt; cp .gpu-carry/dev.sh $OUT/commands.sh
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
L=$b/bgs-llm-gpu; w=/tmp/w; mkdir -p $w
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $o/smi.txt 2>&1
for a in tiny-qwen2 tiny-llama qwen2.5-0.5b smollm2-135m; do $b/bgs model synth --arch $a --seed 7 --dtype bf16 --out $w/$a > $o/synth-$a.txt 2>&1 || echo "synth $a failed"; done
F=BGS_ATTN_FRESH_SCAN=256
ck() { n=$1; d=$2; shift 2; timeout 200 env BGS_LLM_KERNEL_DEFINES="$d" $L check "$@" --json $o/check-$n.json > $o/check-$n.txt 2>&1; echo "check $n rc=$? pass=$(grep -c '^\[PASS\]' $o/check-$n.txt) fail=$(grep -c '^\[FAIL\]' $o/check-$n.txt)"; grep -h "FAIL" $o/check-$n.txt | cut -c1-200 | head -5; }
ck fresh-tq-bf16-inv $F --model $w/tiny-qwen2 --dtype bf16 --invariant-gemm
ck fresh-tl-f16 $F --model $w/tiny-llama --dtype f16
ck fresh-q-inv $F --model $w/qwen2.5-0.5b --dtype bf16 --steps 8 --invariant-gemm
ck fresh-q-def $F --model $w/qwen2.5-0.5b --dtype bf16 --steps 8
ck fresh-s-inv $F --model $w/smollm2-135m --dtype bf16 --steps 16 --invariant-gemm
ck fresh-q-inv-fold $F --model $w/qwen2.5-0.5b --dtype bf16 --steps 8 --invariant-gemm --tc-fold-max-tokens 512
bn() { n=$1; d=$2; shift 2; timeout 150 env BGS_LLM_KERNEL_DEFINES="$d" $L bench --dtype bf16 "$@" --json $o/bench-$n.json > $o/bench-$n.txt 2>&1; echo "$n rc=$? $(grep '^| [0-9]' $o/bench-$n.txt | awk -F'|' '{printf "%s:%s ", $2, $3}')"; }
for r in 1 2; do
  bn q-inv-base-$r "" --arch qwen2.5-0.5b --invariant-gemm --batches 1,2,4,16,64,256
  bn q-inv-fresh-$r $F --arch qwen2.5-0.5b --invariant-gemm --batches 1,2,4,16,64,256
  bn s-inv-base-$r "" --arch smollm2-135m --invariant-gemm --batches 1,16,64
  bn s-inv-fresh-$r $F --arch smollm2-135m --invariant-gemm --batches 1,16,64
done
bn q-def-base "" --arch qwen2.5-0.5b --batches 1,16,256
bn q-def-fresh $F --arch qwen2.5-0.5b --batches 1,16,256
bn q-inv-fresh-perop $F --arch qwen2.5-0.5b --invariant-gemm --batches 1 --per-op
bn q-inv-base-perop "" --arch qwen2.5-0.5b --invariant-gemm --batches 1 --per-op
for k in 1 2 4 8 16 32 64 127; do
  bn q-inv-skip$k "BGS_TIME_SKIP=$k" --arch qwen2.5-0.5b --invariant-gemm --batches 1,16
done
for k in 1 127; do
  bn q-inv-fresh-skip$k "$F BGS_TIME_SKIP=$k" --arch qwen2.5-0.5b --invariant-gemm --batches 1,16
done


