set -u; b=$PWD/.gpu-carry; o=/tmp/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
L=$b/bgs-llm-gpu
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $o/smi.txt 2>&1
for n in q-inv-base s-inv-base q-inv-w8 s-inv-w8; do
  a=qwen2.5-0.5b; [ ${n%%-*} = s ] && a=smollm2-135m
  x=; case $n in *w8) x="--attention-warps 8";; esac
  timeout 120 $L bench --dtype bf16 --batches 1,2,4,8,16,64,256 --arch $a --invariant-gemm $x --json $o/bench-$n.json > $o/bench-$n.txt 2>&1; echo "$n rc=$?"
done
for f in $o/bench-*.txt; do echo "== $(basename $f)"; grep "^| [0-9]" $f | awk -F'|' '{printf "%s:%s ", $2, $3}'; echo; done
for a in qwen2.5-0.5b smollm2-135m; do
timeout 200 ncu --clock-control none --graph-profiling node --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread --csv --page raw \
  $L bench --dtype bf16 --batches 1 --arch $a --invariant-gemm --iters 2 --warmup 1 > $o/ncu-$a.csv 2> $o/ncu-$a.err; echo "ncu $a rc=$? lines=$(wc -l < $o/ncu-$a.csv)"
done
tail -3 $o/ncu-qwen2.5-0.5b.err
cat .gpu-carry/REVISION > $o/revision.txt; cp .gpu-carry/dev.sh $o/commands.sh
cd /tmp && tar czf $OUT/r.tgz o
