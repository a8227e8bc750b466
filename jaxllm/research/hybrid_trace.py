"""The plain one-prompt forward of the hybrid family (Qwen3-Next, Qwen3.5) for inspection.

Built from the serving layers (`gated_attention`'s projections, `delta_mixer`, `block_mlp`)
over one prompt, keeping what the paged forward throws away: the stream after every block,
the attention weights of the full-attention layers and, for the Gated DeltaNet layers (which
have no attention weights), the norm of each head's delta-rule state after every token.
Layers run in `lax.scan` over the repeating groups, as `hybrid_forward` does.

Axes: T prompt tokens, H query heads, Hv DeltaNet value heads, D model width, k experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.config import LINEAR_ATTENTION, ModelConfig
from jaxllm.model.delta_mixer import Segments, delta_mixer
from jaxllm.model.forward import lm_head
from jaxllm.model.gated_attention import input_projections
from jaxllm.model.hybrid import block_mlp, router_logits
from jaxllm.model.layers import apply_rope, project, rms_norm, rope_inv_freq, route
from jaxllm.params import GatedAttentionParams, HybridBlockParams, MoeParams, Params
from jaxllm.state import RecurrentState


def router_choice(h: jax.Array, mlp: MoeParams, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The experts an MoE layer routes each token of normed input `h` [T, D] to: ([T, k] ids,
    [T, k] weights), softmax then top-k (renormalised where the config says so)."""
    top_w, top_e = route(router_logits(h, mlp), cfg)
    return top_e, top_w


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Explicit causal attention on one sequence: q [T, H, Dh], k/v [T, K, Dh] -> ([T, H, Dh]
    output, [H, T, T] weights)."""
    group = cfg.n_heads // cfg.n_kv_heads  # query head h reads kv head h // group
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    T = q.shape[0]
    scores = jnp.einsum("thd,shd->hts", q, k, preferred_element_type=jnp.float32) * cfg.head_dim**-0.5
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("hts,shd->thd", weights.astype(v.dtype), v), weights


def _gated_attention(h: jax.Array, p: GatedAttentionParams, cfg: ModelConfig, positions: jax.Array):
    """`jaxllm.model.gated_attention` on one sequence with its weights kept."""
    q, gate, k, v = input_projections(h, p, cfg)
    q, k = rms_norm(q, p.q_norm, cfg.rms_eps), rms_norm(k, p.k_norm, cfg.rms_eps)
    inv_freq = rope_inv_freq(cfg)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    attn, weights = causal_attention(q, k, v, cfg)
    attn = attn * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)
    return project(attn, p.wo, 2), weights


def _delta(h: jax.Array, p, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """`delta_mixer` on one fresh sequence: ([T, D] output, [T, Hv] Frobenius norm of each
    head's delta-rule state after each token)."""
    T = h.shape[0]
    C = cfg.conv_dim
    fresh = RecurrentState(
        conv=jnp.zeros((1, 1, cfg.conv_kernel - 1, C), jnp.float32),
        delta=jnp.zeros((1, 1, cfg.linear_n_v_heads, cfg.linear_k_dim, cfg.linear_v_dim), jnp.float32),
    )
    none = jnp.zeros((0,), jnp.int32)
    decode = Segments(
        slots=none, targets=none, rows=jnp.zeros((0, 1), jnp.int32), valid=jnp.zeros((0, 1), bool), lengths=none
    )
    seq = Segments(
        slots=jnp.zeros((1,), jnp.int32),
        targets=jnp.zeros((1,), jnp.int32),
        rows=jnp.arange(T, dtype=jnp.int32)[None],
        valid=jnp.ones((1, T), bool),
        lengths=jnp.full((1,), T, jnp.int32),
    )
    # Snapshots: the states after each token ([1, T, Hv, Dk, Dv]), as verification keeps them.
    out, _, deltas, _ = delta_mixer(h, p, fresh, 0, decode, seq, cfg, snapshots=True)
    return out, jnp.sqrt(jnp.sum(deltas[0] ** 2, axis=(-2, -1)))


@functools.partial(jax.jit, static_argnames=("cfg",))
def hybrid_trace(params: Params, cfg: ModelConfig, ids: jax.Array):
    """Returns (stream [L + 1, T, D], attention [L_full, H, T, T], state norms [L_lin, T, Hv] or
    None, router (ids, weights) [L, T, k] or None, logits [T, V]); the per-kind arrays in
    layer order within their kind."""
    layers = params.layers
    x0 = params.embed[ids]  # the params are in the compute dtype
    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
    pattern = cfg.layer_types[: cfg.layer_period]
    groups = cfg.n_layers // cfg.layer_period
    valid = jnp.ones(ids.shape, bool)

    def block(x, lp: HybridBlockParams, mix):
        out, seen = mix(rms_norm(x, lp.attn_norm, cfg.rms_eps))
        x = x + out
        h = rms_norm(x, lp.mlp_norm, cfg.rms_eps)
        out, _ = block_mlp(h, lp.mlp, cfg, valid)
        router = router_choice(h, lp.mlp, cfg) if isinstance(lp.mlp, MoeParams) else None
        return x + out, seen, router

    def body(x, xs):
        lin, full = xs
        stream, weights, norms, routers = [], [], [], []
        i_lin = i_full = 0
        for kind in pattern:
            if kind == LINEAR_ATTENTION:
                lp = jax.tree.map(lambda w, i=i_lin: w[i], lin)
                x, seen, router = block(x, lp, lambda h: _delta(h, lp.mixer, cfg))
                norms.append(seen)
                i_lin += 1
            else:
                lp = jax.tree.map(lambda w, i=i_full: w[i], full)
                x, seen, router = block(x, lp, lambda h: _gated_attention(h, lp.mixer, cfg, positions))
                weights.append(seen)
                i_full += 1
            stream.append(x)
            routers.append(router)
        stack = lambda xs: None if not xs or xs[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *xs)  # noqa: E731
        return x, (stack(stream), stack(weights), stack(norms), stack(routers))

    regroup = lambda t: jax.tree.map(lambda w: w.reshape(groups, w.shape[0] // groups, *w.shape[1:]), t)  # noqa: E731
    xs = (None if layers.linear is None else regroup(layers.linear), regroup(layers.full))
    x, (stream, attention, norms, router) = jax.lax.scan(body, x0, xs)
    flat = lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])  # noqa: E731
    logits = lm_head(params, rms_norm(x, params.final_norm, cfg.rms_eps))
    return (
        jnp.concatenate([x0[None], flat(stream)]),
        flat(attention),
        None if norms is None else flat(norms),
        None if router is None else jax.tree.map(flat, router),
        logits,
    )
