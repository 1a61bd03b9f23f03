# The large tiles on the H200: the invariant step off and on, both shapes, interleaved.
cd .gpu-carry && gunzip -f *.gz && chmod +x bgs* && cd ..
B=.gpu-carry; O=$OUT/h; mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader > $O/gpu.txt; cat $O/gpu.txt
for r in 1 2; do for m in qwen2.5-0.5b smollm2-135m; do for lg in 0 64; do
  timeout 90 $B/bgs-llm-gpu bench --arch $m --dtype bf16 --invariant-gemm --context 128 --tc-large-min-tokens $lg --batches 64,128,256 --iters 30 --json $O/bench-$m-$lg-$r.json > $O/bench-$m-$lg-$r.txt 2>&1
  echo "bench-$m-$lg-$r $? $(grep -E '^\| (64|128|256) ' $O/bench-$m-$lg-$r.txt | awk -F'|' '{printf "%s:%s ", $2, $3}')"
done; done; [ $r = 1 ] && [ $SECONDS -gt 150 ] && break; done
cd $OUT && tar czf h.tgz h && rm -rf h
