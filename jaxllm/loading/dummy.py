"""Random params at a config's real shapes, generated on device (benchmarks, shape tests).

Everything happens inside one jitted function so an 8B model never passes through host
memory, and `out_shardings` can place (or shard) every leaf as it is created.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.params import HybridLayers, Params, param_shapes

# RMSNorm scales: ones keep activations at unit scale like a freshly initialised model.
_NORM_LEAVES = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "norm", "norm_embedding", "norm_hidden")
_STD = 0.02  # small enough that 100+ layers of residual adds stay finite in bfloat16


# Leaves whose float32 draw is larger are drawn one leading-axis slice at a time (`lax.map`):
# a 30B MoE's stacked experts (19 GB in bfloat16) drew 39 GB of float32 at once, and the
# model did not fit an 80 GB card although its weights do.
_SLICED_DRAW_BYTES = 1 << 30
_NEVER_SLICED = 1 << 62


def _random_leaf(key: jax.Array, shape: tuple[int, ...], dtype: Any, norm: bool, sliced_bytes: int) -> jax.Array:
    if norm:
        return jnp.ones(shape, dtype)
    if len(shape) > 1 and 4 * math.prod(shape) > sliced_bytes:
        draw = lambda k: (_STD * jax.random.normal(k, shape[1:], jnp.float32)).astype(dtype)  # noqa: E731
        return jax.lax.map(draw, jax.random.split(key, shape[0]))
    return (_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _random_tree(key: jax.Array, cfg: ModelConfig, dtype: str, sliced_bytes: int) -> Params:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, dtype))
    keys = jax.random.split(key, len(leaves))
    norm = [path[-1].name in _NORM_LEAVES for path, _ in leaves]
    out = [_random_leaf(k, sds.shape, sds.dtype, n, sliced_bytes) for k, (_, sds), n in zip(keys, leaves, norm)]
    return jax.tree_util.tree_unflatten(treedef, out)


def dummy_params(
    cfg: ModelConfig, seed: int = 0, *, dtype: str = "float32", out_shardings: Any = None, unrolled: bool = False
) -> Params:
    """Random weights with the shapes of `cfg` in `dtype`, created on device.

    Weights are normal * 0.02, norm scales are 1, so a forward pass stays finite.

    Args:
      cfg: the model config (static: shapes come from it).
      seed: PRNG seed.
      dtype: element type of the weights (`RuntimeOptions.dtype`).
      out_shardings: optional sharding (one for all leaves, or a Params-shaped tree);
        None lets jit place everything on the default device.
      unrolled: return the layers as a tuple of per-layer params (`params.unstack_layers`'
        layout) drawn layer by layer, so the stacked layers never exist: a 30B MoE's
        stacked experts (19 GB a leaf) beside its 61 GB of weights did not fit an 80 GB card
        while being unstacked. Same values as the stacked tree. Not with `out_shardings`.

    Returns:
      The Params tree.
    """
    # Normals are drawn in float32 then cast (XLA fuses the cast into the RNG loop), so the
    # values agree across target dtypes up to rounding.
    # "rbg" (XLA's RngBitGenerator): threefry's unrolled hash compiles many times slower,
    # even for tiny models on the CPU; dummy weights need no bit-exactness across shardings,
    # which is threefry's advantage.
    key = jax.random.key(seed, impl="rbg")
    if out_shardings is not None:
        if unrolled:
            raise ValueError("dummy_params: unrolled layers are drawn unsharded")
        tree = jax.jit(_random_tree, static_argnums=(1, 2, 3), out_shardings=out_shardings)
        return tree(key, cfg, dtype, _SLICED_DRAW_BYTES)
    # Unsharded: one leaf per call, so only one leaf's float32 draw is ever live (a 35B MoE's
    # whole tree in one call asked for 126 GiB on a 141 GiB GPU); the same values as above.
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, dtype))
    keys = jax.random.split(key, len(leaves))
    leaf = jax.jit(_random_leaf, static_argnums=(1, 2, 3, 4))
    out = []
    for k, (path, sds) in zip(keys, leaves):
        norm = path[-1].name in _NORM_LEAVES
        if unrolled and _is_layer_leaf(path):
            out.append(_layer_pieces(leaf, k, sds, norm))
        else:
            out.append(leaf(k, sds.shape, sds.dtype, norm, _SLICED_DRAW_BYTES))
    params = jax.tree_util.tree_unflatten(treedef, out)
    return params.replace(layers=_unstacked(params.layers)) if unrolled else params


def _is_layer_leaf(path: tuple) -> bool:
    """Whether a leaf of the canonical tree is a stack of layers (its axis 0 the layer)."""
    return getattr(path[0], "name", None) == "layers"


def _layer_pieces(leaf: Any, key: jax.Array, sds: jax.ShapeDtypeStruct, norm: bool) -> list[jax.Array]:
    """A stacked leaf's per-layer arrays, the values `_random_leaf` gives the stack: a leaf it
    draws slice by slice is drawn here one layer at a time (same keys, never stacked); a
    smaller one is drawn whole and sliced (it is transient and under `_SLICED_DRAW_BYTES`)."""
    shape = sds.shape
    if not norm and len(shape) > 1 and 4 * math.prod(shape) > _SLICED_DRAW_BYTES:
        # Each slice drawn whole, as `_random_leaf`'s `lax.map` draws it.
        return [leaf(k, shape[1:], sds.dtype, False, _NEVER_SLICED) for k in jax.random.split(key, shape[0])]
    whole = leaf(key, shape, sds.dtype, norm, _SLICED_DRAW_BYTES)
    return [whole[i] for i in range(shape[0])]


def _unstacked(layers: Any) -> Any:
    """A layers tree whose leaves are per-layer lists -> a tuple of one-layer trees (per
    layer kind for hybrid models), as `params.unstack_layers` lays them out."""
    if isinstance(layers, HybridLayers):
        linear = None if layers.linear is None else _unstacked(layers.linear)
        return HybridLayers(linear=linear, full=_unstacked(layers.full))
    pieces, treedef = jax.tree.flatten(layers, is_leaf=lambda x: isinstance(x, list))
    return tuple(jax.tree.unflatten(treedef, [p[i] for p in pieces]) for i in range(len(pieces[0])))
