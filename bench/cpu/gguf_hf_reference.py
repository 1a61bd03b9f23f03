#!/usr/bin/env python3
"""Hugging Face transformers' answers for a GGUF file, on the CPU in f32: the reference that
`crates/model/tests/hf_gguf.rs` compares our GGUF loader + CPU oracle with (issue 9, part 5).

transformers reads the GGUF itself (the `gguf` package dequantizes, transformers undoes
llama.cpp's q/k row permutation and builds the config from the metadata), so it is an
independent implementation of everything `bgs_model::load` does for a GGUF.

For each prompt (a list of token ids), the JSON has what `bench/gpu/hf_reference.py` writes
(so `bgs-llm-gpu hf` can read it too):
  - `prompt`, `logits` (all of the prompt's last position), `tokens` (`--steps` greedy tokens,
    argmax, EOS ignored: the loop never stops early, KV cache on);
plus, small enough to keep for every position:
  - `prefill_top`: for every prompt position, the `--top` largest logits as [id, logit];
  - `step_top`: for every greedy step i, the `--top` largest logits after feeding `tokens[i]`
    (so `step_top[i][0][0]` is `tokens[i + 1]`; the last entry predicts one token past them).

Usage: PYTHONPATH=target/py-hf python3 bench/cpu/gguf_hf_reference.py \
           --gguf FILE.gguf --steps 32 --prompts '[[1,2,3],[4,5]]' --out ref.json
"""
import argparse
import json
import os
import platform
import time

import torch
import transformers


def top(logits: torch.Tensor, k: int) -> list:
    v, i = torch.topk(logits, k)
    return [[int(a), float(b)] for a, b in zip(i.tolist(), v.tolist())]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True, help="the .gguf file")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=8, help="logits kept per position")
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    prompts = json.loads(a.prompts)
    if not prompts or not all(isinstance(p, list) and p for p in prompts):
        raise SystemExit("--prompts must be a non-empty JSON list of non-empty token-id lists")
    path = os.path.abspath(a.gguf)
    if not os.path.isfile(path):
        raise SystemExit(f"--gguf {a.gguf}: no such file")
    t0 = time.time()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path),
        gguf_file=os.path.basename(path),
        dtype=torch.float32,
        attn_implementation="eager",
    )
    model.eval()
    load_s = time.time() - t0
    vocab = model.config.vocab_size
    for i, ids in enumerate(prompts):
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise SystemExit(f"prompt {i}: token ids {bad[:4]} are outside the vocabulary of {vocab}")
    results = []
    t0 = time.time()
    with torch.no_grad():
        for ids in prompts:
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            all_logits = out.logits[0].float()
            logits0 = all_logits[-1]
            past = out.past_key_values
            tokens, step_top = [], []
            nxt = int(torch.argmax(logits0).item())
            for _ in range(a.steps):
                tokens.append(nxt)
                out = model(
                    input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True
                )
                past = out.past_key_values
                last = out.logits[0, -1].float()
                step_top.append(top(last, a.top))
                nxt = int(torch.argmax(last).item())
            results.append(
                {
                    "prompt": ids,
                    "logits": logits0.tolist(),
                    "tokens": tokens,
                    "prefill_top": [top(row, a.top) for row in all_logits],
                    "step_top": step_top,
                }
            )
    run_s = time.time() - t0
    with open(a.out, "w") as f:
        json.dump(
            {
                "model": path,
                "dtype": "f32",
                "steps": a.steps,
                "top": a.top,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "gguf": _version("gguf"),
                "device": "cpu: " + (platform.processor() or platform.machine()),
                "torch_threads": torch.get_num_threads(),
                "load_seconds": load_s,
                "run_seconds": run_s,
                "results": results,
            },
            f,
        )


def _version(pkg: str) -> str:
    from importlib.metadata import version

    try:
        return version(pkg)
    except Exception:  # the version is informational only
        return "unknown"


if __name__ == "__main__":
    main()
