"""Products of a few rows with a weight matrix on the CPU: C++ XLA FFI kernels (`matvec_cpu.cc`).

For decode rounds of the CPU backend in float32 (`RuntimeOptions.decode_matmul = "auto"`): XLA's
CPU dot for one row streams the weights slower than a plain reduction (docs/lab/2026-12.md),
and a small model's decode step is little else. Built on first use (`jaxllm.cpu_ffi`); XLA's dot
is the oracle (`tests/jaxllm/test_matvec_cpu.py`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxllm import cpu_ffi

_SOURCE = Path(__file__).with_name("matvec_cpu.cc")
_MATMUL = "jaxllm_matmul_f32"
_MATMUL_T = "jaxllm_matmul_transposed_f32"
MAX_ROWS = 8  # rows the kernels take; past that XLA's dot is faster (docs/lab/2026-12.md)


def _library() -> ctypes.CDLL | None:
    return cpu_ffi.load(_SOURCE, ((_MATMUL, "JaxllmMatmulF32"), (_MATMUL_T, "JaxllmMatmulTransposedF32")))


def available(dtype: str | jnp.dtype) -> bool:
    """The kernels run on the CPU backend, for float32."""
    return cpu_ffi.on_cpu() and jnp.dtype(dtype) == jnp.dtype(jnp.float32) and _library() is not None


def matmul_cpu(
    x: jax.Array, w: jax.Array, *, transposed: bool = False, layer: jax.Array | int | None = None
) -> jax.Array:
    """x [M, Din] float32 times w [Din, N] (or w [N, Din] with `transposed`) -> [M, N] float32.

    w may also be a stack [L, Din, N] (or [L, N, Din]) with `layer` picking one: inside a
    layer loop pass the stack, since a slice of it would be copied before every call.
    """
    if _library() is None:
        raise RuntimeError("the CPU matmul kernel is unavailable (see the log)")
    if x.ndim != 2 or w.ndim not in (2, 3) or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"want x [M <= {MAX_ROWS}, Din] and a 2-D or 3-D w, got {x.shape} and {w.shape}")
    if (w.ndim == 3) != (layer is not None):
        raise ValueError("a stacked [L, ...] w needs `layer`, and only a stacked one takes it")
    n = w.shape[-2] if transposed else w.shape[-1]
    call = jax.ffi.ffi_call(_MATMUL_T if transposed else _MATMUL, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x.astype(jnp.float32), w, jnp.asarray(0 if layer is None else layer, jnp.int32))
