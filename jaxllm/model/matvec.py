"""Decode-step matrix-vector products (x [M, K] @ w [K, N], small M) as a Pallas Triton kernel.

At decode every projection reads its whole weight matrix to multiply it by a handful of
rows, so a step is bound by HBM bandwidth. On an H200, a chain of the 8B decode products at
one row took 4.60 ms with XLA's GEMV and 4.28 ms with this kernel (benchmarks/matvec_check.py;
4.66 vs 4.37 ms on 2026-12-03). Inside the whole step it is still slower (5.18 vs 4.79 ms per
token on 2026-12-03, with x read in place: its split-K sums are extra kernels), so the
forward uses it only on request (`ModelConfig.decode_matmul = "pallas"`). It keeps
many small, coalesced, software-pipelined loads of w in flight on every SM:

  * grid (N block, K split): a program owns `block_n` output columns and one share of K;
    it walks that share `block_k` rows at a time, loading a [block_k, block_n] tile of the
    row-major w (contiguous along N) and the matching columns of x;
  * "dot" mode (the default) multiplies a 16-row tile of x (Triton's dot minimum; rows past M
    are masked loads, zeros, so x is never copied) and uses the tensor cores: the wasted rows
    cost no bandwidth, and Triton's software pipelining
    (num_stages) is built around dot operands. "fma" mode keeps a [block_k, block_n] float32
    accumulator per row of x and adds x[:, None] * w to it, summing over block_k once after
    the loop; on the H200 it measured a little slower than dot, even at M = 1;
  * when N alone gives too few blocks to fill 132 SMs (wo, qkv, down), K is split too:
    the splits write float32 partials [split_k, M, N] that one jnp sum adds up. With one
    split the kernel writes x.dtype directly (stores masked to [M, N]: no epilogue at all);
  * `partials` returns the splits' float32 products unsummed, for a consumer kernel that adds
    them as it loads (`jaxllm.model.decode_chain`), and
    `swiglu_input` takes gate|up partials as x, applying SwiGLU to each x tile it loads.

Measured (H200, bf16, per call in a chain of 32 distinct weights, glue included;
benchmarks/matvec_check.py): at M = 1 the defaults beat XLA's dot by 17% (qkv), 13% (wo),
6% (gate_up), 5% (down) and tie on lm_head: the step's GEMVs take 4.28 ms against 4.60
(3.5 TB/s against 3.3). At M = 8 and 64 XLA's own kernels are as fast or faster. Short
calls lose several us each to launch, ramp-up and tail: qkv and wo stay near 2.6-2.9 TB/s.

w is passed whole (not through a BlockSpec) and indexed with `pl.ds`, so blocks need not
divide its shape: the default blocks divide the real shapes where they can, and ragged
edges fall back to masked loads (zeros). The interpreter pads out-of-bounds reads with filler
values, so a missing mask fails the CPU tests.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllm.pallas_triton import MIN_DOT, compiler_params, plgpu, whole_block

_NUM_SMS = 132  # H200
_TARGET_PROGRAMS = 4 * _NUM_SMS  # measured: ~4+ small programs per SM beat fewer, larger ones



def _largest_pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n (1 if n is odd)."""
    return math.gcd(n, 1 << (cap.bit_length() - 1))


def _pick_block(size: int, cap: int, floor: int) -> int:
    """A power-of-two block in [floor, cap] dividing `size` if one does, else masked edges."""
    block = _largest_pow2_divisor(size, cap)
    if block >= floor:
        return block
    # No divisor in range: cover small sizes with one block, large ones with `cap` blocks.
    return max(floor, min(cap, pl.next_power_of_2(size)))


