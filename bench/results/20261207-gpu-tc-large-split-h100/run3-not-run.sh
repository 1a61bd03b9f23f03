# Split large tiles, final check after the bgs_u4 store change: checks (bitwise against wide
# tiles, both shapes), then the Qwen2.5-0.5B shape's invariant step at 128..512 tokens for
# --tc-large-split 0 / 8 / 4 (which G the 384- and 512-token buckets want).
cd .gpu-carry && gunzip -f *.gz && chmod +x bgs* && cd ..
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=.gpu-carry; W=/tmp/bgs-min; mkdir -p $W $OUT/m
for a in qwen2.5-0.5b smollm2-135m; do $B/bgs model synth --arch $a --seed 7 --dtype bf16 --out $W/$a >/dev/null 2>&1; done
for a in qwen2.5-0.5b smollm2-135m; do
  timeout 90 $B/bgs-llm-gpu check --model $W/$a --dtype bf16 --steps 8 --invariant-gemm --tc-large-min-tokens 64 \
    --json $OUT/m/check-$a.json > $OUT/m/check-$a.txt 2>&1
  echo "check $a rc=$? $(grep -c '^\[PASS' $OUT/m/check-$a.txt) pass, $(grep -c '^\[FAIL' $OUT/m/check-$a.txt) fail; $(grep 'split in' $OUT/m/check-$a.txt | grep -c PASS) split lines pass"
done
for sp in 0 8 4; do
  timeout 60 $B/bgs-llm-gpu bench --arch qwen2.5-0.5b --dtype bf16 --invariant-gemm --context 128 --tc-large-split $sp \
    --batches 128,256,384,512 --iters 30 --json $OUT/m/bench-split$sp.json > $OUT/m/bench-split$sp.txt 2>&1
  echo "bench split $sp rc=$? $(grep -E '^\| [0-9]+ ' $OUT/m/bench-split$sp.txt | awk -F'|' '{printf "%s:%s ", $2, $3}')"
done
cd $OUT && tar czf m.tgz m && rm -rf m
