#!/usr/bin/env bash
# The GPU-resident step loop (issue 9 part 3; docs/gpu-model.md "The resident step loop"), one
# device call. FIRST RUN of code written without a GPU: every part logs and goes on.
#  1. tiny Qwen2 in f32 through `bgs serve --executor gpu --gpu-step-loop device`: a few
#     requests by hand (python client), then strict `bgs load --op generate` (every stream
#     compared with the golden reply of its prompt generated alone: a mismatch = a loop bug or
#     a batch-invariance failure), at low and high rate;
#  2. cancel mid-stream: connections that read a few tokens then close; the server must stay
#     healthy (a strict load run afterwards passes, the server's KV blocks return: see the log's
#     stats line at shutdown);
#  3. the paper workload on the Qwen2.5-0.5B shape (bf16; 16-32-token prompts, 64 tokens, EOS
#     ignored, 192 req/s, 128 connections) at slots 16/32/64 with the device loop and, beside
#     it, the host loop (today's default): server CPU per request, p99, TTFT;
#     3b: the same with token frames held 8 ms to share writes (--stream-coalesce-us);
#  4. saturation at 256 slots (served tokens/s).
# Runs ON the GPU machine from the repo root. Usage: bash bench/gpu/step-loop.sh BIN_DIR OUT_DIR
# (BIN_DIR: bgs, REVISION, qwen-tokenizer.json). SECS (default 20): paper workload duration;
# SLOTS (default "16 32 64"; empty skips) and LOOPS (default "device host") pick the paper
# workload's runs. TRANSPORT_FLAGS (default: the native transport) go to every server, e.g.
# "--transport kernel --reply executor-sqe" (the kernel transport refuses the holds of 3b:
# set COALESCE="").
set -uo pipefail
bin=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd); work=/tmp/bgs-steploop
rm -rf "$work"; mkdir -p "$work"
export XDG_CACHE_HOME=/tmp/bgs-cache
export BGS_QWEN_TOKENIZER=${BGS_QWEN_TOKENIZER:-$bin/qwen-tokenizer.json}
export RUST_LOG=${RUST_LOG:-info}
SECS=${SECS:-20}
log() { echo "$*" | tee -a "$out/steps.log"; }
step() {
  local name=$1 t=$2; shift 2
  local t0; t0=$(date +%s)
  timeout "$t" "$@" >"$work/$name.txt" 2>&1
  local rc=$?
  log "$name rc=$rc $(( $(date +%s) - t0 ))s | $(tail -1 "$work/$name.txt")"
  return $rc
}
cp "$bin/REVISION" "$out/revision.txt" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/gpu.txt" 2>&1
mount | grep -q cgroup2 || { mkdir -p /tmp/cg2 && mount -t cgroup2 none /tmp/cg2; }

for a in tiny-qwen2 qwen2.5-0.5b; do
  step "synth-$a" 120 "$bin/bgs" model synth --arch "$a" --seed 7 --dtype bf16 --out "$work/$a"
done

port=8190
start_server() { # name, then serve flags
  local name=$1; shift
  rm -f "$work/$name.server.log"
  # shellcheck disable=SC2086
  "$bin/bgs" serve --listen 127.0.0.1:$port --cpus 0-3 --executor gpu --api-listen off \
    ${TRANSPORT_FLAGS:-} "$@" >"$work/$name.server.log" 2>&1 &
  spid=$!
  for _ in $(seq 900); do
    grep -q listening "$work/$name.server.log" 2>/dev/null && return 0
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.1
  done
  log "$name: server did not start: $(tail -5 "$work/$name.server.log" | tr '\n' ' ')"; return 1
}
stop_server() {
  kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
  log "server log tail: $(tail -3 "$work/$1.server.log" | tr '\n' ' ')"
  # The device loop's counters (steps, per-step times, monitor looks), when it ran.
  grep -h "GPU step loop:" "$work/$1.server.log" | sed 's/^/  /' | tee -a "$out/steps.log"
}
gen_load() { # name, then load flags
  local name=$1; shift
  step "$name" $((SECS + 120)) "$bin/bgs" load --target 127.0.0.1:$port --op generate \
    --server-pid "$spid" --cpus 4-15 --json "$work/$name.json" "$@"
}

