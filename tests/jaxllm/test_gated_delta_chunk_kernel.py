"""The chunked gated delta rule's Pallas kernels (in the interpreter) against the token-by-token
oracle `gated_delta_recurrent`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model.gated_delta import gated_delta_recurrent
from jaxllm.model.gated_delta_chunk_kernel import gated_delta_prefill

CHUNK = 16  # small chunks keep the interpreter fast; the math is the same at 64
TOL = dict(rtol=2e-5, atol=2e-5)


def _inputs(seed: int, N: int, T: int, H: int, Dk: int, Dv: int, lengths=None, dtype=jnp.float32):
    """Random q, k, v (dtype), g <= 0, beta in (0, 1), a nonzero float32 state; positions
    past `lengths` get the padding convention g = 0, beta = 0 with random q, k, v."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    q, k, v = f(N, T, H, Dk), f(N, T, H, Dk), f(N, T, H, Dv)
    g = rng.uniform(-1.0, 0.0, size=(N, T, H)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, size=(N, T, H)).astype(np.float32)
    lengths = np.full((N,), T) if lengths is None else np.asarray(lengths)
    live = (np.arange(T)[None, :] < lengths[:, None])[:, :, None]
    g, beta = np.where(live, g, 0).astype(np.float32), np.where(live, beta, 0).astype(np.float32)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(f(N, H, Dk, Dv))


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("Dk,Dv,block_v", [(16, 16, None), (32, 16, None), (16, 32, 16)])
def test_matches_recurrent(Dk, Dv, block_v, split):
    """T = 70 is no multiple of the chunk (internal padding); segment 1 ends early. Both
    forms (output in the sequential pass, or split out), Dv in one block or several."""
    args = _inputs(0, N=2, T=70, H=2, Dk=Dk, Dv=Dv, lengths=[70, 41])
    out, state = gated_delta_prefill(*args, chunk=CHUNK, split=split, block_v=block_v, out_block_v=block_v,
                                     interpret=True)
    ref_out, ref_state = gated_delta_recurrent(*args)
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert state.shape == ref_state.shape and state.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(state, ref_state, **TOL)


def test_without_l2norm():
    """Unnormalised q, k (small, so the rule stays contractive)."""
    q, k, v, g, beta, state = _inputs(1, N=1, T=33, H=2, Dk=16, Dv=16)
    args = (q * 0.2, k * 0.2, v, g, beta, state)
    out, new_state = gated_delta_prefill(*args, chunk=CHUNK, qk_l2norm=False, interpret=True)
    ref_out, ref_state = gated_delta_recurrent(*args, qk_l2norm=False)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(new_state, ref_state, **TOL)


@pytest.mark.parametrize("split", [False, True])
def test_padding_leaves_state_unchanged(split):
    """A segment of only padding keeps its state exactly; its neighbour is unaffected."""
    args = _inputs(2, N=2, T=20, H=2, Dk=16, Dv=16, lengths=[20, 0])
    _, state = gated_delta_prefill(*args, chunk=CHUNK, split=split, interpret=True)
    np.testing.assert_array_equal(state[1], args[-1][1])
    _, ref_state = gated_delta_recurrent(*args)
    np.testing.assert_allclose(state[0], ref_state[0], **TOL)


@pytest.mark.parametrize("split", [False, True])
def test_split_prompt_equals_one_call(split):
    """Two calls with the state carried (the first cut mid-chunk) give one call's results."""
    q, k, v, g, beta, state = _inputs(3, N=2, T=50, H=2, Dk=16, Dv=16)

    def run(sl: slice, s: jnp.ndarray):
        return gated_delta_prefill(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s, chunk=CHUNK, split=split,
                                   interpret=True)

    out, final = run(slice(None), state)
    out_a, mid = run(slice(0, 23), state)
    out_b, end = run(slice(23, None), mid)
    np.testing.assert_allclose(jnp.concatenate([out_a, out_b], axis=1), out, **TOL)
    np.testing.assert_allclose(end, final, **TOL)


def test_bfloat16_inputs():
    """bf16 q, k, v: out comes back in bf16, the state in float32, both near the oracle's."""
    args = _inputs(4, N=1, T=40, H=2, Dk=16, Dv=16, dtype=jnp.bfloat16)
    out, state = gated_delta_prefill(*args, chunk=CHUNK, interpret=True)
    ref_out, ref_state = gated_delta_recurrent(*args)
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(state, ref_state, rtol=1e-4, atol=1e-4)
