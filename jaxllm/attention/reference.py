"""Paged attention in plain jnp: runs everywhere and is the oracle for faster kernels.

Queries come in *windows*: a window is up to Q consecutive tokens of the flattened batch that
belong to one slot (Q = 1 for decode tokens, Q = the chunk bucket for prompt chunks). Each
window attends to its slot's pages written by earlier rounds and, causally, to its own new
keys; a slot appears in at most one window per round. Cost is windows x Q x S, with S the
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
    k_new: jax.Array,
    v_new: jax.Array,
    positions: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    windows: Windows,
    *,
    window_len: int,
    n_ctx_pages: int,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Attention of windowed queries over paged K/V written before this round plus the
    window's own new K/V (causal). The cache is only read here: the caller writes this
    round's K/V once, after all layers, which keeps every update in place.

    Args:
      q: [T, H, Dh] queries of the whole flat batch.
      k_new, v_new: [T, K, Dh] this round's keys and values.
      positions: [T] absolute position of each token.
      k_pages, v_pages: [P, page, K, Dh] one layer's page pool (earlier rounds' K/V), or with
        `layer` the whole [L, P, page, K, Dh] cache, read at that layer by the page gather
        itself (a slice of it first would be a copy of the layer where XLA does not fuse it).
      page_table: [rows, max_pages] page ids per slot.
      windows: which tokens form each window (one slot per window).
      window_len: static Q.
      n_ctx_pages: static number of leading pages of each slot to read (context bucket).

    Returns:
      [T, H, Dh]: each windowed token's attention output; tokens in no window get zeros.
    """
    T, H, Dh = q.shape
    K = k_pages.shape[-2]
    G = H // K
    W = windows.slot.shape[0]
    page = k_pages.shape[-3]
    S = n_ctx_pages * page

    offsets = jnp.arange(window_len)
    idx = windows.start[:, None] + offsets[None, :]  # [W, Q]
    in_window = offsets[None, :] < windows.length[:, None]
    safe_idx = jnp.where(in_window, idx, 0)
    qw = q[safe_idx].reshape(W, window_len, K, G, Dh)
    # An 8-bit cache is widened to the queries' type as it is read (see RuntimeOptions.kv_dtype).
    kw, vw = k_new[safe_idx].astype(q.dtype), v_new[safe_idx].astype(q.dtype)  # [W, Q, K, Dh]
    qpos = positions[safe_idx]  # [W, Q]
    first_pos = qpos[:, :1]  # [W, 1]: cache positions before it were written by earlier rounds

    pages = page_table[windows.slot, :n_ctx_pages]  # [W, n]
    at = pages if layer is None else (layer, pages)
    k = k_pages[at].reshape(W, S, K, Dh).astype(q.dtype)
    v = v_pages[at].reshape(W, S, K, Dh).astype(q.dtype)

    scale = Dh**-0.5
    cached = jnp.einsum("wqkgd,wskd->wkgqs", qw, k, preferred_element_type=jnp.float32) * scale
    fresh = jnp.einsum("wqkgd,wpkd->wkgqp", qw, kw, preferred_element_type=jnp.float32) * scale
    cache_ok = jnp.arange(S)[None, None, :] < first_pos[:, :, None]  # [W, 1, S]
    fresh_ok = (offsets[None, None, :] <= offsets[None, :, None]) & in_window[:, None, :]  # [W, Q, Q]
    cached = jnp.where(cache_ok[:, None, None], cached, _MASKED)
    fresh = jnp.where(fresh_ok[:, None, None], fresh, _MASKED)
    # Masked values are zeroed, not only weighted 0: pages past the context (the trash page,
    # a page's unwritten tail) and rows outside the window may hold anything, and 0 * nan is nan.
    v = jnp.where(cache_ok[:, 0, :, None, None], v, 0)
    vw = jnp.where(in_window[:, :, None, None], vw, 0)
    probs = jax.nn.softmax(jnp.concatenate([cached, fresh], axis=-1), axis=-1).astype(v.dtype)
    out = jnp.einsum("wkgqs,wskd->wqkgd", probs[..., :S], v, preferred_element_type=jnp.float32)
    out = out + jnp.einsum("wkgqp,wpkd->wqkgd", probs[..., S:], vw, preferred_element_type=jnp.float32)
    out = out.reshape(W * window_len, H, Dh).astype(q.dtype)

    # Scatter back to the flat batch; tokens outside any window are dropped (index T).
    target = jnp.where(in_window, idx, T).reshape(-1)
    return jnp.zeros((T, H, Dh), q.dtype).at[target].set(out, mode="drop")


def paged_decode_reference(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    positions: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    windows: Windows,
    *,
    n_ctx_pages: int,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """`paged_attention` for one-token windows that are the batch's first rows (window i is
    row i, as the steps lay out decode tokens), written for that case.

    The general path gathers each window's queries, computes a [Q, Q] block of fresh scores,
    concatenates them to the cached ones and scatters the output back; with one token at a
    known row all of that reduces to slices and one extra score per head. On the CPU the
    ~15 ops saved per layer are a measurable part of a decode step (XLA runs ops one by one).

    Same arguments as `paged_attention` (window_len is 1, `layer` as there); returns [T, H, Dh].
    """
    T, H, Dh = q.shape
    W = windows.slot.shape[0]
    page, K = k_pages.shape[-3], k_pages.shape[-2]
    G = H // K
    S = n_ctx_pages * page
    scale = Dh**-0.5

    qw = q[:W].reshape(W, K, G, Dh)
    pages = page_table[windows.slot, :n_ctx_pages]  # [W, n]
    at = pages if layer is None else (layer, pages)
    k = k_pages[at].reshape(W, S, K, Dh).astype(q.dtype)  # widens an 8-bit cache
    v = v_pages[at].reshape(W, S, K, Dh).astype(q.dtype)
    cached = jnp.einsum("wkgd,wskd->wkgs", qw, k, preferred_element_type=jnp.float32) * scale
    cached_ok = jnp.arange(S)[None, :] < positions[:W, None]  # [W, S]: written by earlier rounds
    cached = jnp.where(cached_ok[:, None, None, :], cached, _MASKED)
    v = jnp.where(cached_ok[:, :, None, None], v, 0)  # 0 * nan is nan: see `paged_attention`
    fresh = jnp.einsum("wkgd,wkd->wkg", qw, k_new[:W].astype(q.dtype), preferred_element_type=jnp.float32) * scale

    top = jnp.maximum(cached.max(axis=-1), fresh)  # [W, K, G]; finite thanks to the fresh key
    p_cached = jnp.exp(cached - top[..., None])
    p_fresh = jnp.exp(fresh - top)
    denom = p_cached.sum(axis=-1) + p_fresh
    out = jnp.einsum("wkgs,wskd->wkgd", p_cached.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out + p_fresh[..., None] * v_new[:W, :, None, :].astype(jnp.float32)
    out = (out / denom[..., None]).reshape(W, H, Dh).astype(q.dtype)
    return place_decode_rows(out, windows, T)


def place_decode_rows(out: jax.Array, windows: Windows, n_tokens: int) -> jax.Array:
    """Decode windows' outputs [W, H, Dh] (window i is row i) as the flat batch's [T, H, Dh]:
    empty windows and the rows past the decode part are zeros."""
    W = out.shape[0]
    out = jnp.where(windows.length[:, None, None] > 0, out, 0)
    return out if W == n_tokens else jnp.concatenate([out, jnp.zeros((n_tokens - W, *out.shape[1:]), out.dtype)])
