"""Paged attention in plain jnp: runs everywhere and is the oracle for faster kernels.

Queries come in *windows*: a window is up to Q consecutive tokens of the flattened batch that
belong to one slot (Q = 1 for decode tokens, Q = the chunk bucket for prompt chunks). Each
window attends to its slot's pages up to each query's own position, so causality inside a
chunk and attention to earlier chunks are the same rule. Cost is windows x Q x S, with S the
context bucket the caller chose (only the live part of the cache is read).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

_MASKED = -1e30


@struct.dataclass
class Windows:
    slot: jax.Array  # [W] slot of each window (any valid row for an empty window)
    start: jax.Array  # [W] index of the window's first token in the flat batch
    length: jax.Array  # [W] tokens in the window (0 = empty)


def paged_attention(
    q: jax.Array,
    positions: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    windows: Windows,
    *,
    window_len: int,
    n_ctx_pages: int,
) -> jax.Array:
    """Attention of windowed queries over paged K/V.

    Args:
      q: [T, H, Dh] queries of the whole flat batch.
      positions: [T] absolute position of each token.
      k_pages, v_pages: [P, page, K, Dh] one layer's page pool (already holding this batch's K/V).
      page_table: [rows, max_pages] page ids per slot.
      windows: which tokens form each window.
      window_len: static Q.
      n_ctx_pages: static number of leading pages of each slot to read (context bucket).

    Returns:
      [T, H, Dh]: each windowed token's attention output; tokens in no window get zeros.
    """
    T, H, Dh = q.shape
    K = k_pages.shape[2]
    G = H // K
    W = windows.slot.shape[0]
    page = k_pages.shape[1]
    S = n_ctx_pages * page

    offsets = jnp.arange(window_len)
    idx = windows.start[:, None] + offsets[None, :]  # [W, Q]
    in_window = offsets[None, :] < windows.length[:, None]
    safe_idx = jnp.where(in_window, idx, 0)
    qw = q[safe_idx].reshape(W, window_len, K, G, Dh)
    qpos = positions[safe_idx]  # [W, Q]

    pages = page_table[windows.slot, :n_ctx_pages]  # [W, n]
    k = k_pages[pages].reshape(W, S, K, Dh)
    v = v_pages[pages].reshape(W, S, K, Dh)

    scale = Dh**-0.5
    scores = jnp.einsum("wqkgd,wskd->wkgqs", qw, k, preferred_element_type=jnp.float32) * scale
    causal = jnp.arange(S)[None, None, :] <= qpos[:, :, None]  # [W, Q, S]
    scores = jnp.where(causal[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("wkgqs,wskd->wqkgd", probs, v, preferred_element_type=jnp.float32)
    out = out.reshape(W * window_len, H, Dh).astype(q.dtype)

    # Scatter back to the flat batch; tokens outside any window are dropped (index T).
    target = jnp.where(in_window, idx, T).reshape(-1)
    return jnp.zeros((T, H, Dh), q.dtype).at[target].set(out, mode="drop")
