"""Prefill of the gated delta rule (the chunked WY / UT form) as two Pallas (Triton) kernels.

`jaxllm.model.gated_delta.gated_delta_chunked` spells out the math; in its notation, with
chunks of L tokens, cumulative log decay c_i within a chunk and the chunk's initial state S0:

    (I + A) U = beta v,  (I + A) W = beta e^c k,   A_ij = beta_i e^{c_i - c_j} k_i . k_j (j < i)
    delta = U - W S0
    out_i = e^{c_i} q_i^T S0 + sum_{j <= i} e^{c_i - c_j} (q_i . k_j) delta_j
    S_end = e^{c_last} S0 + sum_j e^{c_last - c_j} k_j delta_j^T

The solve needs no state, so it runs for every chunk at once; only the last three lines are
sequential. Hence two kernels, as flash-linear-attention splits it:

  1. `_wy_kernel`, one program per (segment, head, chunk): A from k k^T, the inverse of the
     unit lower-triangular I + A by forward substitution over its L rows (register-only: a
     row is picked with a masked sum, Triton has no dynamic register indexing), then U and
     W by two products, stored in float32 ([N, H, T, D], the layout kernel 2 reads).
  2. `_state_kernel`, one program per (segment, head, block of Dv columns): walks the chunks
     in order with its [Dk, BV] slice of S in registers (columns of S are independent in the
     rule, so splitting Dv is exact), writes each chunk's output and finally the state, into
     the state's own buffer (`input_output_aliases`).

Every product asks for full float32 (`precision=HIGHEST`, which Pallas's Triton lowering
passes on as `input_precision="ieee"`): TF32's 10-bit mantissa would cost about 1e-3
relative error, compounding over chunks through S. Block sizes must be powers of two and at
least `MIN_DOT` on the GPU; the interpreter runs the same kernels on the CPU for the tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllm.pallas_triton import MIN_DOT, compiler_params, whole_block

_HIGHEST = lax.Precision.HIGHEST
_F32 = jnp.float32


Precision = lax.Precision | lax.DotAlgorithmPreset


def _dot(a: jax.Array, b: jax.Array, precision: Precision, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """a @ b (a^T / b^T on request), float32 accumulation."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)


