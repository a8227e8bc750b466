"""The decode state: one registered pytree holding everything a step reads and writes.

KV memory is a pool of pages (`page_size` positions each) sized from a byte budget; each slot
has a row of page ids. Row `max_slots` of the page table is a trash row pointing at page 0,
which is never handed out: padding tokens and idle slots write there, so no step needs a
data-dependent shape. Everything per request (lengths, sampling parameters, penalties' token
counts, seeds) is an array with one row per slot, so nothing recompiles per request.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxllm.config import ModelConfig
from jaxllm.runtime_options import RuntimeOptions

TRASH_PAGE = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateLayout:
    """Static sizes of the decode state (hashable: a jit static argument)."""

    max_slots: int  # B
    page_size: int
    n_pages: int  # P, including the trash page
    max_pages_per_seq: int

    @property
    def max_seq_len(self) -> int:
        return self.max_pages_per_seq * self.page_size

    def pages_for(self, n_positions: int) -> int:
        return -(-n_positions // self.page_size)


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, opts: RuntimeOptions) -> int:
    """Bytes of one page of keys and values over every attention layer, in `opts.kv_dtype`."""
    return 2 * cfg.n_kv_layers * page_size * cfg.n_kv_heads * cfg.head_dim * opts.kv_jnp_dtype.itemsize


def recurrent_shapes(cfg: ModelConfig, rows: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Shapes of the linear-attention layers' conv window and delta-rule matrix for `rows`
    sequences ([Ll, rows, Kc - 1, C], [Ll, rows, Hv, Dk, Dv]); None without such layers."""
    if not cfg.n_linear_layers:
        return None
    Ll = cfg.n_linear_layers
    return (
        (Ll, rows, cfg.conv_kernel - 1, cfg.conv_dim),
        (Ll, rows, cfg.linear_n_v_heads, cfg.linear_k_dim, cfg.linear_v_dim),
    )


def recurrent_bytes_per_sequence(cfg: ModelConfig) -> int:
    """Fixed bytes of one sequence's recurrent state (float32), whatever its length."""
    shapes = recurrent_shapes(cfg, 1)
    return 0 if shapes is None else 4 * sum(math.prod(s) for s in shapes)


