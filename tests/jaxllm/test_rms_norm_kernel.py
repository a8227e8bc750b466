"""The fused residual add + RMSNorm kernel (in the Pallas interpreter) against layers.rms_norm."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model.layers import rms_norm
from jaxllm.model.rms_norm_kernel import add_rms_norm


def _rows(seed: int, T: int, D: int, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(T, D)) * 3, dtype)
    delta = jnp.asarray(rng.normal(size=(T, D)), dtype)
    weight = jnp.asarray(rng.normal(size=(D,)), dtype)
    return x, delta, weight


@pytest.mark.parametrize("T,D", [(1, 64), (3, 48), (5, 576)])  # 48 and 576: not powers of two
def test_add_then_norm_matches_reference(T, D):
    x, delta, weight = _rows(T * D, T, D, jnp.float32)
    total, normed = add_rms_norm(x, delta, weight, eps=1e-5, interpret=True)
    np.testing.assert_array_equal(total, x + delta)
    np.testing.assert_allclose(normed, rms_norm(x + delta, weight, 1e-5), rtol=2e-6, atol=2e-6)


def test_norm_alone_returns_x_unchanged():
    x, _, weight = _rows(1, 4, 96, jnp.float32)
    total, normed = add_rms_norm(x, None, weight, eps=1e-6, interpret=True)
    np.testing.assert_array_equal(total, x)
    np.testing.assert_allclose(normed, rms_norm(x, weight, 1e-6), rtol=2e-6, atol=2e-6)


def test_bfloat16_rounds_like_the_reference():
    """The sum is the bf16 residual stream exactly; the norm agrees to bf16 rounding."""
    x, delta, weight = _rows(2, 3, 320, jnp.bfloat16)
    total, normed = add_rms_norm(x, delta, weight, eps=1e-5, interpret=True)
    assert total.dtype == normed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(total, np.float32), np.asarray(x + delta, np.float32))
    ref = np.asarray(rms_norm(x + delta, weight, 1e-5), np.float32)
    np.testing.assert_allclose(np.asarray(normed, np.float32), ref, rtol=8e-3, atol=8e-3)
