"""SequenceState: fork / rewind / save -> load -> continue give the tokens a fresh prefill of
the same tokens with the same seed gives; recurrent models rewind only to snapshots."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxllm.api import Model
from jaxllm.config import ModelConfig
from jaxllm.loading.dummy import dummy_params
from jaxllm.research.compare import research_engine, run_rows
from jaxllm.sampling import SamplingParams
from jaxllm.sequence_state import SequenceState
from jaxllm.tokenizer import Tokenizer
from tiny_configs import TINY_DELTANET, TINY_DENSE

TINY = TINY_DENSE.replace(max_position=512)
HYBRID = TINY.replace(family="qwen3_next", layer_types=("linear_attention", "full_attention"), **TINY_DELTANET)
IDS = [5, 17, 33, 2, 60, 61, 9, 40, 12, 77, 3, 8, 19, 23]
P = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, ignore_eos=True)


def _model(cfg: ModelConfig) -> Model:
    params = jax.tree.map(lambda x: x * 6 if x.ndim > 1 else x, dummy_params(cfg, seed=5))
    return Model(cfg=cfg, params=params, tokenizer=Tokenizer.synthetic(cfg.vocab_size))


@pytest.fixture(scope="module")
def model() -> Model:
    return _model(TINY)


def fresh(model: Model, ids, params: SamplingParams) -> list[int]:
    """A fresh prefill of `ids` in its own engine (the reference)."""
    engine = research_engine(model, 8, len(ids) + params.max_tokens)
    return run_rows(model, engine, [(list(ids), params)])[0].completion.token_ids


def test_fork_continues_like_fresh_prefills(model):
    state = model.prefill(IDS)
    assert state.checkpoint is not None and int(state.checkpoint.length) == len(IDS) - 1
    params = [dataclasses.replace(P, seed=s) for s in (1, 2, 3)]
    # DRY reads the sequence's history: a forked row must see its whole prompt.
    params.append(
        SamplingParams(
            temperature=0.8, dry_multiplier=2.0, dry_allowed_length=1, seed=4, max_tokens=10, ignore_eos=True
        )
    )
    outs = model.generate_from(state.fork(len(params)), params)
    got = [o.token_ids for o in outs]
    assert got == [fresh(model, IDS, p) for p in params]
    assert len({tuple(g) for g in got}) > 1, "different seeds differ"


def test_rewind_and_reload_continue_like_fresh_prefills(model, tmp_path):
    longer = model.prefill(IDS + [44, 45, 46], seed=9)
    for length in (len(IDS), 1, 2):
        back = longer.rewind(length)
        assert back.tokens == tuple(IDS[:length])
        assert model.generate_from(back, P).token_ids == fresh(model, IDS[:length], dataclasses.replace(P, seed=9))
    state = longer.rewind(len(IDS))
    state.save(tmp_path / "s")
    loaded = SequenceState.load(tmp_path / "s")
    assert loaded.tokens == tuple(IDS) and loaded.seed == 9
    for a, b in zip(jax.tree.leaves(loaded.checkpoint), jax.tree.leaves(state.checkpoint)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert model.generate_from(loaded, P).token_ids == fresh(model, IDS, dataclasses.replace(P, seed=9))
    with pytest.raises(ValueError, match="rewind length"):
        longer.rewind(0)


def test_recurrent_models_rewind_only_to_snapshots():
    model = _model(HYBRID)
    state = model.prefill(IDS, snapshots=[6])
    assert state.recurrent and set(state.snapshots) == {5}
    p = dataclasses.replace(P, seed=3)
    assert model.generate_from(state, p).token_ids == fresh(model, IDS, p)
    assert model.generate_from(state.rewind(6), p).token_ids == fresh(model, IDS[:6], p)
    with pytest.raises(ValueError, match="recurrent"):
        state.rewind(9)
