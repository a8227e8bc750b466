"""Attention kernels against the plain-jnp reference (the oracle), at tiny shapes on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.attention.fused import chunk_attention, fresh_causal_attention
from jaxllm.attention.reference import Windows, paged_attention, paged_decode_reference

T, H, K, Dh, P, PAGE = 24, 4, 2, 16, 12, 4


def _inputs(seed: int, first_positions: tuple[int, int]):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(T, H, Dh)), jnp.float32)
    k_new = jnp.asarray(rng.normal(size=(T, K, Dh)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(T, K, Dh)), jnp.float32)
    k_pages = jnp.asarray(rng.normal(size=(P, PAGE, K, Dh)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(P, PAGE, K, Dh)), jnp.float32)
    page_table = jnp.asarray([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [0] * 5], jnp.int32)
    # Two windows: slot 0 tokens 0..9, slot 1 tokens 12..18; the rest is padding.
    windows = Windows(slot=jnp.asarray([0, 1]), start=jnp.asarray([0, 12]), length=jnp.asarray([10, 7]))
    positions = np.zeros((T,), np.int32)
    positions[0:10] = first_positions[0] + np.arange(10)
    positions[12:19] = first_positions[1] + np.arange(7)
    return q, k_new, v_new, jnp.asarray(positions), k_pages, v_pages, page_table, windows


def _dense_reference(q, k_new, v_new, positions, k_pages, v_pages, page_table, windows) -> np.ndarray:
    """Per-window numpy softmax attention over cached positions < first plus the window causally."""
    out = np.zeros(q.shape, np.float64)
    for w in range(2):
        s, n = int(windows.start[w]), int(windows.length[w])
        first = int(positions[s])
        pages = np.asarray(page_table[int(windows.slot[w])])
        kc = np.asarray(k_pages)[pages].reshape(-1, K, Dh)[:first]
        vc = np.asarray(v_pages)[pages].reshape(-1, K, Dh)[:first]
        for i in range(n):
            keys = np.concatenate([kc, np.asarray(k_new)[s : s + i + 1]])
            vals = np.concatenate([vc, np.asarray(v_new)[s : s + i + 1]])
            for h in range(H):
                logits = keys[:, h // (H // K)] @ np.asarray(q)[s + i, h] / np.sqrt(Dh)
                p = np.exp(logits - logits.max())
                out[s + i, h] = (p / p.sum()) @ vals[:, h // (H // K)]
    return out


def test_reference_matches_numpy_with_and_without_context():
    for firsts in [(0, 0), (5, 9)]:
        args = _inputs(0, firsts)
        ours = paged_attention(*args, window_len=10, n_ctx_pages=5)
        np.testing.assert_allclose(ours, _dense_reference(*args), rtol=1e-5, atol=1e-5)


def test_fused_fresh_attention_matches_reference():
    args = _inputs(1, (0, 0))
    q, k_new, v_new, positions, k_pages, v_pages, page_table, windows = args
    ref = paged_attention(*args, window_len=10, n_ctx_pages=5)
    fused = fresh_causal_attention(q, k_new, v_new, windows, window_len=10, implementation="xla")
    np.testing.assert_allclose(fused, ref, rtol=1e-5, atol=1e-5)


def test_chunk_attention_picks_a_correct_path_either_way():
    for firsts in [(0, 0), (3, 0)]:
        args = _inputs(2, firsts)
        if firsts[0]:  # a chunk with context carries that one prompt only (the engine's packing rule)
            w = args[-1]
            args = (*args[:-1], w.replace(length=w.length.at[1].set(0)))
        ref = paged_attention(*args, window_len=10, n_ctx_pages=5)
        q, k_new, v_new, positions, k_pages, v_pages, page_table, windows = args
        # The whole cache goes in (layer 1 of 2; layer 0 is noise the branch must not read).
        k_cache, v_cache = jnp.stack([-k_pages, k_pages]), jnp.stack([v_pages * 3, v_pages])
        got = jax.jit(chunk_attention, static_argnames=("window_len", "n_ctx_pages", "implementation"))(
            q, k_new, v_new, positions, k_cache, v_cache, 1, page_table, windows,
            window_len=10, n_ctx_pages=5, implementation="xla",
        )  # fmt: skip
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_decode_reference_matches_general_path():
    """Decode windows (window i = row i, one token) through the specialised path: rows past
    the windows and empty windows give zeros; cached lengths 0, mid-page and a full bucket."""
    q, k_new, v_new, _, k_pages, v_pages, page_table, _ = _inputs(3, (0, 0))
    windows = Windows(slot=jnp.asarray([0, 1, 2]), start=jnp.asarray([0, 1, 2]), length=jnp.asarray([1, 1, 0]))
    for cached in [(0, 7), (13, 20)]:
        positions = jnp.zeros((T,), jnp.int32).at[:2].set(jnp.asarray(cached))
        args = (q, k_new, v_new, positions, k_pages, v_pages, page_table, windows)
        want = paged_attention(*args, window_len=1, n_ctx_pages=5)
        got = paged_decode_reference(*args, n_ctx_pages=5)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert not np.any(np.asarray(got)[2:])  # the empty window and the non-decode rows
        assert np.any(np.asarray(got)[:2])


def _poisoned_outside_context(args: tuple) -> tuple:
    """`_inputs` with nan in every page position a window may read but not attend (the pages'
    tails past the context, the trash page, unused pages) and in every row outside the windows."""
    q, k_new, v_new, positions, k_pages, v_pages, page_table, windows = args
    stale = np.ones((P, PAGE), bool)
    for w in range(2):
        first = int(positions[int(windows.start[w])])
        for i in range(first):
            stale[int(page_table[int(windows.slot[w]), i // PAGE]), i % PAGE] = False
    rows = np.ones((T,), bool)
    for w in range(2):
        rows[int(windows.start[w]) : int(windows.start[w]) + int(windows.length[w])] = False
    nan_at = lambda x, m: jnp.where(jnp.asarray(m)[(...,) + (None,) * (x.ndim - m.ndim)], jnp.nan, x)  # noqa: E731
    return (
        q,
        nan_at(k_new, rows),
        nan_at(v_new, rows),
        positions,
        nan_at(k_pages, stale),
        nan_at(v_pages, stale),
        page_table,
        windows,
    )


def test_nothing_outside_a_windows_context_reaches_its_output():
    """Masked keys and values are not only weighted 0 but unread: a zero weight times nan is nan
    (an exact repeat's one-token chunk read the trash page so on an H100; test_padding_rows.py)."""
    for firsts in [(0, 0), (5, 9)]:
        args = _inputs(4, firsts)
        bad = _poisoned_outside_context(args)
        in_windows = np.zeros((T,), bool)
        in_windows[0:10] = in_windows[12:19] = True
        want = paged_attention(*args, window_len=10, n_ctx_pages=5)
        np.testing.assert_allclose(paged_attention(*bad, window_len=10, n_ctx_pages=5)[in_windows], want[in_windows])
        if firsts == (0, 0):
            q, k_new, v_new, _, _, _, _, windows = bad
            got = fresh_causal_attention(q, k_new, v_new, windows, window_len=10, implementation="xla")
            np.testing.assert_allclose(got[in_windows], want[in_windows], rtol=1e-5, atol=1e-5)
    q, k_new, v_new, _, k_pages, v_pages, page_table, _ = _inputs(5, (0, 0))
    windows = Windows(slot=jnp.asarray([0, 1]), start=jnp.asarray([0, 1]), length=jnp.asarray([1, 1]))
    positions = jnp.zeros((T,), jnp.int32).at[:2].set(jnp.asarray([6, 13]))
    args = (q, k_new, v_new, positions, k_pages, v_pages, page_table, windows)
    bad = _poisoned_outside_context(args)
    want = paged_decode_reference(*args, n_ctx_pages=5)[:2]
    np.testing.assert_allclose(paged_decode_reference(*bad, n_ctx_pages=5)[:2], want)
