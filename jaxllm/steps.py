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
from jaxllm.model.forward import TokenBatch, forward, lm_head
from jaxllm.model.hybrid import hybrid_forward
from jaxllm.model.kernel_choice import matmul_kernel, sampler_branches
from jaxllm.params import Params
from jaxllm.sampling import sample
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


def empty_chunk(B: int) -> ChunkBatch:
    z = np.zeros((0,), np.int32)
    return ChunkBatch(
        tokens=z, slots=z, positions=z, seg_slot=z, seg_start=z, seg_len=z, seg_samples=np.zeros((0,), bool)
    )


def _round(
    params: Params,
    state: DecodeState,
    inputs: RoundInputs,
    chunk: ChunkBatch,
    *,
    cfg: ModelConfig,
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
    )
    if cfg.is_hybrid:
        hidden, kv, recurrent, experts = hybrid_forward(
            params, cfg, batch, state.kv, state.recurrent, state.page_table, chunk_len=chunk_len,
            n_ctx_pages=n_ctx_pages,
        )
    else:
        hidden, kv, experts = forward(
            params, cfg, batch, state.kv, state.page_table, chunk_len=chunk_len, n_ctx_pages=n_ctx_pages
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

    logits = lm_head(params, hidden[sample_row], kernel=matmul_kernel(cfg, B))
    draw = sample(
        logits, state.sampling, seen, state.out_counts, state.n_generated, lengths, inputs.want_top,
        token_mask=inputs.token_mask, constrained=inputs.constrained, branches=sampler_branches(cfg),
        full=full_sampler,
    )
    tokens = jnp.where(sampled, draw.tokens, state.last_token)
    n_generated = state.n_generated + sampled
    out_counts = state.out_counts.at[jnp.where(sampled, rows, B), tokens].add(1, mode="drop")
    stops = state.sampling.stop_mask[rows, tokens] | (n_generated >= state.sampling.max_tokens)
    done = jnp.where(sampled, stops, state.done)

    new_state = state.replace(
        kv=kv,
        recurrent=recurrent,
        lengths=lengths,
        last_token=tokens,
        n_generated=n_generated,
        done=done,
        seen=seen,
        out_counts=out_counts,
    )
    out = StepOutput(
        tokens=tokens,
        logprob=draw.logprob,
        top_ids=draw.top_ids,
        top_logprobs=draw.top_logprobs,
        sampled=sampled,
        done=done,
        expert_tokens=experts,
    )
    return new_state, out


@functools.partial(
    jax.jit, static_argnames=("cfg", "chunk_len", "n_ctx_pages", "decode_width"), donate_argnames=("state",)
)
def step(
    params: Params,
    state: DecodeState,
    inputs: RoundInputs,
    chunk: ChunkBatch,
    *,
    cfg: ModelConfig,
    chunk_len: int,
    n_ctx_pages: int,
    decode_width: int,
) -> tuple[DecodeState, StepOutput]:
    """One round: decode tokens of `inputs.decode_mask` slots (all below `decode_width`)
    plus `chunk`'s prompt tokens."""
    return _round(
        params, state, inputs, chunk, cfg=cfg, chunk_len=chunk_len, n_ctx_pages=n_ctx_pages, decode_width=decode_width
    )


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "n_steps", "n_ctx_pages", "decode_width", "full_sampler"),
    donate_argnames=("state",),
)
def decode_steps(
    params: Params,
    state: DecodeState,
    inputs: RoundInputs,
    *,
    cfg: ModelConfig,
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
            params, state, step_inputs, chunk, cfg=cfg, chunk_len=1, n_ctx_pages=n_ctx_pages, decode_width=decode_width,
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
def extract(state: DecodeState, slot: jax.Array, *, n_pages: int) -> SeqCheckpoint:
    """Copies a slot's first `n_pages` pages and scalars out of the state."""
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
        conv=None if state.recurrent is None else state.recurrent.conv[:, slot],
        delta=None if state.recurrent is None else state.recurrent.delta[:, slot],
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


@functools.partial(jax.jit, static_argnames=("cfg", "layout"))
def new_state(cfg: ModelConfig, layout: StateLayout) -> DecodeState:
    """A zeroed state built on device (no host copy of the page pool)."""
    return init_state(cfg, layout)
