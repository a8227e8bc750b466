"""Speculative decoding: drafts change how many tokens a round emits, never which tokens.

The reference is the same engine without drafts: greedy and seeded sampling (with penalties,
stop tokens and max_tokens) must give the same tokens token for token, for a dense model and
a hybrid one (whose linear-attention state rolls back to the accepted length)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.loading.dummy import dummy_params
from jaxllm.sampling import SamplingParams
from jaxllm.speculative import DraftControl, NgramIndex, prompt_lookup
from compile_watch import compilations  # tests/ is on sys.path (conftest)
from tiny_configs import TINY_DENSE, TINY_HYBRID_MOE

DENSE = TINY_DENSE
HYBRID = TINY_HYBRID_MOE
PROMPTS = [[5, 9, 33, 2, 71, 5, 9, 33, 2, 71, 5, 9], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7]]
SAMPLERS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, max_tokens=24),  # eos (id 0) may stop a sequence mid-round
    SamplingParams(
        temperature=0.8,
        top_p=0.9,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        min_tokens=3,
        seed=3,
        max_tokens=24,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
    ),
]


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def model(request):
    cfg = DENSE if request.param == "dense" else HYBRID
    scale = 20 if request.param == "dense" else 8  # far from uniform, so sampled runs differ by seed
    return cfg, jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, dummy_params(cfg, seed=1))


def run(model, prompts, sampling, *, max_drafts=0, source=None, steps=1, verify_cost=2.0):
    cfg, params = model
    config = EngineConfig(
        max_slots=4,
        kv_bytes=1 << 20,
        max_seq_len=96,
        chunk_buckets=(8, 32),
        min_ctx_pages=2,
        decode_widths=(1, 2),
        max_drafts=max_drafts,
        decode_steps_per_call=steps,
        verify_cost=verify_cost,  # default: the GPU's for dense models, the same rounds on any backend
    )
    engine = Engine(cfg, params, eos_ids=[0], config=config, **({} if source is None else {"draft_source": source}))
    seqs = [engine.add(p, sampling) for p in prompts]
    rounds = 0
    while any(s.finish_reason is None for s in seqs):
        engine.step()
        rounds += 1
    return seqs, rounds, engine


def oracle(reference: dict[tuple[int, ...], list[int]], wrong_every: int):
    """Drafts the true continuation, with every `wrong_every`-th draft of a round changed."""

    def source(tokens: list[int], k: int) -> list[int]:
        for prompt, full in reference.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                drafts = full[len(tokens) : len(tokens) + k]
                return [(t + 1) % 96 if (i + 1) % wrong_every == 0 else t for i, t in enumerate(drafts)]
        return []

    return source


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("sampler", range(len(SAMPLERS)))
def test_drafts_never_change_the_tokens(model, sampler, steps):
    sampling = SAMPLERS[sampler]
    plain, plain_rounds, _ = run(model, PROMPTS, sampling, steps=steps)
    reference = {tuple(p): p + s.generated for p, s in zip(PROMPTS, plain)}
    drafted, rounds, engine = run(model, PROMPTS, sampling, max_drafts=3, source=oracle(reference, 3), steps=steps)
    for a, b in zip(plain, drafted):
        assert b.generated == a.generated
        assert b.finish_reason == a.finish_reason
        # Verification attends through the chunk path, decoding through the decode kernel.
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=5e-3)  # logits of magnitude ~100 here
        assert [[i for i, _ in t] for t in b.top_logprobs] == [[i for i, _ in t] for t in a.top_logprobs]
    stats = engine.draft_stats
    assert stats.accepted[:2].sum() > 0 and stats.accepted[2] == 0  # the third draft is always wrong
    assert rounds < plain_rounds or steps > 1
    # Every position dispatched once; a plain call of several steps (taken when drafts are
    # too few to pay for a verification round) may run past the last token by fewer than its steps.
    assert all(len(s.generated) - 1 <= s.dispatched < len(s.generated) - 1 + steps for s in drafted)


def test_random_drafts_over_many_seeds(model):
    """Wrong drafts are rejected and right ones kept, whatever the seed: the sampled tokens
    (so their distribution) equal those of decoding without drafts."""
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 96, size=int(rng.integers(1, 12)))] for _ in range(4)]
    for seed in range(6):
        sampling = SamplingParams(temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True)
        plain, _, _ = run(model, prompts, sampling)
        reference = {tuple(p): p + s.generated for p, s in zip(prompts, plain)}
        guess = oracle(reference, 2)
        noisy = lambda tokens, k: [t if rng.random() < 0.7 else int(rng.integers(0, 96)) for t in guess(tokens, k)]  # noqa: E731
        drafted, _, _ = run(model, prompts, sampling, max_drafts=4, source=noisy)
        assert [s.generated for s in drafted] == [s.generated for s in plain]


def test_prompt_lookup_drafts_on_repetitive_text(model):
    prompt = PROMPTS[0] * 3
    plain, _, _ = run(model, [prompt], SAMPLERS[0])
    drafted, _, engine = run(model, [prompt], SAMPLERS[0], max_drafts=3)
    assert drafted[0].generated == plain[0].generated
    full = prompt + plain[0].generated
    # The first decode round already has a suffix n-gram to look up when the first token
    # continues the prompt's pattern; then drafting must have happened.
    if prompt_lookup(full[: len(prompt) + 1], 3):
        assert engine.draft_stats.proposed.sum() > 0
    assert engine.draft_stats.accepted.sum() <= engine.draft_stats.proposed.sum()


def test_prompt_lookup_takes_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 2, 3]
    assert prompt_lookup(tokens, 2) == [8, 7]  # "2 3" last seen before "8 7"
    assert prompt_lookup(tokens + [8], 3) == [7, 2, 3]  # "3 8" is the longest suffix seen before
    assert prompt_lookup([1, 2, 3, 4], 3) == []
    assert prompt_lookup([5, 5, 5, 5], 2) == [5]  # only what exists after the match
    assert prompt_lookup(tokens, 0) == []


def test_the_incremental_index_proposes_what_prompt_lookup_does():
    """Grown a few tokens at a time over small vocabularies (many repeats), the index's
    proposal equals a full scan's at every length and draft count."""
    rng = np.random.default_rng(0)
    for vocab in (2, 3, 5, 50):
        tokens = rng.integers(0, vocab, 300).tolist()
        index, at = NgramIndex(), 0
        while at < len(tokens):
            step = int(rng.integers(1, 5))
            index.extend(tokens[at : at + step])
            at += step
            for k in (1, 3, 6):
                assert index.propose(k) == prompt_lookup(tokens[:at], k), (vocab, at, k)


