"""The params pytree: registered dataclasses, layers stacked on a leading L axis.

Stacking lets the same params run under `lax.scan` (fast compiles) or unrolled (fast GPU
decode) without conversion. Optional pieces (biases, q/k norms, untied lm_head) are None
where a family lacks them; None is an empty pytree node, so it costs nothing under jit.

Loaders build, and checkpoints store, the *canonical* tree: stacked layers, one matrix per
projection. The *runtime* tree (`layout_params`) may unroll the layers and fuse projections
that read the same input (q/k/v; gate/up; in hybrid blocks the mixer's input projections,
and the router with the shared expert's) into one matrix: a decode step is a chain of
matrix-vector products, and fewer, larger ones stream the weights closer to memory speed.
On a GPU it also stores the dense projections input-axes-last (`OutIn`: XLA's one-row
products run up to 3x faster so). `canonical_params` undoes all three.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxllm.config import ModelConfig


@struct.dataclass
class OutIn:
    """A projection matrix stored with its input (contracted) axes last: `t` is
    [lead..., out..., in...] for the canonical [lead..., in..., out...] (lead: a stacked L
    axis or none). `layers.project` contracts x with `t`'s last `n_in` axes. On the GPU a
    one-row product then reads each output's weights contiguously, where the canonical layout
    made XLA emit a column reduction (docs/lab/2026-12.md, weight layout)."""

    t: jax.Array
    n_in: int = struct.field(pytree_node=False)
    n_out: int = struct.field(pytree_node=False)

    @property
    def dtype(self) -> Any:
        return self.t.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The canonical shape ([lead..., in..., out...])."""
        lead = self.t.ndim - self.n_in - self.n_out
        dims = self.t.shape
        return (*dims[:lead], *dims[lead + self.n_out :], *dims[lead : lead + self.n_out])


@struct.dataclass
class AttentionParams:
    wq: jax.Array | None  # [L, D, H, Dh]; None once fused into wqkv
    wk: jax.Array | None  # [L, D, K, Dh]
    wv: jax.Array | None  # [L, D, K, Dh]
    wo: jax.Array  # [L, H, Dh, D]
    bq: jax.Array | None = None  # [L, H, Dh]   qwen2
    bk: jax.Array | None = None  # [L, K, Dh]
    bv: jax.Array | None = None  # [L, K, Dh]
    q_norm: jax.Array | None = None  # [L, Dh]  qwen3
    k_norm: jax.Array | None = None  # [L, Dh]
    wqkv: jax.Array | None = None  # [L, D, H + 2K, Dh]: runtime layout only (fuse_projections)


@struct.dataclass
class DenseMlpParams:
    w_gate: jax.Array | None  # [L, D, F]; None once fused into w_gate_up
    w_up: jax.Array | None  # [L, D, F]
    w_down: jax.Array  # [L, F, D]
    w_gate_up: jax.Array | None = None  # [L, D, 2F]: runtime layout only (fuse_projections)


@struct.dataclass
class MoeParams:
    router: jax.Array | None  # [L, D, E]; None once fused into w_in
    w_gate: jax.Array  # [L, E, D, F]
    w_up: jax.Array  # [L, E, D, F]
    w_down: jax.Array  # [L, E, F, D]
    # Qwen3-Next / Qwen3.5: a shared expert every token takes, scaled by sigmoid(x . gate).
    shared: DenseMlpParams | None = None  # [L, D, Fs] / [L, Fs, D]
    shared_gate: jax.Array | None = None  # [L, D]
    # router | shared.w_gate | shared.w_up | shared_gate[..., None], along the output axis:
    # runtime layout only (fuse_projections; with a shared expert), shared keeps its w_down.
    w_in: jax.Array | None = None  # [L, D, E + 2 Fs + 1]


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array  # [L, D]
    attn: AttentionParams
    mlp_norm: jax.Array  # [L, D]
    mlp: DenseMlpParams | MoeParams


@struct.dataclass
class GatedAttentionParams:
    """Full-attention mixer of the hybrid family: q/k norms, partial RoPE and a per-head
    output gate (sigmoid) computed from the same input as q."""

    wq: jax.Array | None  # [L, D, H, Dh]; None once fused into w_qgkv
    w_gate: jax.Array | None  # [L, D, H, Dh]
    wk: jax.Array | None  # [L, D, K, Dh]
    wv: jax.Array | None  # [L, D, K, Dh]
    wo: jax.Array  # [L, H, Dh, D]
    q_norm: jax.Array  # [L, Dh]
    k_norm: jax.Array  # [L, Dh]
    w_qgkv: jax.Array | None = None  # [L, D, 2H + 2K, Dh] wq|w_gate|wk|wv: runtime layout only


