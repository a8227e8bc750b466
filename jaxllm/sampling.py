"""Sampling: request parameters on the host, one compiled sampler over per-slot arrays.

Every slot's draw is a function of (seed, absolute position) alone: the Gumbel noise for a
slot comes from `fold_in(key(seed), position)` and is indexed by vocabulary id, and the
top-k/top-p/min-p filters only decide which ids may win. So a sequence samples the same
tokens whatever its slot, its neighbours, its chunking or the steps per call.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxllm import samplers_extra
from jaxllm.state import SlotSampling

MAX_TOP_LOGPROBS = 20
_NEG = -jnp.inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What a request asks of the sampler (OpenAI / vLLM semantics)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # Research samplers (jaxllm.samplers_extra; an engine with EngineConfig.extra_samplers).
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    top_n_sigma: float = 0.0  # 0: off
    dry_multiplier: float = 0.0  # 0: off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[int, ...] = ()
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0  # 0: off
    mirostat_tau: float = 0.0  # > 0: mirostat v2 with this target surprise (bits)
    mirostat_eta: float = 0.1
    logits_processor: Callable | None = None  # (logits [V], RowContext) -> logits, traced into the round
    # Speculative drafts per round (None: the engine's default, 0: none); drafts never change
    # the tokens, only how many one round can emit.
    drafts: int | None = None

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError naming the first invalid field."""
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= -1, "top_k must be -1, 0 (off) or positive"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
            (self.drafts is None or self.drafts >= 0, "drafts must be >= 0"),
            (all(0 <= t < vocab_size for t in self.logit_bias), "logit_bias has a token id outside the vocabulary"),
            (all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
            (all(0 <= t < vocab_size for t in self.stop_token_ids), "stop_token_ids has an id outside the vocabulary"),
            (0 < self.typical_p <= 1, "typical_p must be in (0, 1]"),
            (0 <= self.epsilon_cutoff < 1, "epsilon_cutoff must be in [0, 1)"),
            (0 <= self.eta_cutoff < 1, "eta_cutoff must be in [0, 1)"),
            (self.top_n_sigma >= 0, "top_n_sigma must be >= 0"),
            (self.dry_multiplier >= 0, "dry_multiplier must be >= 0"),
            (self.dry_base >= 1, "dry_base must be >= 1"),
            (self.dry_allowed_length >= 1, "dry_allowed_length must be >= 1"),
            (
                all(0 <= t < vocab_size for t in self.dry_sequence_breakers),
                "dry_sequence_breakers has an id outside the vocabulary",
            ),
            (0 <= self.xtc_threshold <= 1, "xtc_threshold must be in [0, 1]"),
            (0 <= self.xtc_probability <= 1, "xtc_probability must be in [0, 1]"),
            (self.mirostat_tau >= 0, "mirostat_tau must be >= 0"),
            (self.mirostat_eta > 0, "mirostat_eta must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def seed_to_u32(seed: int | None, fallback: int) -> np.uint32:
    """Folds any Python int seed (OpenAI allows 64-bit) into 32 bits; None takes the fallback."""
    value = fallback if seed is None else seed
    return np.uint32((value ^ (value >> 32)) & 0xFFFFFFFF)


def sampling_row(
    p: SamplingParams, vocab_size: int, eos_ids: frozenset[int] | set[int], seed: np.uint32
) -> SlotSampling:
    """One slot's row of `SlotSampling` (scalars and [V] rows), built on the host at admission."""
    bias = np.zeros((vocab_size,), np.float32)
    for token, value in p.logit_bias.items():
        bias[int(token)] = value
    stop = np.zeros((vocab_size,), bool)
    stop[list(p.stop_token_ids)] = True
    if not p.ignore_eos:
        stop[[t for t in eos_ids if t < vocab_size]] = True
    return SlotSampling(
        temperature=np.float32(p.temperature),
        top_k=np.int32(max(p.top_k, 0)),
        top_p=np.float32(p.top_p),
        min_p=np.float32(p.min_p),
        repetition_penalty=np.float32(p.repetition_penalty),
        presence_penalty=np.float32(p.presence_penalty),
        frequency_penalty=np.float32(p.frequency_penalty),
        logit_bias=bias,
        stop_mask=stop,
        min_tokens=np.int32(p.min_tokens),
        max_tokens=np.int32(p.max_tokens),
        seed=np.uint32(seed),
    )


@struct.dataclass
class Sampled:
    tokens: jax.Array  # [B] i32
    logprob: jax.Array  # [B] f32 of the chosen token under the model's distribution
    top_ids: jax.Array  # [B, 20] i32
    top_logprobs: jax.Array  # [B, 20] f32
    extra: samplers_extra.ExtraSampling | None = None  # the research samplers' state after this draw
    entropy: jax.Array | None = None  # [B] f32 of the model's distribution (research engines only)


def process_logits(
    logits: jax.Array,
    s: SlotSampling,
    seen: jax.Array,
    out_counts: jax.Array,
    n_generated: jax.Array,
) -> jax.Array:
    """Penalties, logit bias and min_tokens masking; [B, V] f32 in and out."""
    rp = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - s.frequency_penalty[:, None] * out_counts
    logits = logits - s.presence_penalty[:, None] * (out_counts > 0)
    logits = logits + s.logit_bias
    too_early = (n_generated < s.min_tokens)[:, None]
    return jnp.where(too_early & s.stop_mask, _NEG, logits)


def unpack_token_mask(bits: jax.Array, vocab_size: int) -> jax.Array:
    """[B, W] u32 bitmask -> [B, V] bool."""
    v = jnp.arange(vocab_size)
    words = bits[:, v // 32]
    return ((words >> (v % 32).astype(jnp.uint32)) & 1).astype(bool)


def apply_token_mask(logits: jax.Array, bits: jax.Array, constrained: jax.Array) -> jax.Array:
    allowed = unpack_token_mask(bits, logits.shape[1])
    return jnp.where(constrained[:, None] & ~allowed, _NEG, logits)


def _filter_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """[V] bool: ids allowed by top-k, then top-p (on the renormalised top-k set), then min-p."""
    V = scaled.shape[0]
    desc = -jnp.sort(-scaled)
    rank = jnp.arange(V)
    in_k = (top_k <= 0) | (rank < top_k)
    k_logits = jnp.where(in_k, desc, _NEG)
    probs = jax.nn.softmax(k_logits)
    exclusive_cum = jnp.cumsum(probs) - probs
    keep = in_k & (exclusive_cum < top_p) & (probs >= min_p * probs[0])
    keep = keep.at[0].set(True)
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf))
    return scaled >= cutoff


def _filter_rows(scaled: jax.Array, s: SlotSampling, filters: jax.Array, branches: str = "select") -> jax.Array:
    """[B, V] allowed ids: `_filter_mask` on the rows that filter, everything elsewhere (a
    row without filters keeps its whole vocabulary whatever its neighbours ask; through the
    filter with top_p = 1 a peaked row could lose its float32 tail). The filter sorts the
    vocabulary (costly on a CPU core), so with "cond" branches (the CPU)
    rows that do not filter skip it, a `lax.cond` per row; "select" (GPU) filters every row
    at once."""
    if branches == "cond":
        everything = jnp.ones_like(scaled[0], bool)
        return jax.lax.map(
            lambda a: jax.lax.cond(a[0], lambda: _filter_mask(*a[1:]), lambda: everything),
            (filters, scaled, s.top_k, s.top_p, s.min_p),
        )
    return jax.vmap(_filter_mask)(scaled, s.top_k, s.top_p, s.min_p) | ~filters[:, None]


def _select_cond(pred: jax.Array, true_fn, false_fn):
    """`lax.cond` without the branch: both sides run and `pred` selects (no host sync)."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), true_fn(), false_fn())


def needs_full_sampler(p: SamplingParams) -> bool:
    """Whether a request needs the sampler's costly parts: a top-k/top-p/min-p filter on
    sampled tokens, or top logprobs (see `sample`'s `full`)."""
    filters = p.temperature > 0 and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0)
    return filters or p.top_logprobs > 0 or samplers_extra.uses_extra(p)


def sample(
    logits: jax.Array,
    s: SlotSampling,
    seen: jax.Array,
    out_counts: jax.Array,
    n_generated: jax.Array,
    positions: jax.Array,
    want_top: jax.Array,
    *,
    token_mask: jax.Array | None = None,
    constrained: jax.Array | None = None,
    branches: str = "cond",
    full: bool = True,
) -> Sampled:
    """Draws one token per slot.

    Args:
      logits: [B, V] float32 raw model logits.
      s, seen, out_counts, n_generated: per-slot sampler state.
      positions: [B] absolute position the drawn token will take (feeds the rng).
      want_top: [] bool, whether any slot asked for top logprobs this round.
      token_mask: [B, ceil(V/32)] u32 allowed-token bits (bit v%32 of word v//32).
      constrained: [B] bool, rows where `token_mask` applies.
      branches: "cond" skips the parts no row needs (`lax.cond`); "select" runs every part
        and selects (same results; see RuntimeOptions.sampler_branches).
      full: with False, no row filters (top-k/top-p/min-p) and none wants top logprobs
        (the caller knows; `needs_full_sampler`): those parts, the costly ones (a sort of the
        vocabulary each), are left out and top
        logprobs are zeros. The filter and the top logprobs always run behind `lax.cond`.
    """
    cond = jax.lax.cond if branches == "cond" else _select_cond
    processed = process_logits(logits, s, seen, out_counts, n_generated)
    extra = s.extra
    if extra is not None:
        processed = samplers_extra.adjust_logits(processed, extra, positions, n_generated, s.seed, cond)
    if token_mask is not None:
        processed = cond(
            jnp.any(constrained), lambda: apply_token_mask(processed, token_mask, constrained), lambda: processed
        )
    greedy = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    is_sampled = s.temperature > 0

    def draw() -> tuple[jax.Array, jax.Array | None]:
        scaled = processed / jnp.where(is_sampled, s.temperature, 1.0)[:, None]
        filters = is_sampled & ((s.top_k > 0) | (s.top_p < 1) | (s.min_p > 0))
        keep = (
            jax.lax.cond(
                jnp.any(filters),
                lambda: _filter_rows(scaled, s, filters, branches),
                lambda: jnp.ones_like(scaled, bool),
            )
            if full
            else jnp.ones_like(scaled, bool)
        )
        keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.PRNGKey(seed), pos))(s.seed, positions)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (scaled.shape[1],), jnp.float32))(keys)
        if extra is not None:
            keep = samplers_extra.restrict(keep, scaled, extra, keys, is_sampled, cond)
        drawn = jnp.argmax(jnp.where(keep, scaled + noise, _NEG), axis=-1).astype(jnp.int32)
        tokens = jnp.where(is_sampled, drawn, greedy)
        mu = (
            None
            if extra is None
            else samplers_extra.mirostat_update(extra, jnp.where(keep, scaled, _NEG), tokens, is_sampled)
        )
        return tokens, mu

    tokens, mu = cond(jnp.any(is_sampled), draw, lambda: (greedy, None if extra is None else extra.mu))
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    B, V = logits.shape
    n_top = min(MAX_TOP_LOGPROBS, V)
    nothing = (jnp.zeros((B, n_top), jnp.float32), jnp.zeros((B, n_top), jnp.int32))
    top_lp, top_ids = (
        jax.lax.cond(want_top, lambda: tuple(jax.lax.top_k(logprobs, n_top)), lambda: nothing) if full else nothing
    )
    entropy = (
        None if extra is None else -jnp.sum(jnp.where(jnp.isfinite(logprobs), jnp.exp(logprobs) * logprobs, 0.0), -1)
    )
    return Sampled(
        tokens=tokens,
        logprob=chosen,
        top_ids=top_ids.astype(jnp.int32),
        top_logprobs=top_lp,
        extra=None if extra is None else extra.replace(mu=mu),
        entropy=entropy,
    )
