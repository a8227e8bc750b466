"""Research samplers beyond the server's: typical-p, epsilon, eta, top-nσ, DRY, XTC,
mirostat v2 and user-supplied logits processors, as per-slot arrays over the same draw.

They ride in `SlotSampling.extra` (None in a server's state: then none of this is traced).
An engine built with `EngineConfig(extra_samplers=True)` carries an `ExtraSampling` row per
slot, so rows of different samplers share one compiled round: every parameter is an array,
and a row whose parameter is at its neutral value keeps its whole vocabulary for that filter.

Definitions (each row, on the logits at the sampling temperature; p = softmax):
  * typical-p (Meister et al., 2022): tokens sorted by |-log p - H|, H the entropy; keep the
    shortest prefix whose mass reaches `typical_p`.
  * epsilon (Hewitt et al., 2022): keep p > ε; eta: keep p > min(ε, √ε·exp(-H)).
  * top-nσ (Tang et al., 2024): keep logits >= max - n·σ, σ the std of the finite logits.
  * XTC (p-e-w, text-generation-webui #6335): with probability `xtc_probability`, when at
    least two tokens have p >= `xtc_threshold`, drop all of them but the least likely.
  * mirostat v2 (Basu et al., 2021; llama.cpp's form): keep tokens of surprise -log2 p <= μ
    (at least the top one), draw from the renormalised rest, then μ -= η (s - τ) with s the
    surprise of the drawn token under that renormalised distribution; μ starts at 2τ.
  * DRY (p-e-w, text-generation-webui #5677): a token that would extend a repeat of the
    context's longest matching suffix (length m >= allowed_length, no sequence breaker in
    the match) loses multiplier·base^(m - allowed_length) from its logit, before the
    temperature. Matches are followed up to `DRY_MAX_MATCH` tokens back.
Each filter reads the whole distribution; their keep-sets intersect with top-k/top-p/min-p's
(if the intersection is empty, the most likely token is kept). Randomness (the XTC coin) is
a function of (seed, position) like the draw's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# `jaxllm.sampling.SamplingParams` (that module imports this one, so not back).
SamplingParams = Any

DRY_MAX_MATCH = 32
_NEG = -jnp.inf


@struct.dataclass
class RowContext:
    """What a user logits processor sees of its row besides the logits."""

    tokens: jax.Array  # [S] i32 the sequence so far (prompt then generated); valid below `length`
    length: jax.Array  # [] i32 tokens in context = position of the token being drawn
    n_generated: jax.Array  # [] i32
    seed: jax.Array  # [] u32


LogitsProcessor = Callable[[jax.Array, RowContext], jax.Array]  # ([V] f32, ctx) -> [V] f32


@struct.dataclass
class ExtraSampling:
    """Per-slot parameters and state of the research samplers ([B] unless noted)."""

    typical_p: jax.Array  # f32, 1 = off
    epsilon: jax.Array  # f32, 0 = off
    eta: jax.Array  # f32, 0 = off
    top_n_sigma: jax.Array  # f32, 0 = off
    xtc_threshold: jax.Array  # f32
    xtc_probability: jax.Array  # f32, 0 = off
    dry_multiplier: jax.Array  # f32, 0 = off
    dry_base: jax.Array  # f32
    dry_allowed_length: jax.Array  # i32
    dry_breakers: jax.Array  # [B, V] bool
    mirostat_tau: jax.Array  # f32, 0 = off
    mirostat_eta: jax.Array  # f32
    mu: jax.Array  # f32 mirostat's running threshold (state: updated every draw)
    processor: jax.Array  # i32: 0 = none, i = processors[i - 1]
    history: jax.Array  # [B, S] i32 the sequence's tokens by position (state)
    # The user functions a processor index picks; static (part of the compiled round).
    processors: tuple[LogitsProcessor, ...] = struct.field(pytree_node=False, default=())


def uses_extra(p: SamplingParams) -> bool:
    """Whether a request asks for any sampler of this module."""
    return (
        p.typical_p < 1
        or p.epsilon_cutoff > 0
        or p.eta_cutoff > 0
        or p.top_n_sigma > 0
        or p.xtc_probability > 0
        or p.dry_multiplier > 0
        or p.mirostat_tau > 0
        or p.logits_processor is not None
    )


def empty_extra(B: int, V: int, S: int, processors: tuple[LogitsProcessor, ...] = ()) -> ExtraSampling:
    f = lambda v: jnp.full((B,), v, jnp.float32)  # noqa: E731
    return ExtraSampling(
        typical_p=f(1.0),
        epsilon=f(0.0),
        eta=f(0.0),
        top_n_sigma=f(0.0),
        xtc_threshold=f(0.1),
        xtc_probability=f(0.0),
        dry_multiplier=f(0.0),
        dry_base=f(1.75),
        dry_allowed_length=jnp.full((B,), 2, jnp.int32),
        dry_breakers=jnp.zeros((B, V), bool),
        mirostat_tau=f(0.0),
        mirostat_eta=f(0.1),
        mu=f(0.0),
        processor=jnp.zeros((B,), jnp.int32),
        history=jnp.zeros((B, S), jnp.int32),
        processors=tuple(processors),
    )


def extra_row(
    p: SamplingParams, vocab_size: int, max_len: int, prompt: list[int], processors: tuple[LogitsProcessor, ...]
) -> ExtraSampling:
    """One slot's row, built on the host at admission. The history starts as the prompt, so a
    sequence restored from a checkpoint (prefix cache, fork) sees its whole context."""
    if p.logits_processor is not None and p.logits_processor not in processors:
        raise ValueError("logits_processor is not one the engine was built with (EngineConfig.logits_processors)")
    breakers = np.zeros((vocab_size,), bool)
    breakers[list(p.dry_sequence_breakers)] = True
    history = np.zeros((max_len,), np.int32)
    n = min(len(prompt), max_len)
    history[:n] = prompt[:n]
    f = np.float32
    return ExtraSampling(
        typical_p=f(p.typical_p),
        epsilon=f(p.epsilon_cutoff),
        eta=f(p.eta_cutoff),
        top_n_sigma=f(p.top_n_sigma),
        xtc_threshold=f(p.xtc_threshold),
        xtc_probability=f(p.xtc_probability),
        dry_multiplier=f(p.dry_multiplier),
        dry_base=f(p.dry_base),
        dry_allowed_length=np.int32(p.dry_allowed_length),
        dry_breakers=breakers,
        mirostat_tau=f(p.mirostat_tau),
        mirostat_eta=f(p.mirostat_eta),
        mu=f(2 * p.mirostat_tau),
        processor=np.int32(0 if p.logits_processor is None else processors.index(p.logits_processor) + 1),
        history=history,
        processors=tuple(processors),
    )


# ---- logits adjustments (before the temperature) ----------------------------------------
def dry_penalty(
    history: jax.Array,
    length: jax.Array,
    multiplier: jax.Array,
    base: jax.Array,
    allowed: jax.Array,
    breakers: jax.Array,
) -> jax.Array:
    """[V] f32 amount to subtract from one row's logits (see the module docstring).

    For every earlier position j (1 <= j < L) the match length m(j) counts k = 1, 2, ... while
    history[j - k] == history[L - k] and that token is no breaker; token history[j] then
    takes the largest m over its occurrences.
    """
    S = history.shape[0]
    V = breakers.shape[0]
    j = jnp.arange(S)

    def body(carry, k):
        alive, m = carry
        mine = history[jnp.clip(length - k, 0, S - 1)]
        theirs = history[jnp.clip(j - k, 0, S - 1)]
        alive = alive & (j - k >= 0) & (length - k >= 0) & (theirs == mine) & ~breakers[mine]
        return (alive, m + alive), None

    candidate = (j >= 1) & (j < length) & ~breakers[history]
    (_, m), _ = jax.lax.scan(body, (candidate, jnp.zeros((S,), jnp.int32)), jnp.arange(1, DRY_MAX_MATCH + 1))
    best = jnp.zeros((V,), jnp.int32).at[jnp.where(candidate, history, V)].max(m, mode="drop")
    exponent = jnp.minimum(best - allowed, 60).astype(jnp.float32)
    return jnp.where((best >= allowed) & (best > 0) & (multiplier > 0), multiplier * base**exponent, 0.0)


def adjust_logits(
    logits: jax.Array, e: ExtraSampling, positions: jax.Array, n_generated: jax.Array, seed: jax.Array, cond
) -> jax.Array:
    """DRY penalties, then the user processors; [B, V] f32 in and out."""
    dry = e.dry_multiplier > 0
    penalty = cond(
        jnp.any(dry),
        lambda: jax.vmap(dry_penalty)(
            e.history, positions, e.dry_multiplier, e.dry_base, e.dry_allowed_length, e.dry_breakers
        ),
        lambda: jnp.zeros_like(logits),
    )
    logits = logits - penalty
    if not e.processors:
        return logits
    branches = [lambda x, ctx: x] + [lambda x, ctx, f=f: f(x, ctx).astype(jnp.float32) for f in e.processors]

    def one(x, idx, tokens, length, n_gen, sd):
        return jax.lax.switch(idx, branches, x, RowContext(tokens=tokens, length=length, n_generated=n_gen, seed=sd))

    return jax.vmap(one)(logits, e.processor, e.history, positions, n_generated, seed)


# ---- keep-sets (on the logits at the sampling temperature), one row each ----------------
def _entropy(logp: jax.Array) -> jax.Array:
    return -jnp.sum(jnp.where(jnp.isfinite(logp), jnp.exp(logp) * logp, 0.0))


def _top(x: jax.Array) -> jax.Array:
    return jnp.arange(x.shape[0]) == jnp.argmax(x)


def typical_keep(logits: jax.Array, mass: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits)
    shift = jnp.abs(-logp - _entropy(logp))
    order = jnp.argsort(shift, stable=True)
    p = jnp.exp(logp)[order]
    keep_sorted = (jnp.cumsum(p) - p < mass).at[0].set(True)
    return jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)


def epsilon_keep(logits: jax.Array, epsilon: jax.Array) -> jax.Array:
    return (jax.nn.softmax(logits) > epsilon) | _top(logits)


def eta_keep(logits: jax.Array, epsilon: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits)
    threshold = jnp.minimum(epsilon, jnp.sqrt(epsilon) * jnp.exp(-_entropy(logp)))
    return (jnp.exp(logp) > threshold) | _top(logits)


def top_n_sigma_keep(logits: jax.Array, n: jax.Array) -> jax.Array:
    finite = jnp.isfinite(logits)
    count = jnp.maximum(jnp.sum(finite), 1)
    mean = jnp.sum(jnp.where(finite, logits, 0.0)) / count
    std = jnp.sqrt(jnp.sum(jnp.where(finite, (logits - mean) ** 2, 0.0)) / count)
    return logits >= jnp.max(logits) - n * std


def xtc_keep(logits: jax.Array, threshold: jax.Array, apply: jax.Array) -> jax.Array:
    """`apply` is the row's coin (already drawn against xtc_probability)."""
    p = jax.nn.softmax(logits)
    above = p >= threshold
    least = jnp.arange(p.shape[0]) == jnp.argmin(jnp.where(above, p, jnp.inf))
    return ~(apply & (jnp.sum(above) >= 2)) | ~above | least


