"""The compiled entry points. Each takes the decode state donated and returns a new one.

`step` runs one round over a flattened ragged batch: the next token of every decoding slot
(taken from the state itself, so round N+1 can be dispatched before round N is read) plus
prompt chunks of prefilling slots, with per-token slots and positions. `decode_steps` runs
several decode-only rounds in one call under `lax.scan`, stopping slots on device.
`set_slot`, `extract` and `insert` move one sequence in and out of the state.

Static arguments are only shape buckets and configs; everything per request is an array.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxllm.attention.reference import Windows
from jaxllm.config import ModelConfig
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.model.forward import TokenBatch, forward, lm_head
from jaxllm.model.hybrid import hybrid_forward
from jaxllm.model.mtp import mtp_draft_slots
from jaxllm.model.kernel_choice import matmul_kernel, sampler_branches
from jaxllm import samplers_extra
from jaxllm.params import Params
from jaxllm.sampling import Sampled, sample
from jaxllm.state import DecodeState, KVCache, RecurrentState, SeqCheckpoint, SlotSampling, StateLayout, init_state


@struct.dataclass
class ChunkBatch:
    """Prompt chunks of one round: Tc flat tokens grouped into Nc segments (one slot each)."""

    tokens: jax.Array  # [Tc] i32
    slots: jax.Array  # [Tc] i32, trash row for padding
    positions: jax.Array  # [Tc] i32
    seg_slot: jax.Array  # [Nc] i32
    seg_start: jax.Array  # [Nc] i32 index into the chunk tokens
    seg_len: jax.Array  # [Nc] i32 (0 = unused segment)
    seg_samples: jax.Array  # [Nc] bool: the segment ends its prompt, so its last token samples
    # [Nc] bool, hybrid models: also keep the segment's recurrent state after all but its last
    # token in the state's side row (a prefix checkpoint of prompt[:-1] without a round of its own)
    seg_side: jax.Array


@struct.dataclass
class RoundInputs:
    """Per-round host inputs besides prompt chunks (all arrays: they never recompile)."""

    decode_mask: jax.Array  # [B] bool: slots that decode this round
    want_top: jax.Array  # [] bool: any slot wants top logprobs
    token_mask: jax.Array  # [B, ceil(V/32)] u32 allowed-token bits (constrained decoding)
    constrained: jax.Array  # [B] bool: token_mask applies to this slot


def round_inputs(B: int, V: int) -> RoundInputs:
    """Host-side (numpy) inputs with nothing decoding and nothing constrained."""
    return RoundInputs(
        decode_mask=np.zeros((B,), bool),
        want_top=np.bool_(False),
        token_mask=np.zeros((B, -(-V // 32)), np.uint32),
        constrained=np.zeros((B,), bool),
    )


@struct.dataclass
class StepOutput:
    tokens: jax.Array  # [B] i32 sampled this round (valid where `sampled`)
    logprob: jax.Array  # [B] f32
    top_ids: jax.Array  # [B, 20] i32
    top_logprobs: jax.Array  # [B, 20] f32
    sampled: jax.Array  # [B] bool
    done: jax.Array  # [B] bool after this round
    expert_tokens: jax.Array  # [L, E] tokens routed to each expert ([L, 0] for dense models)
    entropy: jax.Array | None = None  # [B] f32 of the model's distribution (research engines only)
    # Verification rounds of models with an MTP head: each slot's drafts for its next round.
    next_drafts: jax.Array | None = None  # [B, K] i32


def empty_chunk(B: int) -> ChunkBatch:
    z = np.zeros((0,), np.int32)
    return ChunkBatch(
        tokens=z,
        slots=z,
        positions=z,
        seg_slot=z,
        seg_start=z,
        seg_len=z,
        seg_samples=np.zeros((0,), bool),
        seg_side=np.zeros((0,), bool),
    )


def _to_all_slots(a: jax.Array, B: int) -> jax.Array:
    """A part's rows ([n, ...], slots [0, n)) padded with zeros to every slot ([B, ...])."""
    return jnp.pad(a, [(0, B - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def _round(
    params: Params,
    state: DecodeState,
    inputs: RoundInputs,
    chunk: ChunkBatch,
    *,
    cfg: ModelConfig,
    opts: RuntimeOptions,
    chunk_len: int,
    n_ctx_pages: int,
    decode_width: int,
    full_sampler: bool = True,
) -> tuple[DecodeState, StepOutput]:
    B = state.lengths.shape[0]
    Wd = decode_width  # the decode part covers slots [0, Wd): idle slots past it cost nothing
    rows = jnp.arange(B)
    decoding = inputs.decode_mask & ~state.done & (rows < Wd)
    trash = B
    d = slice(0, Wd)

    batch = TokenBatch(
        tokens=jnp.concatenate([state.last_token[d], chunk.tokens]),
        slots=jnp.concatenate([jnp.where(decoding, rows, trash)[d], chunk.slots]),
        positions=jnp.concatenate([jnp.where(decoding, state.lengths, 0)[d], chunk.positions]),
        decode=Windows(slot=rows[d], start=rows[d], length=decoding[d].astype(jnp.int32)),
        chunks=Windows(slot=chunk.seg_slot, start=Wd + chunk.seg_start, length=chunk.seg_len),
        chunk_side=chunk.seg_side,
    )
    if cfg.is_hybrid:
        hidden, kv, recurrent, experts = hybrid_forward(
            params,
            cfg,
            batch,
            state.kv,
            state.recurrent,
            state.page_table,
            opts=opts,
            chunk_len=chunk_len,
            n_ctx_pages=n_ctx_pages,
        )
    else:
        hidden, kv, experts = forward(
            params, cfg, batch, state.kv, state.page_table, opts=opts, chunk_len=chunk_len, n_ctx_pages=n_ctx_pages
        )
        recurrent = state.recurrent

    # Which flat row gives each slot its next token: its decode token, or its last prompt token.
    seg_last = Wd + chunk.seg_start + chunk.seg_len - 1
    seg_target = jnp.where(chunk.seg_samples & (chunk.seg_len > 0), chunk.seg_slot, B)
    # Slots past the decode part draw nothing unless a chunk ends there; clamp their row.
    sample_row = jnp.minimum(rows, Wd - 1).at[seg_target].set(seg_last, mode="drop")
    sampled = decoding.at[seg_target].set(True, mode="drop")

    chunk_end = jnp.where(chunk.seg_len > 0, chunk.seg_slot, B)
    lengths = jnp.where(decoding, state.lengths + 1, state.lengths)
    if chunk.seg_slot.shape[0]:
        last_position = chunk.positions[jnp.maximum(chunk.seg_start + chunk.seg_len - 1, 0)]
        lengths = lengths.at[chunk_end].set(last_position + 1, mode="drop")
    seen = state.seen.at[batch.slots, batch.tokens].set(True, mode="drop")

    # A round without prompt chunks draws for its decode part alone: the slots past it draw
    # nothing, and the sampler's [rows, V] passes (penalties, bias, noise) cost per row.
    n_draw = Wd if not chunk.seg_slot.shape[0] else B
    part = lambda a: a[:n_draw]  # noqa: E731
    logits = lm_head(params, hidden[sample_row[:n_draw]], kernel=matmul_kernel(opts, n_draw))
    draw = sample(
        logits,
        jax.tree.map(part, state.sampling),
        part(seen),
        part(state.out_counts),
        part(state.n_generated),
        part(lengths),
        inputs.want_top,
        token_mask=part(inputs.token_mask),
        constrained=part(inputs.constrained),
        branches=sampler_branches(opts),
        full=full_sampler,
    )
    if n_draw < B:
        draw = jax.tree.map(lambda a: _to_all_slots(a, B), draw)
    tokens = jnp.where(sampled, draw.tokens, state.last_token)
    n_generated = state.n_generated + sampled
    out_counts = state.out_counts.at[jnp.where(sampled, rows, B), tokens].add(1, mode="drop")
    stops = state.sampling.stop_mask[rows, tokens] | (n_generated >= state.sampling.max_tokens)
    done = jnp.where(sampled, stops, state.done)
    sampling = state.sampling
    if draw.extra is not None:  # research samplers: their state moves with each draw
        sampling = sampling.replace(
            extra=samplers_extra.after_round(sampling.extra, draw.extra, tokens, lengths, sampled)
        )

    new_state = state.replace(
        kv=kv,
        recurrent=recurrent,
        lengths=lengths,
        last_token=tokens,
        n_generated=n_generated,
        done=done,
        seen=seen,
        out_counts=out_counts,
        sampling=sampling,
    )
    out = StepOutput(
        tokens=tokens,
        logprob=draw.logprob,
        top_ids=draw.top_ids,
        top_logprobs=draw.top_logprobs,
        sampled=sampled,
        done=done,
        expert_tokens=experts,
        entropy=draw.entropy,
    )
    return new_state, out


@functools.partial(
    jax.jit, static_argnames=("cfg", "opts", "chunk_len", "n_ctx_pages", "decode_width"), donate_argnames=("state",)
)
def step(
    params: Params,
    state: DecodeState,
    inputs: RoundInputs,
    chunk: ChunkBatch,
    *,
    cfg: ModelConfig,
    opts: RuntimeOptions,
    chunk_len: int,
    n_ctx_pages: int,
    decode_width: int,
) -> tuple[DecodeState, StepOutput]:
    """One round: decode tokens of `inputs.decode_mask` slots (all below `decode_width`)
    plus `chunk`'s prompt tokens."""
    return _round(
        params,
        state,
        inputs,
        chunk,
        cfg=cfg,
        opts=opts,
        chunk_len=chunk_len,
        n_ctx_pages=n_ctx_pages,
        decode_width=decode_width,
    )


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "opts", "n_steps", "n_ctx_pages", "decode_width", "full_sampler"),
    donate_argnames=("state",),
)
def decode_steps(
    params: Params,
    state: DecodeState,
    inputs: RoundInputs,
    *,
    cfg: ModelConfig,
    opts: RuntimeOptions,
    n_steps: int,
    n_ctx_pages: int,
    decode_width: int,
    full_sampler: bool = True,
) -> tuple[DecodeState, StepOutput]:
    """`n_steps` decode-only rounds in one call; outputs stacked on a leading [n_steps] axis.

    A constrained slot takes only the first step: its next mask needs the host to see the
    token it just drew. `full_sampler=False` leaves the sampler's filters and top logprobs out (for calls whose
    requests need neither, `jaxllm.sampling.needs_full_sampler`): on the GPU such a call has
    no conditional, so the host queues step after step without waiting for the device.
    """
    chunk = empty_chunk(state.lengths.shape[0])
    later = inputs.replace(decode_mask=inputs.decode_mask & ~inputs.constrained)

    def body(state, first):
        step_inputs = jax.tree.map(lambda a, b: jnp.where(first, a, b), inputs, later)
        return _round(
            params,
            state,
            step_inputs,
            chunk,
            cfg=cfg,
            opts=opts,
            chunk_len=1,
            n_ctx_pages=n_ctx_pages,
            decode_width=decode_width,
            full_sampler=full_sampler,
        )

    return jax.lax.scan(body, state, jnp.arange(n_steps) == 0)


@functools.partial(jax.jit, donate_argnames=("state",))
def set_slot(state: DecodeState, slot: jax.Array, pages: jax.Array, row: SlotSampling) -> DecodeState:
    """Gives `slot` a fresh sequence: its page row, sampling row, zeroed counters."""
    sampling = jax.tree.map(lambda table, value: table.at[slot].set(value), state.sampling, row)
    recurrent = state.recurrent
    if recurrent is not None:  # a fresh sequence starts from a zero recurrent state
        recurrent = jax.tree.map(lambda x: x.at[:, slot].set(0), recurrent)
    return state.replace(
        recurrent=recurrent,
        page_table=state.page_table.at[slot].set(pages),
        lengths=state.lengths.at[slot].set(0),
        last_token=state.last_token.at[slot].set(0),
        n_generated=state.n_generated.at[slot].set(0),
        done=state.done.at[slot].set(False),
        seen=state.seen.at[slot].set(False),
        out_counts=state.out_counts.at[slot].set(0),
        sampling=sampling,
    )


@functools.partial(jax.jit, donate_argnames=("state",))
def release_slot(state: DecodeState, slot: jax.Array) -> DecodeState:
    """Points a finished slot at the trash page so later rounds can never touch its old pages."""
    return state.replace(
        page_table=state.page_table.at[slot].set(0),
        done=state.done.at[slot].set(True),
    )


@functools.partial(jax.jit, static_argnames=("n_pages",))
def extract(state: DecodeState, slot: jax.Array, recurrent_row: jax.Array, *, n_pages: int) -> SeqCheckpoint:
    """Copies a slot's first `n_pages` pages and scalars out of the state, and the recurrent
    state of `recurrent_row`: the slot's own, or the side row (see `RecurrentState`). An array
    either way, so one compiled program serves both."""
    pages = state.page_table[slot, :n_pages]
    return SeqCheckpoint(
        k=state.kv.k[:, pages],
        v=state.kv.v[:, pages],
        length=state.lengths[slot],
        last_token=state.last_token[slot],
        n_generated=state.n_generated[slot],
        done=state.done[slot],
        seen=state.seen[slot],
        out_counts=state.out_counts[slot],
        conv=None if state.recurrent is None else state.recurrent.conv[:, recurrent_row],
        delta=None if state.recurrent is None else state.recurrent.delta[:, recurrent_row],
    )


@functools.partial(jax.jit, donate_argnames=("state",))
def insert(state: DecodeState, slot: jax.Array, ckpt: SeqCheckpoint) -> DecodeState:
    """Writes a checkpoint into `slot`'s pages (already assigned by `set_slot`) and scalars."""
    n = ckpt.k.shape[1]
    pages = state.page_table[slot, :n]
    # Pages past the checkpoint's length may be the trash page (a shorter reservation).
    recurrent = state.recurrent
    if recurrent is not None:
        recurrent = RecurrentState(
            conv=recurrent.conv.at[:, slot].set(ckpt.conv), delta=recurrent.delta.at[:, slot].set(ckpt.delta)
        )
    return state.replace(
        recurrent=recurrent,
        kv=KVCache(k=state.kv.k.at[:, pages].set(ckpt.k), v=state.kv.v.at[:, pages].set(ckpt.v)),
        lengths=state.lengths.at[slot].set(ckpt.length),
        last_token=state.last_token.at[slot].set(ckpt.last_token),
        n_generated=state.n_generated.at[slot].set(ckpt.n_generated),
        done=state.done.at[slot].set(ckpt.done),
        seen=state.seen.at[slot].set(ckpt.seen),
        out_counts=state.out_counts.at[slot].set(ckpt.out_counts),
    )


@functools.partial(jax.jit, static_argnames=("cfg", "layout", "opts"))
def new_state(cfg: ModelConfig, layout: StateLayout, opts: RuntimeOptions) -> DecodeState:
    """A zeroed state built on device (no host copy of the page pool)."""
    return init_state(cfg, layout, opts)


@struct.dataclass
class Drafts:
    """Proposed continuations of the decoding slots for one verification round."""

    tokens: jax.Array  # [B, K] i32
    count: jax.Array  # [B] i32 how many of them to verify (0 = a plain decode step)


def _verify_round(
    params: Params,
    state: DecodeState,
    inputs: RoundInputs,
    drafts: Drafts,
    *,
    cfg: ModelConfig,
    opts: RuntimeOptions,
    n_ctx_pages: int,
    decode_width: int,
    full_sampler: bool,
) -> tuple[DecodeState, StepOutput]:
    """Feeds each decoding slot its last token and its drafts, samples every position with the
    slot's own sampler, and keeps the longest run of drafts that equal what was sampled.

    The sampler's draw at a position is a function of (seed, position) and the logits, and
    the logits at a draft's position are the ones decoding would have seen had the earlier
    drafts been its own tokens. So a draft is accepted exactly when decoding without drafts
    would have produced it, and the emitted tokens are, token for token, those of decoding
    without drafts, greedy or sampled. For a draft that is one fixed token d this is the
    speculative rejection rule: d is kept with probability p(d) (the Gumbel argmax is d), and
    otherwise the token is distributed as p without d.

    Attention layers roll back by length alone (positions past the accepted ones are
    overwritten later); linear-attention layers keep their state after each fed token and
    take the one at the accepted length.

    Only slots [0, decode_width) take part (`EngineConfig.verify_widths`, as a decode call
    covers its decode part): the forward, lm_head and sampler run on their rows alone.

    Returns the state and a StepOutput stacked on a leading [K + 1] axis, step j holding the
    (j + 1)-th emitted token of each slot (`sampled` false past a slot's last one), the
    layout of `decode_steps`.
    """
    B = state.lengths.shape[0]
    Wd = decode_width
    K = drafts.tokens.shape[1]
    Tw = K + 1
    part = lambda a: a[:Wd]  # noqa: E731 - the rows of the verifying part
    to_all = lambda a: _to_all_slots(a, B)  # noqa: E731
    rows = jnp.arange(Wd)
    lengths0, last_token0, n_generated0 = part(state.lengths), part(state.last_token), part(state.n_generated)
    decoding = part(inputs.decode_mask) & ~part(state.done) & ~part(inputs.constrained)
    n = jnp.where(decoding, jnp.clip(part(drafts.count), 0, K), 0)
    d_tokens = part(drafts.tokens)
    fed = jnp.concatenate([last_token0[:, None], d_tokens], axis=1)  # [Wd, Tw]
    at = lengths0[:, None] + jnp.arange(Tw)[None, :]
    valid = decoding[:, None] & (jnp.arange(Tw)[None, :] <= n[:, None])
    none = jnp.zeros((0,), jnp.int32)
    batch = TokenBatch(
        tokens=fed.reshape(-1),
        slots=jnp.where(valid, rows[:, None], B).reshape(-1),
        positions=jnp.where(valid, at, 0).reshape(-1),
        decode=Windows(slot=none, start=none, length=none),
        chunks=Windows(slot=rows, start=rows * Tw, length=jnp.where(decoding, n + 1, 0)),
    )
    if cfg.is_hybrid:
        hidden, kv, snapshots, experts = hybrid_forward(
            params,
            cfg,
            batch,
            state.kv,
            state.recurrent,
            state.page_table,
            opts=opts,
            chunk_len=Tw,
            n_ctx_pages=n_ctx_pages,
            snapshots=True,
        )
    else:
        hidden, kv, experts = forward(
            params, cfg, batch, state.kv, state.page_table, opts=opts, chunk_len=Tw, n_ctx_pages=n_ctx_pages
        )
        snapshots = None
    logits = lm_head(params, hidden, kernel=matmul_kernel(opts, Wd * Tw)).reshape(Wd, Tw, -1)

    # Position j draws the token after fed[:, j]; the earlier drafts count as generated tokens
    # there (penalties, min_tokens, max_tokens), as they would be had decoding produced them.
    # So do the research samplers' state (mirostat's μ after the previous draw, the history
    # DRY and logits processors read): a draw sees the state decoding would have given it.
    seen = part(state.seen).at[jnp.where(decoding, rows, Wd), last_token0].set(True, mode="drop")
    out_counts = part(state.out_counts)
    sampling = jax.tree.map(part, state.sampling)
    draws: list[Sampled] = []
    stops: list[jax.Array] = []
    for j in range(Tw):
        if j:
            d = d_tokens[:, j - 1]
            live = decoding & (j <= n)
            seen = seen.at[jnp.where(live, rows, Wd), d].set(True, mode="drop")
            out_counts = out_counts.at[jnp.where(live, rows, Wd), d].add(1, mode="drop")
            if sampling.extra is not None:
                extra = samplers_extra.after_round(sampling.extra, draws[-1].extra, d, lengths0 + j, live)
                sampling = sampling.replace(extra=extra)
        draw = sample(
            logits[:, j],
            sampling,
            seen,
            out_counts,
            n_generated0 + j,
            lengths0 + j + 1,
            inputs.want_top,
            branches=sampler_branches(opts),
            full=full_sampler,
        )
        draws.append(draw)
        stops.append(sampling.stop_mask[rows, draw.tokens] | (n_generated0 + j + 1 >= sampling.max_tokens))
    tokens = jnp.stack([d.tokens for d in draws], axis=1)  # [Wd, Tw]
    stop = jnp.stack(stops, axis=1)
    # Emitted: tokens up to the first that disagrees with its draft, stops, or has no draft.
    agrees = (tokens[:, :K] == d_tokens) & (jnp.arange(K)[None, :] < n[:, None]) & ~stop[:, :K]
    emitted = jnp.where(decoding, 1 + jnp.sum(jnp.cumprod(agrees, axis=1), axis=1), 0).astype(jnp.int32)  # [Wd]
    last = jnp.maximum(emitted - 1, 0)
    sampled = decoding[:, None] & (jnp.arange(Tw)[None, :] < emitted[:, None])  # [Wd, Tw]

    new_last = jnp.where(decoding, tokens[rows, last], last_token0)
    finished = stop[rows, last]
    decoding_all = to_all(decoding)
    done = jnp.where(decoding_all, to_all(finished), state.done)
    # The state of decoding without drafts after `emitted` steps: every emitted token but the
    # last was fed (and seen), every emitted token counted.
    kept_fed = valid & (jnp.arange(Tw)[None, :] < emitted[:, None])
    seen = state.seen.at[jnp.where(kept_fed, rows[:, None], B), fed].set(True, mode="drop")
    out_counts = state.out_counts.at[jnp.where(sampled, rows[:, None], B), tokens].add(1, mode="drop")
    recurrent = state.recurrent
    if snapshots is not None and recurrent is not None:
        recurrent = snapshots.keep(recurrent, jnp.maximum(emitted, 1))
    sampling = state.sampling
    if sampling.extra is not None:
        verified = _extra_after_verify(jax.tree.map(part, sampling.extra), draws, tokens, lengths0, sampled)
        sampling = sampling.replace(extra=jax.tree.map(lambda a, p: a.at[:Wd].set(p), sampling.extra, verified))
    new_state = state.replace(
        kv=kv,
        recurrent=recurrent,
        lengths=state.lengths + to_all(emitted),
        last_token=jnp.where(decoding_all, to_all(new_last), state.last_token),
        n_generated=state.n_generated + to_all(emitted),
        done=done,
        seen=seen,
        out_counts=out_counts,
        sampling=sampling,
    )
    next_drafts = None
    if params.mtp is not None and cfg.mtp_layers:
        # The head drafts what follows the token just sampled, from the hidden state that
        # sampled it (the accepted position's), for the slot's next verification round.
        h_last = hidden.reshape(Wd, Tw, -1)[rows, last]
        next_drafts = to_all(mtp_draft_slots(params, cfg, h_last, new_last, lengths0 + last, decoding, K))
    steps_axis = jnp.arange(Tw)[:, None]
    by_step = lambda xs: to_all(jnp.stack(xs, axis=1)).swapaxes(0, 1)  # noqa: E731 - [Wd, ...] per step -> [Tw, B, ...]
    sampled_all = by_step([sampled[:, j] for j in range(Tw)])
    out = StepOutput(
        tokens=by_step([d.tokens for d in draws]),
        logprob=by_step([d.logprob for d in draws]),
        top_ids=by_step([d.top_ids for d in draws]),
        top_logprobs=by_step([d.top_logprobs for d in draws]),
        sampled=sampled_all,
        done=(steps_axis == to_all(last)[None, :]) & done[None, :] & sampled_all,
        expert_tokens=jnp.zeros((Tw, *experts.shape), experts.dtype).at[0].set(experts),
        entropy=None if draws[0].entropy is None else by_step([d.entropy for d in draws]),
        next_drafts=next_drafts,
    )
    return new_state, out


def _extra_after_verify(
    before: samplers_extra.ExtraSampling,
    draws: list,
    tokens: jax.Array,
    lengths: jax.Array,
    sampled: jax.Array,
) -> samplers_extra.ExtraSampling:
    """The research samplers' state after a verification round, as decoding would have left
    it after the same tokens: each slot's μ from its last emitted draw, and every emitted
    token ([B, Tw] `tokens` where `sampled`) in the history at its position."""
    B, Tw = tokens.shape
    rows = jnp.arange(B)
    emitted = jnp.sum(sampled, axis=1)
    mus = jnp.stack([d.extra.mu for d in draws], axis=1)  # [B, Tw] μ after each draw
    mu = jnp.where(emitted > 0, mus[rows, jnp.maximum(emitted - 1, 0)], before.mu)
    positions = lengths[:, None] + 1 + jnp.arange(Tw)[None, :]
    history = before.history.at[jnp.where(sampled, rows[:, None], B), positions].set(tokens, mode="drop")
    return before.replace(mu=mu, history=history)


@functools.partial(
    jax.jit, static_argnames=("cfg", "opts", "n_ctx_pages", "decode_width", "full_sampler"), donate_argnames=("state",)
)
def verify(
    params: Params,
    state: DecodeState,
    inputs: RoundInputs,
    drafts: Drafts,
    *,
    cfg: ModelConfig,
    opts: RuntimeOptions,
    n_ctx_pages: int,
    decode_width: int,
    full_sampler: bool = True,
) -> tuple[DecodeState, StepOutput]:
    """One speculative round: every `inputs.decode_mask` slot (all below `decode_width`)
    verifies its drafts (see `_verify_round`); constrained slots take no part (their masks
    need the host per token)."""
    return _verify_round(
        params,
        state,
        inputs,
        drafts,
        cfg=cfg,
        opts=opts,
        n_ctx_pages=n_ctx_pages,
        decode_width=decode_width,
        full_sampler=full_sampler,
    )
