#!/usr/bin/env python3
"""Hugging Face transformers' answers for a checkpoint, as the reference `bgs-llm-gpu hf`
compares the GPU forward pass with (issue 9, part 5).

For each prompt (lists of token ids): the logits of the prompt's last position, and `--steps`
greedy tokens (argmax, EOS ignored: the loop never stops early), computed by transformers
with its KV cache on the GPU in `--dtype`. Runs on the GPU machine (PyTorch and transformers
are installed there; nothing is fetched).

Usage: python3 bench/gpu/hf_reference.py --model DIR --dtype bf16 --steps 64 \
           --prompts '[[1,2,3],[4,5]]' --out ref.json
"""
import argparse
import json
import time

import torch
import transformers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--dtype", choices=["bf16", "f16", "f32"], default="bf16")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    # No TF32: with --dtype f32 the reference is plain f32 arithmetic.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.time()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        a.model, dtype=dtype, attn_implementation="eager"
    ).to("cuda")
    model.eval()
    load_s = time.time() - t0
    prompts = json.loads(a.prompts)
    results = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device="cuda")
            out = model(input_ids=x, use_cache=True)
            logits0 = out.logits[0, -1].float()
            past = out.past_key_values
            tokens = []
            nxt = int(torch.argmax(logits0).item())
            for _ in range(a.steps):
                tokens.append(nxt)
                out = model(
                    input_ids=torch.tensor([[nxt]], device="cuda"),
                    past_key_values=past,
                    use_cache=True,
                )
                past = out.past_key_values
                nxt = int(torch.argmax(out.logits[0, -1].float()).item())
            results.append(
                {"prompt": ids, "logits": logits0.cpu().tolist(), "tokens": tokens}
            )
    json.dump(
        {
            "model": a.model,
            "dtype": a.dtype,
            "steps": a.steps,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0),
            "load_seconds": load_s,
            "results": results,
        },
        open(a.out, "w"),
    )


if __name__ == "__main__":
    main()
