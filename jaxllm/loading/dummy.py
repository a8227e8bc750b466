"""Random params at a config's real shapes, generated on device (benchmarks, shape tests).

Weights never pass through host memory: each leaf (or each layer of a stack of layers) is drawn
by a compiled program on device, or with `out_shardings` the whole tree by one jitted function
that places (or shards) every leaf as it is created.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.params import HybridLayers, Params, param_shapes

# RMSNorm scales: ones keep activations at unit scale like a freshly initialised model.
_NORM_LEAVES = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "norm", "norm_embedding", "norm_hidden")
_STD = 0.02  # small enough that 100+ layers of residual adds stay finite in bfloat16


# A non-layer leaf whose float32 draw is larger (embedding, lm_head) is drawn in row blocks
# (`lax.map`), and stacks of layers one layer at a time: a 30B MoE's stacked experts (19 GB in
# bfloat16) drew 39 GB of float32 at once, and the model did not fit an 80 GB card although its
# weights do.
_SLICED_DRAW_BYTES = 1 << 30


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return (_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _random_leaf(
    key: jax.Array, shape: tuple[int, ...], dtype: Any, norm: bool, per_layer: bool, blocks: int
) -> jax.Array:
    """One leaf's values; `per_layer`: a stack of layers, each layer drawn with its own key
    (`_layer_keys`), so the unrolled loader draws the same values layer by layer; else drawn in
    `blocks` row blocks (`_row_blocks`: a static argument, so a jit never keeps a stale limit)."""
    if norm:
        return jnp.ones(shape, dtype)
    if per_layer:
        return jax.lax.map(lambda k: _random_layer(k, shape[1:], dtype, False), _layer_keys(key, shape[0]))
    if blocks > 1:
        rows = -(-shape[0] // blocks)
        drawn = jax.lax.map(lambda k: _normal(k, (rows, *shape[1:]), dtype), jax.random.split(key, blocks))
        return drawn.reshape(blocks * rows, *shape[1:])[: shape[0]]
    return _normal(key, shape, dtype)


def _random_layer(key: jax.Array, shape: tuple[int, ...], dtype: Any, norm: bool) -> jax.Array:
    """One layer of a stack (drawn whole, whatever its size: a layer of a 30B's experts is
    800 MB of float32)."""
    return jnp.ones(shape, dtype) if norm else _normal(key, shape, dtype)


def _row_blocks(shape: tuple[int, ...]) -> int:
    """How many row blocks a non-layer leaf is drawn in (1: whole)."""
    return -(-4 * math.prod(shape) // _SLICED_DRAW_BYTES) if len(shape) > 1 else 1


def _layer_keys(key: jax.Array, n_layers: int) -> jax.Array:
    return jax.random.split(key, n_layers)


def _is_layer_leaf(path: tuple) -> bool:
    """Whether a leaf of the canonical tree is a stack of layers (its axis 0 the layer)."""
    return getattr(path[0], "name", None) == "layers"


def _is_norm(path: tuple) -> bool:
    return path[-1].name in _NORM_LEAVES


def _random_tree(key: jax.Array, cfg: ModelConfig, dtype: str) -> Params:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, dtype))
    keys = jax.random.split(key, len(leaves))
    out = [
        _random_leaf(k, sds.shape, sds.dtype, _is_norm(path), _is_layer_leaf(path), _row_blocks(sds.shape))
        for k, (path, sds) in zip(keys, leaves)
    ]
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
        tree = jax.jit(_random_tree, static_argnums=(1, 2), out_shardings=out_shardings)
        return tree(key, cfg, dtype)
    # Unsharded: one leaf (or one layer of a leaf) per call, so only one leaf's float32 draw
    # is ever live (a 35B MoE's whole tree in one call asked for 126 GiB on a 141 GiB GPU);
    # the same values as above.
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, dtype))
    keys = jax.random.split(key, len(leaves))
    plan = [_leaf_draws(k, path, sds, unrolled) for k, (path, sds) in zip(keys, leaves)]
    if isinstance(key, jax.core.Tracer):  # under `jax.eval_shape` (shapes only): nothing to compile
        draw = lambda call, k: call[0](k, *call[1:])  # noqa: E731
    else:
        compiled = _compile_ahead({call: k for draws in plan for call, k in draws})
        draw = lambda call, k: compiled[call](k)  # noqa: E731
    out: list[Any] = []
    for (path, _), draws in zip(leaves, plan):
        arrays = [draw(call, k) for call, k in draws]
        out.append(arrays if unrolled and _is_layer_leaf(path) else arrays[0])
    params = jax.tree_util.tree_unflatten(treedef, out)
    return params.replace(layers=_unstacked(params.layers)) if unrolled else params


_LEAF = jax.jit(_random_leaf, static_argnums=(1, 2, 3, 4, 5))
_LAYER = jax.jit(_random_layer, static_argnums=(1, 2, 3))
_Call = tuple  # (_LEAF or _LAYER, its static arguments...): one compiled program


def _leaf_draws(
    key: jax.Array, path: tuple, sds: jax.ShapeDtypeStruct, unrolled: bool
) -> list[tuple[_Call, jax.Array]]:
    """The calls that draw one leaf: the leaf whole, or for unrolled layers one call per
    layer with the stack's per-layer keys (the stack is never built)."""
    norm, stack = _is_norm(path), _is_layer_leaf(path)
    if unrolled and stack:
        return [((_LAYER, sds.shape[1:], sds.dtype, norm), k) for k in _layer_keys(key, sds.shape[0])]
    return [((_LEAF, sds.shape, sds.dtype, norm, stack, _row_blocks(sds.shape)), key)]


def _compile_ahead(calls: dict[_Call, jax.Array]) -> dict[_Call, Any]:
    """Each distinct draw (function and static arguments) compiled once, on a thread pool: a 35B's
    tree has dozens of distinct leaf shapes, each its own XLA program, and compiling them one
    after another was most of a dummy load (compiles release the GIL; lowering is Python, so
    it runs here)."""
    lowered = {call: call[0].lower(key, *call[1:]) for call, key in calls.items()}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(lowered), os.cpu_count() or 1))) as pool:
        futures = {call: pool.submit(low.compile) for call, low in lowered.items()}
        return {call: f.result() for call, f in futures.items()}


def _unstacked(layers: Any) -> Any:
    """A layers tree whose leaves are per-layer lists -> a tuple of one-layer trees (per
    layer kind for hybrid models), as `params.unstack_layers` lays them out."""
    if isinstance(layers, HybridLayers):
        linear = None if layers.linear is None else _unstacked(layers.linear)
        return HybridLayers(linear=linear, full=_unstacked(layers.full))
    pieces, treedef = jax.tree.flatten(layers, is_leaf=lambda x: isinstance(x, list))
    return tuple(jax.tree.unflatten(treedef, [p[i] for p in pieces]) for i in range(len(pieces[0])))
