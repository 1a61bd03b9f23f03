set -u; b=$PWD/.gpu-carry; w=/tmp/w; o=/tmp/o; mkdir -p $w $o; export XDG_CACHE_HOME=/tmp/c
export BGS_QWEN_TOKENIZER=$b/qwen-tokenizer.json
$b/bgs model synth --arch tiny-qwen2 --seed 7 --dtype bf16 --out $w/tq >/dev/null
$b/bgs model synth --arch qwen2.5-0.5b --seed 7 --dtype bf16 --out $w/q >/dev/null
$b/bgs model synth --arch smollm2-135m --seed 7 --dtype bf16 --out $w/s >/dev/null
s() { n=$1; shift; timeout 200 "$@" > $o/$n.txt 2>&1; echo "$n rc=$? | $(tail -1 $o/$n.txt)"; }
s check-tq-inv $b/bgs-llm-gpu check --model $w/tq --dtype bf16 --invariant-gemm --json $o/check-tq-inv.json
s check-q-inv $b/bgs-llm-gpu check --model $w/q --dtype bf16 --steps 8 --invariant-gemm --json $o/check-q-inv.json
s check-s-inv $b/bgs-llm-gpu check --model $w/s --dtype bf16 --steps 16 --invariant-gemm --json $o/check-s-inv.json
s check-q-tc4 $b/bgs-llm-gpu check --model $w/q --dtype bf16 --steps 8 --tc-gemm-max-tokens 4 --json $o/check-q-tc4.json
s check-tq-inv-persistent $b/bgs-llm-gpu check --model $w/tq --dtype bf16 --invariant-gemm --persistent-max-tokens 64 --json $o/check-tq-inv-persistent.json
grep -h "epilogues folded\|persistent form vs\|FAIL" $o/check-*.txt | cut -c1-120 | sort | uniq -c
B=1,2,4,8,16,32,64,128,256,512
for m in qwen2.5-0.5b smollm2-135m; do
  s bench-$m-inv $b/bgs-llm-gpu bench --arch $m --dtype bf16 --invariant-gemm --batches $B --json $o/bench-$m-inv.json
  s bench-$m-inv-apart $b/bgs-llm-gpu bench --arch $m --dtype bf16 --invariant-gemm --no-tc-epilogues --batches $B --json $o/bench-$m-inv-apart.json
  s bench-$m-inv-again $b/bgs-llm-gpu bench --arch $m --dtype bf16 --invariant-gemm --batches $B --json $o/bench-$m-inv-again.json
done
for f in $o/bench-*.txt; do echo "== $(basename $f)"; grep "^| [0-9]" $f | awk -F'|' '{printf "%s:%s ", $2, $3}'; echo; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $o/gpu.txt; cat .gpu-carry/REVISION > $o/revision.txt
cd $o && tar czf $OUT/r.tgz . && cd - >/dev/null
