"""Looking inside the model on one prompt: residual-stream norms, the logit lens, attention
weights of a layer, the experts MoE layers route each token to.

The serving forward (`jaxllm.model.forward`) never materialises attention weights or keeps
per-layer states, so this is a separate plain forward over one prompt built from the same
layer functions (RMSNorm, RoPE, projections, MLPs); its final logits are tested equal to
`Model.logits`, the paged path. Attention-only families (llama, qwen2, qwen3, qwen3_moe) and
the hybrid family (Qwen3-Next, Qwen3.5; `jaxllm.research.hybrid_trace`), whose Gated DeltaNet
layers have no attention weights: for them the trace holds the norm of each head's recurrent
(delta-rule) state after every token instead.

Axes: L layers, T prompt tokens, H query heads, Hv DeltaNet value heads, D model width, k
experts per token.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import LINEAR_ATTENTION, ModelConfig
from jaxllm.model.forward import lm_head
from jaxllm.model.layers import apply_rope, dense_mlp, moe_mlp, project, rms_norm, rope_inv_freq
from jaxllm.params import LayerParams, MoeParams, Params
from jaxllm.research.hybrid_trace import causal_attention, hybrid_trace, router_choice


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trace:
    """What one prompt did inside the model (numpy arrays)."""

    tokens: list[str]  # [T] pieces
    residual: np.ndarray  # [L + 1, T, D] the stream after the embedding and after each block
    attention: np.ndarray  # [len(attention_layers), H, T, T] attention weights (query t over keys s <= t)
    router_experts: np.ndarray | None  # [L, T, k] chosen experts (MoE models)
    router_weights: np.ndarray | None  # [L, T, k] their weights
    logits: np.ndarray  # [T, V] the model's output logits
    attention_layers: tuple[int, ...] = ()  # the layers `attention` rows belong to (all, unless hybrid)
    # Hybrid models: [len(recurrent_layers), T, Hv] Frobenius norm of each DeltaNet head's
    # state after each token (those layers' stand-in for attention weights).
    recurrent_norms: np.ndarray | None = None
    recurrent_layers: tuple[int, ...] = ()

    def attention_of(self, layer: int) -> np.ndarray:
        """[H, T, T] attention weights of model layer `layer`.

        Raises:
          ValueError: the layer is a linear-attention (DeltaNet) layer: see `recurrent_norms`.
        """
        if layer not in self.attention_layers:
            raise ValueError(f"layer {layer} has no attention weights (a linear-attention layer: see recurrent_norms)")
        return self.attention[self.attention_layers.index(layer)]

    @property
    def hidden_norms(self) -> np.ndarray:
        """[L + 1, T] L2 norm of the residual stream per layer and token."""
        return np.linalg.norm(self.residual, axis=-1)


def _block(x: jax.Array, lp: LayerParams, cfg: ModelConfig, positions: jax.Array):
    """One pre-norm block on [T, D]: returns (stream after it, attention [H, T, T], router
    (experts, weights) or None)."""
    a = lp.attn
    h = rms_norm(x, lp.attn_norm, cfg.rms_eps)
    H, K = cfg.n_heads, cfg.n_kv_heads
    if a.wqkv is not None:
        q, k, v = jnp.split(project(h, a.wqkv), [H, H + K], axis=1)
    else:
        q, k, v = (project(h, w) for w in (a.wq, a.wk, a.wv))
    if a.bq is not None:
        q, k, v = q + a.bq, k + a.bk, v + a.bv
    if a.q_norm is not None:
        q, k = rms_norm(q, a.q_norm, cfg.rms_eps), rms_norm(k, a.k_norm, cfg.rms_eps)
    inv_freq = rope_inv_freq(cfg)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    T = x.shape[0]
    attn, weights = causal_attention(q, k, v, cfg)
    x = x + project(attn, a.wo, 2)
    h = rms_norm(x, lp.mlp_norm, cfg.rms_eps)
    router = None
    if isinstance(lp.mlp, MoeParams):
        out, _ = moe_mlp(h, lp.mlp, cfg, jnp.ones((T,), bool))
        router = router_choice(h, lp.mlp, cfg)
    else:
        out = dense_mlp(h, lp.mlp)
    return x + out, weights, router


@functools.partial(jax.jit, static_argnames=("cfg",))
def _trace(params: Params, cfg: ModelConfig, ids: jax.Array):
    x = params.embed[ids]  # the weights are in the compute dtype (RuntimeOptions.dtype)
    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
    if isinstance(params.layers, tuple):
        outs = []
        for lp in params.layers:
            x, weights, router = _block(x, lp, cfg, positions)
            outs.append((x, weights, router))
        stream, attention, experts = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
    else:  # stacked layers: one compiled block under scan (a 30-layer model compiles in seconds)

        def body(x, lp):
            x, weights, router = _block(x, lp, cfg, positions)
            return x, (x, weights, router)

        _, (stream, attention, experts) = jax.lax.scan(body, x, params.layers)
    logits = lm_head(params, rms_norm(stream[-1], params.final_norm, cfg.rms_eps))
    return jnp.concatenate([params.embed[ids][None], stream]), attention, experts, logits


def trace(model, ids: Sequence[int]) -> Trace:
    """Runs one prompt (token ids) through the plain forward and keeps everything."""
    cfg = model.cfg
    tokens = jnp.asarray(list(ids), jnp.int32)
    norms = None
    linear: tuple[int, ...] = ()
    if cfg.is_hybrid:
        residual, attention, norms, experts, logits = jax.device_get(hybrid_trace(model.params, cfg, tokens))
        linear = tuple(i for i, kind in enumerate(cfg.layer_types) if kind == LINEAR_ATTENTION)
    else:
        residual, attention, experts, logits = jax.device_get(_trace(model.params, cfg, tokens))
    pieces = [model.tokenizer.decode([int(t)], skip_special_tokens=False) for t in ids]
    return Trace(
        tokens=pieces,
        residual=np.asarray(residual, np.float32),
        attention=np.asarray(attention),
        router_experts=None if experts is None else np.asarray(experts[0]),
        router_weights=None if experts is None else np.asarray(experts[1]),
        logits=np.asarray(logits),
        attention_layers=tuple(i for i in range(cfg.n_layers) if i not in linear),
        recurrent_norms=None if norms is None else np.asarray(norms),
        recurrent_layers=linear,
    )


@functools.partial(jax.jit, static_argnames=("top",))
def _lens(params: Params, residual: jax.Array, eps: float, top: int):
    n, T, D = residual.shape
    flat = rms_norm(residual.reshape(n * T, D), params.final_norm, eps).astype(params.embed.dtype)
    probs = jax.nn.softmax(lm_head(params, flat), axis=-1).reshape(n, T, -1)
    return jax.lax.top_k(probs, top)


def logit_lens(model, t: Trace, *, top: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The logit lens (nostalgebraist, 2020): each layer's residual stream read out through the
    final norm and the unembedding. Returns ([L + 1, T, top] token ids, their probabilities)."""
    probs, ids = _lens(model.params, jnp.asarray(t.residual, model.params.embed.dtype), model.cfg.rms_eps, top)
    return np.asarray(ids), np.asarray(probs)


