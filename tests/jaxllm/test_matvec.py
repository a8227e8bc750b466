"""The Pallas decode matvec (in the interpreter, on CPU) against numpy in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model.matvec import default_config, matvec
from jaxllm.pallas_triton import kernels_available


def _inputs(seed: int, M: int, K: int, N: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)


# (M, K, N, block_k, block_n, split_k, use_dot). K and N are 16-aligned in the first cases
# (unmasked loads), ragged in the rest (masked edges); split counts both divide the K blocks
# and leave the last split a shorter share (dynamic trip count).
CASES = [
    (1, 64, 48, 16, 16, 1, False),  # one split: the kernel writes x.dtype directly
    (1, 64, 48, 16, 16, 4, False),  # 4 splits of one K block each
    (1, 96, 32, 16, 32, 4, False),  # 6 K blocks over 4 splits: shares 2, 2, 2 -> 3 splits
    (3, 100, 70, 32, 32, 2, False),  # M = 3 (fma, 3 accumulators), ragged K and N
    (3, 100, 70, 32, 32, 2, True),  # same through the padded dot
    (8, 128, 80, 32, 64, 3, True),  # 4 K blocks over 3 splits: shares 2, 2 -> 2 splits
    (8, 50, 20, 16, 16, 1, True),  # ragged everything, one split
    (16, 64, 64, 32, 32, 2, True),  # M = 16: no row padding
    (1, 64, 48, 16, 16, 1, True),  # M = 1 through the dot: rows 1..15 of the x tile are masked
    (1, 100, 70, 32, 32, 2, True),  # ... with ragged K and N
]


@pytest.mark.parametrize("M,K,N,block_k,block_n,split_k,use_dot", CASES)
def test_float32_matches_float64(M, K, N, block_k, block_n, split_k, use_dot):
    x, w = _inputs(M * 1000 + K + N, M, K, N)
    ours = matvec(
        jnp.asarray(x), jnp.asarray(w), interpret=True,
        block_k=block_k, block_n=block_n, split_k=split_k, use_dot=use_dot,
    )
    assert ours.shape == (M, N) and ours.dtype == jnp.float32
    np.testing.assert_allclose(ours, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split_k", [1, 2, 3, 5])
def test_every_split_counts_once(split_k):
    """Each K split's share must be summed exactly once: a lost, doubled or overlapping
    share (a reduction or indexing bug) moves the result far past the tolerance. A constant
    x and w make every share's contribution the same size, so none can hide."""
    M, K, N = 2, 80, 32
    x = np.ones((M, K), np.float32)
    w = np.tile(np.arange(1, K + 1, dtype=np.float32)[:, None], (1, N))  # row k holds k + 1
    ours = np.asarray(matvec(jnp.asarray(x), jnp.asarray(w), interpret=True, block_k=16, block_n=16,
                             split_k=split_k))
    np.testing.assert_array_equal(ours, np.full((M, N), K * (K + 1) / 2, np.float32))


@pytest.mark.parametrize("M,use_dot", [(1, False), (2, False), (5, True)])
def test_bfloat16_close_to_rounded_inputs(M, use_dot):
    """bf16 in, bf16 out: the float32 product of the bf16-rounded inputs, within bf16's rounding."""
    K, N = 96, 48
    x, w = _inputs(M, M, K, N)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    ours = matvec(xb, wb, interpret=True, block_k=32, block_n=16, split_k=2, use_dot=use_dot)
    assert ours.dtype == jnp.bfloat16
    ref = np.asarray(xb, np.float64) @ np.asarray(wb, np.float64)
    np.testing.assert_allclose(np.asarray(ours, np.float64), ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


def test_default_config_runs_and_matches():
    """The default blocks and splits (chosen from the shape) give the right answer too."""
    x, w = _inputs(11, 3, 200, 96)
    ours = matvec(jnp.asarray(x), jnp.asarray(w), interpret=True)
    np.testing.assert_allclose(ours, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "M,K,N",
    [(1, 4096, 6144), (1, 4096, 4096), (1, 4096, 28672), (1, 14336, 4096), (1, 4096, 128256), (8, 4096, 6144)],
)
def test_default_config_divides_llama3_8b_shapes(M, K, N):
    """The 8B decode shapes need no masks, and the grid has >= 4 programs per SM (132)."""
    cfg = default_config(M, K, N, 2)
    assert K % cfg["block_k"] == 0 and N % cfg["block_n"] == 0
    n_k_blocks = K // cfg["block_k"]
    assert n_k_blocks % cfg["split_k"] == 0
    assert (N // cfg["block_n"]) * cfg["split_k"] >= 4 * 132
    assert n_k_blocks // cfg["split_k"] >= 2  # each program still loops (pipelined loads)


def test_rejects_bad_blocks():
    x, w = _inputs(0, 1, 32, 32)
    with pytest.raises(ValueError, match="power of two"):
        matvec(jnp.asarray(x), jnp.asarray(w), interpret=True, block_k=24)


def test_available_only_on_gpu():
    assert kernels_available("bfloat16") is False  # CI runs on CPU


def test_partials_sum_to_the_product():
    """partials=True returns the splits' float32 products unsummed; they add up to x @ w."""
    x, w = _inputs(5, 1, 96, 40)
    parts = matvec(jnp.asarray(x), jnp.asarray(w), interpret=True, block_k=16, block_n=16, split_k=3, partials=True)
    assert parts.shape == (3, 1, 40) and parts.dtype == jnp.float32
    assert not np.allclose(parts[0], parts[1])  # real shares of K, not copies
    np.testing.assert_allclose(parts.sum(axis=0), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_input_from_gate_up_partials(dtype):
    """The down projection straight from gate|up partials: silu(gate) * up of the summed halves
    (rounded to w's dtype, as XLA's product would be) times w."""
    rng = np.random.default_rng(9)
    K, N = 48, 40
    parts = jnp.asarray(rng.standard_normal((2, 1, 2 * K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K, N)), dtype)
    ours = matvec(parts, w, interpret=True, block_k=16, block_n=16, split_k=2, swiglu_input=True)
    gate, up = (parts.sum(axis=0)[:, :K].astype(dtype), parts.sum(axis=0)[:, K:].astype(dtype))
    hidden = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)
    ref = np.asarray(hidden, np.float64) @ np.asarray(w, np.float64)
    assert ours.shape == (1, N) and ours.dtype == dtype
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(ours, np.float64), ref, rtol=tol, atol=tol * np.abs(ref).max())
