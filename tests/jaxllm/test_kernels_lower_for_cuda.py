"""The Pallas kernels lower to Triton for CUDA, checked on the CPU.

The interpreter runs the kernels' arithmetic on the CPU (the parity tests), but not their
lowering to Triton, which only a GPU run would otherwise exercise: an indexing form the
Triton lowering does not take (a gather load, a branch on a program's liveness) would pass
every CPU test and fail a GPU server's warm-up. Lowering for the "cuda" platform runs that
step here; compiling the Triton IR to GPU code still needs a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxllm.model.gated_delta_kernel import gated_delta_decode, gated_delta_decode_from_projections
from jaxllm.model.moe_kernels import moe_ffn
from jaxllm.model.route_kernel import route_and_count


def _triton_calls(fn, *args) -> int:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("stablehlo.custom_call @__gpu$xla.gpu.triton")


@pytest.mark.parametrize("layout,T,block_m", [("pairs", 2, None), ("grouped", 24, 16), ("grouped", 256, 64)])
def test_moe_kernels_lower(layout, T, block_m):
    E, k, D, F = 16, 2, 128, 64
    x = jnp.zeros((T, D), jnp.bfloat16)
    top_e, top_w = jnp.zeros((T, k), jnp.int32), jnp.zeros((T, k), jnp.float32)
    w, w_down = jnp.zeros((E, D, F), jnp.bfloat16), jnp.zeros((E, F, D), jnp.bfloat16)
    valid = jnp.arange(T) < T - 1

    def fn(x, top_e, top_w, w, w_down, valid):
        return moe_ffn(x, top_e, top_w, w, w, w_down, valid=valid, _layout=layout, _block_m=block_m)

    assert _triton_calls(fn, x, top_e, top_w, w, w_down, valid) == 2  # gate|up, down


def test_delta_decode_kernel_lowers():
    W, H, Dk = 4, 2, 16
    q, g = jnp.zeros((W, H, Dk)), jnp.zeros((W, H))
    pool = jnp.zeros((8, H, Dk, Dk))

    def fn(q, g, pool, slots, live):
        return gated_delta_decode(q, q, q, g, g, pool, slots, live=live)

    assert _triton_calls(fn, q, g, pool, jnp.arange(W, dtype=jnp.int32), jnp.ones((W,), jnp.int32)) == 1


def test_delta_decode_from_projections_kernel_lowers():
    W, Hk, H, Dk, Kc, L, S = 4, 2, 4, 16, 4, 2, 8
    C = 2 * Hk * Dk + H * Dk
    qkv, ab = jnp.zeros((W, C), jnp.bfloat16), jnp.zeros((W, H), jnp.bfloat16)
    conv, conv_w, vec = jnp.zeros((L, S, Kc - 1, C)), jnp.zeros((C, Kc), jnp.bfloat16), jnp.zeros((H,))
    pool = jnp.zeros((L, S, H, Dk, Dk))

    def fn(qkv, ab, conv, conv_w, vec, pool, slots, live, layer):
        return gated_delta_decode_from_projections(
            qkv, ab, ab, conv, conv_w, vec, vec, pool, slots, layer=layer, n_k_heads=Hk, live=live
        )

    slots, live = jnp.arange(W, dtype=jnp.int32), jnp.ones((W,), jnp.int32)
    assert _triton_calls(fn, qkv, ab, conv, conv_w, vec, pool, slots, live, jnp.int32(1)) == 1


def test_route_kernel_lowers():
    logits, valid = jnp.zeros((4, 16), jnp.float32), jnp.ones((4,), bool)
    assert _triton_calls(lambda lg, v: route_and_count(lg, v, k=2, norm_topk_prob=True), logits, valid) == 1
