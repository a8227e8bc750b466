"""The routed experts' SwiGLU MLP as two Pallas (Triton) grouped-matmul kernels that read only
the weights of experts some token was routed to.

Why: on CUDA, XLA rewrites `jax.lax.ragged_dot` into a dense dot over every expert with the
unrouted ones masked, so a decode step of a 128-expert model reads every expert's weights
(all 60 GB of Qwen3-30B-A3B) and does E/k times the arithmetic. Here each program of the grid
owns one *block* of rows that all go to one expert and one tile of output columns; it loads
only that expert's weight tiles, and blocks past the ones in use exit at once. Decode is
memory-bound, so time follows the bytes of the experts actually routed to.

Two ways to lay rows into blocks, both with static shapes (the round's token count is static
under jit), chosen by `moe_layout`:

  * "pairs": each (token, expert) pair is its own block of one row, the block's expert being
    the pair's; no sort. Two pairs on one expert read its weights twice, so this pays only
    while few pairs share an expert (a round of one or a few tokens), where it saves the
    sort, scatters and gathers of the grouped layout.
  * "grouped" (fused-MoE style): pairs are sorted by expert and each expert's rows padded to
    a multiple of `block_m`; a block holds `block_m` rows of one expert, so each routed
    expert's weights are read once per column tile whatever the number of its tokens.

Kernel 1 computes silu(x @ w_gate[e]) * (x @ w_up[e]) for a block's rows (gate and up tiles
in one loop, SwiGLU in the epilogue, so neither product is written out); kernel 2 multiplies
that by w_down[e] and by each row's routing weight. The k weighted rows of a token are summed
in float32 by XLA afterwards.

The Pallas interpreter runs the same kernels on the CPU (tests); `moe_ffn_reference` is the
plain-jnp oracle they are checked against.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllm.pallas_triton import MIN_DOT, compiler_params, kernels_available, plgpu, whole_block


def moe_ffn_reference(
    x: jax.Array, top_e: jax.Array, top_w: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """sum_j top_w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = top_e[t, j], in float32
    with full-precision products: the oracle for the kernels. [T, D] float32."""
    hi = lax.Precision.HIGHEST
    xf = x.astype(jnp.float32)
    g = jnp.einsum("td,tkdf->tkf", xf, w_gate[top_e].astype(jnp.float32), precision=hi)
    u = jnp.einsum("td,tkdf->tkf", xf, w_up[top_e].astype(jnp.float32), precision=hi)
    h = jax.nn.silu(g) * u
    y = jnp.einsum("tkf,tkfd->tkd", h, w_down[top_e].astype(jnp.float32), precision=hi)
    return jnp.einsum("tkd,tk->td", y, top_w.astype(jnp.float32), precision=hi)


def _pow2_block(size: int, cap: int) -> int:
    """The largest power of two <= cap dividing `size`: the kernels' tiles divide D and F."""
    return math.gcd(size, 1 << (cap.bit_length() - 1))


def shapes_supported(d_model: int, ffn: int) -> bool:
    """Tiles are powers of two >= 16 (Triton's dot minimum) that divide D and F exactly."""
    return d_model % MIN_DOT == 0 and ffn % MIN_DOT == 0


def moe_kernel(dtype: jnp.dtype, d_model: int, ffn: int) -> str | None:
    """ "pallas" where the kernels compile (a GPU; float32 and half precision) and tile the
    shapes, else None: `jax.lax.ragged_dot` (the CPU, and shapes the tiles don't divide)."""
    return "pallas" if kernels_available(dtype) and shapes_supported(d_model, ffn) else None


# Rounds of at most this many tokens use the "pairs" layout (no sort; a shared expert is read
# once per pair), wider rounds the grouped one: on the H200 pairs won at 1 and 2 tokens, tied
# at 4 and lost from 8 on (docs/lab/moe-h200.md).
PAIRS_MAX_TOKENS = 2


def moe_layout(n_tokens: int) -> str:
    """ "pairs" or "grouped" for a round of `n_tokens` tokens (static under jit)."""
    return "pairs" if n_tokens <= PAIRS_MAX_TOKENS else "grouped"


