"""MoE routing of a round of few tokens as one Pallas (Triton) kernel: top-k experts, their
weights and the tokens counted per expert.

At batch 1 an MoE layer's routing is launch-bound: XLA runs `layers.route` (softmax, then
`lax.top_k`, then the renormalisation) and the expert-count scatter of `moe_mlp` as four or
five tiny kernels per layer, `top_k` among them as a sort of the row (the 35B-A3B's step on
an H200, docs/lab/hybrid-h200.md). Here one program does all of it without a sort: the
row's softmax (with `jax.nn.softmax`'s arithmetic), then k passes of max / first index of
the max / mask it out. Taking the first index among equal maxima breaks ties toward the
lower expert, as `lax.top_k` does. The passes run over the probabilities, not the logits,
although softmax is monotone: logits far below the row's max all underflow to probability 0,
and `lax.top_k` orders those ties by index, not by logit; the experts chosen among them have
weight 0 but are read by the expert kernels and counted.

One program loops over blocks of rows, so the per-expert counts of the whole round stay in
registers and are stored once: three outputs, one launch. Rows and experts are padded to
powers of two (Triton's block shapes) by masked loads; padded experts are never chosen.
The interpreter runs the same kernel on the CPU for the tests. Launch parameters and the
round width it serves (`kernel_choice.ROUTE_KERNEL_MAX_ROWS`) come from benchmarks/route_check.py
(figures in docs/lab/hybrid-h200.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllm.pallas_triton import compiler_params, plgpu, whole_block

# Rows per loop step (at most). The rows of a block are reduced along experts in parallel, so
# more rows mean fewer sequential reductions but more live registers: 16 rows of 256 experts
# fit 8 warps with room to spare, where 64 rows reach the 255-register limit (ptxas, sm_90a).
_BLOCK_ROWS = 16


def _kernel(
    logits_ref,  # [T, E] f32 router logits
    valid_ref,  # [T] i32 0 = a padding token: routed, not counted
    w_ref,  # [T, k] f32 routing weights, out
    e_ref,  # [T, k] i32 expert ids, best first, out
    count_ref,  # [E] i32 valid tokens routed to each expert, out
    *,
    n_rows: int,
    n_experts: int,
    k: int,
    norm_topk_prob: bool,
    block_rows: int,
):
    block_e, block_k = pl.next_power_of_2(n_experts), pl.next_power_of_2(k)
    cols = lax.broadcasted_iota(jnp.int32, (block_rows, block_e), 1)
    col_live = cols < n_experts
    slots = lax.broadcasted_iota(jnp.int32, (block_rows, block_k), 1)

    def row_block(b, counts):
        row0 = b * block_rows
        rows = row0 + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
        row_live = rows < n_rows
        # Rows past T load zeros (finite, so their unused arithmetic stays quiet).
        x = plgpu.load(
            logits_ref.at[pl.ds(row0, block_rows), pl.ds(0, block_e)], mask=row_live[:, None] & col_live, other=0
        )
        x = jnp.where(col_live, x, -jnp.inf)  # padded experts: probability 0
        valid = plgpu.load(valid_ref.at[pl.ds(row0, block_rows)], mask=row_live, other=0) > 0
        # `jax.nn.softmax`'s arithmetic, so that probabilities equal there are equal here.
        unnormalised = jnp.exp(x - jnp.max(x, axis=1)[:, None])
        probs = unnormalised / jnp.sum(unnormalised, axis=1)[:, None]
        # -1, below every probability, marks what no pass may pick: padded experts (lest a
        # row of underflowed zeros reach them) and the experts already chosen.
        probs = jnp.where(col_live, probs, -1.0)
        weights = jnp.zeros((block_rows, block_k), jnp.float32)
        ids = jnp.zeros((block_rows, block_k), jnp.int32)
        for j in range(k):
            best = jnp.max(probs, axis=1)  # [R]
            idx = jnp.min(jnp.where(probs == best[:, None], cols, block_e), axis=1)  # its first index
            # A NaN row matches nothing; its ids must still name real experts, since the expert
            # kernels index weights by them (one bad row would otherwise fault the whole round).
            idx = jnp.minimum(idx, n_experts - 1)
            hit = cols == idx[:, None]
            probs = jnp.where(hit, -1.0, probs)
            weights = jnp.where(slots == j, best[:, None], weights)
            ids = jnp.where(slots == j, idx[:, None], ids)
        if norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=1)[:, None]  # unused slots hold 0
        out_live = row_live[:, None] & (slots < k)
        plgpu.store(w_ref.at[pl.ds(row0, block_rows), pl.ds(0, block_k)], weights, mask=out_live)
        plgpu.store(e_ref.at[pl.ds(row0, block_rows), pl.ds(0, block_k)], ids, mask=out_live)
        chosen = (probs < 0) & col_live  # the -1s of real experts (no mask held through the passes)
        return counts + jnp.sum(jnp.where(chosen & valid[:, None], 1, 0), axis=0)

    n_blocks = pl.cdiv(n_rows, block_rows)
    counts = lax.fori_loop(0, n_blocks, row_block, jnp.zeros((block_e,), jnp.int32))
    plgpu.store(
        count_ref.at[pl.ds(0, block_e)], counts, mask=lax.broadcasted_iota(jnp.int32, (block_e,), 0) < n_experts
    )


@functools.partial(jax.jit, static_argnames=("k", "norm_topk_prob", "interpret", "_block_rows", "_num_warps"))
def route_and_count(
    router_logits: jax.Array,
    valid: jax.Array,
    *,
    k: int,
    norm_topk_prob: bool,
    interpret: bool = False,
    _block_rows: int | None = None,
    _num_warps: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`layers.route` and `moe_mlp`'s expert counts in one kernel, for rounds of few tokens.

    Args:
      router_logits: [T, E] float32 router logits.
      valid: [T] bool/int, False for padding tokens (routed, not counted).
      k: experts per token (k <= E).
      norm_topk_prob: renormalise the k weights to sum to 1 (else the softmax probabilities).
      interpret: run the kernel in the Pallas interpreter (CPU tests).
      _block_rows: rows per loop step, a power of two (default: T rounded up to one, at most 16).
      _num_warps: Triton warps (default: about 8 logits of a row block a thread, 1 to 8).

    Returns:
      ([T, k] float32 weights, [T, k] int32 expert ids in descending order of probability,
      [E] int32 valid tokens routed to each expert).
    """
    T, E = router_logits.shape
    if not 0 < k <= E:
        raise ValueError(f"route_and_count: k={k} experts per token of {E}")
    block_rows = _block_rows or min(pl.next_power_of_2(T), _BLOCK_ROWS)
    # One warp reduces a row of up to 512 logits with shuffles alone (no shared memory, no
    # barrier); wider blocks spread over more warps, ~8 logits a thread up to 8 warps: the
    # passes keep a few values per logit live (at 32 a thread 16 rows of 256 spilled, ptxas
    # sm_90a), and 8 warps beat 4 at 16 rows of 128 (route_check.py).
    num_warps = _num_warps or min(8, max(1, block_rows * pl.next_power_of_2(E) // 256))
    operands = [router_logits.astype(jnp.float32), valid.astype(jnp.int32)]
    outs = [
        jax.ShapeDtypeStruct((T, k), jnp.float32),
        jax.ShapeDtypeStruct((T, k), jnp.int32),
        jax.ShapeDtypeStruct((E,), jnp.int32),
    ]
    kernel = functools.partial(
        _kernel, n_rows=T, n_experts=E, k=k, norm_topk_prob=norm_topk_prob, block_rows=block_rows
    )
    top_w, top_e, expert_tokens = pl.pallas_call(
        kernel,
        grid=(1,),
        in_specs=[whole_block(a) for a in operands],
        out_specs=[whole_block(o) for o in outs],
        out_shape=outs,
        interpret=interpret,
        compiler_params=compiler_params(interpret=interpret, num_warps=num_warps, num_stages=1),
        name="moe_route",
    )(*operands)
    return top_w, top_e, expert_tokens
