set -u; b=$PWD/.gpu-carry; o=/tmp/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
cat .gpu-carry/REVISION > $o/revision.txt; cp .gpu-carry/dev.sh $o/commands.sh
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
L=$b/bgs-llm-gpu; w=/tmp/w; mkdir -p $w
for a in tiny-qwen2 qwen2.5-0.5b smollm2-135m; do $b/bgs model synth --arch $a --seed 7 --dtype bf16 --out $w/$a > $o/synth-$a.txt 2>&1 || echo "synth $a failed"; done
bn() { n=$1; d=$2; shift 2; timeout 100 env BGS_LLM_KERNEL_DEFINES="$d" $L bench --dtype bf16 "$@" --json $o/bench-$n.json > $o/bench-$n.txt 2>&1; echo "$n rc=$? $(grep '^| [0-9]' $o/bench-$n.txt | awk -F'|' '{printf "%s:%s ", $2, $3}')"; }
N0=BGS_TC_PREFETCH_NEXT=0
N0=BGS_TC_PREFETCH_NEXT=0
bn q-inv-pf-1 "" --arch qwen2.5-0.5b --invariant-gemm --batches 1,2,4,16
(cd /tmp && tar czf $OUT/r.tgz o)
bn q-inv-nopf-1 $N0 --arch qwen2.5-0.5b --invariant-gemm --batches 1,2,4,16
(cd /tmp && tar czf $OUT/r.tgz o)
ck() { n=$1; shift; timeout 150 $L check "$@" --json $o/check-$n.json > $o/check-$n.txt 2>&1; echo "check $n rc=$? pass=$(grep -c '^\[PASS\]' $o/check-$n.txt) fail=$(grep -c '^\[FAIL\]' $o/check-$n.txt)"; grep -h "FAIL" $o/check-$n.txt | cut -c1-200 | head -5; }
ck q-inv --model $w/qwen2.5-0.5b --dtype bf16 --steps 8 --invariant-gemm
(cd /tmp && tar czf $OUT/r.tgz o)
bn s-inv-pf "" --arch smollm2-135m --invariant-gemm --batches 1,16
(cd /tmp && tar czf $OUT/r.tgz o)
bn s-inv-nopf $N0 --arch smollm2-135m --invariant-gemm --batches 1,16
(cd /tmp && tar czf $OUT/r.tgz o)
bn q-inv-pf-2 "" --arch qwen2.5-0.5b --invariant-gemm --batches 1,2,4,16
(cd /tmp && tar czf $OUT/r.tgz o)
bn q-inv-nopf-2 $N0 --arch qwen2.5-0.5b --invariant-gemm --batches 1,2,4,16
(cd /tmp && tar czf $OUT/r.tgz o)
ck tq-bf16-inv --model $w/tiny-qwen2 --dtype bf16 --invariant-gemm
(cd /tmp && tar czf $OUT/r.tgz o)
ck s-inv --model $w/smollm2-135m --dtype bf16 --steps 16 --invariant-gemm
(cd /tmp && tar czf $OUT/r.tgz o)
cd /tmp && tar czf $OUT/r.tgz o
