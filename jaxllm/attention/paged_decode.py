"""Paged decode attention as a Pallas (Triton) kernel: flash-decoding over our page layout.

Each decoding slot contributes one query token. Its heads attend to the slot's cached
positions [0, cached_len) plus the token's own fresh key/value (the forward writes this
round's K/V into the pages only after the last layer). The reference (`paged_attention`)
first gathers every window's `n_ctx_pages` pages into a dense copy and then runs einsums over
the whole bucket; that copy, and the work on positions past `cached_len`, is what makes decode
slow. This kernel instead reads each needed K/V page once, straight from the pool:

  * grid (window, kv head, split): a program owns the G = H / K query heads of one kv head
    (padded to >= 16 rows so the dots map to tensor cores) and one share of the window's
    *live* pages, so a short sequence in a long bucket launches programs that exit at once;
  * it walks its pages a block at a time (page ids are read inside the kernel), keeping a
    running max / sum / f32 accumulator, and writes the partial (o, m, l);
  * a small jnp epilogue merges the splits and the fresh key.

The pool layout is [P, page_size, K, Dh]; the kernel sees it as rows [P * page_size, K * Dh]
(a free reshape), so one kv head of one position is `Dh` contiguous elements. It also takes
the whole [L, ...] stack plus a layer index, which a layer loop should pass: a slice of the
stack as a kernel operand would be copied (the whole layer's pool) before every call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllm.pallas_triton import MIN_DOT, compiler_params, whole_block

_MASKED = -1e30  # finite: exp(_MASKED - m) is 0 without inf - inf = nan
_TARGET_PROGRAMS = 256  # ~2 programs per SM on an H200 (132 SMs): measured best for W = 8
_TRASH_PAGE = 0  # page never handed out (see jaxllm.state): dead rows read it, an L2 hit



def default_splits(n_windows: int, n_kv_heads: int, n_ctx_pages: int, pages_per_block: int) -> int:
    """Splits of each window's pages so that the grid fills the GPU even with few windows."""
    wanted = -(-_TARGET_PROGRAMS // (n_windows * n_kv_heads))
    return max(1, min(wanted, -(-n_ctx_pages // pages_per_block)))


def _cdiv(a: jax.Array, b: int) -> jax.Array:
    return lax.div(a + (b - 1), b)


def _decode_kernel(
    layer_ref,  # [1] i32 layer of the stacked pool (0 for one layer's pool)
    len_ref,  # [W] i32 live cached positions per window
    pages_ref,  # [W, n_pad] i32 page ids (padded with the trash page)
    q_ref,  # [Gp, Dh] this program's query heads
    k_ref,  # [L * P * page_size, K * Dh] whole pool, every layer
    v_ref,
    o_ref,  # [Gp, Dh] f32 partial output (unnormalised)
    m_ref,  # [Gp] f32 running max
    l_ref,  # [Gp] f32 softmax denominator
    *,
    page_size: int,
    pages_per_block: int,
    n_splits: int,
    head_dim: int,
    scale: float,
    precision: lax.Precision | None,
    grid_order: str,
    pool_rows: int,
):
    w, h, s = (pl.program_id(grid_order.index(axis)) for axis in "whs")
    length = len_ref[w]
    # lax.div, not //: everything is non-negative, and floor division lowers to more ops.
    n_pages = _cdiv(length, page_size)
    # This split's share of the live pages, in whole blocks; later splits may get none.
    per_split = _cdiv(_cdiv(n_pages, n_splits), pages_per_block) * pages_per_block
    first_page = s * per_split
    my_pages = jnp.minimum(jnp.maximum(n_pages - first_page, 0), per_split)
    n_blocks = _cdiv(my_pages, pages_per_block)

    block_rows = pages_per_block * page_size
    layer_base = layer_ref[0] * pool_rows  # first row of this layer's pool
    row = lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    cols = pl.ds(h * head_dim, head_dim)
    q = q_ref[...]
    dims = (((1,), (1,)), ((), ()))  # q @ k.T

    def body(b, carry):
        o, m, l = carry
        pos = (first_page + b * pages_per_block) * page_size + row  # cache positions of the block
        live = pos < length
        page = pages_ref[w, lax.div(pos, page_size)]
        # Dead rows (past cached_len) read the trash page: cached, so no HBM traffic.
        page = jnp.where(live, page, _TRASH_PAGE)
        rows = layer_base + page * page_size + lax.rem(pos, page_size)
        k = k_ref[rows, cols]  # [block_rows, Dh]
        v = v_ref[rows, cols]
        logits = lax.dot_general(q, k, dims, precision=precision, preferred_element_type=jnp.float32)
        logits = jnp.where(live[None, :], logits * scale, _MASKED)
        m_new = jnp.maximum(m, logits.max(axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])
        l_new = l * correction + p.sum(axis=1)
        # Zero dead values: a 0 weight times a non-finite stale value would still be nan.
        v = jnp.where(live[:, None], v, jnp.zeros_like(v))
        pv = lax.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        return o * correction[:, None] + pv, m_new, l_new

    gp = q.shape[0]
    init = (
        jnp.zeros((gp, head_dim), jnp.float32),
        jnp.full((gp,), _MASKED, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
    )
    o, m, l = lax.fori_loop(0, n_blocks, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _merge(
    o: jax.Array, m: jax.Array, l: jax.Array, q: jax.Array, k_new: jax.Array, v_new: jax.Array, scale: float
) -> jax.Array:
    """Combines the splits' partials ([W, K, S, G, ...]) with each query's fresh key."""
    W, K, G, _ = q.shape
    fresh = jnp.einsum("wkgd,wkd->wkg", q, k_new, preferred_element_type=jnp.float32,
                       precision=lax.Precision.HIGHEST) * scale
    m_all = jnp.maximum(m.max(axis=2), fresh)  # [W, K, G]; finite thanks to the fresh key
    c = jnp.exp(m - m_all[:, :, None])  # [W, K, S, G]
    c_fresh = jnp.exp(fresh - m_all)
    denom = (l * c).sum(axis=2) + c_fresh
    numer = (o * c[..., None]).sum(axis=2) + c_fresh[..., None] * v_new[:, :, None, :].astype(jnp.float32)
    return numer / denom[..., None]


@functools.partial(
    jax.jit, static_argnames=("interpret", "pages_per_block", "n_splits", "num_warps", "num_stages", "grid_order"),
)
def paged_decode_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    pages: jax.Array,
    cached_len: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    interpret: bool = False,
    pages_per_block: int | None = None,
    n_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    grid_order: str = "hsw",
) -> jax.Array:
    """Decode attention of one query per window over its slot's pages plus its fresh key.

    Args:
      q: [W, H, Dh] one query per window (H = K * G heads).
      k_new, v_new: [W, K, Dh] the window's own new key and value (not yet in the cache).
      k_pages, v_pages: [P, page_size, K, Dh] one layer's pool, or [L, P, page_size, K, Dh]
        every layer's with `layer` picking one. Pass the stack inside a layer loop: slicing
        it (`kv.k[i]`) to feed the kernel makes XLA copy the layer's whole pool first.
      pages: [W, n_ctx_pages] i32 page ids of each window's slot.
      cached_len: [W] i32; cache positions [0, cached_len) are attended (0 allowed; clipped
        to the bucket, n_ctx_pages * page_size, like the reference).
      layer: i32 scalar, the layer of a stacked pool (required with one, else unused).
      interpret: run the kernel in the Pallas interpreter (CPU tests).
      pages_per_block: pages per loop step (default: 64 positions, at least 16 rows).
      n_splits: programs per (window, kv head) (default: enough to fill the GPU).
      num_warps, num_stages: Triton launch parameters.
      grid_order: the grid's axes, fastest-varying first (the GPU launches blocks in x order):
        w = window, h = kv head, s = split. "hsw" runs a window's heads side by side, so
        the pool rows they share (K heads x Dh contiguous) are fetched together.

    Returns:
      [W, H, Dh] in q.dtype: softmax(q k / sqrt(Dh)) v over the live cache and the fresh key,
      accumulated in float32.
    """
    W, H, Dh = q.shape
    if k_pages.ndim == 5:
        if layer is None:
            raise ValueError("a stacked [L, P, page, K, Dh] pool needs `layer`")
    else:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    _, n_pool, page_size, K, _ = k_pages.shape
    n_ctx_pages = pages.shape[1]
    G = H // K
    if sorted(grid_order) != sorted("whs"):
        raise ValueError(f"grid_order must order 'w', 'h' and 's', got {grid_order!r}")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if pages_per_block is None:
        pages_per_block = max(1, 64 // page_size)
    pages_per_block = max(pages_per_block, -(-MIN_DOT // page_size))
    if n_splits is None:
        n_splits = default_splits(W, K, n_ctx_pages, pages_per_block)
    scale = Dh**-0.5
    # float32 dots would otherwise run as TF32 on the GPU (~1e-3 relative error).
    precision = lax.Precision.HIGHEST if k_pages.dtype == jnp.float32 else None

    # Query heads of one kv head, padded to a power of two >= 16 rows (zeros, sliced off).
    gp = max(MIN_DOT, pl.next_power_of_2(G))
    qg = q.reshape(W, K, G, Dh).astype(k_pages.dtype)
    q_pad = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - G), (0, 0)))
    # Blocks may run up to pages_per_block - 1 pages past the live range: pad the ids so
    # those reads stay in bounds (their rows are masked and read the trash page anyway).
    pages_pad = jnp.pad(pages.astype(jnp.int32), ((0, 0), (0, pages_per_block)), constant_values=_TRASH_PAGE)
    length = jnp.minimum(cached_len.astype(jnp.int32), n_ctx_pages * page_size)
    k_rows = k_pages.reshape(-1, K * Dh)
    v_rows = v_pages.reshape(-1, K * Dh)

    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    kernel = functools.partial(
        _decode_kernel,
        pool_rows=n_pool * page_size,
        page_size=page_size,
        pages_per_block=pages_per_block,
        n_splits=n_splits,
        head_dim=Dh,
        scale=scale,
        precision=precision,
        grid_order=grid_order,
    )
    sizes = dict(w=W, h=K, s=n_splits)

    def by_axes(index_map):
        """An index map of (w, h, s) over a grid laid out in `grid_order`."""
        return lambda *g: index_map(*(g[grid_order.index(axis)] for axis in "whs"))

    params = compiler_params(interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    o, m, l = pl.pallas_call(
        kernel,
        grid=tuple(sizes[axis] for axis in grid_order),
        in_specs=[
            whole_block(layer_arr),
            whole_block(length),
            whole_block(pages_pad),
            pl.BlockSpec((None, None, gp, Dh), by_axes(lambda w, h, s: (w, h, 0, 0))),
            whole_block(k_rows),
            whole_block(v_rows),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, Dh), by_axes(lambda w, h, s: (w, h, s, 0, 0))),
            pl.BlockSpec((None, None, None, gp), by_axes(lambda w, h, s: (w, h, s, 0))),
            pl.BlockSpec((None, None, None, gp), by_axes(lambda w, h, s: (w, h, s, 0))),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((W, K, n_splits, gp, Dh), jnp.float32),
            jax.ShapeDtypeStruct((W, K, n_splits, gp), jnp.float32),
            jax.ShapeDtypeStruct((W, K, n_splits, gp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=params,
        name="paged_decode_attention",
    )(layer_arr, length, pages_pad, q_pad, k_rows, v_rows)

    out = _merge(o[..., :G, :], m[..., :G], l[..., :G], qg.astype(jnp.float32),
                 k_new.astype(jnp.float32), v_new, scale)
    return out.reshape(W, H, Dh).astype(q.dtype)
