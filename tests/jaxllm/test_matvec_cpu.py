"""The C++ (XLA FFI) CPU products of a few rows with a weight matrix, against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model import matvec_cpu

pytestmark = pytest.mark.skipif(
    not matvec_cpu.available(jnp.float32), reason="needs the CPU backend and a C++ compiler"
)


# Shapes cover: one row; several; the most rows; Din not a multiple of the 4-row unroll or
# of the parts; N not a multiple of a vector or of the parts; a single column.
@pytest.mark.parametrize("M,Din,N", [(1, 64, 96), (3, 130, 257), (8, 576, 960), (2, 7, 1), (1, 1, 33)])
@pytest.mark.parametrize("transposed", [False, True])
def test_matmul_matches_numpy(M, Din, N, transposed):
    rng = np.random.default_rng(M * 1000 + Din + N)
    x = rng.normal(size=(M, Din)).astype(np.float32)
    w = rng.normal(size=(N, Din) if transposed else (Din, N)).astype(np.float32)
    expected = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    ours = jax.jit(lambda x, w: matvec_cpu.matmul_cpu(x, w, transposed=transposed))(x, w)
    assert ours.shape == (M, N) and ours.dtype == jnp.float32
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-4 * np.sqrt(Din))


def test_too_many_rows_are_refused():
    x = jnp.zeros((matvec_cpu.MAX_ROWS + 1, 8), jnp.float32)
    with pytest.raises(ValueError, match="M <="):
        matvec_cpu.matmul_cpu(x, jnp.zeros((8, 4), jnp.float32))


@pytest.mark.parametrize("transposed", [False, True])
def test_a_stacked_weight_uses_the_given_layer_only(transposed):
    """A traced layer index picks one matrix of an [L, ...] stack; the others are never read."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(2, 40)).astype(np.float32)
    w = rng.normal(size=(24, 40) if transposed else (40, 24)).astype(np.float32)
    poison = np.full_like(w, np.nan)
    stack = jnp.asarray(np.stack([poison, w, poison]))
    run = jax.jit(lambda layer: matvec_cpu.matmul_cpu(x, stack, transposed=transposed, layer=layer))
    expected = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    np.testing.assert_allclose(run(jnp.int32(1)), expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="needs `layer`"):
        matvec_cpu.matmul_cpu(x, stack, transposed=transposed)
