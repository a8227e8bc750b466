"""The research samplers against numpy statements of their papers' definitions.

Each filter's keep-set and renormalised distribution on fixed logits equals numpy's; the draws
of the whole compiled sampler (`jaxllm.sampling.sample` with `ExtraSampling` rows) follow
numpy's distribution (χ²); DRY's penalties equal the reference loop of text-generation-webui;
mirostat's μ follows its update rule; user processors see their row's context.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxllm import samplers_extra as sx
from jaxllm.sampling import SamplingParams, sample, sampling_row

V = 24
S = 64


# ---- numpy references ---------------------------------------------------------------------
def np_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def np_entropy(p: np.ndarray) -> float:
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum())


def np_typical(logits, mass):
    """Meister et al. 2022: sort by |−log p − H|, keep the shortest prefix of mass >= τ."""
    p = np_softmax(logits)
    with np.errstate(divide="ignore", invalid="ignore"):
        shift = np.abs(-np.log(p) - np_entropy(p))
    order = np.argsort(shift, kind="stable")
    keep, total = np.zeros(len(p), bool), 0.0
    for i in order:
        keep[i] = True
        total += p[i]
        if total >= mass:
            break
    return keep


def np_epsilon(logits, eps):
    p = np_softmax(logits)
    return (p > eps) | (np.arange(len(p)) == p.argmax())


def np_eta(logits, eps):
    p = np_softmax(logits)
    eta = min(eps, np.sqrt(eps) * np.exp(-np_entropy(p)))
    return (p > eta) | (np.arange(len(p)) == p.argmax())


def np_top_n_sigma(logits, n):
    finite = logits[np.isfinite(logits)]
    return logits >= finite.max() - n * finite.std()


def np_xtc(logits, threshold):
    """Applied (the coin came up): all tokens of p >= threshold but the least likely go."""
    p = np_softmax(logits)
    above = np.flatnonzero(p >= threshold)
    keep = np.ones(len(p), bool)
    if len(above) >= 2:
        keep[above] = False
        keep[above[np.argmin(p[above])]] = True
    return keep


def np_mirostat_keep(logits, mu):
    p = np_softmax(logits)
    with np.errstate(divide="ignore"):
        return (-np.log2(p) <= mu) | (np.arange(len(p)) == p.argmax())


def np_dry(history, multiplier, base, allowed, breakers):
    """text-generation-webui's DRY loop (the reference implementation), one row."""
    penalty = np.zeros(V)
    last = history[-1]
    if last in breakers:
        return penalty
    lengths: dict[int, int] = {}
    for i in np.flatnonzero(history[:-1] == last):
        nxt = int(history[i + 1])
        if nxt in breakers:
            continue
        m = 1
        while True:
            j = i - m
            if j < 0 or history[j] in breakers or history[j] != history[-m - 1]:
                break
            m += 1
        lengths[nxt] = max(m, lengths.get(nxt, 0))
    for token, m in lengths.items():
        if m >= allowed:
            penalty[token] += multiplier * base ** (m - allowed)
    return penalty


def renormalised(logits, keep):
    return np_softmax(np.where(keep, logits, -np.inf))


# ---- fixtures -----------------------------------------------------------------------------
def fixed_logits(n_rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.5, 4.0, (n_rows, 1))
    return (rng.standard_normal((n_rows, V)) * scale).astype(np.float32)


def slot_rows(params: list[SamplingParams], prompts: list[list[int]] | None = None, processors=()):
    prompts = prompts or [[1, 2, 3]] * len(params)
    rows = []
    for p, prompt in zip(params, prompts):
        row = sampling_row(p, V, set(), np.uint32(p.seed or 0))
        rows.append(row.replace(extra=sx.extra_row(p, V, S, prompt, tuple(processors))))
    return jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *rows)


@jax.jit
def _sample(logits, s, positions):
    """The compiled sampler with no penalties' state (one compilation per batch shape)."""
    B = logits.shape[0]
    return sample(
        logits,
        s,
        jnp.zeros((B, V), bool),
        jnp.zeros((B, V), jnp.int32),
        jnp.zeros((B,), jnp.int32),
        positions,
        jnp.bool_(False),
    )


def draw(logits: np.ndarray, params: list[SamplingParams], positions=None, prompts=None, processors=()):
    B = logits.shape[0]
    s = slot_rows(params, prompts, processors)
    positions = jnp.full((B,), 3, jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)
    return _sample(jnp.asarray(logits), s, positions)


KEEP_CASES = {
    "typical": (lambda x, a: sx.typical_keep(x, a), np_typical, (0.2, 0.5, 0.9)),
    "epsilon": (lambda x, a: sx.epsilon_keep(x, a), np_epsilon, (0.01, 0.05, 0.2)),
    "eta": (lambda x, a: sx.eta_keep(x, a), np_eta, (0.001, 0.02, 0.3)),
    "top-n-sigma": (lambda x, a: sx.top_n_sigma_keep(x, a), np_top_n_sigma, (0.5, 1.0, 2.0)),
    "xtc": (lambda x, a: sx.xtc_keep(x, a, jnp.bool_(True)), np_xtc, (0.05, 0.1, 0.3)),
    "mirostat": (lambda x, a: sx.mirostat_keep(x, a), np_mirostat_keep, (1.0, 3.0, 6.0)),
}


