"""How far an 8-bit K/V cache moves the default model's predictions (CPU is fine).

For a few chat prompts: the model's greedy continuation with its own-dtype cache, then both
caches' logits at every continuation position (teacher forcing: both see the same tokens).
Prints top-1 agreement and KL(wide || 8-bit) of the next-token distributions.

    python benchmarks/kv8_accuracy.py [--model smollm2] [--dtype float32|bfloat16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

import jaxllm.api as jx
from jaxllm.sampling import SamplingParams

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn.",
    "What is the capital of Japan, and what is it known for?",
    "List three uses of a paperclip.",
]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", help="the model's dtype (the wide cache's too)")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    model = jx.load(args.model, dtype=args.dtype)
    narrow = dataclasses.replace(model, options=model.options.replace(kv_dtype="float8_e4m3fn"))
    agree = total = 0
    kl: list[float] = []
    for prompt in PROMPTS:
        ids = model.chat_ids([{"role": "user", "content": prompt}])
        out = model.generate([ids], SamplingParams(temperature=0, max_tokens=args.tokens))[0].token_ids
        seq = ids + out
        wide_lp = log_softmax(model.logits(seq)[len(ids) - 1 : -1])
        narrow_lp = log_softmax(narrow.logits(seq)[len(ids) - 1 : -1])
        agree += int((wide_lp.argmax(-1) == narrow_lp.argmax(-1)).sum())
        total += len(out)
        kl += list((np.exp(wide_lp) * (wide_lp - narrow_lp)).sum(-1))
    print(
        f"{args.model} ({args.dtype}): top-1 agreement {agree}/{total} = {agree / total:.3f}; "
        f"KL({args.dtype} || 8-bit) mean {np.mean(kl):.4f}, max {np.max(kl):.4f} nats"
    )


if __name__ == "__main__":
    main()