# A raw client: N generate requests on fresh connections, reading `keep` token frames of each
# and then closing (keep < 0: read to the final frame). Prints one line per request.
cat >"$work/client.py" <<'PY'
import socket, struct, sys
port, n, keep, max_tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
bad = 0
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    prompt = [(7 * i + k) % 200 + 1 for k in range(5 + i % 11)]
    hdr = struct.pack("<IHHIIII", 0x31534742, 1, 3, 1000 + i, len(prompt), max_tokens, 1)
    s.sendall(hdr + struct.pack(f"<{len(prompt)}I", *prompt))
    toks, final = [], None
    buf = b""
    while final is None and (keep < 0 or len(toks) < keep):
        while len(buf) < 24:
            d = s.recv(65536)
            if not d: break
            buf += d
        if len(buf) < 24: break
        magic, ver, status, rid, words, seq, _ = struct.unpack("<IHHIIII", buf[:24])
        while len(buf) < 24 + 4 * words:
            buf += s.recv(65536)
        w = struct.unpack(f"<{words}I", buf[24:24 + 4 * words]); buf = buf[24 + 4 * words:]
        if magic != 0x31524742 or rid != 1000 + i: bad += 1; break
        if status == 1:
            if seq != len(toks): bad += 1
            toks.append(w[0])
        else:
            final = (status, seq, list(w))
    s.close()
    print(f"req {i}: prompt {len(prompt)} tokens, {len(toks)} token frames, final {final}, tokens {toks}")
    if keep < 0 and (final is None or final[0] != 2 or final[1] != len(toks) or len(toks) != max_tokens):
        bad += 1
print(f"client: {n} requests, {bad} bad")
sys.exit(1 if bad else 0)
PY

# 0. The same requests through the host loop, for the device loop's output to be compared with.
port=$((port + 2))
if start_server tiny-host --model "$work/tiny-qwen2" --dtype f32 --slots 8 --gpu-step-loop host; then
  step tiny-host-client 60 python3 "$work/client.py" $port 8 -1 24
  stop_server tiny-host
fi

# 1 + 2. Tiny model, f32: correctness through the rings, with the loop's own checks on (its
# bookkeeping after every step, its lane-parallel walks against the plain C functions).
device_ok=1
port=$((port + 2))
if start_server tiny-device --model "$work/tiny-qwen2" --dtype f32 --slots 8 --gpu-step-loop device --gpu-step-loop-check; then
  if ! step tiny-client 60 python3 "$work/client.py" $port 8 -1 24; then
    # Fail fast: a device loop that cannot answer 8 requests would only burn the call's
    # time in the runs below (each waits for its timeout).
    log "tiny-client failed: skipping the rest of the device loop's runs"
    device_ok=0
  fi
  if [ "$device_ok" = 0 ]; then :
  elif cmp -s "$work/tiny-host-client.txt" "$work/tiny-client.txt"; then
    log "tiny-client: device loop tokens equal the host loop's"
  else
    log "tiny-client: device loop tokens DIFFER from the host loop's (diff in logs)"
    diff "$work/tiny-host-client.txt" "$work/tiny-client.txt" >"$work/tiny-client.diff"
  fi
  [ "$device_ok" = 1 ] && gen_load tiny-strict-low --prompt-tokens 16 --max-tokens 32 --ignore-eos --connections 8 \
    --rate 20 --duration 5 --prompts 16 --strict
  [ "$device_ok" = 1 ] && gen_load tiny-strict-high --prompt-tokens 24 --max-tokens 64 --ignore-eos --connections 64 \
    --rate 400 --duration 10 --prompts 32 --strict
  [ "$device_ok" = 1 ] && gen_load tiny-strict-eos --prompt-tokens 16 --max-tokens 64 --connections 16 \
    --rate 50 --duration 5 --prompts 16 --strict
  [ "$device_ok" = 1 ] && step tiny-cancel 120 python3 "$work/client.py" $port 64 3 64
  [ "$device_ok" = 1 ] && step tiny-after-cancel-client 60 python3 "$work/client.py" $port 8 -1 24
  [ "$device_ok" = 1 ] && gen_load tiny-strict-after-cancel --prompt-tokens 16 --max-tokens 32 --ignore-eos \
    --connections 16 --rate 50 --duration 5 --prompts 16 --strict
  stop_server tiny-device