@pytest.mark.parametrize("name", KEEP_CASES)
def test_keep_set_and_renormalised_probabilities_match_numpy(name):
    jax_keep, np_keep, values = KEEP_CASES[name]
    logits = fixed_logits(12, seed=len(name))
    logits[0, 5:9] = logits[0, 4]  # ties
    logits[1, 3] = -np.inf  # a masked token (logit bias / constraint)
    for value in values:
        for row in logits:
            got = np.asarray(jax_keep(jnp.asarray(row), jnp.float32(value)))
            want = np_keep(row.astype(np.float64), value)
            assert (got == want).all(), (name, value, np.flatnonzero(got != want))
            got_p = np.asarray(jax.nn.softmax(jnp.where(got, row, -jnp.inf)))
            np.testing.assert_allclose(got_p, renormalised(row, want), atol=1e-6)


SAMPLERS = {
    "typical": (SamplingParams(temperature=0.8, typical_p=0.6), lambda x: np_typical(x, 0.6)),
    "epsilon": (SamplingParams(temperature=1.2, epsilon_cutoff=0.03), lambda x: np_epsilon(x, 0.03)),
    "eta": (SamplingParams(temperature=1.0, eta_cutoff=0.05), lambda x: np_eta(x, 0.05)),
    "top-n-sigma": (SamplingParams(temperature=1.5, top_n_sigma=1.0), lambda x: np_top_n_sigma(x, 1.0)),
    "xtc always": (SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.08), lambda x: np_xtc(x, 0.08)),
    "mirostat": (SamplingParams(temperature=1.0, mirostat_tau=2.0), lambda x: np_mirostat_keep(x, 4.0)),
}


@pytest.mark.parametrize("name", SAMPLERS)
def test_draws_follow_the_numpy_distribution(name):
    """4000 seeds draw the first token of one row of logits through the compiled sampler; the
    counts fit numpy's renormalised distribution (χ², p > 1e-4) and nothing outside the
    keep-set is ever drawn."""
    params, np_keep = SAMPLERS[name]
    n = 4000
    row = np.random.default_rng(7).standard_normal(V).astype(np.float32) * 1.5
    scaled = row / params.temperature
    keep = np_keep(scaled.astype(np.float64))
    assert 1 < keep.sum() < V, "a case where the filter both keeps and drops"
    tokens = np.asarray(
        draw(np.repeat(row[None], n, 0), [params.__class__(**{**params.__dict__, "seed": i}) for i in range(n)]).tokens
    )
    assert keep[tokens].all()
    expected = renormalised(scaled, keep)
    counts = np.bincount(tokens, minlength=V)[keep]
    e = expected[keep] * n
    assert stats.chisquare(counts, e).pvalue > 1e-4


def test_xtc_applies_with_its_probability():
    n = 4000
    row = np.random.default_rng(7).standard_normal(V).astype(np.float32) * 1.5
    p = SamplingParams(temperature=1.0, xtc_probability=0.3, xtc_threshold=0.08)
    removed = ~np_xtc(row.astype(np.float64), 0.08)
    assert removed.any()
    tokens = np.asarray(
        draw(np.repeat(row[None], n, 0), [SamplingParams(**{**p.__dict__, "seed": i}) for i in range(n)]).tokens
    )
    # Removed tokens are drawn only in rows where the coin did not come up (70%), and then
    # with their whole-distribution probability.
    share = removed[tokens].mean()
    expected = 0.7 * np_softmax(row)[removed].sum()
    assert abs(share - expected) < 4 * np.sqrt(expected * (1 - expected) / n)


def test_dry_penalties_match_the_reference_loop():
    rng = np.random.default_rng(0)
    histories = [rng.integers(0, 4, 40) for _ in range(6)]
    motif = [5, 6, 7, 8, 9, 10]
    histories += [np.array((motif * 5)[:29]), np.array([1, 2, 3, 11, 1, 2, 3, 12, 4, 1, 2, 3])]
    for allowed, base, mult, breakers in [(2, 1.75, 0.8, ()), (1, 2.0, 1.0, (2,)), (3, 1.5, 0.5, (7, 0))]:
        mask = np.zeros(V, bool)
        mask[list(breakers)] = True
        for h in histories:
            padded = np.zeros(S, np.int32)
            padded[: len(h)] = h
            got = np.asarray(
                jax.jit(sx.dry_penalty)(
                    jnp.asarray(padded),
                    jnp.int32(len(h)),
                    jnp.float32(mult),
                    jnp.float32(base),
                    jnp.int32(allowed),
                    jnp.asarray(mask),
                )
            )
            want = np_dry(h, mult, base, allowed, set(breakers))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            assert want.any() or len(breakers), "every case without breakers penalises something"


