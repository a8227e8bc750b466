"""The default model end to end: greedy generations equal transformers' on the same GGUF.

transformers dequantizes the GGUF itself (its own gguf integration), so the reference shares
only the file with us. Tokens must agree up to the first step where transformers' top-1/top-2
logit gap is under 0.05, a near-tie that float rounding may flip.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.api import load
from jaxllm.sampling import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a hash map is in one sentence.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model(smollm2_gguf_path):
    return load(str(smollm2_gguf_path))


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf_path):
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    )
    m.eval()
    return m


def hf_greedy(hf_model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens from transformers and the top-1/top-2 logit gap at each step."""
    import torch

    tokens, gaps = [], []
    with torch.no_grad():
        seq = torch.tensor([ids])
        past = None
        for _ in range(n):
            out = hf_model(seq if past is None else seq[:, -1:], past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].numpy()
            top2 = np.sort(logits)[-2:]
            tokens.append(int(np.argmax(logits)))
            gaps.append(float(top2[1] - top2[0]))
            seq = torch.cat([seq, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, gaps


def test_greedy_chat_generations_match_transformers(model, hf_model):
    prompts = [model.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = model.generate(prompts, params)
    compared = 0
    for ids, out in zip(prompts, ours):
        ref, gaps = hf_greedy(hf_model, ids, MAX_TOKENS)
        for mine, theirs, gap in zip(out.token_ids, ref, gaps):
            if gap < 0.05:
                break
            assert mine == theirs, (model.tokenizer.decode(out.token_ids), model.tokenizer.decode(ref))
            compared += 1
    assert compared >= len(PROMPTS) * 8


def test_chat_answer_is_sensible(model):
    ids = model.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    (out,) = model.generate([ids], SamplingParams(temperature=0, max_tokens=20))
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert "<|im_end|>" not in out.text