def default_block_m(n_pairs: int, n_experts: int) -> int:
    """Rows per grouped block: 16 (Triton's dot minimum) while an expert gets few rows (decode),
    more where experts get many (prefill), so the padding stays a small share. From 64 rows an
    expert on average, blocks of 64 with `WIDE_BLOCK_TILES` (faster than 32 on the H200 at 2k
    tokens; 128 was slower: docs/lab/hybrid-h200.md)."""
    per_expert = n_pairs / n_experts
    return 16 if per_expert <= 16 else (32 if per_expert < 64 else 64)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How rows are laid into blocks (see the module docstring).

    rows: [R] int32, the token each kernel row reads (grouped layout), or None (pairs: block
      b's one row reads token b // row_div).
    block_expert: [n_blocks] int32, each block's expert.
    used: [1] int32, blocks in use (the rest exit at once).
    out_row: [T * k] int32, the kernel row holding each (token, slot) pair's output, or None
      (pairs: row b is pair b).
    """

    rows: jax.Array | None
    block_expert: jax.Array
    used: jax.Array
    out_row: jax.Array | None
    rows_per_block: int
    row_div: int
    n_blocks: int


def pair_blocks(top_e: jax.Array) -> Blocks:
    """One block per (token, slot) pair, in token-major order; nothing to sort."""
    T, k = top_e.shape
    flat = top_e.reshape(-1).astype(jnp.int32)
    return Blocks(None, flat, jnp.full((1,), T * k, jnp.int32), None, rows_per_block=1, row_div=k, n_blocks=T * k)


# Up to this many (token, expert) pairs (a 64-row decode round of top-8), `grouped_blocks` lays
# rows out by counting ([P, P] and [rows, P] comparisons); beyond, by sorting (prompt rounds,
# whose pairs would make those comparisons quadratic).
COUNTING_LAYOUT_MAX_PAIRS = 512


def grouped_blocks(top_e: jax.Array, n_experts: int, block_m: int, valid: jax.Array | None = None) -> Blocks:
    """Pairs sorted by expert, each expert's rows padded to a multiple of block_m.

    The number of blocks is bounded statically: sum_e ceil(n_e / block_m) <=
    (P + min(E, P) * (block_m - 1)) / block_m for P pairs; blocks past the ones in use are
    skipped by the kernels. Padding rows read token 0 and are never gathered back.

    Tokens with `valid` False ([T] bool; a round's padding rows, its idle decode slots) get no
    rows at all: routed like the others, they would read experts nobody needs (a 64-wide
    decode part with 16 live slots routed 48 idle rows). Their pairs' `out_row` is past the
    last kernel row (`n_blocks * block_m`).
    """
    T, k = top_e.shape
    P, E = T * k, n_experts
    flat = top_e.reshape(-1).astype(jnp.int32)
    if valid is not None:  # idle pairs go to a virtual expert E that gets no blocks
        flat = jnp.where(jnp.repeat(valid, k), flat, E)
    n_blocks = -(-(P + min(E, P) * (block_m - 1)) // block_m)
    layout = _rows_by_counting if P <= COUNTING_LAYOUT_MAX_PAIRS else _rows_by_sorting
    out_row, block_end = layout(flat, E, block_m, n_blocks)
    rows = on_kernel_rows(out_row, jnp.arange(P, dtype=jnp.int32) // k, n_blocks * block_m)
    block_end = block_end[:E]
    # "compare_all": one fusion. The default bisection is a while loop, and each trip of a
    # while loop on the GPU waits for its predicate on the host (docs/lab/moe-h200.md).
    block_expert = jnp.searchsorted(
        block_end, jnp.arange(n_blocks, dtype=jnp.int32), side="right", method="compare_all"
    )
    block_expert = jnp.minimum(block_expert, E - 1).astype(jnp.int32)
    return Blocks(
        rows,
        block_expert,
        block_end[-1:].astype(jnp.int32),
        out_row,
        rows_per_block=block_m,
        row_div=1,
        n_blocks=n_blocks,
    )


def _rows_by_sorting(flat: jax.Array, E: int, block_m: int, n_blocks: int) -> tuple[jax.Array, jax.Array]:
    """`grouped_blocks`' kernel row of each pair and the blocks' cumulative ends ([P],
    [E + 1]) by a stable sort of the pairs by expert (prompt rounds); idle pairs (expert E)
    land past every kernel row."""
    P = flat.shape[0]
    sizes = jnp.zeros((E + 1,), jnp.int32).at[flat].add(1)
    n_exp_blocks = ((sizes + block_m - 1) // block_m).at[E].set(0)
    block_end = jnp.cumsum(n_exp_blocks)
    first_row = (block_end - n_exp_blocks) * block_m  # [E + 1] each expert's first kernel row
    first_row = first_row.at[E].set(n_blocks * block_m)
    order = jnp.argsort(flat, stable=True)  # sorted position -> pair
    sorted_e = flat[order]
    group_start = jnp.cumsum(sizes) - sizes
    row_of_sorted = first_row[sorted_e] + jnp.arange(P, dtype=jnp.int32) - group_start[sorted_e]
    return jnp.zeros((P,), jnp.int32).at[order].set(row_of_sorted), block_end


def _rows_by_counting(flat: jax.Array, E: int, block_m: int, n_blocks: int) -> tuple[jax.Array, jax.Array]:
    """The same as `_rows_by_sorting` by comparisons instead of a sort and scatters, for
    decode rounds' few pairs: a pair's row is its expert's first row plus the number of
    earlier pairs on that expert (the stable sort's order). On the GPU the sort, scatters and
    gathers were a dozen launch-bound kernels a layer (docs/lab/server-rows-and-first-tokens.md);
    these are a few reductions."""
    P = flat.shape[0]
    pairs = jnp.arange(P, dtype=jnp.int32)
    same = (flat[:, None] == flat[None, :]) & (pairs[None, :] < pairs[:, None])
    rank = jnp.sum(same, axis=1, dtype=jnp.int32)  # [P] earlier pairs on the same expert
    experts = jnp.arange(E + 1, dtype=jnp.int32)
    sizes = jnp.sum(flat[None, :] == experts[:, None], axis=1, dtype=jnp.int32)  # [E + 1]
    n_exp_blocks = jnp.where(experts < E, (sizes + block_m - 1) // block_m, 0)
    block_end = jnp.sum(jnp.where(experts[None, :] <= experts[:, None], n_exp_blocks[None, :], 0), axis=1)
    first_row = (block_end - n_exp_blocks) * block_m  # [E + 1]
    return jnp.where(flat < E, first_row[flat] + rank, n_blocks * block_m), block_end


def on_kernel_rows(out_row: jax.Array, values: jax.Array, n_rows: int) -> jax.Array:
    """[n_rows]: each pair's value ([P]) on its kernel row `out_row`, 0 on rows no pair holds
    (and a pair past the last row drops out). A scatter, written as a comparison while the
    pairs are few (`COUNTING_LAYOUT_MAX_PAIRS`), where it fuses into one small reduction."""
    if out_row.shape[0] > COUNTING_LAYOUT_MAX_PAIRS:
        return jnp.zeros((n_rows,), values.dtype).at[out_row].set(values, mode="drop")
    kernel_rows = jnp.arange(n_rows, dtype=jnp.int32)
    return jnp.sum(jnp.where(kernel_rows[:, None] == out_row[None, :], values[None, :], 0), axis=1, dtype=values.dtype)


def _without_absent_refs(kernel, present: list[bool]):
    """The kernel called with None in place of each absent input (a pallas_call takes arrays
    only; e.g. the pairs layout has no row map)."""

    def call(*refs):
        it = iter(refs)
        inputs = [next(it) if here else None for here in present]
        return kernel(*inputs, *it)

    return call


def _row_tile(b, rows_per_block: int, row_div: int, bm: int, n_rows: int):
    """The first input row of block b, and which of its `bm`-row tile's rows are live."""
    row0 = (b * rows_per_block) // row_div if row_div > 1 else b * rows_per_block
    live = lax.broadcasted_iota(jnp.int32, (bm,), 0) < min(rows_per_block, n_rows)
    return row0, live


def _gate_up_kernel(
    be_ref,
    used_ref,
    rows_ref,
    x_ref,
    wg_ref,
    wu_ref,
    h_ref,
    *,
    D: int,
    block_k: int,
    block_n: int,
    rows_per_block: int,
    row_div: int,
    bm: int,
    precision,
):
    b, n = pl.program_id(0), pl.program_id(1)

    @pl.when(b < used_ref[0])
    def _():
        e = be_ref[b]
        n0 = pl.multiple_of(n * block_n, block_n)
        row0, live = _row_tile(b, rows_per_block, row_div, bm, x_ref.shape[0])
        masked = rows_per_block < bm
        # Grouped blocks read their tokens' rows of x in place (a gather load), not from a
        # copy of x laid out by block: that copy is a block-padded [rows, D] array written
        # and read once per column tile (2k-token rounds: ~130 MB a layer).
        tokens = None if rows_ref is None else rows_ref[pl.ds(row0, bm)]

        def body(i, accs):
            k0 = pl.multiple_of(i * block_k, block_k)
            cols = pl.ds(k0, block_k)
            if tokens is not None:
                xt = x_ref[tokens, cols]
            elif masked:
                xt = plgpu.load(x_ref.at[pl.ds(row0, bm), cols], mask=live[:, None], other=0)
            else:
                xt = x_ref[pl.ds(row0, bm), cols]
            wg = wg_ref[e, cols, pl.ds(n0, block_n)]
            wu = wu_ref[e, cols, pl.ds(n0, block_n)]
            dot = functools.partial(
                lax.dot_general,
                dimension_numbers=(((1,), (0,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            return accs[0] + dot(xt, wg), accs[1] + dot(xt, wu)

        zero = jnp.zeros((bm, block_n), jnp.float32)
        g, u = lax.fori_loop(0, D // block_k, body, (zero, zero))
        h = (jax.nn.silu(g) * u).astype(h_ref.dtype)
        out = h_ref.at[pl.ds(b * rows_per_block, bm), pl.ds(n0, block_n)]
        if masked:
            plgpu.store(out, h, mask=live[:, None])
        else:
            out[...] = h


def _down_kernel(
    be_ref,
    used_ref,
    h_ref,
    wd_ref,
    rw_ref,
    o_ref,
    *,
    F: int,
    block_k: int,
    block_n: int,
    rows_per_block: int,
    bm: int,
    precision,
):
    b, n = pl.program_id(0), pl.program_id(1)

    @pl.when(b < used_ref[0])
    def _():
        e = be_ref[b]
        n0 = pl.multiple_of(n * block_n, block_n)
        row0 = b * rows_per_block
        live = lax.broadcasted_iota(jnp.int32, (bm,), 0) < rows_per_block
        masked = rows_per_block < bm

        def body(i, acc):
            k0 = pl.multiple_of(i * block_k, block_k)
            cols = pl.ds(k0, block_k)
            if masked:
                ht = plgpu.load(h_ref.at[pl.ds(row0, bm), cols], mask=live[:, None], other=0)
            else:
                ht = h_ref[pl.ds(row0, bm), cols]
            wd = wd_ref[e, cols, pl.ds(n0, block_n)]
            return acc + lax.dot_general(
                ht, wd, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )

        acc = lax.fori_loop(0, F // block_k, body, jnp.zeros((bm, block_n), jnp.float32))
        if masked:
            rw = plgpu.load(rw_ref.at[pl.ds(row0, bm)], mask=live, other=0)
        else:
            rw = rw_ref[pl.ds(row0, bm)]
        y = (acc * rw[:, None]).astype(o_ref.dtype)
        out = o_ref.at[pl.ds(row0, bm), pl.ds(n0, block_n)]
        if masked:
            plgpu.store(out, y, mask=live[:, None])
        else:
            out[...] = y


# Launch defaults per layout, from one-knob-at-a-time sweeps on the H200 (docs/lab/moe-h200.md):
# the pairs layout (a few rows, 8-16 blocks) wants deeper pipelining and longer K steps; the
# grouped one (100+ blocks) wider gate/up column tiles. Splitting gate/up over D into float32
# partials (more programs for the pairs layout) measured slower at every split and was dropped.
DEFAULTS: dict[str, dict[str, int]] = {
    "pairs": dict(gu_block_k=128, gu_block_n=32, dn_block_k=64, dn_block_n=64, num_warps=4, num_stages=4),
    "grouped": dict(gu_block_k=64, gu_block_n=128, dn_block_k=64, dn_block_n=64, num_warps=4, num_stages=3),
}
# Grouped blocks of 64 rows (prompt rounds, `default_block_m`) have twice the work per program:
# 8 warps and 128-wide down tiles, the best of `moe_check.py --sweep-set prefill` on both
# 30B-A3B and 35B-A3B shapes (docs/lab/hybrid-h200.md).
WIDE_BLOCK_M = 64
WIDE_BLOCK_TILES: dict[str, int] = dict(dn_block_n=128, num_warps=8)


@functools.partial(jax.jit, static_argnames=("interpret", "_layout", "_block_m", "_config"))
def moe_ffn(
    x: jax.Array,
    top_e: jax.Array,
    top_w: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    valid: jax.Array | None = None,
    interpret: bool = False,
    _layout: str | None = None,
    _block_m: int | None = None,
    _config: tuple[tuple[str, int], ...] = (),
) -> jax.Array:
    """The routed experts' SwiGLU MLP of each token, weighted and summed over its k experts.

    Args:
      x: [T, D] activations.
      top_e: [T, k] int32 experts of each token.
      top_w: [T, k] routing weights (already normalised as the model wants).
      w_gate, w_up: [E, D, F]; w_down: [E, F, D], x's dtype.
      valid: [T] bool, tokens that count (default all); the grouped layout computes nothing
        for the others, whose output rows are zeros.
      interpret: run the kernels in the Pallas interpreter (CPU tests).

    The underscored knobs are for tests and `benchmarks/moe_check.py`'s sweeps, not part of
    the API:
      _layout: "pairs" or "grouped" (default: `moe_layout(T)`).
      _block_m: rows per grouped block (default: `default_block_m`).
      _config: launch overrides as (name, value) pairs: gu_block_k, gu_block_n, dn_block_k,
        dn_block_n (tile sizes; powers of two >= 16 dividing D or F), num_warps, num_stages.

    Returns:
      [T, D] in x's dtype; each token's k rows summed in float32.
    """
    T, D = x.shape
    E, _, F = w_gate.shape
    k = top_e.shape[1]
    if not shapes_supported(D, F):
        raise ValueError(f"D={D} and F={F} must be multiples of {MIN_DOT}")
    layout = _layout or moe_layout(T)
    if layout not in DEFAULTS:
        raise ValueError(f"layout must be pairs or grouped, got {layout!r}")
    cfg = dict(DEFAULTS[layout])
    if set(dict(_config)) - set(cfg):
        raise ValueError(f"unknown launch settings {sorted(set(dict(_config)) - set(cfg))}")
    bm = MIN_DOT if layout == "pairs" else (_block_m or default_block_m(T * k, E))
    if layout == "grouped" and bm == WIDE_BLOCK_M:
        cfg.update(WIDE_BLOCK_TILES)
    cfg.update(dict(_config))
    if layout == "pairs":
        blocks = pair_blocks(top_e)
        row_w = top_w.reshape(-1).astype(jnp.float32)
    else:  # grouped
        blocks = grouped_blocks(top_e, E, bm, valid)
        row_w = on_kernel_rows(blocks.out_row, top_w.reshape(-1).astype(jnp.float32), blocks.n_blocks * bm)
    n_rows = blocks.n_blocks * blocks.rows_per_block
    gu_bk, gu_bn = _pow2_block(D, cfg["gu_block_k"]), _pow2_block(F, cfg["gu_block_n"])
    dn_bk, dn_bn = _pow2_block(F, cfg["dn_block_k"]), _pow2_block(D, cfg["dn_block_n"])
    if min(gu_bk, gu_bn, dn_bk, dn_bn) < MIN_DOT:
        raise ValueError(f"no tile >= {MIN_DOT} divides D={D}, F={F}")
    # float32 dots would otherwise run as TF32 on the GPU (~1e-3 relative error).
    precision = lax.Precision.HIGHEST if w_gate.dtype == jnp.float32 else None
    params = compiler_params(interpret=interpret, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    common = dict(rows_per_block=blocks.rows_per_block, bm=bm, precision=precision)

    h_shape = jax.ShapeDtypeStruct((n_rows, F), w_gate.dtype)
    gate_up_args = (blocks.block_expert, blocks.used, blocks.rows, x.astype(w_gate.dtype), w_gate, w_up)
    h = pl.pallas_call(
        _without_absent_refs(
            functools.partial(_gate_up_kernel, D=D, block_k=gu_bk, block_n=gu_bn, row_div=blocks.row_div, **common),
            present=[a is not None for a in gate_up_args],
        ),
        grid=(blocks.n_blocks, F // gu_bn),
        in_specs=[whole_block(a) for a in gate_up_args if a is not None],
        out_specs=whole_block(h_shape),
        out_shape=h_shape,
        interpret=interpret,
        compiler_params=params,
        name="moe_gate_up",
    )(*(a for a in gate_up_args if a is not None))

    o_shape = jax.ShapeDtypeStruct((n_rows, D), x.dtype)
    args = (blocks.block_expert, blocks.used, h, w_down, row_w)
    y = pl.pallas_call(
        functools.partial(_down_kernel, F=F, block_k=dn_bk, block_n=dn_bn, **common),
        grid=(blocks.n_blocks, D // dn_bn),
        in_specs=[whole_block(a) for a in args],
        out_specs=whole_block(o_shape),
        out_shape=o_shape,
        interpret=interpret,
        compiler_params=params,
        name="moe_down",
    )(*args)
    if blocks.out_row is not None:
        y = y[jnp.minimum(blocks.out_row, n_rows - 1)]  # [T * k, D] in (token, slot) order
    y = y.reshape(T, k, D).astype(jnp.float32)
    if valid is not None:  # an idle token's rows: zeros (grouped: not whatever lies past the kernel's rows)
        y = jnp.where(valid[:, None, None], y, 0)
    return y.sum(axis=1).astype(x.dtype)
