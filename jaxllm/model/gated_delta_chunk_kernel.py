"""Prefill of the gated delta rule (the chunked WY / UT form) as Pallas (Triton) kernels.

`jaxllm.model.gated_delta.gated_delta_chunked` spells out the math; in its notation, with
chunks of L tokens, cumulative log decay c_i within a chunk and the chunk's initial state S0:

    (I + A) U = beta v,  (I + A) W = beta e^c k,   A_ij = beta_i e^{c_i - c_j} k_i . k_j (j < i)
    delta = U - W S0
    out_i = e^{c_i} q_i^T S0 + sum_{j <= i} e^{c_i - c_j} (q_i . k_j) delta_j
    S_end = e^{c_last} S0 + sum_j e^{c_last - c_j} k_j delta_j^T

The solve needs no state, so it runs for every chunk at once; only the last three lines are
sequential. Hence, by default, two kernels:

  1. `_wy_kernel`, one program per (segment, head, chunk): A from k k^T, the inverse of the
     unit lower-triangular I + A by forward substitution over its L rows (register-only: a
     row is picked with a masked sum, Triton has no dynamic register indexing), then U and
     W by two products, stored in float32 ([N, H, T, D], the layout kernel 2 reads).
  2. `_state_kernel`, one program per (segment, head, block of Dv columns): walks the chunks
     in order with its [Dk, BV] slice of S in registers (columns of S are independent in the
     rule, so splitting Dv is exact), writes each chunk's output and finally the state, into
     the state's own buffer (`input_output_aliases`).

`split=True` swaps kernel 2 for flash-linear-attention's own split: the sequential pass keeps
only delta = U - W S and the state update, storing each chunk's initial state and delta, and
a third kernel, parallel over (segment, head, chunk, Dv block), makes the outputs. Which form
is faster on a GPU is not measured yet (benchmarks/gated_delta_check.py compares them).

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


def _dot(a: jax.Array, b: jax.Array, precision: Precision, *, trans_a: bool = False,
         trans_b: bool = False) -> jax.Array:
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


def _chunk_states_kernel(
    k_ref,  # [N, Tp, H, Dk]
    u_ref,  # [N, H, Tp, Dv] f32
    w_ref,  # [N, H, Tp, Dk] f32
    cum_ref,  # [N, H, Tp] f32
    state_ref,  # [N, H, Dk, Dv] f32 (read)
    h_ref,  # [N, H, C, Dk, Dv] f32 out: the state before each chunk
    delta_ref,  # [N, H, Tp, Dv] f32 out: delta = U - W S0 of each chunk
    new_state_ref,  # [N, H, Dk, Dv] the same buffer as state_ref (written)
    *,
    chunk: int,
    n_chunks: int,
    block_v: int,
    qk_l2norm: bool,
    precision: Precision,
):
    """The split form's sequential pass: only the two products the next state needs."""
    n, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)

    def step(c, s):  # s [Dk, BV] f32, the state before chunk c
        rows = pl.ds(c * chunk, chunk)
        h_ref[n, h, c, :, cols] = s
        delta = u_ref[n, h, rows, cols] - _dot(w_ref[n, h, rows, :], s, precision)  # [L, BV]
        delta_ref[n, h, rows, cols] = delta
        k = k_ref[n, rows, h, :].astype(_F32)
        if qk_l2norm:
            k = _l2_normalize(k)
        cum = cum_ref[n, h, rows]
        last = cum_ref[n, h, c * chunk + chunk - 1]
        return jnp.exp(last) * s + _dot(jnp.exp(last - cum)[:, None] * k, delta, precision, trans_a=True)

    s = lax.fori_loop(0, n_chunks, step, state_ref[n, h, :, cols].astype(_F32))
    new_state_ref[n, h, :, cols] = s.astype(new_state_ref.dtype)


def _output_kernel(
    q_ref,  # [N, Tp, H, Dk]
    k_ref,  # [N, Tp, H, Dk]
    h_ref,  # [N, H, C, Dk, Dv] f32 state before each chunk
    delta_ref,  # [N, H, Tp, Dv] f32
    cum_ref,  # [N, H, Tp] f32
    out_ref,  # [N, Tp, H, Dv] out, q's dtype
    *,
    chunk: int,
    n_heads: int,
    block_v: int,
    qk_l2norm: bool,
    precision: Precision,
):
    """The split form's outputs, every (segment, head, chunk, Dv block) at once."""
    nh, c, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n, h = nh // n_heads, nh % n_heads
    rows, cols = pl.ds(c * chunk, chunk), pl.ds(j * block_v, block_v)
    q, k = q_ref[n, rows, h, :].astype(_F32), k_ref[n, rows, h, :].astype(_F32)  # [L, Dk]
    if qk_l2norm:
        q, k = _l2_normalize(q), _l2_normalize(k)
    q = q * (q_ref.shape[-1] ** -0.5)
    cum = cum_ref[n, h, rows]
    intra = _dot(q, k, precision, trans_b=True) * _decay(cum, strict=False)  # [L, L]
    out = _dot(jnp.exp(cum)[:, None] * q, h_ref[n, h, c, :, cols], precision)
    out = out + _dot(intra, delta_ref[n, h, rows, cols], precision)
    out_ref[n, rows, h, cols] = out.astype(out_ref.dtype)


def _call(kernel, grid: tuple[int, ...], ins: list, outs: list, *, name: str, interpret: bool, num_warps: int,
          num_stages: int = 1, aliases: dict[int, int] | None = None):
    """pallas_call with every operand passed whole (the kernels index them by program id)."""
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole_block(a) for a in ins],
        out_specs=[whole_block(o) for o in outs],
        out_shape=outs,
        input_output_aliases=aliases or {},
        interpret=interpret,
        compiler_params=compiler_params(interpret=interpret, num_warps=num_warps, num_stages=num_stages),
        name=name,
    )(*ins)


