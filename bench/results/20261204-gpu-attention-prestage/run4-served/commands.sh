set -u; b=$PWD/.gpu-carry; o=/tmp/o; mkdir -p $o; export XDG_CACHE_HOME=/tmp/c
cat .gpu-carry/REVISION > $o/revision.txt; cp .gpu-carry/dev.sh $o/commands.sh
SECS=12 SLOTS="16 32" LOOPS=device COALESCE= SAT_SLOTS= SERVE_FLAGS=--batch-invariant timeout 420 bash bench/gpu/step-loop.sh .gpu-carry $o/served-invariant > $o/served.log 2>&1; echo "served rc=$?"
tail -25 $o/served.log
cd /tmp && tar czf $OUT/r.tgz o
