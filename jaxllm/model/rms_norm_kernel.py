"""The residual add and the RMSNorm after it as one Pallas (Triton) kernel, for decode rounds.

A decode round has a handful of rows, so every normalisation is a launch-bound sliver of
work. XLA runs each RMSNorm as two kernels (the mean-square reduction, then the scaling) and
the residual add in a third or inside one of them; at 32 layers x 2 norms that is ~200
launch-bound kernels per step of an 8B model (docs/lab/2026-12.md). Here one program per row does all of
it: x + delta (rounded to x's dtype, the residual stream), then HF's RMSNorm of that sum.

Rows are loaded whole (the model width padded to a power of two and masked), so any width
works; the interpreter runs the same kernel on the CPU for the tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllm.pallas_triton import compiler_params, plgpu, whole_block


def _kernel(x_ref, delta_ref, w_ref, sum_ref, out_ref, *, eps: float, width: int):
    t = pl.program_id(0)
    block = pl.next_power_of_2(width)
    live = lax.broadcasted_iota(jnp.int32, (block,), 0) < width
    cols = pl.ds(0, block)
    x = plgpu.load(x_ref.at[t, cols], mask=live, other=0)
    if delta_ref is not None:
        delta = plgpu.load(delta_ref.at[t, cols], mask=live, other=0)
        x = (x.astype(jnp.float32) + delta.astype(jnp.float32)).astype(x_ref.dtype)
        plgpu.store(sum_ref.at[t, cols], x, mask=live)
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt((x32 * x32).sum() / width + eps)
    w = plgpu.load(w_ref.at[cols], mask=live, other=0).astype(jnp.float32)
    out = w * normed.astype(x_ref.dtype).astype(jnp.float32)
    plgpu.store(out_ref.at[t, cols], out.astype(out_ref.dtype), mask=live)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(
    x: jax.Array, delta: jax.Array | None, weight: jax.Array, *, eps: float, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """(x + delta, rms_norm(x + delta) * weight) for x, delta [T, D]; without delta, (x, norm).

    Same arithmetic as `jaxllm.model.layers.rms_norm` (float32 statistics, the normalised
    row rounded to x's dtype before the weight) up to the order of the mean's summation.
    """
    T, D = x.shape
    out_dtype = jnp.result_type(weight.dtype, x.dtype)
    if delta is not None:
        delta = delta.astype(x.dtype)
    operands = [x] + ([] if delta is None else [delta]) + [weight]
    outs = ([] if delta is None else [jax.ShapeDtypeStruct((T, D), x.dtype)]) + [
        jax.ShapeDtypeStruct((T, D), out_dtype)
    ]

    def kernel(*refs):
        if delta is None:
            (x_ref, w_ref, out_ref), delta_ref, sum_ref = refs, None, None
        else:
            x_ref, delta_ref, w_ref, sum_ref, out_ref = refs
        _kernel(x_ref, delta_ref, w_ref, sum_ref, out_ref, eps=eps, width=D)

    results = pl.pallas_call(
        kernel,
        grid=(T,),
        in_specs=[whole_block(a) for a in operands],
        out_specs=[whole_block(o) for o in outs],
        out_shape=outs,
        interpret=interpret,
        compiler_params=compiler_params(interpret=interpret, num_warps=4, num_stages=1),
        name="add_rms_norm",
    )(*operands)
    return (x, results[0]) if delta is None else tuple(results)
