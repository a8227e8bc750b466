"""The transformer over a flattened ragged token batch with a paged KV cache.

`forward` is a pure function: (params, tokens, their slots and positions, the cache) ->
(hidden states, new cache, expert activity). Stacked layers run under `lax.scan`, a tuple of
layers unrolled (see `params.layout_params`); both share `_layer`, so they compute the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxllm.attention.fused import chunk_attention, fused_attention_available
from jaxllm.attention import paged_decode_cpu
from jaxllm.attention.paged_decode import paged_decode_attention, paged_decode_attention_qkv
from jaxllm.attention.reference import Windows, paged_attention, paged_decode_reference, place_decode_rows
from jaxllm.config import ModelConfig
from jaxllm.model import matvec_cpu
from jaxllm.model.kernel_choice import (
    add_rms_norm,
    decode_attention_kernel,
    matmul_kernel,
    norm_kernel,
    route_kernel_choice,
)
from jaxllm.model.layers import LayerSlice, apply_rope, dense_mlp, moe_mlp, project, rms_norm, rope_inv_freq
from jaxllm.params import LayerParams, MoeParams, OutIn, Params
from jaxllm.state import KVCache, to_kv_dtype
from jaxllm.runtime_options import RuntimeOptions


@struct.dataclass
class TokenBatch:
    """A flat batch of tokens and the windows attention groups them into."""

    tokens: jax.Array  # [T] i32
    slots: jax.Array  # [T] i32; the trash row (B) for padding
    positions: jax.Array  # [T] i32
    decode: Windows  # one-token windows; window i is row i (the batch's first rows)
    chunks: Windows  # multi-token windows (prompt chunks)
    # [Nc] bool per chunk window, hybrid models only: also keep its recurrent state after all
    # but its last token, in the state's side row (`RecurrentState`); None: no window does.
    chunk_side: jax.Array | None = None


@struct.dataclass
class DecodeLookups:
    """What decode attention reads per window, the same for every layer: looked up once."""

    pages: jax.Array  # [W, n_ctx_pages] i32 page ids of each decode window's slot
    cached: jax.Array  # [W] i32 cached positions (0 for windows that do not decode)


def raw_projection_attends(lp: LayerParams, batch: TokenBatch) -> bool:
    """Whether decode attention can read q/k/v straight from the fused qkv projection's output
    (rotating them itself): a decode-only round, and nothing between projection and RoPE (no
    qkv bias, no q/k norm)."""
    a = lp.attn
    only_decode = batch.decode.slot.shape[0] and not batch.chunks.slot.shape[0]
    return bool(only_decode) and a.wqkv is not None and a.bq is None and a.q_norm is None


def _layer(
    x: jax.Array,
    pending: jax.Array | None,
    kv: KVCache,
    layer_index: jax.Array | int,
    lp: LayerParams,
    batch: TokenBatch,
    page_table: jax.Array,
    lookups: DecodeLookups,
    cfg: ModelConfig,
    *,
    opts: RuntimeOptions,
    chunk_len: int,
    n_ctx_pages: int,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array], jax.Array]:
    """One block on the residual stream `x + pending` (the previous block's MLP output is
    added here, inside this block's first norm). Returns (the stream after attention, the MLP
    output still to add, this round's (k, v) for the caller to write, expert activity)."""
    a = lp.attn
    inv_freq = rope_inv_freq(cfg)
    norm = norm_kernel(opts, x.shape[0])
    x, h = add_rms_norm(x, pending, lp.attn_norm, cfg.rms_eps, kernel=norm)
    mm = matmul_kernel(opts, x.shape[0])
    qkv = None
    if a.wqkv is not None:  # the runtime layout: one matmul for all three
        H = cfg.n_heads
        qkv = project(h, a.wqkv, kernel=mm)
        q, k, v = jnp.split(qkv, [H, H + cfg.n_kv_heads], axis=1)
    else:
        q, k, v = (project(h, w, kernel=mm) for w in (a.wq, a.wk, a.wv))
    if a.bq is not None:
        q, k, v = q + a.bq, k + a.bk, v + a.bv
    if a.q_norm is not None:
        q = rms_norm(q, a.q_norm, cfg.rms_eps)
        k = rms_norm(k, a.k_norm, cfg.rms_eps)
    q = apply_rope(q, batch.positions, inv_freq)
    k = to_kv_dtype(apply_rope(k, batch.positions, inv_freq), kv.k.dtype)
    v = to_kv_dtype(v, kv.v.dtype)

    page_table = _after(page_table, x)  # read this layer's context only once its input exists
    kernel = decode_attention_kernel(opts)
    # A decode-only round hands the Pallas kernel the raw projection output: it slices and
    # rotates q and the fresh k itself (the rotated k here then feeds only the cache write).
    raw = kernel is not None and kernel != "cpu" and raw_projection_attends(lp, batch)
    attn = attend(
        q,
        k,
        v,
        kv,
        layer_index,
        batch,
        page_table,
        lookups,
        cfg,
        opts=opts,
        chunk_len=chunk_len,
        n_ctx_pages=n_ctx_pages,
        fused_input=(qkv, inv_freq) if raw else None,
    )
    x, h = add_rms_norm(x, project(attn, a.wo, 2, kernel=mm), lp.mlp_norm, cfg.rms_eps, kernel=norm)
    if isinstance(lp.mlp, MoeParams):
        valid = batch.slots < page_table.shape[0] - 1
        route = route_kernel_choice(opts, x.shape[0])
        out, expert_tokens = moe_mlp(h, lp.mlp, cfg, valid, route_kernel=route)
    else:
        out, expert_tokens = dense_mlp(h, lp.mlp, kernel=mm), jnp.zeros((0,), jnp.int32)
    return x, out, (k, v), expert_tokens


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv: KVCache,
    layer_index: jax.Array | int,
    batch: TokenBatch,
    page_table: jax.Array,
    lookups: DecodeLookups,
    cfg: ModelConfig,
    *,
    opts: RuntimeOptions,
    chunk_len: int,
    n_ctx_pages: int,
    fused_input: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Attention of every row of the batch over its own context in the pages plus this
    round's fresh keys and values: decode windows by a paged kernel (or the reference),
    prompt chunks by cuDNN (or the reference). Returns [T, H, Dh].

    Args:
      q, k, v: this round's [T, heads, Dh], rotated, k and v already in the cache's dtype.
      kv: the whole [L, ...] cache (kernels index the layer themselves); L counts only the
        layers with a cache.
      fused_input: see `_decode_kernel_attention`.
    """
    # The references read the whole cache at the layer inside their page gathers: a slice of
    # the layer first was a copy of that layer's pool (XLA did not fuse it into the gather).
    kernel = decode_attention_kernel(opts)
    if kernel is not None and batch.decode.slot.shape[0]:
        attn = _decode_kernel_attention(q, k, v, kv, layer_index, lookups, batch, kernel, fused_input)
    else:
        attn = paged_decode_reference(
            q, k, v, batch.positions, kv.k, kv.v, page_table, batch.decode, n_ctx_pages=n_ctx_pages, layer=layer_index
        )
    if batch.chunks.slot.shape[0] and fused_attention_available(opts.dtype):
        attn = attn + chunk_attention(
            q,
            k,
            v,
            batch.positions,
            kv.k,
            kv.v,
            layer_index,
            page_table,
            batch.chunks,
            window_len=chunk_len,
            n_ctx_pages=n_ctx_pages,
            implementation="cudnn",
        )
    elif batch.chunks.slot.shape[0]:
        attn = attn + paged_attention(
            q,
            k,
            v,
            batch.positions,
            kv.k,
            kv.v,
            page_table,
            batch.chunks,
            window_len=chunk_len,
            n_ctx_pages=n_ctx_pages,
            layer=layer_index,
        )
    return attn


def _decode_kernel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv: KVCache,
    layer_index: jax.Array | int,
    lookups: DecodeLookups,
    batch: TokenBatch,
    kernel: str,
    fused_input: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Decode windows' attention by a paged kernel (see `decode_attention_kernel`); [T, H, Dh]
    with zeros past them.

    Decode windows are the batch's first rows, one token each (see `steps`). The kernel gets
    the whole [L, ...] cache and the layer index: a per-layer slice would be copied first.
    `fused_input` = (the [T, H + 2K, Dh] projection before RoPE, RoPE's frequencies) lets the
    Pallas kernel read q, k, v from it and rotate them itself.
    """
    W = batch.decode.slot.shape[0]
    pages, cached = lookups.pages, lookups.cached
    if kernel == "cpu":
        out = paged_decode_cpu.paged_decode_attention_cpu(
            q[:W], k[:W], v[:W], kv.k, kv.v, pages, cached, layer=layer_index
        )
        return place_decode_rows(out.astype(q.dtype), batch.decode, q.shape[0])
    # The Pallas kernel writes zeros for windows that do not decode itself.
    common = dict(layer=layer_index, window_live=batch.decode.length > 0, interpret=kernel == "interpret")
    if fused_input is not None:
        qkv, inv_freq = fused_input
        out = paged_decode_attention_qkv(
            qkv[:W], batch.positions[:W], inv_freq, kv.k, kv.v, pages, cached, n_heads=q.shape[1], **common
        )
    else:
        out = paged_decode_attention(q[:W], k[:W], v[:W], kv.k, kv.v, pages, cached, **common)
    return out if W == q.shape[0] else jnp.concatenate([out, jnp.zeros((q.shape[0] - W, *out.shape[1:]), out.dtype)])


def _projections_by_reference(lp: LayerParams, layers: LayerParams, i: jax.Array) -> LayerParams:
    """One scanned layer's params with its dense projection matrices as `LayerSlice` views of
    the stacks (the slices scan made of them are then unused, and XLA drops them)."""

    def swap(sliced, stacked, names: tuple[str, ...]):
        return sliced.replace(
            **{
                n: LayerSlice(w, i)
                for n in names
                if (w := getattr(stacked, n)) is not None and not isinstance(w, OutIn)
            }
        )

    attn = swap(lp.attn, layers.attn, ("wqkv", "wq", "wk", "wv", "wo"))
    mlp = (
        lp.mlp if isinstance(lp.mlp, MoeParams) else swap(lp.mlp, layers.mlp, ("w_gate_up", "w_gate", "w_up", "w_down"))
    )
    return lp.replace(attn=attn, mlp=mlp)


def write_kv(kv: KVCache, k_new: jax.Array, v_new: jax.Array, batch: TokenBatch, page_table: jax.Array) -> KVCache:
    """Writes every layer's new K/V ([L, T, K, Dh]) into the pages in one in-place scatter."""
    page_size = kv.k.shape[2]
    page = page_table[batch.slots, batch.positions // page_size]  # [T]; padding -> trash page
    offset = batch.positions % page_size
    return KVCache(
        k=kv.k.at[:, page, offset].set(k_new),
        v=kv.v.at[:, page, offset].set(v_new),
    )


def _after(values: jax.Array, anchor: jax.Array) -> jax.Array:
    """`values` (int32, each below the int32 maximum) unchanged, but computed from `anchor`.

    XLA orders ops by data dependencies only, and two orderings matter here:

    * The cache write is one in-place update after all layers. Every layer's cache read feeds
      the next layer's K/V except the last layer's, which feeds only the hidden state; with no
      data path from that read to the write XLA copies the whole cache, twice, every step.
    * With unrolled layers, every layer's cache read depends only on the cache, so XLA hoists
      all of them to the start of the step: their outputs (all layers' context K/V) are then
      live at once, a temp buffer of hundreds of MB at 8 slots that is page-faulted anew on
      every call. Tying a layer's page lookups to its input keeps one layer's copy live.

    An optimization barrier does not give either ordering; a data dependency does. The sign
    bit of `anchor` is 0 or 1, so the minimum is always `values` itself.
    """
    first = anchor.reshape(-1)[0].astype(jnp.float32)
    sign = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(first, jnp.uint32), jnp.uint32(31))
    return jnp.minimum(values, jnp.iinfo(jnp.int32).max - 1 + sign.astype(jnp.int32))


def forward(
    params: Params,
    cfg: ModelConfig,
    batch: TokenBatch,
    kv: KVCache,
    page_table: jax.Array,
    *,
    opts: RuntimeOptions,
    chunk_len: int,
    n_ctx_pages: int,
) -> tuple[jax.Array, KVCache, jax.Array]:
    """Runs every layer over the batch, then writes the batch's K/V into the pages.

    `opts` (static) picks the compute dtype and each part's kernel.

    Returns:
      (final-normed hidden [T, D], the updated cache, tokens per expert [L, E] or [L, 0]).
    """
    x = params.embed[batch.tokens].astype(opts.jnp_dtype)
    W = batch.decode.slot.shape[0]
    lookups = DecodeLookups(
        pages=page_table[batch.decode.slot, :n_ctx_pages],
        cached=jnp.where(batch.decode.length > 0, batch.positions[:W], 0),
    )
    kwargs = dict(
        page_table=page_table, lookups=lookups, cfg=cfg, opts=opts, chunk_len=chunk_len, n_ctx_pages=n_ctx_pages
    )
    # The residual stream is x + pending: each block adds its predecessor's MLP output inside
    # its first norm (one kernel for both in decode rounds; see `norm_kernel`).
    pending = None

    if not isinstance(params.layers, tuple):
        pending = jnp.zeros_like(x)  # scan's carry needs an array from the start
        by_reference = matmul_kernel(opts, batch.tokens.shape[0]) == "cpu"

        def body(carry, xs):
            lp, i = xs
            if by_reference:
                lp = _projections_by_reference(lp, params.layers, i)
            x, pending, new_kv, experts = _layer(*carry, kv, i, lp, batch, **kwargs)
            return (x, pending), (new_kv, experts)

        (x, pending), ((k_new, v_new), experts) = jax.lax.scan(
            body, (x, pending), (params.layers, jnp.arange(cfg.n_layers))
        )
    else:
        # The layers share one jitted body, so a round traces and lowers one layer, not all of
        # them (warm-up lowers every round shape serially); XLA inlines the calls, so the
        # compiled round is the same as with the layers written out.
        run_layer = jax.jit(lambda x, pending, i, lp: _layer(x, pending, kv, i, lp, batch, **kwargs))
        ks, vs, per_layer = [], [], []
        for i, lp in enumerate(params.layers):
            x, pending, (k, v), e = run_layer(x, pending, jnp.int32(i), lp)
            ks.append(k)
            vs.append(v)
            per_layer.append(e)
        k_new, v_new, experts = jnp.stack(ks), jnp.stack(vs), jnp.stack(per_layer)
    x, hidden = add_rms_norm(x, pending, params.final_norm, cfg.rms_eps, kernel=norm_kernel(opts, x.shape[0]))
    # The write must follow every read of the cache; see `_after`.
    batch = batch.replace(positions=_after(batch.positions, hidden))
    kv = write_kv(kv, k_new, v_new, batch, page_table)
    return hidden, kv, experts


def lm_head(params: Params, hidden: jax.Array, *, kernel: str = "xla") -> jax.Array:
    """[N, D] -> float32 logits [N, V]; kernel "cpu" runs the C++ product (see `matmul_kernel`)."""
    if kernel == "cpu":
        if params.lm_head is None:
            return matvec_cpu.matmul_cpu(hidden, params.embed, transposed=True)
        return matvec_cpu.matmul_cpu(hidden, params.lm_head)
    if params.lm_head is None:
        logits = jnp.einsum("nd,vd->nv", hidden, params.embed)
    else:
        logits = jnp.einsum("nd,dv->nv", hidden, params.lm_head)
    return logits.astype(jnp.float32)
