#!/usr/bin/env bash
# Generation on the CPU executor (issue "Generation end to end"), tiny synthetic model and the
# real SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to f32):
#  (1) in process, our forward pass beside candle-transformers' on the same weights: time to
#      first token, decode tokens/s at batch 1 and larger batches, process CPU per token
#      (cargo bench -p bgs-model --bench generate_vs_candle);
#  (2) over TCP: `bgs serve --model` (server on CPU 0) driven by `bgs load --op generate`
#      (client on the other CPUs): time to first token, tokens/s, server process CPU per
#      generated token, with exact replay of every stream.
# Writes bench/results/<date>-generate-cpu/ (raw outputs and summary.json with date,
# machine, command and git revision).
# Usage: bash bench/generate_cpu.sh [seconds_per_load_run]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
eval "$(bash scripts/fetch-models.sh target/models)"
cargo build --release --locked -p bgs >/dev/null
bgs=./target/release/bgs
out=bench/results/$(date -u +%Y%m%d)-generate-cpu
mkdir -p "$out"
rev=$(git rev-parse --short=12 HEAD)
ncpu=$(nproc)
client_cpus="1-$((ncpu - 1))"
tiny=$out/tiny-llama
rm -rf "$tiny"
"$bgs" model synth --arch tiny-llama --seed 1 --out "$tiny" >/dev/null

# (1) In process, ours beside candle.
BGS_BENCH_STEPS=128 BGS_BENCH_BATCHES=1,4,16,32 \
  cargo bench --locked -p bgs-model --bench generate_vs_candle \
  >"$out/engine-tiny.jsonl" 2>"$out/engine-tiny.txt"
BGS_BENCH_MODEL="$BGS_SMOLLM2_GGUF" BGS_BENCH_STEPS=16 BGS_BENCH_BATCHES=1,4,16 \
  cargo bench --locked -p bgs-model --bench generate_vs_candle \
  >"$out/engine-smollm2.jsonl" 2>"$out/engine-smollm2.txt"

# (2) Over TCP.
port=7820
start_server() { # model slots
  port=$((port + 1))
  log="$out/server-$port.log"
  rm -f "$log" # a fresh file: the wait below must not see an earlier server's line
  "$bgs" serve --listen 127.0.0.1:$port --cpus 0 --model "$1" --slots "$2" \
    --api-listen off >"$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 300); do grep -q listening "$log" 2>/dev/null && return; sleep 0.1; done
  echo "server did not start" >&2; cat "$log" >&2; exit 1
}
stop_server() { kill -TERM "$server_pid"; wait "$server_pid"; }
run_load() { # name rate max_tokens [extra load flags]
  local name=$1 rate=$2 max=$3; shift 3
  "$bgs" load --target 127.0.0.1:$port --op generate --prompt-tokens 16 --max-tokens "$max" \
    --ignore-eos --rate "$rate" --connections 16 --duration "$secs" --warmup 2 \
    --cpus "$client_cpus" --server-pid "$server_pid" --json "$out/$name.json" --strict "$@" \
    >"$out/$name.txt" 2>&1
}
for rate in 20 100 400; do
  start_server "$tiny" 16; run_load "tcp-tiny-r$rate" "$rate" 64; stop_server
done
for rate in 0.5 2; do
  start_server "$BGS_SMOLLM2_GGUF" 16; run_load "tcp-smollm2-r$rate" "$rate" 32 --prompts 16; stop_server
done

python3 - "$out" "$rev" "$*" >"$out/summary.json" <<'EOF'
import glob, json, os, platform, sys, datetime
out, rev, args = sys.argv[1], sys.argv[2], sys.argv[3]
s = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.platform()})",
    "command": f"bash bench/generate_cpu.sh {args}".strip(),
    "revision": rev,
    "load_average_at_end": open("/proc/loadavg").read().split()[:3],
    "engine": [],
    "tcp": [],
}
for f in sorted(glob.glob(f"{out}/engine-*.jsonl")):
    s["engine"] += [json.loads(l) for l in open(f) if l.startswith("{")]
for f in sorted(glob.glob(f"{out}/tcp-*.json")):
    r = json.load(open(f))["report"]
    g = r.get("generate") or {}
    tokens = g.get("tokens") or 0
    cpu = (r.get("server_cpu") or {})
    per_req = (cpu.get("per_request") or {}).get("run_us")
    ok = r["counts"]["ok"]
    s["tcp"].append({
        "run": os.path.basename(f)[:-5],
        "offered_rate": r["offered_rate"], "achieved_rate": r["achieved_rate"],
        "ok": ok, "failures": r["failures"], "busy": r["counts"]["busy"],
        "tokens_per_s": g.get("tokens_per_s"),
        "ttft_p50_ms": (g.get("ttft") or {}).get("p50_us", 0) / 1e3,
        "ttft_p99_ms": (g.get("ttft") or {}).get("p99_us", 0) / 1e3,
        "gap_p99_ms": (g.get("inter_token") or {}).get("p99_us", 0) / 1e3,
        "server_cpu_us_per_token": (per_req * ok / tokens) if per_req and tokens else None,
    })
print(json.dumps(s, indent=1))
EOF
cat "$out/summary.json"