def layout_for_budget(
    cfg: ModelConfig,
    opts: RuntimeOptions,
    *,
    kv_bytes: int,
    max_slots: int,
    max_seq_len: int | None = None,
    page_size: int = 16,
) -> StateLayout:
    """Sizes the page pool from a byte budget; raises if not even one full sequence fits."""
    max_seq_len = min(max_seq_len or cfg.max_position, cfg.max_position)
    max_pages_per_seq = -(-max_seq_len // page_size)
    n_pages = kv_bytes // kv_bytes_per_page(cfg, page_size, opts)
    if n_pages < 2:
        raise ValueError(
            f"kv budget of {kv_bytes} bytes holds {n_pages} pages of {page_size} positions; need at least 2"
        )
    return StateLayout(
        max_slots=max_slots, page_size=page_size, n_pages=int(n_pages), max_pages_per_seq=max_pages_per_seq
    )


def to_kv_dtype(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Keys or values rounded to the cache's element type. 8-bit floats saturate at their
    largest finite value: float8_e4m3fn has no infinity, so an overflow would be nan. The
    clip runs in float32 (exact for any input type), which is also the form the Pallas
    decode kernel lowers to Triton for its own writes."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, P, page, K, Dh]
    v: jax.Array  # [L, P, page, K, Dh]


@struct.dataclass
class RecurrentState:
    """Per-slot state of the linear-attention (Gated DeltaNet) layers, float32. Row B is a
    trash row like the page table's: padding and idle rows write there. Row B + 1 is the side
    row: a prompt segment that ends its prompt and asks for it
    (`ChunkBatch.seg_side`) leaves there its state after all but its last token, so a prefix
    checkpoint of prompt[:-1] (an exact repeat's) costs no round of its own."""

    conv: jax.Array  # [Ll, B + 2, Kc - 1, C]: the causal conv's last inputs
    delta: jax.Array  # [Ll, B + 2, Hv, Dk, Dv]: the delta-rule matrix


@struct.dataclass
class SlotSampling:
    """Sampling parameters, one row per slot (see `jaxllm.sampling.SamplingParams`)."""

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array  # [B] i32, 0 = off
    top_p: jax.Array  # [B] f32, 1 = off
    min_p: jax.Array  # [B] f32, 0 = off
    repetition_penalty: jax.Array  # [B] f32, 1 = off
    presence_penalty: jax.Array  # [B] f32
    frequency_penalty: jax.Array  # [B] f32
    logit_bias: jax.Array  # [B, V] f32
    stop_mask: jax.Array  # [B, V] bool: sampling one of these ends the sequence
    min_tokens: jax.Array  # [B] i32: stop tokens are masked until this many were generated
    max_tokens: jax.Array  # [B] i32
    seed: jax.Array  # [B] u32
    # The research samplers' rows (jaxllm.samplers_extra.ExtraSampling); None: compiled out.
    extra: Any = None


@struct.dataclass
class DecodeState:
    kv: KVCache
    page_table: jax.Array  # [B + 1, max_pages] i32; row B is the trash row
    lengths: jax.Array  # [B] i32 positions already in the cache
    last_token: jax.Array  # [B] i32 sampled, not yet written to the cache
    n_generated: jax.Array  # [B] i32
    done: jax.Array  # [B] bool: stopped on device (stop token or max_tokens)
    seen: jax.Array  # [B, V] bool: tokens in prompt or output (repetition penalty)
    out_counts: jax.Array  # [B, V] i32: output token counts (presence/frequency penalties)
    sampling: SlotSampling
    recurrent: RecurrentState | None = None  # hybrid models only


@struct.dataclass
class SeqCheckpoint:
    """One sequence's slice of the decode state, as plain arrays (n = pages bucket)."""

    k: jax.Array  # [L, n, page, K, Dh]
    v: jax.Array  # [L, n, page, K, Dh]
    length: jax.Array  # [] i32
    last_token: jax.Array  # [] i32
    n_generated: jax.Array  # [] i32
    done: jax.Array  # [] bool
    seen: jax.Array  # [V] bool
    out_counts: jax.Array  # [V] i32
    # Hybrid models: the recurrent state after exactly `length` positions.
    conv: jax.Array | None = None  # [Ll, Kc - 1, C] f32
    delta: jax.Array | None = None  # [Ll, Hv, Dk, Dv] f32

    @property
    def n_pages(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def empty_sampling(B: int, V: int) -> SlotSampling:
    f = lambda v: jnp.full((B,), v, jnp.float32)  # noqa: E731
    return SlotSampling(
        temperature=f(0.0),
        top_k=jnp.zeros((B,), jnp.int32),
        top_p=f(1.0),
        min_p=f(0.0),
        repetition_penalty=f(1.0),
        presence_penalty=f(0.0),
        frequency_penalty=f(0.0),
        logit_bias=jnp.zeros((B, V), jnp.float32),
        stop_mask=jnp.zeros((B, V), bool),
        min_tokens=jnp.zeros((B,), jnp.int32),
        max_tokens=jnp.zeros((B,), jnp.int32),
        seed=jnp.zeros((B,), jnp.uint32),
    )


def init_state(cfg: ModelConfig, layout: StateLayout, opts: RuntimeOptions) -> DecodeState:
    """Allocates a zeroed decode state (call under jit to build it on device)."""
    B, V = layout.max_slots, cfg.vocab_size
    kv_shape = (cfg.n_kv_layers, layout.n_pages, layout.page_size, cfg.n_kv_heads, cfg.head_dim)
    shapes = recurrent_shapes(cfg, B + 2)  # the slots, the trash row, the side row
    recurrent = (
        None
        if shapes is None
        else RecurrentState(conv=jnp.zeros(shapes[0], jnp.float32), delta=jnp.zeros(shapes[1], jnp.float32))
    )
    return DecodeState(
        kv=KVCache(k=jnp.zeros(kv_shape, opts.kv_jnp_dtype), v=jnp.zeros(kv_shape, opts.kv_jnp_dtype)),
        page_table=jnp.full((B + 1, layout.max_pages_per_seq), TRASH_PAGE, jnp.int32),
        lengths=jnp.zeros((B,), jnp.int32),
        last_token=jnp.zeros((B,), jnp.int32),
        n_generated=jnp.zeros((B,), jnp.int32),
        done=jnp.ones((B,), bool),
        seen=jnp.zeros((B, V), bool),
        out_counts=jnp.zeros((B, V), jnp.int32),
        sampling=empty_sampling(B, V),
        recurrent=recurrent,
    )


def pages_bucket(n_pages: int, max_pages: int) -> int:
    """Rounds a page count up to a power of two (capped), the context buckets of the steps."""
    bucket = 1
    while bucket < n_pages:
        bucket *= 2
    return min(bucket, max_pages)


def page_row(pages: list[int], layout: StateLayout) -> np.ndarray:
    row = np.full((layout.max_pages_per_seq,), TRASH_PAGE, np.int32)
    row[: len(pages)] = pages
    return row