def _pick_split(n_k_blocks: int, n_n_blocks: int) -> int:
    """K splits that lift the grid to ~_TARGET_PROGRAMS, preferring divisors of the K blocks
    (every split then runs the same static trip count)."""
    wanted = min(n_k_blocks, -(-_TARGET_PROGRAMS // n_n_blocks))
    if wanted <= 1:
        return 1
    divisors = [d for d in range(wanted, min(2 * wanted, n_k_blocks) + 1) if n_k_blocks % d == 0]
    return divisors[0] if divisors else wanted


def default_config(M: int, K: int, N: int, itemsize: int) -> dict[str, int | bool]:
    """Blocks, splits and mode for x [M, K] @ w [K, N] (w elements of `itemsize` bytes).

    Measured on an H200 (bf16, Llama-3-8B shapes, M = 1 and 8; benchmarks/matvec_check.py):
    small tiles in many programs win. The tensor-core dot with block_k = 32 and
    block_n = 64 (4 KB of w per step, num_stages=3 keeping ~3 steps of loads in flight) was
    the best or within noise of it for every shape, both M, ahead of the fma mode and of
    16-64 KB tiles; block_n = 128 only helps where the N blocks alone fill the GPU many
    times over (lm_head). split_k then lifts the grid to ~4 programs per SM.
    """
    del M, itemsize  # the measured best did not depend on them (M <= 8, bf16)
    block_n = 128 if -(-N // 128) >= _TARGET_PROGRAMS else 64
    block_n = _pick_block(N, block_n, MIN_DOT)
    block_k = _pick_block(K, 32, MIN_DOT)
    split_k = _pick_split(-(-K // block_k), -(-N // block_n))
    return dict(block_n=block_n, block_k=block_k, split_k=split_k, use_dot=True)


def _swiglu_tile(x_ref, mp: int, gate_cols, up_cols, mask, dtype) -> jax.Array:
    """silu(gate) * up for a [mp, block] tile, from the float32 split partials [S, M, 2K] of a
    gate|up product: each half summed over the splits and rounded to `dtype` first, like the
    product XLA would have returned."""
    f32 = jnp.float32

    def summed(cols):
        # int32 split indices, not Python ints: the interpreter's masked load wants shaped ones.
        parts = [plgpu.load(x_ref.at[jnp.int32(i), pl.ds(0, mp), cols], mask=mask, other=0)
                 for i in range(x_ref.shape[0])]
        return functools.reduce(jnp.add, parts).astype(dtype).astype(f32)

    gate, up = summed(gate_cols), summed(up_cols)
    return (jax.nn.silu(gate) * up).astype(dtype)


def _matvec_kernel(
    x_ref,  # [M, K] whole x
    w_ref,  # [K, N] whole w
    o_ref,  # [split_k, M, N] whole output; this program stores its split's block
    *,
    K: int,
    N: int,
    M: int,
    block_k: int,
    block_n: int,
    k_blocks_per_split: int,
    n_k_blocks: int,
    use_dot: bool,
    swiglu_input: bool,
    precision: lax.Precision | None,
):
    n, s = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(n * block_n, block_n)
    first = s * k_blocks_per_split
    if n_k_blocks % k_blocks_per_split == 0:
        n_iter = k_blocks_per_split  # static: every split has the same share
    else:
        n_iter = jnp.clip(n_k_blocks - first, 0, k_blocks_per_split)  # the last splits get less
    ragged_k, ragged_n = K % block_k != 0, N % block_n != 0
    col_live = (n0 + lax.broadcasted_iota(jnp.int32, (block_n,), 0)) < N
    # Dot mode multiplies a [mp >= 16, block_k] tile of x: rows past M load as zeros (masked,
    # never read), so x needs no padded copy.
    mp = max(MIN_DOT, pl.next_power_of_2(M))
    x_row_live = lax.broadcasted_iota(jnp.int32, (mp,), 0) < M

    def row_live(k0):
        return (k0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)) < K

    def load_w(k0):
        """The [block_k, block_n] tile of w at rows k0.., zero past K and N."""
        rows, cols = pl.ds(k0, block_k), pl.ds(n0, block_n)
        if not (ragged_k or ragged_n):
            return w_ref[rows, cols]
        return plgpu.load(w_ref.at[rows, cols], mask=row_live(k0)[:, None] & col_live[None, :], other=0)

    def load_x(m, k0):
        """Row m of x (the [mp, block_k] tile of every row for m=None) at columns k0.., zero
        past K and M."""
        cols = pl.ds(k0, block_k)
        if m is None:
            mask = jnp.broadcast_to(x_row_live[:, None] & (row_live(k0)[None, :] if ragged_k else True), (mp, block_k))
            if swiglu_input:
                return _swiglu_tile(x_ref, mp, cols, pl.ds(K + k0, block_k), mask, w_ref.dtype)
            return plgpu.load(x_ref.at[pl.ds(0, mp), cols], mask=mask, other=0)
        # An int32 row, not a Python int: the interpreter's masked load wants shaped indices.
        at = (jnp.int32(m), cols)
        if not ragged_k:
            return x_ref[at]
        return plgpu.load(x_ref.at[at], mask=row_live(k0), other=0)

    def k_start(i):
        return pl.multiple_of((first + i) * block_k, block_k)

    if use_dot:

        def dot_body(i, acc):
            k0 = k_start(i)
            return acc + lax.dot_general(
                load_x(None, k0), load_w(k0), (((1,), (0,)), ((), ())),
                precision=precision, preferred_element_type=jnp.float32,
            )

        acc = lax.fori_loop(0, n_iter, dot_body, jnp.zeros((mp, block_n), jnp.float32))
        mask = x_row_live[:, None] & col_live[None, :]
        plgpu.store(o_ref.at[s, pl.ds(0, mp), pl.ds(n0, block_n)], acc.astype(o_ref.dtype), mask=mask)
        return

    def fma_body(i, accs):
        k0 = k_start(i)
        w = load_w(k0).astype(jnp.float32)
        return tuple(a + load_x(m, k0).astype(jnp.float32)[:, None] * w for m, a in enumerate(accs))

    init = tuple(jnp.zeros((block_k, block_n), jnp.float32) for _ in range(M))
    accs = lax.fori_loop(0, n_iter, fma_body, init)
    for m, acc in enumerate(accs):  # row by row: M need not be a power of two here
        plgpu.store(o_ref.at[s, jnp.int32(m), pl.ds(n0, block_n)], acc.sum(axis=0).astype(o_ref.dtype), mask=col_live)

@functools.partial(
    jax.jit,
    static_argnames=(
        "interpret", "block_n", "block_k", "split_k", "use_dot", "num_warps", "num_stages", "partials",
        "swiglu_input",
    ),
)
def matvec(
    x: jax.Array,
    w: jax.Array,
    *,
    interpret: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    use_dot: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    partials: bool = False,
    swiglu_input: bool = False,
) -> jax.Array:
    """x @ w for a few rows of x, accumulated in float32: the decode step's projections.

    Use it where `kernels_available(w.dtype)` (jaxllm.pallas_triton) and M == 1: on the H200 it beat XLA's dot at
    M = 1 but not at M = 8 or 64 (see benchmarks/matvec_check.py).

    Args:
      x: [M, K] activations (M small: the decode batch; any M works, M > 16 is no GEMV).
      w: [K, N] row-major weights (the params' "td,df->tf" layout), x's dtype.
      interpret: run the kernel in the Pallas interpreter (CPU tests).
      block_n, block_k: powers of two >= 16; w tiles are [block_k, block_n]. Need not divide
        N or K (edges are masked), but the defaults (`default_config`) do where they can.
      split_k: programs per N block, each summing a share of K (default: fill the GPU).
      use_dot: tensor-core dot on x padded to 16 rows (the default), else per-row float32
        FMA accumulators reduced after the loop (M accumulators: for M of 1 or 2).
      num_warps, num_stages: Triton launch parameters.
      partials: return the splits' float32 partial products [split_k, M, N] unsummed, for a
        consumer that sums them while loading (no separate sum kernel).
      swiglu_input: x is such partials [S, M, 2K] of a gate|up product, and the kernel
        multiplies silu(gate) * up (each half summed and rounded to w's dtype) by w [K, N].

    Returns:
      [M, N] in x.dtype (float32 partials [split_k, M, N] with `partials`; w's dtype with
      `swiglu_input`). float32 inputs use full-precision products (no TF32).
    """
    if swiglu_input:
        if use_dot is False:
            raise ValueError("swiglu_input runs in dot mode")
        (M, K), x_in, result_dtype = (x.shape[1], x.shape[2] // 2), x, w.dtype
    else:
        (M, K), x_in, result_dtype = x.shape, x.astype(w.dtype), x.dtype
    K_w, N = w.shape
    if K_w != K:
        raise ValueError(f"x is [M, {K}] but w is [{K_w}, N]")
    if jnp.dtype(w.dtype).itemsize == 1:
        raise ValueError(f"matvec takes float weights, got {w.dtype}")
    defaults = default_config(M, K, N, jnp.dtype(w.dtype).itemsize)
    block_n = block_n or defaults["block_n"]
    block_k = block_k or defaults["block_k"]
    use_dot = defaults["use_dot"] if use_dot is None else use_dot
    for name, b in (("block_n", block_n), ("block_k", block_k)):
        if b < MIN_DOT or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= {MIN_DOT}, got {b}")
    n_k_blocks = -(-K // block_k)
    n_n_blocks = -(-N // block_n)
    if split_k is None:
        split_k = _pick_split(n_k_blocks, n_n_blocks)
    split_k = max(1, min(split_k, n_k_blocks))
    k_blocks_per_split = -(-n_k_blocks // split_k)
    split_k = -(-n_k_blocks // k_blocks_per_split)  # no split left without work

    # float32 dots would otherwise run as TF32 on the GPU (~1e-3 relative error).
    precision = lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
    out_dtype = result_dtype if split_k == 1 and not partials else jnp.float32

    kernel = functools.partial(
        _matvec_kernel,
        K=K,
        N=N,
        M=M,
        block_k=block_k,
        block_n=block_n,
        k_blocks_per_split=k_blocks_per_split,
        n_k_blocks=n_k_blocks,
        use_dot=use_dot,
        swiglu_input=swiglu_input,
        precision=precision,
    )
    params = compiler_params(interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    out_shape = jax.ShapeDtypeStruct((split_k, M, N), out_dtype)
    out = pl.pallas_call(
        kernel,
        grid=(n_n_blocks, split_k),
        in_specs=[whole_block(x_in), whole_block(w)],
        # Stores are masked to [M, N]: one split's output is the result as it stands.
        out_specs=whole_block(out_shape),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=params,
        name="matvec",
    )(x_in, w)
    if partials:
        return out
    out = out[0] if split_k == 1 else out.sum(axis=0)
    return out.astype(result_dtype)
