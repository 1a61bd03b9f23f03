# Split large tiles (min chunks a block 16; variant mc4: 4): checks, the invariant step per
# config, then served saturation (--batch-invariant, 256 slots) with split 0 and 8.
cd .gpu-carry && gunzip -f *.gz && chmod +x bgs* && cd ..
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 env PARTS=large LARGE_CONFIGS="64:0 64:8 64:4 64:2" VARIANT_SPLIT=8 bash bench/gpu/generate.sh .gpu-carry $OUT/g
echo "generate rc=$?"
grep -H -E '^\| (32|64|128|256) ' /tmp/bgs-gen/bench-*.txt | grep -v perop | sed 's|/tmp/bgs-gen/||' | sort
grep -H -E 'gemm_tc' /tmp/bgs-gen/bench-*perop.txt | sed 's|/tmp/bgs-gen/||'
grep -h -E '^\[FAIL' /tmp/bgs-gen/check-*.txt | head; grep -c PASS /tmp/bgs-gen/check-*.txt
cd /tmp/bgs-gen && tar czf $OUT/work.tgz --exclude='*.safetensors' --exclude='*.gguf' *.txt *.json 2>/dev/null; cd - >/dev/null
for sp in 0 8; do
  SECS=12 SLOTS= LOOPS=device COALESCE= SAT_SLOTS=256 SERVE_FLAGS="--batch-invariant --gpu-tc-large-split $sp" \
    timeout 140 bash bench/gpu/step-loop.sh .gpu-carry $OUT/sat-split$sp > $OUT/sat-split$sp.log 2>&1
  echo "sat split $sp rc=$?"; grep -E "sat-|GPU step loop" $OUT/sat-split$sp/steps.log | cut -c1-400
done
ls -la $OUT