def test_draft_control_turns_itself_down_and_back_up():
    c = DraftControl(most=3, rest=4)
    assert c.wanted() == 3
    for _ in range(3):
        c.verified(c.wanted(), 0)
    assert c.wanted() == 0  # three rounds with nothing accepted: resting
    c.plain_tokens(4)
    assert c.wanted() == 1
    c.verified(1, 1)
    c.verified(2, 2)
    assert c.wanted() == 3 and (c.proposed, c.accepted) == (9, 3)


def test_no_compilation_after_warmup_with_drafts(model):
    cfg, params = model
    if cfg.is_hybrid:
        pytest.skip("the variant keys do not depend on the family; one warm-up keeps the suite's time")
    config = EngineConfig(
        max_slots=3,
        kv_bytes=1 << 20,
        max_seq_len=96,
        chunk_buckets=(8, 32),
        min_ctx_pages=2,
        decode_widths=(1,),
        max_drafts=3,
        decode_steps_per_call=2,
        warmup_runs=True,
        verify_cost=1.0,  # every round with drafts verifies: both round kinds must be warm
    )
    engine = Engine(cfg, params, eos_ids=[0], config=config, draft_source=lambda tokens, k: tokens[-k:])
    engine.warmup()
    with compilations() as compiles:
        seqs = [engine.add(p, s) for p, s in zip(PROMPTS, SAMPLERS)]
        while any(s.finish_reason is None for s in seqs):
            engine.step()
    assert engine.draft_stats.proposed.sum() > 0
    assert compiles == [], f"{len(compiles)} compilations after warm-up"


def test_mtp_head_drafts_on_device_without_changing_tokens():
    cfg = HYBRID.replace(mtp_layers=1)
    params = dummy_params(cfg, seed=2)
    params = params.replace(layers=jax.tree.map(lambda x: x * 8 if x.ndim > 1 else x, params.layers))
    model = (cfg, params)
    for sampling in SAMPLERS[:2]:
        plain, _, _ = run(model, PROMPTS, sampling)
        drafted, _, engine = run(model, PROMPTS, sampling, max_drafts=2)
        assert engine.mtp_drafts
        assert [s.generated for s in drafted] == [s.generated for s in plain]
        assert engine.draft_stats.proposed[0] > 0  # the head drafted from the second round on


def recent_and_position(logits: jax.Array, ctx) -> jax.Array:
    """A user processor that reads its context: a position-dependent nudge, and the token
    just before the one drawn (from the row's history) banned."""
    ids = jnp.arange(logits.shape[0])
    return logits + 0.5 * jnp.cos(ids + ctx.length) - 1e4 * (ids == ctx.tokens[ctx.length - 1])


STATEFUL = {
    "temperature": SamplingParams(temperature=1.0, seed=11),
    "penalties": SamplingParams(
        temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, seed=3
    ),
    "mirostat": SamplingParams(temperature=1.0, mirostat_tau=3.0, mirostat_eta=0.5, seed=5),
    "dry": SamplingParams(temperature=0.7, dry_multiplier=1.0, dry_allowed_length=1, seed=9),
    "processor": SamplingParams(temperature=1.0, logits_processor=recent_and_position, seed=13),
}