def mirostat_keep(logits: jax.Array, mu: jax.Array) -> jax.Array:
    surprise = -jax.nn.log_softmax(logits) / jnp.log(2.0)
    return (surprise <= mu) | _top(logits)


def restrict(
    keep: jax.Array, scaled: jax.Array, e: ExtraSampling, keys: jax.Array, is_sampled: jax.Array, cond
) -> jax.Array:
    """The research filters' keep-sets intersected with `keep` ([B, V] bool) on sampled rows."""
    xtc_on = e.xtc_probability > 0
    coin = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys) < e.xtc_probability
    filters = [
        (e.typical_p < 1, lambda: jax.vmap(typical_keep)(scaled, e.typical_p)),
        (e.epsilon > 0, lambda: jax.vmap(epsilon_keep)(scaled, e.epsilon)),
        (e.eta > 0, lambda: jax.vmap(eta_keep)(scaled, e.eta)),
        (e.top_n_sigma > 0, lambda: jax.vmap(top_n_sigma_keep)(scaled, e.top_n_sigma)),
        (xtc_on, lambda: jax.vmap(xtc_keep)(scaled, e.xtc_threshold, coin)),
        (e.mirostat_tau > 0, lambda: jax.vmap(mirostat_keep)(scaled, e.mu)),
    ]
    everything = jnp.ones_like(keep)
    for active, mask in filters:
        on = active & is_sampled
        keep = keep & (cond(jnp.any(on), mask, lambda: everything) | ~on[:, None])
    empty = ~jnp.any(keep, axis=-1, keepdims=True)
    return keep | (empty & jax.vmap(_top)(scaled))


def mirostat_update(e: ExtraSampling, kept_logits: jax.Array, tokens: jax.Array, is_sampled: jax.Array) -> jax.Array:
    """New μ per row: μ - η (surprise of the drawn token under the kept distribution - τ)."""
    logp = jax.nn.log_softmax(kept_logits, axis=-1)
    surprise = -jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0] / jnp.log(2.0)
    on = (e.mirostat_tau > 0) & is_sampled
    return jnp.where(on, e.mu - e.mirostat_eta * (surprise - e.mirostat_tau), e.mu)


def after_round(
    before: ExtraSampling, drawn: ExtraSampling, tokens: jax.Array, positions: jax.Array, sampled: jax.Array
) -> ExtraSampling:
    """The state after a round: rows that drew a token take their new μ and record the token
    in their history at the position it takes; the others stay as they were."""
    B = tokens.shape[0]
    rows = jnp.where(sampled, jnp.arange(B), B)
    return before.replace(
        mu=jnp.where(sampled, drawn.mu, before.mu), history=before.history.at[rows, positions].set(tokens, mode="drop")
    )