@struct.dataclass
class DeltaNetParams:
    """Gated DeltaNet mixer (linear attention). C = 2 Hk Dk + Hv Dv conv channels (q, k, v)."""

    w_qkv: jax.Array | None  # [L, D, C]; None once fused into w_in
    w_z: jax.Array | None  # [L, D, Hv, Dv]   output gate of the gated RMSNorm
    w_b: jax.Array | None  # [L, D, Hv]       beta = sigmoid(x . w_b)
    w_a: jax.Array | None  # [L, D, Hv]       decay input
    conv: jax.Array  # [L, C, Kc]      depthwise causal conv
    dt_bias: jax.Array  # [L, Hv]
    a_log: jax.Array  # [L, Hv]        g = -exp(a_log) * softplus(x . w_a + dt_bias)
    norm: jax.Array  # [L, Dv]         gated RMSNorm scale
    w_out: jax.Array  # [L, Hv, Dv, D]
    w_in: jax.Array | None = None  # [L, D, C + Hv*Dv + 2*Hv] w_qkv|w_z|w_b|w_a: runtime layout only


@struct.dataclass
class HybridBlockParams:
    """The blocks of one layer kind, stacked on a leading axis in layer order."""

    attn_norm: jax.Array  # [n, D]
    mixer: DeltaNetParams | GatedAttentionParams
    mlp_norm: jax.Array  # [n, D]
    mlp: DenseMlpParams | MoeParams


@struct.dataclass
class HybridLayers:
    """Layers of a hybrid model by kind (see `ModelConfig.layer_types`). Stacked, the forward
    scans over repeating groups of `layer_period` layers (each kind's stack reshaped to
    [groups, per-group, ...] there); unrolled, each kind is a tuple of one-layer blocks."""

    linear: HybridBlockParams | tuple[HybridBlockParams, ...] | None  # Gated DeltaNet blocks
    full: HybridBlockParams | tuple[HybridBlockParams, ...]  # gated attention blocks


@struct.dataclass
class MtpParams:
    """A multi-token-prediction head: fc(concat(norm(embed(next token)), norm(hidden))) then
    one full-attention block and a final norm; the lm_head is the model's."""

    fc: jax.Array  # [2D, D]   input: [embedding ; hidden]
    norm_embedding: jax.Array  # [D]
    norm_hidden: jax.Array  # [D]
    block: HybridBlockParams  # stacked over the MTP layers
    final_norm: jax.Array  # [D]


@struct.dataclass
class Params:
    embed: jax.Array  # [V, D]
    # Stacked on a leading L axis (for lax.scan), or a tuple of per-layer params (for unrolled
    # layers: slicing a stacked weight inside the step makes XLA copy it on every call).
    # Hybrid models stack each layer kind apart (`HybridLayers`).
    layers: LayerParams | tuple[LayerParams, ...] | HybridLayers
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [D, V]; None when tied to embed
    mtp: MtpParams | None = None


def param_shapes(cfg: ModelConfig, dtype: Any = "float32") -> Params:
    """The params tree of `jax.ShapeDtypeStruct`s for a config (no allocation), in `dtype`."""
    L, D, H, K, Dh, V = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    dt = jnp.dtype(dtype)

    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dt)

    attn = AttentionParams(
        wq=s(L, D, H, Dh),
        wk=s(L, D, K, Dh),
        wv=s(L, D, K, Dh),
        wo=s(L, H, Dh, D),
        bq=s(L, H, Dh) if cfg.qkv_bias else None,
        bk=s(L, K, Dh) if cfg.qkv_bias else None,
        bv=s(L, K, Dh) if cfg.qkv_bias else None,
        q_norm=s(L, Dh) if cfg.qk_norm else None,
        k_norm=s(L, Dh) if cfg.qk_norm else None,
    )
    if cfg.is_hybrid:
        return Params(
            embed=s(V, D),
            layers=_hybrid_shapes(cfg, s),
            final_norm=s(D),
            lm_head=None if cfg.tie_embeddings else s(D, V),
            mtp=_mtp_shapes(cfg, s) if cfg.mtp_layers else None,
        )
    layers = LayerParams(attn_norm=s(L, D), attn=attn, mlp_norm=s(L, D), mlp=_mlp_shapes(cfg, L, s))
    return Params(
        embed=s(V, D),
        layers=layers,
        final_norm=s(D),
        lm_head=None if cfg.tie_embeddings else s(D, V),
    )


