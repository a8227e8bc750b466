"""What the Pallas (Triton backend) kernels share: where they compile, launch parameters,
and the block spec of an operand passed whole (indexed inside the kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Triton compiler parameters and masked loads; absent only without the GPU Pallas backend.
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None  # type: ignore[assignment]

MIN_DOT = 16  # Triton's dot wants every dimension >= 16


def kernels_available(dtype: str | jnp.dtype) -> bool:
    """The Pallas Triton kernels compile on GPUs, for float32 and half precision."""
    return jax.default_backend() == "gpu" and jnp.dtype(dtype) in (
        jnp.dtype(jnp.float32),
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float16),
    )


def compiler_params(*, interpret: bool, num_warps: int, num_stages: int):
    """Triton launch parameters, or None in the interpreter (or without the GPU backend)."""
    if plgpu is None or interpret:
        return None
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def whole_block(a: jax.Array) -> pl.BlockSpec:
    """Every program sees all of `a` (the kernel indexes it itself)."""
    return pl.BlockSpec(a.shape, lambda *grid: (0,) * a.ndim)
