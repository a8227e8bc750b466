"""A one-token decode round's layer as a chain of Pallas kernels with no XLA kernel between.

At batch 1 a decode step is bandwidth-bound GEMVs plus, per layer, a dozen small kernels
(norms, RoPE, split-K sums, SiLU x up) that each cost a few us and a launch gap. Here the
matvec kernels leave their K splits unsummed and each next kernel sums them as it loads, so a
layer is eight kernels (two add + norms, qkv, attention, merge, o, gate|up, down; XLA's path
runs ~11 with its split-K sums and SiLU x up). Chosen with
`ModelConfig.decode_matmul = "pallas"` on unrolled dense layers (`chain_kernel`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from jaxllm.attention.paged_decode import paged_decode_attention_qkv
from jaxllm.config import ModelConfig
from jaxllm.model.kernel_choice import add_rms_norm, decode_attention_kernel, matmul_kernel, norm_kernel
from jaxllm.model.layers import rope_inv_freq
from jaxllm.model.matvec import matvec
from jaxllm.params import LayerParams, MoeParams
from jaxllm.state import KVCache

if TYPE_CHECKING:  # forward imports this module
    from jaxllm.model.forward import TokenBatch


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


def chain_kernel(cfg: ModelConfig, lp: LayerParams, batch: TokenBatch) -> str | None:
    """"pallas" / "interpret" when a layer of this round runs as `chain_layer`: a
    one-token decode-only round of a dense model with fused projections (no qkv bias or q/k
    norm) where the Pallas matvec and decode attention kernels are chosen; else None."""
    mm = matmul_kernel(cfg, batch.tokens.shape[0])
    if mm not in ("pallas", "interpret") or decode_attention_kernel(cfg) not in ("pallas", "interpret"):
        return None
    if isinstance(lp.mlp, MoeParams) or lp.mlp.w_gate_up is None or not raw_projection_attends(lp, batch):
        return None
    return mm


def chain_layer(
    x: jax.Array,
    pending: jax.Array | None,
    kv: KVCache,
    layer_index: jax.Array | int,
    lp: LayerParams,
    batch: TokenBatch,
    lookups: DecodeLookups,
    cfg: ModelConfig,
    *,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array], jax.Array]:
    """`forward._layer` for a one-token decode round as a chain of Pallas kernels that hand
    each other the matvecs' float32 split partials: no XLA kernel runs between them.

    The matvec kernels leave their K splits unsummed (`matvec(partials=True)`), and the next
    kernel sums them while loading: attention sums the qkv partials (and rotates q and k, and
    returns the k and v the cache write stores), the add + RMSNorm kernel sums the o and down
    partials, the down matvec applies SwiGLU to the gate|up partials. So a layer is eight
    kernels: add + norm (adding the previous layer's down partials), qkv, attention, merge, o,
    add + norm, gate|up, down. Same arithmetic as `_layer` up to the order of float32 sums.
    """
    a, mlp = lp.attn, lp.mlp
    T, D = x.shape
    norm = norm_kernel(cfg, T)  # XLA's norm (decode_norm = "xla") sums the partials itself
    x, h = add_rms_norm(x, pending, lp.attn_norm, cfg.rms_eps, kernel=norm)
    qkv = matvec(h, a.wqkv.reshape(D, -1), partials=True, interpret=interpret)
    qkv = qkv.reshape(qkv.shape[0], T, -1, cfg.head_dim)  # [S, T, H + 2K, Dh]
    attn, k, v = paged_decode_attention_qkv(
        qkv, batch.positions, rope_inv_freq(cfg), kv.k, kv.v, lookups.pages, lookups.cached,
        n_heads=cfg.n_heads, layer=layer_index, window_live=batch.decode.length > 0, interpret=interpret,
        return_kv=True, dtype=cfg.dtype,
    )
    o = matvec(attn.reshape(T, -1), a.wo.reshape(-1, D), partials=True, interpret=interpret)
    x, h = add_rms_norm(x, o, lp.mlp_norm, cfg.rms_eps, kernel=norm)
    gate_up = matvec(h, mlp.w_gate_up, partials=True, interpret=interpret)
    down = matvec(gate_up, mlp.w_down, swiglu_input=True, partials=True, interpret=interpret)
    return x, down, (k, v), jnp.zeros((0,), jnp.int32)
