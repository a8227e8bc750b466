"""jaxllm.research: comparisons as DataFrames, tasks, metrics, frontier; draws against the
model's own logits (χ²); same prompt + seed -> same tokens whatever else is in the batch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from tiny_configs import TINY_DENSE
from jaxllm.api import Model
from jaxllm.loading.dummy import dummy_params
from jaxllm.research import compare, frontier, make_tasks, pareto_front
from jaxllm.research import metrics, tasks
from jaxllm.engine_runs import research_engine, run_rows
from jaxllm.research.compare import sequence_logits
from jaxllm.sampling import SamplingParams, sample, sampling_row
from jaxllm.tokenizer import Tokenizer
from compile_watch import compilations  # tests/ is on sys.path (conftest)

TINY = TINY_DENSE.replace(max_position=512)
V = TINY.vocab_size


@pytest.fixture(scope="module")
def model() -> Model:
    # Larger weights than the loader's default so the distribution is not near uniform.
    params = jax.tree.map(lambda x: x * 6 if x.ndim > 1 else x, dummy_params(TINY, seed=3))
    return Model(cfg=TINY, params=params, tokenizer=Tokenizer.synthetic(V))


def shift(logits: jax.Array, ctx) -> jax.Array:
    """A user processor: a position-dependent nudge (every test's engine compiles it in, so
    they share compilations)."""
    return logits + 0.5 * jnp.cos(jnp.arange(logits.shape[0]) + ctx.length)


PROCS = (shift,)

SAMPLERS = {
    "greedy": SamplingParams(temperature=0),
    "t0.8": SamplingParams(temperature=0.8),
    "top-p": SamplingParams(temperature=1.0, top_p=0.8),
    "min-p": SamplingParams(temperature=1.0, min_p=0.1),
    "typical": SamplingParams(temperature=1.0, typical_p=0.7),
    "dry": SamplingParams(temperature=0.7, dry_multiplier=1.0, dry_allowed_length=1),
    "xtc": SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.1),
    "mirostat": SamplingParams(temperature=1.0, mirostat_tau=3.0),
    "processor": SamplingParams(temperature=1.0, logits_processor=shift),
}


def test_compare_table_measures_each_sample(model):
    prompts = [
        "t5 t6 t7",
        [{"role": "user", "content": "t9 t9 t10"}],
        [3, 4, 5, 6, 7, 8],
        make_tasks(1, kinds=("copy",))[0],
    ]
    table = compare(model, prompts, SAMPLERS, seeds=[0, 1], max_tokens=12, max_slots=8)
    assert len(table) == len(prompts) * len(SAMPLERS) * 2
    for column in (
        "prompt",
        "sampler",
        "seed",
        "text",
        "token_ids",
        "n_tokens",
        "nll",
        "mean_entropy",
        "distinct_1",
        "distinct_2",
        "repetition",
        "score",
    ):
        assert column in table.columns
    chat = model.chat_ids([{"role": "user", "content": "t5 t6 t7"}])
    for row in table.itertuples():
        ids = list(row.token_ids)
        assert row.n_tokens == len(ids) > 0
        if row.prompt == "t5 t6 t7":
            # nll and entropy against numpy on the model's logits of the whole sequence (an
            # independent prefill of prompt + sample).
            logits = np.asarray(model.logits(chat + ids), np.float64)[len(chat) - 1 : len(chat) - 1 + len(ids)]
            logp = logits - logits.max(-1, keepdims=True)
            logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
            np.testing.assert_allclose(row.nll, -logp[np.arange(len(ids)), ids].mean(), rtol=2e-3, atol=2e-3)
            np.testing.assert_allclose(row.mean_entropy, -(np.exp(logp) * logp).sum(-1).mean(), rtol=2e-3, atol=2e-3)
        assert row.distinct_1 == len(set(ids)) / len(ids)
        bigrams = list(zip(ids, ids[1:]))
        assert row.distinct_2 == pytest.approx(len(set(bigrams)) / len(bigrams))
        grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
        assert row.repetition == pytest.approx(1 - len(set(grams)) / len(grams) if grams else 0.0)
        assert np.isnan(row.score) == (not isinstance(row.task, str))
    greedy = table[table.sampler == "greedy"]
    assert (greedy.groupby("prompt").text.nunique() == 1).all(), "greedy ignores the seed"
    # A row's tokens depend on its (prompt, sampler, seed) only: rerun one row alone.
    row = table[(table.sampler == "mirostat") & (table.seed == 1)].iloc[2]
    alone = compare(
        model,
        [prompts[2]],
        {"mirostat": SAMPLERS["mirostat"]},
        seeds=[1],
        max_tokens=12,
        max_slots=8,
        logits_processors=PROCS,
    )
    assert list(alone.token_ids[0]) == list(row.token_ids)


def test_samplers_share_compiled_rounds(model):
    """A second run of the same row layout with every sampler's values changed (and a user
    processor's rows swapped in) compiles nothing."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, V, int(n)).tolist() for n in rng.integers(3, 40, 12)]
    first = list(SAMPLERS.values())
    second = [
        dataclasses.replace(
            p,
            temperature=0.9,
            typical_p=0.5,
            dry_multiplier=0.3,
            mirostat_tau=2.0,
            logits_processor=shift if i % 2 else None,
        )
        for i, p in enumerate(first)
    ]
    engine = research_engine(model, 12, 64, max_slots=8, logits_processors=PROCS)

    def rows(samplers):
        return [
            (p, dataclasses.replace(samplers[i % len(samplers)], seed=i, max_tokens=10)) for i, p in enumerate(prompts)
        ]

    run_rows(model, engine, rows(first))
    with compilations() as compiles:
        out = run_rows(model, engine, rows(second))
    assert compiles == []
    assert all(s.completion.token_ids for s in out)