def _mlp_shapes(cfg: ModelConfig, L: int, s: Callable[..., jax.ShapeDtypeStruct]) -> DenseMlpParams | MoeParams:
    D = cfg.d_model
    if not cfg.is_moe:
        F = cfg.ffn_dim
        return DenseMlpParams(w_gate=s(L, D, F), w_up=s(L, D, F), w_down=s(L, F, D))
    E, F, Fs = cfg.n_experts, cfg.moe_ffn_dim, cfg.shared_expert_ffn_dim
    shared = DenseMlpParams(w_gate=s(L, D, Fs), w_up=s(L, D, Fs), w_down=s(L, Fs, D)) if Fs else None
    return MoeParams(
        router=s(L, D, E),
        w_gate=s(L, E, D, F),
        w_up=s(L, E, D, F),
        w_down=s(L, E, F, D),
        shared=shared,
        shared_gate=s(L, D) if Fs else None,
    )


def _attention_block_shapes(cfg: ModelConfig, n: int, s: Callable[..., jax.ShapeDtypeStruct]) -> HybridBlockParams:
    D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    mixer = GatedAttentionParams(
        wq=s(n, D, H, Dh),
        w_gate=s(n, D, H, Dh),
        wk=s(n, D, K, Dh),
        wv=s(n, D, K, Dh),
        wo=s(n, H, Dh, D),
        q_norm=s(n, Dh),
        k_norm=s(n, Dh),
    )
    return HybridBlockParams(attn_norm=s(n, D), mixer=mixer, mlp_norm=s(n, D), mlp=_mlp_shapes(cfg, n, s))


def _hybrid_shapes(cfg: ModelConfig, s: Callable[..., jax.ShapeDtypeStruct]) -> HybridLayers:
    D, Hv, Dv, n = cfg.d_model, cfg.linear_n_v_heads, cfg.linear_v_dim, cfg.n_linear_layers
    linear = None
    if n:
        mixer = DeltaNetParams(
            w_qkv=s(n, D, cfg.conv_dim),
            w_z=s(n, D, Hv, Dv),
            w_b=s(n, D, Hv),
            w_a=s(n, D, Hv),
            conv=s(n, cfg.conv_dim, cfg.conv_kernel),
            dt_bias=s(n, Hv),
            a_log=s(n, Hv),
            norm=s(n, Dv),
            w_out=s(n, Hv, Dv, D),
        )
        linear = HybridBlockParams(attn_norm=s(n, D), mixer=mixer, mlp_norm=s(n, D), mlp=_mlp_shapes(cfg, n, s))
    return HybridLayers(linear=linear, full=_attention_block_shapes(cfg, cfg.n_kv_layers, s))


def _mtp_shapes(cfg: ModelConfig, s: Callable[..., jax.ShapeDtypeStruct]) -> MtpParams:
    D = cfg.d_model
    return MtpParams(
        fc=s(2 * D, D),
        norm_embedding=s(D),
        norm_hidden=s(D),
        block=_attention_block_shapes(cfg, cfg.mtp_layers, s),
        final_norm=s(D),
    )


def check_params(params: Params, cfg: ModelConfig) -> None:
    """Raises ValueError naming the first leaf whose shape differs from the config's."""
    expected = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))[0]
    actual = jax.tree_util.tree_flatten_with_path(jax.eval_shape(canonical_params, params))[0]
    if len(expected) != len(actual):
        raise ValueError(f"params have {len(actual)} tensors, the config expects {len(expected)}")
    for (path, want), (_, got) in zip(expected, actual):
        if tuple(got.shape) != tuple(want.shape):
            name = jax.tree_util.keystr(path)
            raise ValueError(f"param {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")


def _unstack(stacked, consume: bool):
    leaves, treedef = jax.tree.flatten(stacked)
    n = leaves[0].shape[0]
    per_leaf = []
    uses = collections.Counter(id(w) for w in leaves)  # a leaf may appear twice (one array reused)
    for w in leaves:
        per_leaf.append([w[i] for i in range(n)])
        uses[id(w)] -= 1
        if consume and isinstance(w, jax.Array) and not uses[id(w)]:
            w.delete()  # one stacked leaf at a time: the peak is the model plus one leaf, not twice it
    return tuple(jax.tree.unflatten(treedef, [pieces[i] for pieces in per_leaf]) for i in range(n))


