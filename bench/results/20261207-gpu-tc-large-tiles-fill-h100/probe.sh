# Large-tile probe 2 (copies from per-thread row pointers; large only where the grid fills the
# device): SmolLM2 check per geometry, then the invariant step per geometry against the large
# tiles off, Qwen2.5-0.5B and SmolLM2-135M (off and 64x64 twice, interleaved).
cd .gpu-carry && gunzip -f *.gz && chmod +x bgs* && cd ..
B=.gpu-carry; O=$OUT/p; mkdir -p $O; W=/tmp/w; mkdir -p $W
nvidia-smi --query-gpu=name --format=csv,noheader > $O/gpu.txt
$B/bgs model synth --arch smollm2-135m --seed 7 --dtype bf16 --out $W/smollm2 > /dev/null 2>&1
for v in "" -64x128 -128x64; do
  timeout 120 $B/bgs-llm-gpu$v check --model $W/smollm2 --dtype bf16 --steps 16 --invariant-gemm --tc-large-min-tokens 64 --json $O/check$v.json > $O/check$v.txt 2>&1; echo "check$v $? $(tail -1 $O/check$v.txt)"
done
for r in 1 2; do for m in qwen2.5-0.5b smollm2-135m; do
  vs='off ""'; [ $r = 1 ] && vs='off "" -64x128 -128x64'
  for v in $(eval echo $vs); do :; done
  for v in off "" -64x128 -128x64; do
    [ $r = 2 ] && [ "$v" != off ] && [ -n "$v" ] && continue
    if [ "$v" = off ]; then b=$B/bgs-llm-gpu; lg=0; else b=$B/bgs-llm-gpu$v; lg=64; fi
    timeout 120 $b bench --arch $m --dtype bf16 --invariant-gemm --context 128 --tc-large-min-tokens $lg --batches 32,64,128,256 --iters 30 --per-op --json $O/bench-$m$v-$lg-$r.json > $O/bench-$m$v-$lg-$r.txt 2>&1
    echo "bench-$m$v-$lg-$r $? $(grep -E '^\| (32|64|128|256) ' $O/bench-$m$v-$lg-$r.txt | awk -F'|' '{printf "%s:%s ", $2, $3}')"
  done
done; done
cd $OUT && tar czf p.tgz p && rm -rf p
