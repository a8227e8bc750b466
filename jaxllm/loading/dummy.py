"""Random params at a config's real shapes, generated on device (benchmarks, shape tests).

Everything happens inside one jitted function so an 8B model never passes through host
memory, and `out_shardings` can place (or shard) every leaf as it is created.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.params import Params, param_shapes

# RMSNorm scales: ones keep activations at unit scale like a freshly initialised model.
_NORM_LEAVES = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "norm", "norm_embedding", "norm_hidden")
_STD = 0.02  # small enough that 100+ layers of residual adds stay finite in bfloat16


def _random_leaf(key: jax.Array, shape: tuple[int, ...], dtype: Any, norm: bool) -> jax.Array:
    if norm:
        return jnp.ones(shape, dtype)
    return (_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _random_tree(key: jax.Array, cfg: ModelConfig, dtype: str) -> Params:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, dtype))
    keys = jax.random.split(key, len(leaves))
    out = [_random_leaf(k, sds.shape, sds.dtype, path[-1].name in _NORM_LEAVES) for k, (path, sds) in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def dummy_params(cfg: ModelConfig, seed: int = 0, *, dtype: str = "float32", out_shardings: Any = None) -> Params:
    """Random weights with the shapes of `cfg` in `dtype`, created on device.

    Weights are normal * 0.02, norm scales are 1, so a forward pass stays finite.

    Args:
      cfg: the model config (static: shapes come from it).
      seed: PRNG seed.
      dtype: element type of the weights (`RuntimeOptions.dtype`).
      out_shardings: optional sharding (one for all leaves, or a Params-shaped tree);
        None lets jit place everything on the default device.

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
        return jax.jit(_random_tree, static_argnums=(1, 2), out_shardings=out_shardings)(key, cfg, dtype)
    # Unsharded: one leaf per call, so only one leaf's float32 draw is ever live (a 35B MoE's
    # whole tree in one call asked for 126 GiB on a 141 GiB GPU); the same values as above.
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, dtype))
    keys = jax.random.split(key, len(leaves))
    leaf = jax.jit(_random_leaf, static_argnums=(1, 2, 3))
    out = [leaf(k, sds.shape, sds.dtype, path[-1].name in _NORM_LEAVES) for k, (path, sds) in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)
