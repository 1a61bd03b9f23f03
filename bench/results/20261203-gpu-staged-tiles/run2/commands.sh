set -u; b=$PWD/.gpu-carry; o=/tmp/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
L=$b/bgs-llm-gpu; w=/tmp/w; mkdir -p $w
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $o/smi.txt 2>&1
for a in tiny-qwen2 qwen2.5-0.5b smollm2-135m; do $b/bgs model synth --arch $a --seed 7 --dtype bf16 --out $w/$a > /dev/null 2>&1 || echo "synth $a failed"; done
ck() { n=$1; shift; timeout 240 $L check "$@" --json $o/check-$n.json > $o/check-$n.txt 2>&1; echo "check $n rc=$?"; grep -iE "staged|small tiles vs|FAIL|invarian" $o/check-$n.txt | head -12; }
ck q-inv --model $w/qwen2.5-0.5b --dtype bf16 --steps 8 --invariant-gemm
ck s-inv --model $w/smollm2-135m --dtype bf16 --steps 16 --invariant-gemm
ck q-def --model $w/qwen2.5-0.5b --dtype bf16 --steps 8
ck tiny-bf16 --model $w/tiny-qwen2 --dtype bf16
ck tiny-f32 --model $w/tiny-qwen2 --dtype f32
for n in q-inv s-inv q-inv-nostage s-inv-nostage q-inv-nopf q-def s-def; do
  a=qwen2.5-0.5b; [ ${n%%-*} = s ] && a=smollm2-135m
  x=; case $n in *nostage) x="--no-tc-stage";; esac
  case $n in *inv*) x="$x --invariant-gemm";; esac
  pf=; case $n in *nopf) pf=BGS_ATTN_PREFETCH_L2=0;; esac
  BGS_LLM_KERNEL_DEFINES=$pf timeout 120 $L bench --dtype bf16 --batches 1,2,4,8,16,64,256 --arch $a $x --json $o/bench-$n.json > $o/bench-$n.txt 2>&1; echo "$n rc=$?"
done
for f in $o/bench-*.txt; do echo "== $(basename $f)"; grep "^| [0-9]" $f | awk -F'|' '{printf "%s:%s ", $2, $3}'; echo; done
timeout 200 ncu --clock-control none --graph-profiling node --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread --csv --page raw \
  $L bench --dtype bf16 --batches 1 --arch qwen2.5-0.5b --invariant-gemm --iters 2 --warmup 1 > $o/ncu-qwen2.5-0.5b.csv 2> $o/ncu-q.err; echo "ncu rc=$?"
cat .gpu-carry/REVISION > $o/revision.txt; cp .gpu-carry/dev.sh $o/commands.sh
cd /tmp && tar czf $OUT/r.tgz o
