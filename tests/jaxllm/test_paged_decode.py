"""The Pallas paged decode kernel (in the interpreter, on CPU) against the reference oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.attention.paged_decode import paged_decode_attention, paged_decode_attention_qkv
from jaxllm.attention.reference import Windows, paged_attention
from jaxllm.model.layers import apply_rope
from jaxllm.pallas_triton import kernels_available

PAGE, N_CTX, P, DH = 4, 6, 16, 16
# Lengths cover: empty cache, one position, a page boundary, mid-page, the full bucket.
CACHED = (0, 1, PAGE, 2 * PAGE + 3, N_CTX * PAGE)


def _inputs(seed: int, H: int, K: int, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    W = len(CACHED)
    q = jnp.asarray(rng.normal(size=(W, H, DH)), dtype)
    k_new = jnp.asarray(rng.normal(size=(W, K, DH)), dtype)
    v_new = jnp.asarray(rng.normal(size=(W, K, DH)), dtype)
    k_pages = jnp.asarray(rng.normal(size=(P, PAGE, K, DH)), dtype)
    v_pages = jnp.asarray(rng.normal(size=(P, PAGE, K, DH)), dtype)
    # Distinct random pages per window (never the trash page 0) ...
    pages = np.stack([rng.permutation(np.arange(1, P))[:N_CTX] for _ in range(W)]).astype(np.int32)
    # ... except that the last two windows share a prefix, like forked sequences.
    pages[-1, :3] = pages[-2, :3]
    cached = jnp.asarray(CACHED, jnp.int32)
    return q, k_new, v_new, k_pages, v_pages, jnp.asarray(pages), cached


def _reference(q, k_new, v_new, k_pages, v_pages, pages, cached_len):
    """Each window is one decode token of slot w at position cached_len[w]."""
    W = q.shape[0]
    windows = Windows(slot=jnp.arange(W), start=jnp.arange(W), length=jnp.ones((W,), jnp.int32))
    return paged_attention(
        q,
        k_new,
        v_new,
        cached_len,
        k_pages,
        v_pages,
        pages,
        windows,
        window_len=1,
        n_ctx_pages=pages.shape[1],
    )


@pytest.mark.parametrize(
    "H,K,pages_per_block,n_splits,grid_order",
    [
        (2, 2, 4, 1, "hsw"),  # G = 1, one block per window, one split
        (6, 2, 4, 3, "whs"),  # G = 3 (not a power of two), splits with no work
        (8, 2, 8, 2, "swh"),  # G = 4, blocks of 32 rows over 2 splits
        (4, 1, None, None, "hsw"),  # default knobs
    ],
)
def test_kernel_matches_reference(H, K, pages_per_block, n_splits, grid_order):
    args = _inputs(H * 10 + K, H, K)
    ours = paged_decode_attention(
        *args, interpret=True, _pages_per_block=pages_per_block, _n_splits=n_splits, _grid_order=grid_order
    )
    assert ours.shape == args[0].shape and ours.dtype == args[0].dtype
    np.testing.assert_allclose(ours, _reference(*args), rtol=1e-5, atol=1e-5)


def test_stacked_layers_pick_one_layer():
    """The [L, ...] stack with a (traced) layer index reads that layer's pool only."""
    q, k_new, v_new, k_pages, v_pages, pages, cached = _inputs(5, 6, 2)
    k_stack = jnp.stack([k_pages * 0 + 7, k_pages, k_pages * 0 - 3])
    v_stack = jnp.stack([v_pages * 0 + 5, v_pages, v_pages * 0 - 1])
    ours = paged_decode_attention(
        q, k_new, v_new, k_stack, v_stack, pages, cached, layer=jnp.int32(1), interpret=True, _pages_per_block=4
    )
    np.testing.assert_allclose(ours, _reference(q, k_new, v_new, k_pages, v_pages, pages, cached), rtol=1e-5, atol=1e-5)


def test_dead_pages_do_not_leak():
    """Rows past cached_len are never used, even if their pages hold non-finite garbage."""
    q, k_new, v_new, k_pages, v_pages, pages, cached = _inputs(7, 6, 2)
    ours = paged_decode_attention(q, k_new, v_new, k_pages, v_pages, pages, cached, interpret=True, _pages_per_block=4)
    # Poison every position past each window's length in its own pages, and the trash page.
    k_bad, v_bad = np.array(k_pages), np.array(v_pages)
    k_bad[0] = v_bad[0] = np.nan
    for w, n in enumerate(CACHED):
        for i, page in enumerate(np.asarray(pages[w])):
            shared_live = any(page in np.asarray(pages[o])[: -(-m // PAGE)] for o, m in enumerate(CACHED) if o != w)
            if not shared_live:
                lo = max(0, n - i * PAGE)
                k_bad[page, lo:] = v_bad[page, lo:] = np.inf
    poisoned = paged_decode_attention(
        q, k_new, v_new, jnp.asarray(k_bad), jnp.asarray(v_bad), pages, cached, interpret=True, _pages_per_block=4
    )
    np.testing.assert_allclose(poisoned, ours, rtol=0, atol=0)


def test_windows_that_do_not_decode_are_zeros():
    """`window_live` zeroes whole windows and leaves the others exactly as without it."""
    args = _inputs(11, 6, 2)
    live = jnp.asarray([1, 0, 1, 0, 1], jnp.int32)
    full = paged_decode_attention(*args, interpret=True, _pages_per_block=4, _n_splits=2)
    ours = paged_decode_attention(*args, window_live=live, interpret=True, _pages_per_block=4, _n_splits=2)
    np.testing.assert_array_equal(ours, jnp.where(live[:, None, None] > 0, full, 0))
    assert np.all(np.abs(np.asarray(full)[np.asarray(live) == 0]) > 0)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_fused_projection_input_with_rope(dtype, tol):
    """From one [W, H + 2K, Dh] projection output, rotating q and the fresh k in the kernel,
    the result is the reference's on rotated inputs."""
    H, K = 6, 2
    q, k_new, v_new, k_pages, v_pages, pages, cached = _inputs(13, H, K, dtype)
    qkv = jnp.concatenate([q, k_new, v_new], axis=1)
    inv_freq = 1.0 / (500.0 ** (jnp.arange(DH // 2, dtype=jnp.float32) * 2 / DH))
    positions = cached + 3  # any positions: rotation uses them, attention uses cached_len
    ours = paged_decode_attention_qkv(
        qkv, positions, inv_freq, k_pages, v_pages, pages, cached, n_heads=H, interpret=True
    )
    rotated = [apply_rope(x, positions, inv_freq) for x in (q, k_new)]
    ref = _reference(rotated[0], rotated[1], v_new, k_pages, v_pages, pages, cached)
    assert ours.shape == q.shape and ours.dtype == dtype
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)
    unrotated = _reference(q, k_new, v_new, k_pages, v_pages, pages, cached)
    assert not np.allclose(np.asarray(ours, np.float32), np.asarray(unrotated, np.float32), rtol=tol, atol=tol)


def test_bfloat16_close_to_reference():
    args = _inputs(3, 6, 2, jnp.bfloat16)
    ours = paged_decode_attention(*args, interpret=True, _pages_per_block=4, _n_splits=2)
    assert ours.dtype == jnp.bfloat16
    ref = _reference(*args)
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)


def test_available_only_on_gpu():
    on_gpu = jax.default_backend() == "gpu"
    assert kernels_available("float32") is on_gpu and kernels_available("bfloat16") is on_gpu
    assert kernels_available("int8") is False