def _stack(layers):
    return jax.tree.map(lambda *ws: jnp.stack(ws), *layers)


def unstack_layers(params: Params, *, consume: bool = False) -> Params:
    """Stacked layers -> a tuple of per-layer params (the unrolled layout); for hybrid
    models, a tuple per layer kind. `consume` deletes each stacked weight once sliced (the
    caller's `params` are unusable afterwards): a 35B model fits twice in no GPU."""
    layers = params.layers
    if isinstance(layers, HybridLayers):
        if isinstance(layers.full, tuple):
            return params
        linear = None if layers.linear is None else _unstack(layers.linear, consume)
        return params.replace(layers=HybridLayers(linear=linear, full=_unstack(layers.full, consume)))
    if isinstance(layers, tuple):
        return params
    return params.replace(layers=_unstack(layers, consume))


def stack_layers(params: Params) -> Params:
    """A tuple of per-layer params -> stacked layers (the scan layout)."""
    layers = params.layers
    if isinstance(layers, HybridLayers):
        if not isinstance(layers.full, tuple):
            return params
        linear = None if layers.linear is None else _stack(layers.linear)
        return params.replace(layers=HybridLayers(linear=linear, full=_stack(layers.full)))
    if not isinstance(layers, tuple):
        return params
    return params.replace(layers=_stack(layers))


def _map_layers(
    fn: Callable[[LayerParams], LayerParams], block_fn: Callable[[HybridBlockParams], HybridBlockParams], params: Params
) -> Params:
    """`fn` on every layer, or for hybrid models `block_fn` on every block of each kind (the
    MTP head's block is left alone: it runs once a draft, not once a layer)."""
    layers = params.layers
    if isinstance(layers, HybridLayers):

        def each(blocks):
            if blocks is None:
                return None
            return tuple(map(block_fn, blocks)) if isinstance(blocks, tuple) else block_fn(blocks)

        return params.replace(layers=layers.replace(linear=each(layers.linear), full=each(layers.full)))
    return params.replace(layers=tuple(map(fn, layers)) if isinstance(layers, tuple) else fn(layers))


def _fuse_mlp(mlp: DenseMlpParams) -> DenseMlpParams:
    if mlp.w_gate_up is not None:
        return mlp
    return mlp.replace(w_gate_up=jnp.concatenate([mlp.w_gate, mlp.w_up], axis=-1), w_gate=None, w_up=None)


def _unfuse_mlp(mlp: DenseMlpParams) -> DenseMlpParams:
    if mlp.w_gate_up is None:
        return mlp
    w_gate, w_up = jnp.split(mlp.w_gate_up, 2, axis=-1)
    return mlp.replace(w_gate=w_gate, w_up=w_up, w_gate_up=None)


def delta_in_splits(C: int, Hv: int, Dv: int) -> list[int]:
    """Where `DeltaNetParams.w_in`'s output axis (and its product's) splits: qkv | z | b | a."""
    return [C, C + Hv * Dv, C + Hv * Dv + Hv]


def qgkv_splits(H: int, K: int) -> list[int]:
    """Where `GatedAttentionParams.w_qgkv`'s heads axis splits: q | gate | k | v."""
    return [H, 2 * H, 2 * H + K]


def moe_in_splits(E: int, Fs: int) -> list[int]:
    """Where `MoeParams.w_in`'s output axis splits: router | shared gate | shared up | shared-gate logit."""
    return [E, E + Fs, E + 2 * Fs]


