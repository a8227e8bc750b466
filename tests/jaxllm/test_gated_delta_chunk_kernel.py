"""The Pallas state pass of the chunked gated delta rule (jaxllm.model.gated_delta_chunk_kernel),
in its interpreter, against the token-by-token rule at full float32 precision. Shapes are
tiny (the interpreter is slow) but cross several chunks of 16 tokens."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.model.gated_delta import chunk_terms, gated_delta_chunked, gated_delta_recurrent
from jaxllm.model.gated_delta_chunk_kernel import chunk_state_pass

H, DK, DV = 2, 16, 32
CHUNK = 16


def _inputs(seed: int, N: int, T: int, lengths: list[int] | None = None):
    """Random q, k, v, g <= 0, beta, and a nonzero initial state (float32); positions past
    `lengths` follow the padding convention g = 0, beta = 0."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    q, k, v, state = f(N, T, H, DK), f(N, T, H, DK), f(N, T, H, DV), f(N, H, DK, DV)
    g = rng.uniform(-1, 0, size=(N, T, H)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, size=(N, T, H)).astype(np.float32)
    lengths = [T] * N if lengths is None else lengths
    live = (np.arange(T)[None, :] < np.asarray(lengths)[:, None])[:, :, None]
    return q, k, v, np.where(live, g, 0).astype(np.float32), np.where(live, beta, 0).astype(np.float32), state


def _kernel_rule(*args):
    return gated_delta_chunked(*args, chunk=CHUNK, kernel="interpret")


@pytest.mark.parametrize("T,lengths", [(48, [48, 48]), (37, [37, 20])])  # 3 whole chunks; 3 with a padded tail
def test_kernel_matches_recurrent(T, lengths):
    """Two segments from nonzero states, one shorter than the other (its tail padding): the
    outputs at live positions and the final states of the recurrent rule."""
    q, k, v, g, beta, state = _inputs(T, 2, T, lengths)
    out, new_state = _kernel_rule(q, k, v, g, beta, state)
    ref_out, ref_state = gated_delta_recurrent(q, k, v, g, beta, state)
    assert out.shape == v.shape and new_state.shape == state.shape
    for n, length in enumerate(lengths):
        np.testing.assert_allclose(out[n, :length], ref_out[n, :length], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new_state, ref_state, rtol=1e-4, atol=1e-5)


def test_padding_leaves_state_unchanged():
    """g = 0, beta = 0 everywhere: the state comes back bit for bit, whatever q, k, v are."""
    q, k, v, g, beta, state = _inputs(1, 2, 19, lengths=[0, 0])
    _, new_state = _kernel_rule(q * 100, k * 100, v * 100, g, beta, state)
    np.testing.assert_array_equal(new_state, state)


def test_column_blocks_split_exactly():
    """Dv cut into two programs' blocks of 16 columns gives the single block's results."""
    q, k, v, g, beta, state = _inputs(2, 1, 40)
    terms = chunk_terms(q, k, v, g, beta, chunk=CHUNK, qk_l2norm=True, precision=None)
    args = (terms.q, terms.k, terms.uw, terms.intra, terms.cum, state)
    whole = chunk_state_pass(*args, interpret=True, _block_v=DV)
    split = chunk_state_pass(*args, interpret=True, _block_v=16)
    for a, b in zip(whole, split):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_launch_shapes_are_checked():
    """Triton's dots want powers of two >= 16; the interpreter takes any shape."""
    q, k, v, g, beta, state = _inputs(3, 1, 16)
    terms = chunk_terms(q[..., :8], k[..., :8], v, g, beta, chunk=CHUNK, qk_l2norm=True, precision=None)
    args = (terms.q, terms.k, terms.uw, terms.intra, terms.cum, state[:, :, :8])
    with pytest.raises(ValueError, match="powers of two"):
        chunk_state_pass(*args)
    with pytest.raises(ValueError, match="must divide"):
        chunk_state_pass(*args, interpret=True, _block_v=24)
    chunk_state_pass(*args, interpret=True)  # Dk = 8 runs in the interpreter
