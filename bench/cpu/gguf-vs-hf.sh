#!/usr/bin/env bash
# The real SmolLM2-135M-Instruct GGUF: our loader + CPU oracle (bgs_model::CpuModel, f32)
# against Hugging Face transformers loading the same GGUF itself, on the CPU in f32
# (issue 9, part 5; docs/gpu-model.md). A manual check, not part of CI (CI installs no torch).
#
#  1. installs torch, transformers, gguf, accelerate into target/py-hf (once; ~5.6 GB: PyPI's
#     Linux torch wheel is the CUDA build and pulls the CUDA libraries, unused here);
#  2. bench/cpu/gguf_hf_reference.py writes transformers' logits and greedy tokens for the
#     prompts below to target/gguf-hf/reference.json (~4 MB, not committed);
#  3. cargo test -p bgs-model --test hf_gguf compares ours with it (tolerance in that file);
#  4. writes bench/results/<date>-cpu-gguf-hf/result.json (date, machine, command, revision,
#     versions, measured differences) and test.txt (the test's output).
# Usage: bash bench/cpu/gguf-vs-hf.sh [greedy_steps]   (default 32)
set -euo pipefail
cd "$(dirname "$0")/../.."
steps=${1:-32}
root=$PWD
eval "$(bash scripts/fetch-models.sh target/models)"

py=$root/target/py-hf
export PYTHONPATH=$py
# Nothing may be fetched from a model hub: transformers reads only the local GGUF.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
if ! python3 -c 'import torch, transformers, gguf, accelerate' 2>/dev/null; then
  echo "gguf-vs-hf: installing torch, transformers, gguf, accelerate into $py" >&2
  python3 -m pip install --quiet --disable-pip-version-check --upgrade --target "$py" \
    torch==2.15.0 transformers==5.24.0 gguf==0.19.0 accelerate==1.15.0 numpy >&2
fi

# Prompts (token ids of SmolLM2's tokenizer):
#  - the chat template around "What is the capital of France? Answer in one sentence." (42);
#  - "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by
#    the sea," (23, no BOS);
#  - arbitrary ids, as crates/model/tests/oracle_candle.rs uses (8);
#  - BOS alone (1).
prompts='[[1,9690,198,2683,359,253,5356,5646,11173,3365,3511,308,34519,28,7018,411,407,19712,8182,2,198,1,4093,198,1780,314,260,3575,282,4649,47,19842,281,582,6330,30,2,198,1,520,9531,198],
[504,2365,6354,16438,27003,690,260,23790,2767,30,4027,1980,253,655,28,281,253,1165,6560,411,260,3426,28],
[1,28,1234,5000,42,300,7,9999],
[1]]'

work=$root/target/gguf-hf
mkdir -p "$work"
python3 bench/cpu/gguf_hf_reference.py --gguf "$BGS_SMOLLM2_GGUF" --steps "$steps" \
  --prompts "$prompts" --out "$work/reference.json" 2>"$work/reference.log" || {
  cat "$work/reference.log" >&2; exit 1; }

out=bench/results/$(date -u +%Y%m%d)-cpu-gguf-hf
mkdir -p "$out"
rc=0
BGS_SMOLLM2_HF_JSON=$work/reference.json BGS_SMOLLM2_HF_OUT=$work/compare.json \
  cargo test --release --locked -p bgs-model --test hf_gguf -- --nocapture \
  >"$out/test.txt" 2>&1 || rc=$?
grep -E '^(prompt |worst |test result)' "$out/test.txt" || true

python3 - "$work" "$out" "$*" "$rc" <<'EOF'
import datetime, json, os, platform, re, subprocess, sys
work, out, args, rc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ref = json.load(open(f"{work}/reference.json"))
try:
    cmp = json.load(open(f"{work}/compare.json"))
except FileNotFoundError:  # the test did not get as far as measuring
    cmp = None
git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
r = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {cpu}, {platform.platform()})",
    "command": f"bash bench/cpu/gguf-vs-hf.sh {args}".strip(),
    "revision": git("rev-parse", "--short=12", "HEAD") + (" (dirty)" if git("status", "--porcelain", "--untracked-files=no") else ""),
    "reference": {k: ref[k] for k in ("transformers", "torch", "gguf", "dtype", "steps", "top", "device", "torch_threads", "load_seconds", "run_seconds")},
    "prompts": [r["prompt"] for r in ref["results"]],
    "transformers_greedy_tokens": [r["tokens"] for r in ref["results"]],
    "test_exit_code": rc,
    "comparison": cmp,
}
text = json.dumps(r, indent=1)
# Lists of numbers (prompts, tokens) on one line each.
text = re.sub(r"\[\s+([-+\d.e,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
open(f"{out}/result.json", "w").write(text + "\n")
print(f"wrote {out}/result.json")
EOF
exit "$rc"
