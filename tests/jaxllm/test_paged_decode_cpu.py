"""The C++ (XLA FFI) CPU paged decode kernel against the jnp reference oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.attention import paged_decode_cpu
from test_paged_decode import CACHED, _inputs, _reference

pytestmark = pytest.mark.skipif(
    not paged_decode_cpu.available(jnp.float32), reason="needs the CPU backend and a C++ compiler"
)


@pytest.mark.parametrize("H,K", [(2, 2), (6, 2), (8, 2), (4, 1)])
def test_kernel_matches_reference(H, K):
    args = _inputs(H * 10 + K, H, K)
    ours = paged_decode_cpu.paged_decode_attention_cpu(*args)
    assert ours.shape == args[0].shape and ours.dtype == jnp.float32
    np.testing.assert_allclose(ours, _reference(*args), rtol=1e-5, atol=1e-5)


def test_stacked_pool_reads_the_given_layer_only():
    """A traced layer index picks one layer of the [L, ...] stack; the others are never read."""
    q, k_new, v_new, k_pages, v_pages, pages, cached = _inputs(3, 6, 2)
    poison = jnp.full_like(k_pages, jnp.nan)
    k_stack, v_stack = jnp.stack([poison, k_pages, poison]), jnp.stack([poison, v_pages, poison])
    run = jax.jit(
        lambda layer: paged_decode_cpu.paged_decode_attention_cpu(
            q, k_new, v_new, k_stack, v_stack, pages, cached, layer=layer
        )
    )
    np.testing.assert_allclose(
        run(jnp.int32(1)), _reference(q, k_new, v_new, k_pages, v_pages, pages, cached), rtol=1e-5, atol=1e-5
    )


def test_rows_past_the_cached_length_are_never_read():
    """Poisoned rows past each window's length (and pages past it) leave the output finite."""
    q, k_new, v_new, k_pages, v_pages, pages, cached = _inputs(5, 4, 2)
    page = k_pages.shape[1]
    k_np, v_np = np.array(k_pages), np.array(v_pages)
    for w, n in enumerate(CACHED):
        for s in range(n, pages.shape[1] * page):
            p, r = int(pages[w, s // page]), s % page
            if not any(
                int(pages[o, t // page]) == p and t % page == r and t < CACHED[o]
                for o in range(len(CACHED))
                for t in range(CACHED[o])
            ):
                k_np[p, r], v_np[p, r] = np.nan, np.nan
    ours = paged_decode_cpu.paged_decode_attention_cpu(
        q, k_new, v_new, jnp.asarray(k_np), jnp.asarray(v_np), pages, cached
    )
    np.testing.assert_allclose(ours, _reference(q, k_new, v_new, k_pages, v_pages, pages, cached), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cached", [300, 64, 17])
def test_a_long_window_split_across_threads_matches_reference(cached):
    """One window with hundreds of cached rows is split into parts run side by side (on a
    machine with several threads) and merged; short ones are not split."""
    rng = np.random.default_rng(cached)
    P, page, K, H, Dh, n_ctx = 30, 16, 2, 6, 16, 24
    q = jnp.asarray(rng.normal(size=(1, H, Dh)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.normal(size=(1, K, Dh)), jnp.float32) for _ in range(2))
    k_pages, v_pages = (jnp.asarray(rng.normal(size=(P, page, K, Dh)) * 2, jnp.float32) for _ in range(2))
    pages = jnp.asarray(rng.permutation(np.arange(1, P))[:n_ctx][None], jnp.int32)
    args = (q, k_new, v_new, k_pages, v_pages, pages, jnp.asarray([cached], jnp.int32))
    np.testing.assert_allclose(
        paged_decode_cpu.paged_decode_attention_cpu(*args), _reference(*args), rtol=1e-5, atol=1e-5
    )
