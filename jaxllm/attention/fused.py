"""Fused attention for prompt chunks with no cached context (cuDNN flash attention on GPU).

A chunk that starts a sequence attends only to itself, causally: exactly what
`jax.nn.dot_product_attention(is_causal=True)` computes, with cuDNN's flash kernel on the GPU
instead of the reference's materialised [Q, S] scores. Chunks that continue a sequence keep
the reference path (they also read pages); `chunk_attention` picks per round on the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.attention.reference import Windows, paged_attention


def fresh_causal_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    windows: Windows,
    *,
    window_len: int,
    implementation: str | None,
) -> jax.Array:
    """Causal self-attention of each window's tokens; [T, H, Dh] like `paged_attention`."""
    T = q.shape[0]
    offsets = jnp.arange(window_len)
    idx = windows.start[:, None] + offsets[None, :]  # [W, Q]
    in_window = offsets[None, :] < windows.length[:, None]
    safe_idx = jnp.where(in_window, idx, 0)
    lengths = jnp.maximum(windows.length, 1).astype(jnp.int32)
    # Rows past a window's length are masked keys, but a zero weight times a non-finite value
    # (a padding row's) is still nan inside the product: they are zeroed.
    v = jnp.where(in_window[:, :, None, None], v_new[safe_idx].astype(q.dtype), 0)
    out = jax.nn.dot_product_attention(
        q[safe_idx],
        k_new[safe_idx].astype(q.dtype),  # widens an 8-bit cache's keys and values
        v,
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=implementation,
    )  # [W, Q, H, Dh]
    target = jnp.where(in_window, idx, T).reshape(-1)
    flat = out.reshape(-1, *out.shape[2:]).astype(q.dtype)
    return jnp.zeros_like(q).at[target].set(flat, mode="drop")


def fused_attention_available(dtype: str) -> bool:
    """cuDNN's flash attention runs on NVIDIA GPUs in half precision."""
    return jax.default_backend() == "gpu" and dtype in ("bfloat16", "float16")


def chunk_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    positions: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    page_table: jax.Array,
    windows: Windows,
    *,
    window_len: int,
    n_ctx_pages: int,
    implementation: str | None,
) -> jax.Array:
    """Prompt-chunk attention: fused when no window has cached context, else the reference.

    Only the first window may have context: the engine packs several prompts into a chunk
    only when all of them start there (see `Engine._chunk_members`). So the reference
    branch reads just that window, not a bucket-sized window per (empty) segment.

    `k_cache`, `v_cache` are the whole [L, P, page, K, Dh] cache and the branch takes layer
    `layer` itself: a conditional's operands are buffers, so a per-layer slice passed in was
    copied whole, every layer of every prompt round (12 of an 8B's 47 ms 1k-token round on
    an H100: docs/lab/2026-12.md).
    """
    first = positions[windows.start]
    no_context = jnp.all((windows.length == 0) | (first == 0))
    continuing = Windows(slot=windows.slot[:1], start=windows.start[:1], length=windows.length[:1])

    def fused() -> jax.Array:
        return fresh_causal_attention(q, k_new, v_new, windows, window_len=window_len, implementation=implementation)

    def reference() -> jax.Array:
        return paged_attention(
            q,
            k_new,
            v_new,
            positions,
            k_cache,
            v_cache,
            page_table,
            continuing,
            window_len=window_len,
            n_ctx_pages=n_ctx_pages,
            layer=layer,
        )

    return jax.lax.cond(no_context, fused, reference)
