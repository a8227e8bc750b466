"""Paged decode attention on the CPU: a C++ XLA FFI kernel (`paged_decode_cpu.cc`).

Same contract as the Pallas GPU kernel (`paged_decode.paged_decode_attention`): one query per
window over its slot's live pages plus its fresh key, reading the stacked [L, ...] pool with
a layer index so no layer's pool is copied. The jnp reference stays the oracle
(`tests/jaxllm/test_paged_decode_cpu.py`). Built on first use (`jaxllm.cpu_ffi`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxllm import cpu_ffi

_SOURCE = Path(__file__).with_name("paged_decode_cpu.cc")
_TARGET = "jaxllm_paged_decode_f32"


def _library() -> ctypes.CDLL | None:
    return cpu_ffi.load(_SOURCE, ((_TARGET, "JaxllmPagedDecodeF32"),))


def available(dtype: str | jnp.dtype) -> bool:
    """The kernel runs on the CPU backend, for float32 (the CPU's parity dtype)."""
    return cpu_ffi.on_cpu() and jnp.dtype(dtype) == jnp.dtype(jnp.float32) and _library() is not None


def paged_decode_attention_cpu(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    pages: jax.Array,
    cached_len: jax.Array,
    *,
    layer: jax.Array | int = 0,
) -> jax.Array:
    """Decode attention of one query per window over its slot's pages plus its fresh key.

    Args:
      q: [W, H, Dh] float32, one query per window.
      k_new, v_new: [W, K, Dh] the window's own new key and value (not yet in the cache).
      k_pages, v_pages: [L, P, page_size, K, Dh] every layer's pool (or [P, page_size, K, Dh]).
      pages: [W, n_ctx_pages] i32 page ids of each window's slot.
      cached_len: [W] i32; cache positions [0, cached_len) are attended, clipped to the bucket.
      layer: which layer of a stacked pool.

    Returns:
      [W, H, Dh] float32.
    """
    if _library() is None:
        raise RuntimeError("the CPU decode attention kernel is unavailable (see the log)")
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q,
        k_new,
        v_new,
        k_pages,
        v_pages,
        pages.astype(jnp.int32),
        cached_len.astype(jnp.int32),
        jnp.asarray(layer, jnp.int32),
    )