def _np_reference(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """vLLM / OpenAI semantics in numpy: temperature, then top-p on the sorted distribution
    (a token stays while the mass before it is < top_p), then min-p against the top token."""
    x = logits.astype(np.float64) / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(len(probs), bool)
    keep[order[before < p.top_p]] = True
    keep &= probs >= p.min_p * probs.max()
    out = np.where(keep, probs, 0)
    return out / out.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.6),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.2, min_p=0.08),
    ],
    ids=["T=0.7", "T=1.6", "top-p", "min-p"],
)
def test_draws_follow_the_models_own_distribution(model, params):
    """The engine's first token for a seed is the compiled sampler's draw on the model's own
    logits (checked for 8 seeds); 3000 seeds of that sampler fit numpy's distribution (χ²)."""
    prompt = [7, 21, 33, 2, 50]
    logits = np.asarray(model.logits(prompt))[-1]
    want = _np_reference(logits, params)
    assert (want > 1e-3).sum() >= 3, "a distribution worth testing"
    n = 3000
    rows = [sampling_row(dataclasses.replace(params, seed=i), V, set(), np.uint32(i)) for i in range(n)]
    s = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *rows)
    tokens = np.asarray(
        jax.jit(sample)(
            jnp.asarray(np.repeat(logits[None], n, 0)),
            s,
            jnp.zeros((n, V), bool),
            jnp.zeros((n, V), jnp.int32),
            jnp.zeros((n,), jnp.int32),
            jnp.full((n,), len(prompt), jnp.int32),
            jnp.bool_(False),
        ).tokens
    )
    assert (want[tokens] > 0).all(), "a token outside the kept set"
    counts = np.bincount(tokens, minlength=V)
    big = want * n >= 5  # χ² cells with enough expectation; the rest pooled
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(want[big] * n, want[~big].sum() * n)
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    assert stats.chisquare(observed, expected).pvalue > 1e-4
    engine = research_engine(model, 8, 16, logits_processors=PROCS)
    firsts = run_rows(model, engine, [(prompt, dataclasses.replace(params, seed=i, max_tokens=1)) for i in range(8)])
    assert [s.completion.token_ids[0] for s in firsts] == tokens[:8].tolist()


def _prefix_checkpoint(model, row):
    """The state of all of `row`'s prompt but its last token: what a prefix-cache hit restores."""
    ids, params = row
    engine = research_engine(model, 8, 48, logits_processors=PROCS)
    seq = engine.add(ids, dataclasses.replace(params, max_tokens=1))
    while seq.prefilled < len(ids):
        engine.step()
    return engine.extract(seq, len(ids) - 1)