@functools.partial(
    jax.jit,
    static_argnames=(
        "chunk", "qk_l2norm", "split", "block_v", "out_block_v", "precision", "interpret", "num_warps", "num_stages",
        "wy_num_warps",
    ),
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
    split: bool = False,
    block_v: int | None = None,
    out_block_v: int | None = None,
    precision: Precision = _HIGHEST,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 1,
    wy_num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over N segments of T tokens: `gated_delta_chunked`'s arguments
    and results, computed by the kernels above.

    Args:
      q, k: [N, T, H, Dk] (k heads already repeated to H).
      v: [N, T, H, Dv].
      g: [N, T, H] log decay (<= 0); 0 at padding positions.
      beta: [N, T, H] write strength in (0, 1); 0 at padding positions.
      state: [N, H, Dk, Dv] float32 state before x[:, 0].
      chunk: L, tokens per chunk (a power of two >= 16 on the GPU). T is padded up to a
        multiple of it with g = 0, beta = 0, which leaves S unchanged.
      qk_l2norm: l2-normalise q and k first (Qwen3-Next does).
      split: False: the sequential kernel also writes the outputs (two kernels, nothing
        but U and W through memory). True: flash-linear-attention's split, the sequential
        pass keeps only the two products the state needs and stores each chunk's initial
        state and delta, and a third kernel, parallel over chunks, makes the outputs (a
        shorter critical path for more memory traffic, N x H x T/L x Dk x Dv floats).
      block_v: Dv columns per program of the sequential kernel, a power of two dividing Dv
        (default min(Dv, 32): more programs for the GPU at N = 1).
      out_block_v: Dv columns per program of the split form's output kernel (default
        min(Dv, 64)).
      precision: of the kernels' products: HIGHEST (Triton's "ieee", exact float32 FMAs)
        by default; `lax.DotAlgorithmPreset.TF32_TF32_F32_X3` runs them on tensor cores
        as three TF32 products, near float32 accuracy (GPU only, an experiment).
      interpret: run in the Pallas interpreter (CPU tests).
      num_warps, num_stages: Triton launch parameters of the sequential kernel (stages > 1
        let Triton prefetch the next chunk's loads inside the chunk loop); wy_num_warps of
        the parallel ones.

    Returns:
      out: [N, T, H, Dv] in q's dtype.
      new_state: [N, H, Dk, Dv] float32 after the last position. The kernel writes into the
        state's buffer: donate `state` to the enclosing jit to spare XLA a copy.
    """
    N, T, H, Dk = k.shape
    Dv = v.shape[-1]
    L = chunk
    block_v = block_v or min(Dv, 32)
    out_block_v = out_block_v or min(Dv, 64)
    for name, bv in (("block_v", block_v), ("out_block_v", out_block_v)):
        if Dv % bv:
            raise ValueError(f"{name}={bv} must divide Dv={Dv}")
    if not interpret and min(L, Dk, block_v, out_block_v) < MIN_DOT:
        raise ValueError(f"chunk, Dk and the Dv blocks must be >= {MIN_DOT} for Triton's dot")
    pad = -T % L
    C = (T + pad) // L
    Tp = T + pad
    time_pad = [(0, 0), (0, pad), (0, 0), (0, 0)]
    q, k, v = (jnp.pad(a, time_pad) if pad else a for a in (q, k, v))
    # Small [N, H, Tp] side inputs, made by XLA: head-major so a chunk's values are contiguous.
    gf = jnp.pad(g.astype(_F32), [(0, 0), (0, pad), (0, 0)])
    cum = jnp.cumsum(gf.reshape(N, C, L, H), axis=2).reshape(N, Tp, H).transpose(0, 2, 1)
    bf = jnp.pad(beta.astype(_F32), [(0, 0), (0, pad), (0, 0)]).transpose(0, 2, 1)
    state = state.astype(_F32)
    call = functools.partial(_call, interpret=interpret)
    common = dict(chunk=L, qk_l2norm=qk_l2norm, precision=precision)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, _F32)  # noqa: E731
    out_shape = jax.ShapeDtypeStruct((N, Tp, H, Dv), q.dtype)

    wy = functools.partial(_wy_kernel, **common)
    u, w = call(wy, (N, H, C), [k, v, cum, bf], [f32(N, H, Tp, Dv), f32(N, H, Tp, Dk)], name="gated_delta_wy",
                num_warps=wy_num_warps)
    seq = dict(common, n_chunks=C, block_v=block_v)
    seq_launch = dict(num_warps=num_warps, num_stages=num_stages)
    if not split:
        fused = functools.partial(_state_kernel, **seq)
        out, new_state = call(fused, (N, H, Dv // block_v), [q, k, u, w, cum, state], [out_shape, f32(N, H, Dk, Dv)],
                              name="gated_delta_state", aliases={5: 1}, **seq_launch)  # the state updated in place
        return out[:, :T], new_state
    states = functools.partial(_chunk_states_kernel, **seq)
    h_all, delta, new_state = call(states, (N, H, Dv // block_v), [k, u, w, cum, state],
                                   [f32(N, H, C, Dk, Dv), f32(N, H, Tp, Dv), f32(N, H, Dk, Dv)],
                                   name="gated_delta_chunk_states", aliases={4: 2}, **seq_launch)
    outputs = functools.partial(_output_kernel, **common, n_heads=H, block_v=out_block_v)
    (out,) = call(outputs, (N * H, C, Dv // out_block_v), [q, k, h_all, delta, cum], [out_shape],
                  name="gated_delta_output", num_warps=wy_num_warps)
    return out[:, :T], new_state