def logit_lens_table(model, t: Trace):
    """A DataFrame (layers x tokens) of each layer's most likely next token, as text."""
    import pandas as pd

    ids, probs = logit_lens(model, t)
    cells = [
        [f"{model.tokenizer.decode([int(i)], skip_special_tokens=False)!r} {p:.2f}" for i, p in zip(row, prow)]
        for row, prow in zip(ids[..., 0], probs[..., 0])
    ]
    return pd.DataFrame(
        cells,
        index=["embed"] + [f"layer {i}" for i in range(len(cells) - 1)],
        columns=[f"{j}:{tok!r}" for j, tok in enumerate(t.tokens)],
    )


def plot_attention(t: Trace, layer: int, head: int | None = None, ax=None):
    """Heatmap of one layer's attention (one head, or the mean over heads); returns the Axes."""
    import matplotlib.pyplot as plt

    w = t.attention_of(layer).mean(0) if head is None else t.attention_of(layer)[head]
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 5))
    ax.imshow(w, cmap="viridis")
    ax.set_xticks(range(len(t.tokens)), t.tokens, rotation=90, fontsize=7)
    ax.set_yticks(range(len(t.tokens)), t.tokens, fontsize=7)
    ax.set_title(f"layer {layer}" + ("" if head is None else f", head {head}"))
    return ax
