set -u; b=$PWD/.gpu-carry; o=/tmp/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
L=$b/bgs-llm-gpu; w=/tmp/w; mkdir -p $w
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $o/smi.txt 2>&1
for a in qwen2.5-0.5b; do $b/bgs model synth --arch $a --seed 7 --dtype bf16 --out $w/$a > $o/synth-$a.txt 2>&1 || echo "synth $a failed"; done
ck() { n=$1; shift; timeout 240 $L check "$@" --json $o/check-$n.json > $o/check-$n.txt 2>&1; echo "check $n rc=$?"; grep -iE "staged|FAIL|invarian|argmax equal for [0-9]+/[0-9]+ \(|oracle" $o/check-$n.txt | cut -c1-160 | head -14; }
ck q-inv --model $w/qwen2.5-0.5b --dtype bf16 --steps 8 --invariant-gemm
ck q-def --model $w/qwen2.5-0.5b --dtype bf16 --steps 8
bn() { n=$1; a=$2; shift 2; timeout 120 $L bench --dtype bf16 --batches 1,2,4,8,16,64 --arch $a --invariant-gemm "$@" --json $o/bench-$n.json > $o/bench-$n.txt 2>&1; echo "$n rc=$?"; }
Q=qwen2.5-0.5b; S=smollm2-135m
bn q-default-1 $Q; bn q-nostage-1 $Q --no-tc-stage; bn q-waves-only $Q --tc-stage-min-rounds 0; bn q-rounds-only $Q --no-tc-stage-waves
bn q-default-2 $Q; bn q-nostage-2 $Q --no-tc-stage
bn s-default $S; bn s-rounds2 $S --tc-stage-min-rounds 2; bn s-nostage $S --no-tc-stage
for f in $o/bench-*.txt; do echo "== $(basename $f)"; grep "^| [0-9]" $f | awk -F'|' '{printf "%s:%s ", $2, $3}'; echo; done
cat .gpu-carry/REVISION > $o/revision.txt; cp .gpu-carry/dev.sh $o/commands.sh
cd /tmp && tar czf $OUT/r.tgz o
