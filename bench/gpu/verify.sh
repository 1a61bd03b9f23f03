#!/usr/bin/env bash
# Correctness on the GPU machine after a change to the GPU executor or anything it reads (op
# table, ring layout): in-process checks of both dispatchers (bgs-gpu-bench check: every op,
# cancel markers interleaved and never answered, stream = 0 on every completion), then strict
# TCP checks of every op and repeat count through native + GPU, kernel loop + GPU and GPU-written
# SENDs (bench/kernel_gpu.sh's correctness step), then CPU generation over TCP (tiny model).
# Runs ON the GPU machine from the repo root.
# Usage: bash bench/gpu/verify.sh BIN_DIR OUT_DIR   (BIN_DIR: bgs and bgs-gpu-bench)
set -uo pipefail
bin=$(cd "$1" && pwd); out=$2; work=/tmp/bgs-verify
rm -rf "$work"; mkdir -p "$out" "$work"
export XDG_CACHE_HOME=/tmp/bgs-cache
(cd "$bin" && cat REVISION 2>/dev/null) > "$out/revision.txt"
for d in device host; do
  timeout 180 "$bin/bgs-gpu-bench" check --dispatcher "$d" > "$work/check-$d.txt" 2>&1
  echo "bgs-gpu-bench check --dispatcher $d rc=$? $(tail -1 "$work/check-$d.txt")" | tee -a "$out/steps.log"
done
CHECK="native-gpu kloop-gpu ksqe-gpu" PERF="" ROUNDS=1 \
  timeout 420 bash bench/kernel_gpu.sh "$bin" "$work/k" > "$work/k.log" 2>&1
echo "kernel_gpu.sh correctness rc=$?" | tee -a "$out/steps.log"
cat "$work/k/steps.log" >> "$out/steps.log" 2>/dev/null
"$bin/bgs" model synth --arch tiny-llama --out "$work/tiny" > /dev/null
"$bin/bgs" serve --listen 127.0.0.1:7990 --model "$work/tiny" --api-listen off --cpus 0-3 \
  > "$work/gen.server.log" 2>&1 &
spid=$!
for _ in $(seq 100); do grep -q listening "$work/gen.server.log" && break; sleep 0.1; done
for http in "" "--http"; do
  timeout 60 "$bin/bgs" load --target 127.0.0.1:7990 --op generate --prompt-tokens 16 \
    --max-tokens 64 --ignore-eos --rate 200 --duration 5 --connections 16 --strict $http \
    --cpus 4-15 > "$work/gen$http.txt" 2>&1
  echo "generate tiny $http rc=$? $(grep -E 'requests|tokens ' "$work/gen$http.txt" | tr '\n' ' ')" | tee -a "$out/steps.log"
done
kill -TERM $spid; wait $spid
# The completion notifier (--gpu-completion-wake interrupt): strict gemm8 through native + GPU
# and kernel loop + GPU, at a low and a high rate; the server's shutdown lines carry the
# notifier's and the transport's wake-up counters.
mount | grep -q cgroup2 || { mkdir -p /tmp/cg2 && mount -t cgroup2 none /tmp/cg2; }
p=7980
for t in "--transport native" "--transport kernel --reply loop"; do
  p=$((p + 1)); name=int-$(echo $t | awk '{print $2}')
  rm -f "$work/$name.server.log"
  "$bin/bgs" serve --listen 127.0.0.1:$p $t --executor gpu --gpu-completion-wake interrupt \
    --cpus 0-3 > "$work/$name.server.log" 2>&1 &
  spid=$!
  for _ in $(seq 100); do grep -q listening "$work/$name.server.log" && break; sleep 0.1; done
  for rate in 1000 20000; do
    timeout 60 "$bin/bgs" load --target 127.0.0.1:$p --op gemm8 --rate $rate --duration 5 \
      --connections 128 --strict --cpus 4-15 --server-pid $spid > "$work/$name-$rate.txt" 2>&1
    echo "$name rate $rate rc=$? $(grep -E 'requests|  complete|server ' "$work/$name-$rate.txt" | tr -s ' ' | tr '\n' ' ')" | tee -a "$out/steps.log"
  done
  kill -TERM $spid; wait $spid
  echo "$name server: $(grep -iE 'notifier|wake' "$work/$name.server.log" | tr -s ' ' | tr '\n' ' ')" | tee -a "$out/steps.log"
done
tar czf "$out/logs.tgz" -C "$work" . 2>/dev/null
echo "verify: done"