def _l2_normalize(x: jax.Array) -> jax.Array:
    """Rows of x [L, D] over D, eps inside the root (gated_delta.l2_normalize)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + 1e-6)


def _decay(cum: jax.Array, *, strict: bool) -> jax.Array:
    """[L, L] e^{c_i - c_j} below (strict) or on and below the diagonal, 0 elsewhere; masked
    before the exp, where c_i - c_j > 0 could overflow."""
    L = cum.shape[0]
    i = lax.broadcasted_iota(jnp.int32, (L, L), 0)
    j = lax.broadcasted_iota(jnp.int32, (L, L), 1)
    keep = j < i if strict else j <= i
    return jnp.exp(jnp.where(keep, cum[:, None] - cum[None, :], -jnp.inf))


def _wy_kernel(
    k_ref,  # [N, Tp, H, Dk] keys (input dtype)
    v_ref,  # [N, Tp, H, Dv]
    cum_ref,  # [N, H, Tp] f32 cumulative log decay within each chunk
    beta_ref,  # [N, H, Tp] f32
    u_ref,  # [N, H, Tp, Dv] f32 out: U = (I + A)^-1 beta v
    w_ref,  # [N, H, Tp, Dk] f32 out: W = (I + A)^-1 beta e^c k
    *,
    chunk: int,
    qk_l2norm: bool,
    precision: Precision,
):
    n, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(c * chunk, chunk)
    k = k_ref[n, rows, h, :].astype(_F32)  # [L, Dk]
    if qk_l2norm:
        k = _l2_normalize(k)
    v = v_ref[n, rows, h, :].astype(_F32)  # [L, Dv]
    cum = cum_ref[n, h, rows]  # [L]
    beta = beta_ref[n, h, rows]  # [L]
    a = beta[:, None] * _dot(k, k, precision, trans_b=True) * _decay(cum, strict=True)  # [L, L] strictly lower

    # inv = (I + A)^-1 row by row: inv_i = e_i - sum_{j<i} A_ij inv_j. Rows >= i still hold
    # the identity, where A_i is 0, so the sum may run over all rows.
    r = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    eye = jnp.where(r == lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1), 1.0, 0.0).astype(_F32)

    def row(i, inv):
        a_i = jnp.sum(jnp.where(r == i, a, 0.0), axis=0)  # [L] A_i, indexed by j
        return jnp.where(r == i, inv - jnp.sum(a_i[:, None] * inv, axis=0)[None, :], inv)

    inv = lax.fori_loop(1, chunk, row, eye)  # row 0 is e_0
    u_ref[n, h, rows, :] = _dot(inv, beta[:, None] * v, precision)
    w_ref[n, h, rows, :] = _dot(inv, (beta * jnp.exp(cum))[:, None] * k, precision)


def _state_kernel(
    q_ref,  # [N, Tp, H, Dk]
    k_ref,  # [N, Tp, H, Dk]
    u_ref,  # [N, H, Tp, Dv] f32
    w_ref,  # [N, H, Tp, Dk] f32
    cum_ref,  # [N, H, Tp] f32
    state_ref,  # [N, H, Dk, Dv] f32 (read)
    out_ref,  # [N, Tp, H, Dv] out, q's dtype
    new_state_ref,  # [N, H, Dk, Dv] the same buffer as state_ref (written)
    *,
    chunk: int,
    n_chunks: int,
    block_v: int,
    qk_l2norm: bool,
    precision: Precision,
):
    n, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)
    scale = q_ref.shape[-1] ** -0.5

    def step(c, s):  # s [Dk, BV] f32, the state before chunk c
        rows = pl.ds(c * chunk, chunk)
        q, k = q_ref[n, rows, h, :].astype(_F32), k_ref[n, rows, h, :].astype(_F32)  # [L, Dk]
        if qk_l2norm:
            q, k = _l2_normalize(q), _l2_normalize(k)
        q = q * scale
        cum = cum_ref[n, h, rows]  # [L]
        last = cum_ref[n, h, c * chunk + chunk - 1]  # c_last, a scalar load (no register indexing)
        delta = u_ref[n, h, rows, cols] - _dot(w_ref[n, h, rows, :], s, precision)  # [L, BV]
        intra = _dot(q, k, precision, trans_b=True) * _decay(cum, strict=False)  # [L, L]
        out = _dot(jnp.exp(cum)[:, None] * q, s, precision) + _dot(intra, delta, precision)
        out_ref[n, rows, h, cols] = out.astype(out_ref.dtype)
        return jnp.exp(last) * s + _dot(jnp.exp(last - cum)[:, None] * k, delta, precision, trans_a=True)

    s = lax.fori_loop(0, n_chunks, step, state_ref[n, h, :, cols].astype(_F32))
    new_state_ref[n, h, :, cols] = s.astype(new_state_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("chunk", "qk_l2norm", "block_v", "precision", "interpret", "num_warps", "wy_num_warps")
)
def gated_delta_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    chunk: int = 64,
    qk_l2norm: bool = True,
    block_v: int | None = None,
    precision: Precision = _HIGHEST,
    interpret: bool = False,
    num_warps: int = 4,
    wy_num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over N segments of T tokens: `gated_delta_chunked`'s arguments
    and results, computed by the two kernels above.

    Args:
      q, k: [N, T, H, Dk] (k heads already repeated to H).
      v: [N, T, H, Dv].
      g: [N, T, H] log decay (<= 0); 0 at padding positions.
      beta: [N, T, H] write strength in (0, 1); 0 at padding positions.
      state: [N, H, Dk, Dv] float32 state before x[:, 0].
      chunk: L, tokens per chunk (a power of two >= 16 on the GPU). T is padded up to a
        multiple of it with g = 0, beta = 0, which leaves S unchanged.
      qk_l2norm: l2-normalise q and k first (Qwen3-Next does).
      block_v: Dv columns per program of the sequential kernel, a power of two dividing Dv
        (default min(Dv, 32): more programs for the GPU at N = 1).
      precision: of the kernels' products: HIGHEST (Triton's "ieee", exact float32 FMAs)
        by default; `lax.DotAlgorithmPreset.TF32_TF32_F32_X3` runs them on tensor cores
        as three TF32 products, near float32 accuracy (GPU only, an experiment).
      interpret: run in the Pallas interpreter (CPU tests).
      num_warps, wy_num_warps: Triton launch parameters of the state and WY kernels.

    Returns:
      out: [N, T, H, Dv] in q's dtype.
      new_state: [N, H, Dk, Dv] float32 after the last position. The kernel writes into the
        state's buffer: donate `state` to the enclosing jit to spare XLA a copy.
    """
    N, T, H, Dk = k.shape
    Dv = v.shape[-1]
    L = chunk
    block_v = block_v or min(Dv, 32)
    if Dv % block_v:
        raise ValueError(f"block_v={block_v} must divide Dv={Dv}")
    if not interpret and min(L, Dk, block_v) < MIN_DOT:
        raise ValueError(f"chunk, Dk and block_v must be >= {MIN_DOT} for Triton's dot")
    pad = -T % L
    C = (T + pad) // L
    Tp = T + pad
    time_pad = [(0, 0), (0, pad), (0, 0), (0, 0)]
    q, k, v = (jnp.pad(a, time_pad) if pad else a for a in (q, k, v))
    # Small [N, H, Tp] side inputs, made by XLA: head-major so a chunk's values are contiguous.
    gf = jnp.pad(g.astype(_F32), [(0, 0), (0, pad), (0, 0)])
    cum = jnp.cumsum(gf.reshape(N, C, L, H), axis=2).reshape(N, Tp, H).transpose(0, 2, 1)
    bf = jnp.pad(beta.astype(_F32), [(0, 0), (0, pad), (0, 0)]).transpose(0, 2, 1)

    params = functools.partial(compiler_params, interpret=interpret, num_stages=1)
    wy_in = [k, v, cum, bf]
    wy_out = [jax.ShapeDtypeStruct((N, H, Tp, Dv), _F32), jax.ShapeDtypeStruct((N, H, Tp, Dk), _F32)]
    u, w = pl.pallas_call(
        functools.partial(_wy_kernel, chunk=L, qk_l2norm=qk_l2norm, precision=precision),
        grid=(N, H, C),
        in_specs=[whole_block(a) for a in wy_in],
        out_specs=[whole_block(o) for o in wy_out],
        out_shape=wy_out,
        interpret=interpret,
        compiler_params=params(num_warps=wy_num_warps),
        name="gated_delta_wy",
    )(*wy_in)

    st_in = [q, k, u, w, cum, state.astype(_F32)]
    st_out = [jax.ShapeDtypeStruct((N, Tp, H, Dv), q.dtype), jax.ShapeDtypeStruct((N, H, Dk, Dv), _F32)]
    out, new_state = pl.pallas_call(
        functools.partial(_state_kernel, chunk=L, n_chunks=C, block_v=block_v, qk_l2norm=qk_l2norm,
                          precision=precision),
        grid=(N, H, Dv // block_v),
        in_specs=[whole_block(a) for a in st_in],
        out_specs=[whole_block(o) for o in st_out],
        out_shape=st_out,
        input_output_aliases={len(st_in) - 1: 1},  # the state is updated where it lies
        interpret=interpret,
        compiler_params=params(num_warps=num_warps),
        name="gated_delta_state",
    )(*st_in)
    return out[:, :T], new_state
