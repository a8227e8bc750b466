"""The transformer over a flattened ragged token batch with a paged KV cache.

`forward` is a pure function: (params, tokens, their slots and positions, the cache) ->
(hidden states, new cache, expert activity). Layers run under `lax.scan` or unrolled
(`cfg.scan_layers`); both share `_layer`, so they compute the same thing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxllm.attention.reference import Windows, paged_attention
from jaxllm.config import ModelConfig
from jaxllm.model.layers import apply_rope, dense_mlp, moe_mlp, rms_norm, rope_inv_freq
from jaxllm.params import LayerParams, MoeParams, Params
from jaxllm.state import KVCache


@struct.dataclass
class TokenBatch:
    """A flat batch of tokens and the windows attention groups them into."""

    tokens: jax.Array  # [T] i32
    slots: jax.Array  # [T] i32; the trash row (B) for padding
    positions: jax.Array  # [T] i32
    decode: Windows  # one-token windows
    chunks: Windows  # multi-token windows (prompt chunks)


def _layer(
    x: jax.Array,
    kv: KVCache,
    layer_index: jax.Array | int,
    lp: LayerParams,
    batch: TokenBatch,
    page_table: jax.Array,
    cfg: ModelConfig,
    *,
    chunk_len: int,
    n_ctx_pages: int,
) -> tuple[jax.Array, KVCache, jax.Array]:
    a = lp.attn
    inv_freq = rope_inv_freq(cfg)
    h = rms_norm(x, lp.attn_norm, cfg.rms_eps)
    q = jnp.einsum("td,dhk->thk", h, a.wq)
    k = jnp.einsum("td,dhk->thk", h, a.wk)
    v = jnp.einsum("td,dhk->thk", h, a.wv)
    if a.bq is not None:
        q, k, v = q + a.bq, k + a.bk, v + a.bv
    if a.q_norm is not None:
        q = rms_norm(q, a.q_norm, cfg.rms_eps)
        k = rms_norm(k, a.k_norm, cfg.rms_eps)
    q = apply_rope(q, batch.positions, inv_freq)
    k = apply_rope(k, batch.positions, inv_freq)

    page_size = kv.k.shape[2]
    page = page_table[batch.slots, batch.positions // page_size]
    offset = batch.positions % page_size
    kv = KVCache(
        k=kv.k.at[layer_index, page, offset].set(k.astype(kv.k.dtype)),
        v=kv.v.at[layer_index, page, offset].set(v.astype(kv.v.dtype)),
    )
    k_layer, v_layer = kv.k[layer_index], kv.v[layer_index]
    attn = paged_attention(
        q, batch.positions, k_layer, v_layer, page_table, batch.decode, window_len=1, n_ctx_pages=n_ctx_pages
    )
    if batch.chunks.slot.shape[0]:
        attn = attn + paged_attention(
            q,
            batch.positions,
            k_layer,
            v_layer,
            page_table,
            batch.chunks,
            window_len=chunk_len,
            n_ctx_pages=n_ctx_pages,
        )
    x = x + jnp.einsum("thk,hkd->td", attn, a.wo)

    h = rms_norm(x, lp.mlp_norm, cfg.rms_eps)
    if isinstance(lp.mlp, MoeParams):
        valid = batch.slots < page_table.shape[0] - 1
        out, expert_tokens = moe_mlp(h, lp.mlp, cfg, valid)
    else:
        out, expert_tokens = dense_mlp(h, lp.mlp), jnp.zeros((0,), jnp.int32)
    return x + out, kv, expert_tokens


def forward(
    params: Params,
    cfg: ModelConfig,
    batch: TokenBatch,
    kv: KVCache,
    page_table: jax.Array,
    *,
    chunk_len: int,
    n_ctx_pages: int,
) -> tuple[jax.Array, KVCache, jax.Array]:
    """Runs every layer over the batch, writing its K/V into the pages.

    Returns:
      (final-normed hidden [T, D], the updated cache, tokens per expert [L, E] or [L, 0]).
    """
    x = params.embed[batch.tokens].astype(cfg.jnp_dtype)
    kwargs = dict(page_table=page_table, cfg=cfg, chunk_len=chunk_len, n_ctx_pages=n_ctx_pages)

    if cfg.scan_layers:

        def body(carry, xs):
            x, kv = carry
            lp, i = xs
            x, kv, experts = _layer(x, kv, i, lp, batch, **kwargs)
            return (x, kv), experts

        (x, kv), experts = jax.lax.scan(body, (x, kv), (params.layers, jnp.arange(cfg.n_layers)))
    else:
        per_layer = []
        for i in range(cfg.n_layers):
            lp = jax.tree.map(lambda w: w[i], params.layers)
            x, kv, e = _layer(x, kv, i, lp, batch, **kwargs)
            per_layer.append(e)
        experts = jnp.stack(per_layer)
    return rms_norm(x, params.final_norm, cfg.rms_eps), kv, experts


def lm_head(params: Params, hidden: jax.Array) -> jax.Array:
    """[N, D] -> float32 logits [N, V]."""
    if params.lm_head is None:
        logits = jnp.einsum("nd,vd->nv", hidden, params.embed)
    else:
        logits = jnp.einsum("nd,dv->nv", hidden, params.lm_head)
    return logits.astype(jnp.float32)
