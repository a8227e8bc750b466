"""The branch-free sampler (every optional part computed, results selected: what the GPU runs
so the host never waits inside a multi-step call) draws exactly what the branched one does,
and both agree with numpy on the parts numpy can state directly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny_configs import TINY_DENSE
from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.loading.dummy import dummy_params
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.sampling import (
    MAX_TOP_LOGPROBS,
    SamplingParams,
    _filter_mask,
    _filter_rows,
    needs_full_sampler,
    sample,
    sampling_row,
)

V = 300
GREEDY = SamplingParams(temperature=0, max_tokens=8)
FILTERED = SamplingParams(temperature=0.9, top_k=40, top_p=0.8, seed=11, max_tokens=8)
PLAIN_DRAW = SamplingParams(temperature=1.3, seed=5, max_tokens=8)
MIN_P = SamplingParams(temperature=1.0, min_p=0.05, seed=2, max_tokens=8)

CASES = {
    "greedy only": ([GREEDY, GREEDY], False, None),
    "greedy with top logprobs": ([GREEDY, GREEDY], True, None),
    "mixed rows": ([GREEDY, FILTERED, PLAIN_DRAW, MIN_P], True, None),
    "sampled without filters": ([PLAIN_DRAW, GREEDY], False, None),
    "constrained rows": ([FILTERED, GREEDY, PLAIN_DRAW], False, [True, True, False]),
    "constrained rows, no filter": ([PLAIN_DRAW, GREEDY, PLAIN_DRAW], False, [True, True, False]),
}


TINY = TINY_DENSE


@pytest.fixture(scope="module")
def tiny_params():
    # Larger weights than the loader's default so the distribution is not near uniform.
    return jax.tree.map(lambda x: x * 20 if x.ndim > 1 else x, dummy_params(TINY, seed=1))


def _tiny_engine(params, branches: str) -> Engine:
    config = EngineConfig(
        max_slots=4,
        kv_bytes=1 << 20,
        max_seq_len=64,
        chunk_buckets=(8, 16),
        min_ctx_pages=2,
        decode_steps_per_call=4,
        decode_widths=(4,),
    )
    return Engine(TINY, params, eos_ids=[0], config=config, options=RuntimeOptions(sampler_branches=branches))


def _run(engine: Engine, requests) -> list:
    seqs = [engine.add(prompt, p) for prompt, p in requests]
    while any(s.finish_reason is None for s in seqs):
        engine.step()
    return seqs


def _rows(params: list[SamplingParams]):
    rows = [sampling_row(p, V, {0}, np.uint32(p.seed or 0)) for p in params]
    return jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *rows)


@pytest.mark.parametrize("case", CASES)
def test_select_sampler_draws_what_the_branched_one_does(case):
    params, want_top, constrained = CASES[case]
    B = len(params)
    logits = jax.random.normal(jax.random.PRNGKey(len(case)), (B, V), jnp.float32) * 4
    rng = np.random.default_rng(0)
    seen = jnp.asarray(rng.random((B, V)) < 0.1)
    out_counts = jnp.asarray(rng.integers(0, 3, (B, V)) * (rng.random((B, V)) < 0.05), jnp.float32)
    kwargs = {}
    if constrained is not None:
        bits = rng.integers(0, 2**32, (B, -(-V // 32)), dtype=np.uint64).astype(np.uint32)
        kwargs = dict(token_mask=jnp.asarray(bits), constrained=jnp.asarray(constrained))
    args = (
        logits,
        _rows(params),
        seen,
        out_counts,
        jnp.zeros((B,), jnp.int32),
        jnp.full((B,), 17, jnp.int32),
        jnp.bool_(want_top),
    )
    # Without filters or top logprobs asked, the plain sampler (those parts compiled out)
    # must draw the same too.
    plain_ok = not want_top and not any(needs_full_sampler(p) for p in params)
    results = {
        (branches, full): jax.jit(lambda *a, b=branches, f=full: sample(*a, branches=b, full=f, **kwargs))(*args)
        for branches in ("cond", "select")
        for full in ((True, False) if plain_ok else (True,))
    }
    branched, selected = results["cond", True], results["select", True]
    for other in results.values():
        np.testing.assert_array_equal(other.tokens, branched.tokens)
        np.testing.assert_array_equal(other.logprob, branched.logprob)
        np.testing.assert_array_equal(other.top_ids, branched.top_ids)
        np.testing.assert_array_equal(other.top_logprobs, branched.top_logprobs)

    # Independent of both: greedy rows take numpy's argmax, the chosen logprob is numpy's
    # log-softmax at the token, and top logprobs are numpy's largest ones (or zeros when no
    # row asked for them).
    x = np.asarray(logits, np.float64)
    log_probs = x - x.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    tokens = np.asarray(selected.tokens)
    np.testing.assert_allclose(selected.logprob, log_probs[np.arange(B), tokens], atol=1e-5)
    for row, p in enumerate(params):
        if p.temperature == 0 and not (constrained and constrained[row]):
            assert tokens[row] == int(np.argmax(x[row]))  # no penalties asked: the raw logits
        if constrained and constrained[row]:
            word = int(np.asarray(kwargs["token_mask"])[row, tokens[row] // 32])
            assert (word >> int(tokens[row] % 32)) & 1, "a constrained row drew a token its mask forbids"
    if want_top:
        expected = -np.sort(-log_probs, axis=-1)[:, :MAX_TOP_LOGPROBS]
        np.testing.assert_allclose(selected.top_logprobs, expected, atol=1e-5)
    else:
        assert not np.asarray(selected.top_logprobs).any()


def test_engine_with_the_select_sampler_generates_the_same(tiny_params):
    """Wiring: the GPU's branch-free sampler inside the real multi-step decode call gives the
    same tokens, logprobs and top logprobs as the branched one, for a batch mixing greedy,
    filtered, penalised and top-logprob requests."""
    requests = [
        ([5, 9, 33, 2], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, top_logprobs=4)),
        (
            [7, 7, 1],
            SamplingParams(
                temperature=0.8,
                top_k=5,
                top_p=0.5,
                seed=2,
                max_tokens=9,
                ignore_eos=True,
                logprobs=True,
                top_logprobs=20,
            ),
        ),
        (
            [3] * 11,
            SamplingParams(
                temperature=1.0,
                min_p=0.2,
                repetition_penalty=1.2,
                frequency_penalty=0.4,
                logit_bias={1: 5.0},
                seed=9,
                max_tokens=9,
                ignore_eos=True,
            ),
        ),
    ]
    results = {}
    for branches in ("cond", "select"):
        seqs = _run(_tiny_engine(tiny_params, branches), requests)
        results[branches] = [(s.generated, s.logprobs, s.top_logprobs) for s in seqs]
    assert results["select"] == results["cond"]
    assert len(set(results["select"][1][0])) > 2  # the sampled row really sampled


def test_plain_decode_calls_draw_what_full_ones_do(tiny_params):
    """Decode calls whose requests need no filter and no top logprobs compile those parts
    out; a request draws the same tokens and logprobs whether its neighbour forces the full
    sampler (top logprobs) or not."""
    plain = [
        ([5, 9, 33, 2], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=True)),
        ([3] * 11, SamplingParams(temperature=1.1, repetition_penalty=1.2, seed=9, max_tokens=9, ignore_eos=True)),
    ]
    forcing = ([7, 7, 1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, top_logprobs=2))
    results, calls = {}, {}
    for neighbour in (False, True):
        engine = _tiny_engine(tiny_params, "select")
        engine.warmup()
        seen = []

        class Recording(dict):  # notes which compiled variant each round asks for
            def get(self, key, default=None):
                seen.append(key)
                return super().get(key, default)

        engine._compiled = Recording(engine._compiled)
        seqs = _run(engine, plain + ([forcing] if neighbour else []))
        results[neighbour] = [(s.generated, s.logprobs) for s in seqs[: len(plain)]]
        calls[neighbour] = {key[-1] for key in seen if key[0] == "decode"}
    # Prompts are packed differently with the neighbour, so logprobs may differ in the last bits
    # (of float32 logits in the tens: the weights are scaled x20).
    for (tokens, logprobs), (tokens_ref, logprobs_ref) in zip(results[True], results[False]):
        assert tokens == tokens_ref
        np.testing.assert_allclose(logprobs, logprobs_ref, rtol=3e-5, atol=1e-5)
    assert calls == {False: {False}, True: {True}}  # plain calls alone, then full calls only
    assert len(set(results[False][1][0])) > 2


@pytest.mark.parametrize("branches", ["cond", "select"])
def test_a_row_without_filters_keeps_its_vocabulary_beside_a_filtering_row(branches):
    """Filtering runs per row: a row asking no top-k/top-p/min-p keeps every id even when a
    neighbour filters. (Run through the filter with top_p = 1, a near-certain row would lose
    its tail: the float32 cumulative sum reaches 1.0 before the end.)"""

    peaked = jnp.zeros((V,), jnp.float32).at[3].set(25.0)
    scaled = jnp.stack([peaked, jax.random.normal(jax.random.PRNGKey(0), (V,)) * 3])
    s = _rows([PLAIN_DRAW, FILTERED])
    assert not np.asarray(_filter_mask(peaked, jnp.int32(0), jnp.float32(1.0), jnp.float32(0.0))).all()
    keep = np.asarray(jax.jit(lambda: _filter_rows(scaled, s, jnp.array([False, True]), branches))())
    assert keep[0].all()
    np.testing.assert_array_equal(keep[1], _filter_mask(scaled[1], s.top_k[1], s.top_p[1], s.min_p[1]))
    assert 0 < keep[1].sum() <= FILTERED.top_k


def test_plain_decode_variants_compile_only_where_they_save_a_wait(tiny_params):
    """With lax.cond (the CPU) the parts a plain sampler leaves out already cost nothing
    unused, so no plain variant is compiled and every decode call takes the full one."""
    keys = {}
    for branches in ("cond", "select"):
        engine = _tiny_engine(tiny_params, branches)
        engine.warmup()
        keys[branches] = {key for key in engine._compiled if key[0] == "decode"}
        seqs = _run(engine, [([5, 9, 33, 2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))])
        assert len(seqs[0].generated) == 6
    assert {key[-1] for key in keys["cond"]} == {True}
    assert {key[-1] for key in keys["select"]} == {True, False}
    assert len(keys["select"]) == 2 * len(keys["cond"])