def test_dry_in_the_sampler_penalises_before_the_temperature():
    """Greedy rows with DRY take argmax(logits - penalty), the penalty from the row's history."""
    history = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    logits = np.zeros((1, V), np.float32)
    logits[0, 8] = 3.0  # the repeat's continuation is the model's favourite
    logits[0, 9] = 2.5
    p = SamplingParams(temperature=0, dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)
    want = np.argmax(logits[0] - np_dry(np.array(history), 1.0, 2.0, 2, set()))
    out = draw(logits, [p], positions=[len(history)], prompts=[history])
    assert int(out.tokens[0]) == want == 9


def test_mirostat_mu_follows_its_update_rule():
    """Several steps on fixed logits: each drawn token lies in numpy's keep-set for the current
    μ, and μ moves by -η (surprise under the renormalised kept distribution - τ)."""
    row = fixed_logits(1, seed=11)[0] * 2
    tau, eta = 2.5, 0.3
    params = [SamplingParams(temperature=1.0, mirostat_tau=tau, mirostat_eta=eta, seed=s) for s in range(8)]
    s = slot_rows(params)
    mu = np.full(8, 2 * tau)
    B = len(params)
    fn = lambda s, pos: _sample(jnp.asarray(np.repeat(row[None], B, 0)), s, pos)  # noqa: E731
    for step in range(5):
        out = fn(s, jnp.full((B,), 3 + step, jnp.int32))
        tokens = np.asarray(out.tokens)
        for b in range(B):
            keep = np_mirostat_keep(row.astype(np.float64), mu[b])
            assert keep[tokens[b]]
            surprise = -np.log2(renormalised(row, keep)[tokens[b]])
            mu[b] = mu[b] - eta * (surprise - tau)
        np.testing.assert_allclose(np.asarray(out.extra.mu), mu, rtol=1e-4)
        s = s.replace(extra=out.extra)


def test_user_processor_sees_its_row_context():
    """A processor forcing token `(length + n_generated) % V` and one banning even ids, in one
    batch with a plain row: each row gets its own function and context."""

    def force_position(logits, ctx):
        return jnp.where(jnp.arange(logits.shape[0]) == (ctx.length + ctx.n_generated) % V, 50.0, -50.0)

    def ban_even(logits, ctx):
        return jnp.where(jnp.arange(logits.shape[0]) % 2 == 0, -jnp.inf, logits)

    procs = (force_position, ban_even)
    n = 64
    logits = np.repeat(fixed_logits(1, seed=2), n, 0)
    params = [
        SamplingParams(temperature=1.0, seed=i, logits_processor=procs[i % 3] if i % 3 < 2 else None) for i in range(n)
    ]
    positions = np.arange(n) + 5
    out = np.asarray(draw(logits, params, positions=positions, processors=procs).tokens)
    forced, banned, plain = out[0::3], out[1::3], out[2::3]
    assert (forced == positions[0::3] % V).all()
    assert (banned % 2 == 1).all()
    assert (plain % 2 == 0).any()


def test_neutral_extra_rows_draw_what_the_plain_sampler_does():
    """Rows with every research sampler off draw exactly what a state without them draws."""
    logits = fixed_logits(16, seed=4) * 2
    params = [
        SamplingParams(temperature=[0, 0.7, 1.0, 1.3][i % 4], top_p=0.9 if i % 2 else 1.0, seed=i) for i in range(16)
    ]
    with_extra = np.asarray(draw(logits, params).tokens)
    plain = slot_rows(params).replace(extra=None)
    B = len(params)
    without = jax.jit(
        lambda lg, s: sample(
            lg,
            s,
            jnp.zeros((B, V), bool),
            jnp.zeros((B, V), jnp.int32),
            jnp.zeros((B,), jnp.int32),
            jnp.full((B,), 3, jnp.int32),
            jnp.bool_(False),
        )
    )(jnp.asarray(logits), plain)
    assert (with_extra == np.asarray(without.tokens)).all()


def test_select_branches_draw_what_cond_branches_do():
    """The GPU's branch-free sampler (every part computed, results selected) draws the same
    tokens and moves mirostat's μ the same way with research rows in the batch."""
    logits = fixed_logits(len(SAMPLERS) + 2, seed=9) * 2
    params = [dataclasses.replace(p, seed=i) for i, (p, _) in enumerate(SAMPLERS.values())]
    params += [SamplingParams(temperature=0), SamplingParams(temperature=0.8, dry_multiplier=1.0, seed=3)]
    B = len(params)
    s = slot_rows(params, prompts=[[1, 2, 3, 1, 2]] * B)
    outs = [
        jax.jit(
            lambda lg, s, b=b: sample(
                lg,
                s,
                jnp.zeros((B, V), bool),
                jnp.zeros((B, V), jnp.int32),
                jnp.zeros((B,), jnp.int32),
                jnp.full((B,), 5, jnp.int32),
                jnp.bool_(False),
                branches=b,
            )
        )(jnp.asarray(logits), s)
        for b in ("cond", "select")
    ]
    assert (np.asarray(outs[0].tokens) == np.asarray(outs[1].tokens)).all()
    np.testing.assert_allclose(np.asarray(outs[0].extra.mu), np.asarray(outs[1].extra.mu), rtol=1e-6)
