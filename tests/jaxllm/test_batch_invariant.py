"""EngineConfig.batch_invariant: a seeded sequence's logprobs are bitwise the same alone and
among mixed neighbours (and from a prefix-cache hit); without the mode they are not."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxllm.api import Model
from jaxllm.config import ModelConfig
from jaxllm.engine_config import EngineConfig
from jaxllm.engine_runs import kv_bytes, run_rows
from jaxllm.loading.dummy import dummy_params
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.sampling import SamplingParams
from jaxllm.tokenizer import Tokenizer

# 576-wide rows: XLA's CPU dot gives a row other last bits by the round's row count here
# (docs/lab/batch-invariance.md); the narrower test models sum the same way at every count
# in bfloat16, so there the mode would have nothing to fix.
WIDE = ModelConfig(
    family="llama",
    vocab_size=256,
    d_model=576,
    n_layers=2,
    n_heads=9,
    n_kv_heads=3,
    head_dim=64,
    ffn_dim=576,
    max_position=512,
)
V = WIDE.vocab_size
CHUNK = 64  # the mode's chunk: the largest bucket
PREFIX = [int(t) for t in np.random.default_rng(1).integers(1, V, 70)]


def _model(dtype: str) -> Model:
    params = jax.tree.map(lambda x: (x * 6 if x.ndim > 1 else x).astype(dtype), dummy_params(WIDE, seed=3))
    return Model(cfg=WIDE, params=params, tokenizer=Tokenizer.synthetic(V), options=RuntimeOptions(dtype=dtype))


def _engine(model: Model, invariant: bool):
    # A server's CPU shapes: a one-row decode part beside the full width, two chunk buckets,
    # drafting on (the mode turns what varies off).
    engine = model.engine(
        EngineConfig(
            max_slots=32,
            max_seq_len=128,
            kv_bytes=kv_bytes(WIDE, 32, 128, opts=model.options),
            chunk_buckets=(32, CHUNK),
            decode_widths=(1, 8),
            max_drafts=2,
            batch_invariant=invariant,
        )
    )
    # Drafts in every round (the last token again, sometimes right), so verification rounds
    # carry the targets and their neighbours whatever the text.
    engine.draft_source = lambda tokens, k: [tokens[-1]] * k
    return engine


TARGETS = [
    ([5, 9, 14, 3, 7, 7, 2], SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=10, ignore_eos=True)),
    (PREFIX + [3, 1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, drafts=2)),
]


def _neighbours(n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(n)
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=20),
        dict(temperature=1.2, min_p=0.05),
    ]
    return [
        (
            rng.integers(1, V, int(rng.integers(1, 90))).tolist(),
            SamplingParams(
                seed=int(rng.integers(0, 1000)),
                max_tokens=int(rng.integers(1, 14)),
                ignore_eos=True,
                drafts=2 if i % 3 == 0 else 0,
                **kinds[i % len(kinds)],
            ),
        )
        for i in range(n)
    ]


def _cache_hit(model: Model, invariant: bool):
    """The second target's prompt but its last token from a prefix-cache entry written by
    another prompt that shares it (prompt[:-1], the server's longest hit)."""
    engine = _engine(model, invariant)
    ids, params = TARGETS[1]
    other = ids[:-1] + [9, 9, 9]
    seq = engine.add(other, dataclasses.replace(params, max_tokens=1))
    while seq.prefilled < len(other):
        engine.step()
    return (ids, params, engine.extract(seq, len(ids) - 1))


def _crowd_logprobs(model: Model, invariant: bool, n: int) -> list[list[float]]:
    """The targets' logprobs among n neighbours, then again from a prefix-cache hit."""
    others = _neighbours(n)
    half = len(others) // 2
    rows = others[:half] + TARGETS + [_cache_hit(model, invariant)] + others[half:]
    out = run_rows(model, _engine(model, invariant), rows)
    return [out[half + i].completion.logprobs for i in range(len(TARGETS) + 1)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_logprobs_are_bitwise_whatever_the_batch(dtype):
    model = _model(dtype)
    alone = {}
    for invariant in (False, True):
        engine = _engine(model, invariant)
        got = [run_rows(model, engine, [t])[0].completion.logprobs for t in TARGETS]
        alone[invariant] = got + [got[1]]  # the cache hit must give the second target's
    for n in (7, 31):
        assert _crowd_logprobs(model, True, n) == alone[True], f"{n} neighbours"
    # Without the mode the same comparison sees the last bits move (so it measures something).
    crowd = _crowd_logprobs(model, False, 31)
    assert crowd != alone[False]
    np.testing.assert_allclose(np.concatenate(crowd), np.concatenate(alone[False]), atol=0.1)