else
  device_ok=0
fi

# One served run of the Qwen2.5-0.5B shape: NAME LOOP RATE DURATION SERVER_ARGS... (the load:
# 24-token prompts, 64 tokens, EOS ignored, CONNS connections, 128 unless set). The device
# loop's runs are skipped once its tiny-model checks failed.
served() {
  local name=$1 loop=$2 rate=$3 secs=$4 conns=${CONNS:-128}; shift 4
  [ "$loop" = device ] && [ "$device_ok" = 0 ] && return
  port=$((port + 2))
  # SERVE_FLAGS: more server flags for every served run (e.g. --gpu-fused-max-tokens 2).
  # shellcheck disable=SC2086
  if start_server "qwen-$name" --model "$work/qwen2.5-0.5b" --gpu-step-loop "$loop" "$@" ${SERVE_FLAGS:-}; then
    gen_load "$name" --prompt-tokens 24 --max-tokens 64 --ignore-eos \
      --connections "$conns" --rate "$rate" --duration "$secs" --warmup 2 --prompts 64
    stop_server "qwen-$name"
  fi
}

# 3. The paper workload, device loop beside the host loop.
for slots in ${SLOTS-16 32 64}; do
  for loop in ${LOOPS:-device host}; do
    served "paper-$loop-s$slots" "$loop" 192 "$SECS" --slots "$slots"
  done
done

# 3b. The same workload with token frames held to share writes (--stream-coalesce-us, docs/cost.md
#     "Streams"): 32 slots, each loop. COALESCE (default "8000"; empty skips) lists the holds.
for hold in ${COALESCE-8000}; do
  for loop in ${LOOPS:-device host}; do
    served "paper-$loop-s32-hold$hold" "$loop" 192 "$SECS" --slots 32 --stream-coalesce-us "$hold"
  done
done

# 4. Saturation: many slots, offered well above what a step can serve (2,500 req/s x 64 tokens
#    = 160,000 tokens/s; 1,500 req/s stopped being enough once the loop served 95,000: the
#    table never filled, bench/results/20261201-gpu-step-loop-lanes/run10); the generated
#    tokens/s is the served throughput (issue 9's target: 100,000 at batch 256), the excess is
#    answered busy. SAT_SLOTS (default 256; empty skips) and SAT_RATE override.
#    Twice as many connections as slots, to rule out the client: a connection's replies go
#    back in order (a pipelined request's frames wait behind the stream before it), and with
#    128 connections the 128- and 256-slot runs averaged only 84 and 118 tokens per step
#    (bench/results/20261201-gpu-step-loop-batch-publish).
for slots in ${SAT_SLOTS-256}; do
  for loop in ${LOOPS:-device host}; do
    CONNS=$((2 * slots)) served "sat-$loop-s$slots" "$loop" "${SAT_RATE:-2500}" 10 --slots "$slots"
  done
done

python3 - "$work" "$out" <<'PY' >"$out/summary.json"
import glob, json, os, platform, sys, datetime
work, out = sys.argv[1], sys.argv[2]
def load(p):
    try:
        return json.load(open(p))
    except Exception as e:
        return {"error": str(e)}
s = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "machine": f"{platform.node()} ({os.cpu_count()} CPUs), GPU: {open(out + '/gpu.txt').read().strip()}",
    "command": "bash bench/gpu/step-loop.sh .gpu-carry $OUT",
    "transport_flags": os.environ.get("TRANSPORT_FLAGS", ""),
    "revision": open(out + "/revision.txt").read().strip() if os.path.exists(out + "/revision.txt") else None,
    "steps": open(out + "/steps.log").read().splitlines(),
    "runs": {os.path.basename(p)[:-5]: load(p) for p in sorted(glob.glob(f"{work}/*.json"))},
}
print(json.dumps(s, indent=1))
PY
tar czf "$out/logs.tgz" -C "$work" --exclude='*.safetensors' --exclude='*.gguf' . 2>/dev/null
echo "step-loop.sh: done"