def _fuse_block(b: HybridBlockParams) -> HybridBlockParams:
    """A hybrid block's projections of one input -> one matrix each: DeltaNet's w_in, gated
    attention's w_qgkv, the shared-expert MoE's w_in (router, shared gate/up, shared gate)."""
    m, mlp = b.mixer, b.mlp
    if isinstance(m, DeltaNetParams) and m.w_in is None:
        z = m.w_z.reshape(*m.w_z.shape[:-2], -1)
        w_in = jnp.concatenate([m.w_qkv, z, m.w_b, m.w_a], axis=-1)
        m = m.replace(w_in=w_in, w_qkv=None, w_z=None, w_b=None, w_a=None)
    elif isinstance(m, GatedAttentionParams) and m.w_qgkv is None:
        w_qgkv = jnp.concatenate([m.wq, m.w_gate, m.wk, m.wv], axis=-2)
        m = m.replace(w_qgkv=w_qgkv, wq=None, w_gate=None, wk=None, wv=None)
    if isinstance(mlp, DenseMlpParams):
        mlp = _fuse_mlp(mlp)
    elif mlp.shared is not None and mlp.w_in is None:
        s = mlp.shared
        w_in = jnp.concatenate([mlp.router, s.w_gate, s.w_up, mlp.shared_gate[..., None]], axis=-1)
        mlp = mlp.replace(w_in=w_in, router=None, shared=s.replace(w_gate=None, w_up=None), shared_gate=None)
    return b.replace(mixer=m, mlp=mlp)


def _unfuse_block(b: HybridBlockParams) -> HybridBlockParams:
    m, mlp = b.mixer, b.mlp
    if isinstance(m, DeltaNetParams) and m.w_in is not None:
        C, (Hv, Dv) = m.conv.shape[-2], m.w_out.shape[-3:-1]
        w_qkv, z, w_b, w_a = jnp.split(m.w_in, delta_in_splits(C, Hv, Dv), axis=-1)
        m = m.replace(w_qkv=w_qkv, w_z=z.reshape(*z.shape[:-1], Hv, Dv), w_b=w_b, w_a=w_a, w_in=None)
    elif isinstance(m, GatedAttentionParams) and m.w_qgkv is not None:
        H = m.wo.shape[-3]
        K = (m.w_qgkv.shape[-2] - 2 * H) // 2
        wq, w_gate, wk, wv = jnp.split(m.w_qgkv, qgkv_splits(H, K), axis=-2)
        m = m.replace(wq=wq, w_gate=w_gate, wk=wk, wv=wv, w_qgkv=None)
    if isinstance(mlp, DenseMlpParams):
        mlp = _unfuse_mlp(mlp)
    elif mlp.w_in is not None:
        E, Fs = mlp.w_gate.shape[-3], mlp.shared.w_down.shape[-2]
        router, w_gate, w_up, gate = jnp.split(mlp.w_in, moe_in_splits(E, Fs), axis=-1)
        shared = mlp.shared.replace(w_gate=w_gate, w_up=w_up)
        mlp = mlp.replace(router=router, shared=shared, shared_gate=gate[..., 0], w_in=None)
    return b.replace(mixer=m, mlp=mlp)


def fuse_projections(params: Params) -> Params:
    """q/k/v weights -> one wqkv (heads axis), gate/up -> one w_gate_up (F axis); hybrid
    blocks as `_fuse_block`."""

    def fuse(lp: LayerParams) -> LayerParams:
        a, mlp = lp.attn, lp.mlp
        if a.wqkv is None:
            a = a.replace(wqkv=jnp.concatenate([a.wq, a.wk, a.wv], axis=-2), wq=None, wk=None, wv=None)
        return lp.replace(attn=a, mlp=_fuse_mlp(mlp) if isinstance(mlp, DenseMlpParams) else mlp)

    return _map_layers(fuse, _fuse_block, params)


def unfuse_projections(params: Params) -> Params:
    """The inverse of `fuse_projections` (a no-op on unfused params)."""

    def unfuse(lp: LayerParams) -> LayerParams:
        a, mlp = lp.attn, lp.mlp
        if a.wqkv is not None:
            H = a.wo.shape[-3]
            K = (a.wqkv.shape[-2] - H) // 2
            wq, wk, wv = jnp.split(a.wqkv, [H, H + K], axis=-2)
            a = a.replace(wq=wq, wk=wk, wv=wv, wqkv=None)
        return lp.replace(attn=a, mlp=_unfuse_mlp(mlp) if isinstance(mlp, DenseMlpParams) else mlp)

    return _map_layers(unfuse, _unfuse_block, params)


def layout_params(
    params: Params, scan_layers: bool, *, fuse: bool = True, out_in: bool = False, consume: bool = False
) -> Params:
    """The runtime tree: layers stacked for `lax.scan` or unrolled, projections fused, and
    with `out_in` stored input-axes-last (`OutIn`; see RuntimeOptions.weight_layout).

    Fusing is faster on both CPU and GPU (docs/lab/2026-12.md). `fuse=False` keeps one matrix
    per projection (for A/B runs). `consume`: see `unstack_layers`.
    """
    params = stack_layers(params) if scan_layers else unstack_layers(params, consume=consume)
    params = fuse_projections(params) if fuse else params
    return out_in_weights(params, consume=consume) if out_in else params


