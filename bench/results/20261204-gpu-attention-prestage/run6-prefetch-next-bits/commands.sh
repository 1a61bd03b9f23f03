set -u; b=$PWD/.gpu-carry; o=/tmp/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
cat .gpu-carry/REVISION > $o/revision.txt; cp .gpu-carry/dev.sh $o/commands.sh
L=$b/bgs-llm-gpu
bn() { n=$1; d=$2; shift 2; timeout 40 env BGS_LLM_KERNEL_DEFINES="$d" $L bench --dtype bf16 "$@" --json $o/bench-$n.json > $o/bench-$n.txt 2>&1; echo "$n rc=$? $(grep '^| [0-9]' $o/bench-$n.txt | awk -F'|' '{printf "%s:%s ", $2, $3}')"; (cd /tmp && tar czf $OUT/r.tgz o); }
for k in 2 4 0 1; do bn q-inv-pf$k BGS_TC_PREFETCH_NEXT=$k --arch qwen2.5-0.5b --invariant-gemm --batches 1,16 --iters 100; done
for k in 2 0; do bn s-inv-pf$k BGS_TC_PREFETCH_NEXT=$k --arch smollm2-135m --invariant-gemm --batches 1,16 --iters 100; done