@pytest.mark.parametrize("concurrent,drafts", [(8, 0), (32, 2)])
def test_same_prompt_and_seed_give_the_same_tokens_whatever_the_batch(model, concurrent, drafts):
    """Each target (a server sampler; stateful research ones) alone (1 concurrent) gives the
    tokens it gives among `concurrent` rows of mixed neighbours: other samplers, lengths,
    seeds and budgets (finished neighbours free slots that later rows take), drafting
    neighbours (`drafts`: prompt-lookup drafts verified in the same rounds; the targets then
    draft too) and resumed from a prefix checkpoint (a prefix-cache hit)."""
    targets = [
        ([5, 9, 14, 3], SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=10, ignore_eos=True)),
        (
            [8, 8, 2],
            SamplingParams(
                temperature=1.0, mirostat_tau=2.5, dry_multiplier=0.5, seed=7, max_tokens=10, ignore_eos=True
            ),
        ),
    ]
    alone = [
        run_rows(model, research_engine(model, 8, 48, logits_processors=PROCS), [t])[0].completion.token_ids
        for t in targets
    ]
    resumed = [(*t, _prefix_checkpoint(model, t)) for t in targets]
    rng = np.random.default_rng(concurrent)
    names = list(SAMPLERS)
    neighbours = [
        (
            rng.integers(1, V, int(rng.integers(1, 30))).tolist(),
            dataclasses.replace(
                SAMPLERS[names[i % len(names)]], seed=int(rng.integers(0, 1000)), max_tokens=int(rng.integers(1, 14))
            ),
        )
        for i in range(concurrent + 4 - 2 * len(targets))
    ]
    half = len(neighbours) // 2
    rows = neighbours[:half] + targets + resumed + neighbours[half:]
    # The GPU's verification cost: rounds alternate between verifying (while the drafts are
    # expected to pay) and plain multi-step calls, so the targets' samplers cross both kinds.
    engine = research_engine(model, concurrent, 48, logits_processors=PROCS, max_drafts=drafts, verify_cost=2.0)
    # Drafts in every round (the last token again, sometimes right), so verification rounds
    # carry the targets and their neighbours whatever the text.
    engine.draft_source = lambda tokens, k: [tokens[-1]] * k
    rounds = []
    launch = engine.launch

    def recorded(**kw):
        rounds.append(launch(**kw))
        return rounds[-1]

    engine.launch = recorded
    out = run_rows(model, engine, rows)
    assert [out[half + i].completion.token_ids for i in range(4)] == alone + alone
    assert (engine.draft_stats.proposed.sum() > 0) == (drafts > 0)
    rounds = [r for r in rounds if r is not None]
    assert any(r.plan.steps > 1 for r in rounds)  # plain multi-step calls...
    assert any(r.drafts for r in rounds) == (drafts > 0)  # ...and verification rounds


def test_task_checkers_score_right_and_wrong_answers():
    for seed in range(5):
        a = tasks.arithmetic(seed)
        assert a.check(f"{a.answer}") == 1 and a.check(f"The answer is {int(a.answer) + 1}.") == 0
        c = tasks.copying(seed)
        assert c.check(f"Sure:\n{c.answer}") == 1 and c.check(c.answer.rsplit(" ", 1)[0]) == 0
        j = tasks.json_extraction(seed)
        assert j.check(f"Here: {j.answer}") == 1 and j.check("no json") == 0
        import json

        broken = {**json.loads(j.answer), "city": "Nowhere"}
        assert j.check(json.dumps(broken)) == pytest.approx(2 / 3)
        lst = tasks.counted_list(seed)
        n = int(lst.prompt.split("until item ")[1].split(",")[0])
        assert lst.check("\n".join(f"{k}. owl" for k in range(3, n + 1))) == 1
        assert lst.check("3. owl\n4. fox") == pytest.approx(2 / (n - 2))
    assert make_tasks(2) == make_tasks(2) and len(make_tasks(2)) == 8


def test_metrics_on_known_sequences():
    assert metrics.distinct_n([1, 2, 1, 2], 1) == 0.5
    assert metrics.distinct_n([1, 2, 1, 2], 2) == pytest.approx(2 / 3)
    assert metrics.repetition([1, 2, 3, 4, 1, 2, 3, 4], 4) == pytest.approx(1 / 5)
    assert metrics.repetition([1, 2, 3], 4) == 0.0


def test_pareto_front_matches_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(20):
        xs, ys = rng.random(9), rng.random(9)
        front = set(pareto_front(xs, ys, y_lower=True).tolist())
        for i in range(9):
            dominated = any(xs[j] >= xs[i] and ys[j] <= ys[i] and (xs[j], ys[j]) != (xs[i], ys[i]) for j in range(9))
            assert (i in front) == (not dominated)


def test_frontier_draws_every_sampler(model):
    import matplotlib

    matplotlib.use("Agg")
    table = compare(
        model,
        [[3, 4, 5]],
        {k: SAMPLERS[k] for k in ("greedy", "t0.8", "min-p", "dry")},
        seeds=[0, 1],
        max_tokens=6,
        max_slots=8,
        logits_processors=PROCS,
    )
    ax = frontier(table, x="distinct_2", y="nll")
    assert sorted(t.get_text() for t in ax.texts) == ["dry", "greedy", "min-p", "t0.8"]
    assert ax.get_ylabel().startswith("nll")
    assert len(sequence_logits(model, [1, 2, 3])) == 3
