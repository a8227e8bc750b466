"""The building blocks every family shares: RMSNorm, RoPE, the gated MLP and the MoE MLP."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.model.matvec_cpu import matmul_cpu
from jaxllm.model.moe_kernels import moe_ffn, moe_kernel
from jaxllm.model.route_kernel import route_and_count
from jaxllm.params import DenseMlpParams, MoeParams, OutIn


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF semantics: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies [Dh/2], with llama3 scaling applied where configured."""
    dim = cfg.rope_dim  # partial RoPE (hybrid family) rotates only the leading dims
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(dim // 2, dtype=jnp.float32) * 2.0 / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (same formula as transformers' _compute_llama3_parameters).
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates [T, heads, Dh] by position, HF `rotate_half` layout (the two halves pair up).

    With fewer frequencies than Dh / 2 (partial RoPE) only the leading 2 * len(inv_freq)
    dims rotate; the rest pass through."""
    rotary = 2 * inv_freq.shape[0]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], positions, inv_freq), x[..., rotary:]], axis=-1)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, Dh/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class LayerSlice:
    """Layer `index` of a stacked [L, ...] weight, left unsliced for a kernel that indexes the
    stack itself: inside `lax.scan` a slice handed to a custom call is a copy of the layer's
    weights, made before every call (on the CPU that copy cost as much as the product)."""

    stack: jax.Array
    index: jax.Array


def project(x: jax.Array, w: jax.Array | LayerSlice | OutIn, n_contract: int = 1, *, kernel: str = "xla") -> jax.Array:
    """x's last `n_contract` axes times w's first ones, e.g. [T, D] x [D, H, Dh] -> [T, H, Dh].

    kernel "xla" is XLA's dot; "cpu" the C++ matmul on the free 2-D views of x and w (rounds of
    a few tokens; see `jaxllm.model.matvec_cpu`). A `LayerSlice` w goes to the C++ kernel as its
    whole stack.
    """
    if isinstance(w, OutIn):
        # Input axes last (RuntimeOptions.weight_layout): the layout decides, not `kernel` (the
        # C++ kernel reads the canonical layout only), so this is always XLA's dot.
        if w.n_in != n_contract:
            raise ValueError(f"an OutIn weight with {w.n_in} input axes contracted over {n_contract}")
        x_axes = tuple(range(x.ndim - n_contract, x.ndim))
        w_axes = tuple(range(w.t.ndim - n_contract, w.t.ndim))
        return jax.lax.dot_general(x, w.t, ((x_axes, w_axes), ((), ())))
    if isinstance(w, LayerSlice) and kernel != "cpu":
        raise ValueError("a LayerSlice weight is for the CPU kernel")
    if kernel == "xla":
        return jnp.tensordot(x, w, axes=n_contract)
    stack, layer = (w.stack, w.index) if isinstance(w, LayerSlice) else (w, None)
    shape = stack.shape[1:] if layer is not None else stack.shape  # one layer's matrix
    lead, inner = x.shape[: x.ndim - n_contract], math.prod(shape[:n_contract])
    x2 = x.reshape(-1, inner)
    if kernel != "cpu":
        raise ValueError(f"unknown projection kernel {kernel!r}")
    out = matmul_cpu(x2, stack.reshape(*stack.shape[: stack.ndim - len(shape)], inner, -1), layer=layer)
    return out.reshape(*lead, *shape[n_contract:])


def dense_mlp(x: jax.Array, p: DenseMlpParams, *, kernel: str = "xla") -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x)); x [T, D]."""
    if p.w_gate_up is not None:  # the runtime layout: one matmul for both
        gate, up = jnp.split(project(x, p.w_gate_up, kernel=kernel), 2, axis=1)
    else:
        gate = project(x, p.w_gate, kernel=kernel)
        up = project(x, p.w_up, kernel=kernel)
    return project(jax.nn.silu(gate) * up, p.w_down, kernel=kernel)


def route(router_logits: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """([T, k] routing weights, [T, k] expert ids) of [T, E] float32 router logits: softmax,
    then top-k, renormalised where the config says so."""
    probs = jax.nn.softmax(router_logits, axis=-1)
    top_w, top_e = jax.lax.top_k(probs, cfg.n_experts_per_token)
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w, top_e


def expert_counts(top_e: jax.Array, valid: jax.Array, n_experts: int) -> jax.Array:
    """[E] int32 number of valid tokens routed to each expert, of [T, k] expert ids."""
    k = top_e.shape[1]
    counted = jnp.where(jnp.repeat(valid, k), 1, 0)
    return jnp.zeros((n_experts,), jnp.int32).at[top_e.reshape(-1)].add(counted)


def moe_mlp(
    x: jax.Array,
    p: MoeParams,
    cfg: ModelConfig,
    valid: jax.Array,
    *,
    kernel: str | None = "auto",
    route_kernel: str | None = None,
    router_logits: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Top-k routed experts with a grouped matmul: compute scales with tokens per expert.

    Args:
      x: [T, D] activations.
      p: one layer's MoE params.
      cfg: config (experts, top-k, normalisation).
      valid: [T] bool, False for padding tokens: routed but not counted, their output rows
        zeros (the kernels' grouped layout runs no expert for them).
      kernel: "pallas" / "interpret" run the experts through `jaxllm.model.moe_kernels` (which
        read only routed experts' weights), None through `jax.lax.ragged_dot` (on CUDA, XLA
        makes that a dense dot over every expert); "auto" picks (`moe_kernel`).
      route_kernel: "pallas" / "interpret" route and count in one kernel
        (`jaxllm.model.route_kernel`, for rounds of few tokens), None by XLA's ops (`route`,
        `expert_counts`); chosen by `kernel_choice.route_kernel_choice`.
      router_logits: [T, E] float32 x . router, where the caller has them (from the hybrid
        family's fused input product, `MoeParams.w_in`).

    Returns:
      ([T, D] output, [E] number of valid tokens routed to each expert).
    """
    T, D = x.shape
    E, k = cfg.n_experts, cfg.n_experts_per_token
    if router_logits is None:
        router_logits = project(x, p.router).astype(jnp.float32)
    if route_kernel is not None:
        top_w, top_e, expert_tokens = route_and_count(
            router_logits, valid, k=k, norm_topk_prob=cfg.norm_topk_prob, interpret=route_kernel == "interpret"
        )
    else:
        top_w, top_e = route(router_logits, cfg)  # [T, k]
        expert_tokens = expert_counts(top_e, valid, E)
    kernel = moe_kernel(x.dtype, D, p.w_gate.shape[-1]) if kernel == "auto" else kernel
    if kernel is not None:
        out = moe_ffn(x, top_e, top_w, p.w_gate, p.w_up, p.w_down, valid=valid, interpret=kernel == "interpret")
        return out, expert_tokens
    flat_e = top_e.reshape(-1)  # [T*k]
    order = jnp.argsort(flat_e, stable=True)
    token_of = order // k
    x_sorted = x[token_of]  # [T*k, D], grouped by expert
    group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    gate = jax.lax.ragged_dot(x_sorted, p.w_gate, group_sizes)
    up = jax.lax.ragged_dot(x_sorted, p.w_up, group_sizes)
    out_sorted = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p.w_down, group_sizes)  # [T*k, D]
    weights = jnp.where(jnp.repeat(valid, k), top_w.reshape(-1), 0)[order].astype(out_sorted.dtype)
    out = jnp.zeros((T, D), out_sorted.dtype).at[token_of].add(out_sorted * weights[:, None])
    return out.astype(x.dtype), expert_tokens