def every_other_call(source):
    """`source`, but each sequence (told apart by its first token) is given drafts only on
    every other call: rounds alternate between verification and plain multi-step calls."""
    calls: dict[int, int] = {}

    def alternating(tokens: list[int], k: int) -> list[int]:
        calls[tokens[0]] = calls.get(tokens[0], 0) + 1
        return source(tokens, k) if calls[tokens[0]] % 2 else []

    return alternating


@pytest.mark.parametrize("name", STATEFUL)
def test_seeded_tokens_do_not_depend_on_the_round_kinds(model, name):
    """A stateful sampler (mirostat's μ, DRY's and a processor's view of the history, penalty
    counts) carries its state through verification rounds exactly as through decode steps:
    rounds alternating verification and 3-step plain calls give each sequence the tokens
    (and entropies) it gets alone without drafts."""
    cfg, params = model
    sampling = dataclasses.replace(STATEFUL[name], max_tokens=20, ignore_eos=True)

    def research_run(prompts, max_drafts=0, source=None):
        config = EngineConfig(
            max_slots=4,
            kv_bytes=1 << 20,
            max_seq_len=96,
            chunk_buckets=(8, 32),
            min_ctx_pages=2,
            decode_widths=(1, 2),
            max_drafts=max_drafts,
            decode_steps_per_call=3,
            extra_samplers=True,
            logits_processors=(recent_and_position,),
            verify_cost=1.0,  # every round with drafts verifies: the source alone alternates them
        )
        engine = Engine(cfg, params, eos_ids=[0], config=config, **({} if source is None else {"draft_source": source}))
        seqs = [engine.add(p, sampling) for p in prompts]
        kinds = []
        while any(s.finish_reason is None for s in seqs):
            handle = engine.launch()
            kinds.append("verify" if handle.drafts else f"plain{handle.plan.steps}")
            engine.collect(handle)
        return seqs, kinds, engine

    alone = [research_run([p])[0][0] for p in PROMPTS]
    reference = {tuple(p): p + s.generated for p, s in zip(PROMPTS, alone)}
    drafted, kinds, engine = research_run(PROMPTS, max_drafts=3, source=every_other_call(oracle(reference, 3)))
    assert {"verify", "plain3"} <= set(kinds)
    assert engine.draft_stats.accepted.sum() > 0  # some verification rounds emitted several tokens
    for a, b in zip(alone, drafted):
        assert b.generated == a.generated
        np.testing.assert_allclose(b.entropies, a.entropies, atol=5e-3)


def test_a_lone_draft_does_not_turn_a_wide_multi_step_round_into_a_verification(model):
    """With several decoding sequences and several steps a call, a verification round (one
    step for everyone) is launched only when the drafts are expected to give `verify_cost`
    tokens a sequence: one sequence's lone retry never costs the others their multi-step
    call, while a lone sequence still verifies its drafts."""
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    lone = lambda tokens, k: [tokens[-1]] if tokens[: len(PROMPTS[0])] == PROMPTS[0] else []  # noqa: E731
    _, _, engine = run(model, PROMPTS, sampling, max_drafts=3, source=lone, steps=3)
    assert engine.draft_stats.proposed.sum() == 0
    _, _, engine = run(model, PROMPTS[:1], sampling, max_drafts=3, source=lone, steps=3)
    assert engine.draft_stats.proposed.sum() > 0
    everyone = lambda tokens, k: [tokens[-1]] * k  # noqa: E731
    _, _, engine = run(model, PROMPTS, sampling, max_drafts=3, source=everyone, steps=3)
    assert engine.draft_stats.proposed.sum() > 0


def test_a_lone_sequence_does_not_draft_where_no_round_could_pay(model):
    """Where a verification round costs more plain steps than 1 + max_drafts tokens (the
    35B-A3B shape's MTP rounds on an H200: 4.01), even a lone sequence keeps its multi-step
    calls; below that bound it verifies as before."""
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    everyone = lambda tokens, k: [tokens[-1]] * k  # noqa: E731
    alone, _, _ = run(model, PROMPTS[:1], sampling)
    drafted, _, engine = run(model, PROMPTS[:1], sampling, max_drafts=3, source=everyone, steps=3, verify_cost=4.01)
    assert engine.draft_stats.proposed.sum() == 0
    assert drafted[0].generated == alone[0].generated
    _, _, engine = run(model, PROMPTS[:1], sampling, max_drafts=3, source=everyone, steps=3, verify_cost=3.9)
    assert engine.draft_stats.proposed.sum() > 0


def test_acceptance_counts_the_drafts_that_were_checked():
    """A round's drafts after its first miss were never compared with the model's token, so
    the rate is accepted over checked; with few checks it leans on the optimistic prior."""
    c = DraftControl(most=3)
    assert c.acceptance() == pytest.approx(0.8) and c.expected_tokens(2) == pytest.approx(1 + 0.8 + 0.64)
    for _ in range(40):
        c.verified(3, 1)  # one accepted, then a miss: 2 checked of 3 proposed
    assert c.checked == 80 and c.acceptance() == pytest.approx((40 + 3.2) / 84)
    assert c.expected_tokens(0) == 1 and c.expected_tokens(3) < 2
