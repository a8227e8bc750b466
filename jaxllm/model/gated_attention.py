"""Gated full attention of the hybrid family (Qwen3-Next, Qwen3.5): the attention mixer.

Against a qwen3 attention block it adds a per-head output gate, `attn * sigmoid(x . w_gate)`,
and rotates only the leading `rotary_dim` dims of each head (partial RoPE); its q/k norms are
zero-centred in the checkpoint, which the loader turns into plain scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.model.forward import DecodeLookups, TokenBatch, attend
from jaxllm.model.layers import apply_rope, project, rms_norm, rope_inv_freq
from jaxllm.params import GatedAttentionParams, qgkv_splits
from jaxllm.state import KVCache, to_kv_dtype
from jaxllm.runtime_options import RuntimeOptions


def input_projections(
    h: jax.Array, p: GatedAttentionParams, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """q, gate [T, H, Dh] and k, v [T, K, Dh] of the normed input h [T, D] (before q/k norms)."""
    if p.w_qgkv is None:
        return project(h, p.wq), project(h, p.w_gate), project(h, p.wk), project(h, p.wv)
    # At one decode row each matmul is a kernel launch; one product of the shared input replaces four.
    H, K = cfg.n_heads, cfg.n_kv_heads
    q, gate, k, v = jnp.split(project(h, p.w_qgkv), qgkv_splits(H, K), axis=1)
    return q, gate, k, v


def gated_attention(
    h: jax.Array,
    p: GatedAttentionParams,
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
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's attention over the ragged batch.

    Args:
      h: [T, D] normed input.
      p: this layer's params (one slice of the stack).
      kv: the whole cache; `layer_index` counts attention layers only.

    Returns:
      ([T, D] output, this round's k and v [T, K, Dh] in the cache's dtype, for the caller
      to write after every layer has read the cache).
    """
    q, gate, k, v = input_projections(h, p, cfg)
    q, k = rms_norm(q, p.q_norm, cfg.rms_eps), rms_norm(k, p.k_norm, cfg.rms_eps)
    inv_freq = rope_inv_freq(cfg)
    q = apply_rope(q, batch.positions, inv_freq)
    k = to_kv_dtype(apply_rope(k, batch.positions, inv_freq), kv.k.dtype)
    v = to_kv_dtype(v, kv.v.dtype)
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
    )
    attn = attn * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)
    return project(attn, p.wo, 2), k, v