def canonical_params(params: Params) -> Params:
    """The tree loaders build and checkpoints store: stacked layers, unfused projections."""
    return stack_layers(unfuse_projections(in_out_weights(params)))


# Per params class: its dense projection fields and their (input, output) axis counts, lead
# axes aside. Routed experts are not here (their kernels read them as stored).
_HEADS = (1, 2)  # [D] -> [heads, Dh]
_PROJECTIONS: dict[type, dict[str, tuple[int, int]]] = {
    AttentionParams: {"wq": _HEADS, "wk": _HEADS, "wv": _HEADS, "wqkv": _HEADS, "wo": (2, 1)},
    GatedAttentionParams: {"wq": _HEADS, "w_gate": _HEADS, "wk": _HEADS, "wv": _HEADS, "w_qgkv": _HEADS, "wo": (2, 1)},
    DeltaNetParams: {"w_qkv": (1, 1), "w_z": _HEADS, "w_b": (1, 1), "w_a": (1, 1), "w_in": (1, 1), "w_out": (2, 1)},
    DenseMlpParams: {"w_gate_up": (1, 1), "w_gate": (1, 1), "w_up": (1, 1), "w_down": (1, 1)},
    MoeParams: {"router": (1, 1), "w_in": (1, 1)},
}


def _to_out_in(w: jax.Array, n_in: int, n_out: int) -> OutIn:
    lead = w.ndim - n_in - n_out
    perm = (*range(lead), *range(lead + n_in, w.ndim), *range(lead, lead + n_in))
    return OutIn(t=jnp.transpose(w, perm), n_in=n_in, n_out=n_out)


def _to_in_out(w: OutIn) -> jax.Array:
    lead = w.t.ndim - w.n_in - w.n_out
    perm = (*range(lead), *range(lead + w.n_out, w.t.ndim), *range(lead, lead + w.n_out))
    return jnp.transpose(w.t, perm)


def _map_projections(node: Any, fn: Callable[[Any, int, int], Any]) -> Any:
    """`node` with fn(weight, n_in, n_out) applied to every dense projection in it."""
    if isinstance(node, tuple):
        return tuple(_map_projections(n, fn) for n in node)
    if not dataclasses.is_dataclass(node) or isinstance(node, OutIn):
        return node
    fields = _PROJECTIONS.get(type(node), {})
    changes = {}
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if value is None:
            continue
        if f.name in fields:
            changes[f.name] = fn(value, *fields[f.name])
        elif dataclasses.is_dataclass(value) or isinstance(value, tuple):
            changes[f.name] = _map_projections(value, fn)
    return node.replace(**changes) if changes else node


# Matrices from this many elements (one layer's, lead axes aside) keep the canonical layout.
# One-row products on an H100 (benchmarks/gemv_layout_check.py): 2048 x 4096 and 4096 x 2048
# ran 1.85x and 3.1x faster input-axes-last, 2048 x 12288 and the lm_head the same; an 8B's
# decode (all its matrices 4096 x 4096 or larger) ran 4% slower (5.89 vs 5.64 ms a token).
OUT_IN_MAX_ELEMENTS = 1 << 24


def out_in_weights(params: Params, *, consume: bool = False) -> Params:
    """Every dense projection under `OUT_IN_MAX_ELEMENTS` as `OutIn` (a no-op on those already
    so). `consume` deletes each canonical matrix once transposed (the peak is the model plus
    one matrix)."""

    done: dict[tuple[int, int, int], OutIn] = {}  # a matrix reused in the tree converts once

    def convert(w: Any, n_in: int, n_out: int) -> Any:
        if isinstance(w, OutIn) or math.prod(w.shape[w.ndim - n_in - n_out :]) >= OUT_IN_MAX_ELEMENTS:
            return w
        key = (id(w), n_in, n_out)
        if key not in done:
            done[key] = _to_out_in(w, n_in, n_out)
            if consume and isinstance(w, jax.Array):
                done[key].t.block_until_ready()
                w.delete()
        return done[key]

    return _map_projections(params, convert)


def in_out_weights(params: Params) -> Params:
    """The inverse of `out_in_weights`."""
    return _map_projections(params, lambda w, n_in, n_out: _to_in_out(w) if isinstance(w, OutIn) else w)
