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
from jaxllm.params import GatedAttentionParams
from jaxllm.state import KVCache, to_kv_dtype
from jaxllm.runtime_options import RuntimeOptions


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
    q = rms_norm(project(h, p.wq), p.q_norm, cfg.rms_eps)
    k = rms_norm(project(h, p.wk), p.k_norm, cfg.rms_eps)
    v = project(h, p.wv)
    gate = project(h, p.w_gate)
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
