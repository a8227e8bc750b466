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
  * it walks its pages a block at a time (page ids are read inside the kernel, clamped to the
    bucket), keeping a running max / sum / f32 accumulator; split 0 starts from the token's
    own fresh key and value, so every window's softmax has at least one live term;
  * a second small kernel merges the splits' partials (o, m, l) per query head and writes
    the output rows (zeros for windows that do not decode).

Everything around the two kernels is left to the caller's fusions: a decode step runs this
once per layer, and on a GPU each extra small kernel (padding q or the page ids, an XLA
epilogue) is a launch-bound sliver paid once per layer (docs/lab/2026-12.md).

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

from jaxllm.pallas_triton import MIN_DOT, compiler_params, plgpu, whole_block
from jaxllm.state import to_kv_dtype

_MASKED = -1e30  # finite: exp(_MASKED - m) is 0 without inf - inf = nan
_TARGET_PROGRAMS = 256  # ~2 programs per SM on an H200 (132 SMs): best for W = 8 (docs/lab/2026-12.md)
_TRASH_PAGE = 0  # page never handed out (see jaxllm.state): dead rows read it, an L2 hit


def default_splits(n_windows: int, n_kv_heads: int, n_ctx_pages: int, pages_per_block: int) -> int:
    """Splits of each window's pages so that the grid fills the GPU even with few windows
    (a power of two: the merge kernel loads all of a head's splits as one block)."""
    wanted = -(-_TARGET_PROGRAMS // (n_windows * n_kv_heads))
    return pl.next_power_of_2(max(1, min(wanted, -(-n_ctx_pages // pages_per_block))))


def _cdiv(a: jax.Array, b: int) -> jax.Array:
    return lax.div(a + (b - 1), b)


def _rotate(x1: jax.Array, x2: jax.Array, cos: jax.Array, sin: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """RoPE on the two halves of rows (HF `rotate_half` layout) in float32, rounded to `dtype`
    like `jaxllm.model.layers.apply_rope`."""
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    return (x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)


def _decode_kernel(
    layer_ref,  # [1] i32 layer of the stacked pool (0 for one layer's pool)
    len_ref,  # [W] i32 cached positions per window
    pages_ref,  # [W, n_ctx_pages] i32 page ids
    q_ref,  # [W, R, Dh] rows holding the queries from row q_off (H heads)
    k_new_ref,  # [W, R', Dh] rows holding the fresh keys from row k_off (K heads)
    v_new_ref,  # [W, R'', Dh] rows holding the fresh values from row v_off
    k_ref,  # [L * P * page_size, K * Dh] whole pool, every layer
    v_ref,
    *rest,  # (positions [W] i32, inv_freq [Dh/2] f32) with rope; o, m, l
    offsets: tuple[int, int, int],
    rope: bool,
    page_size: int,
    pages_per_block: int,
    n_splits: int,
    n_ctx_pages: int,
    group: int,
    head_dim: int,
    scale: float,
    precision: lax.Precision | None,
    grid_order: str,
    pool_rows: int,
    dtype: jnp.dtype,
):
    refs = list(rest)
    pos_ref, inv_freq_ref = (refs.pop(0), refs.pop(0)) if rope else (None, None)
    o_ref, m_ref, l_ref = refs  # o: [W, K, S, Gp, Dh] whole; m, l: [Gp] this program's
    w, h, s = (pl.program_id(grid_order.index(axis)) for axis in "whs")
    # Attended positions are clipped to the bucket, like the reference's gather.
    length = jnp.minimum(len_ref[w], n_ctx_pages * page_size)
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
    half = head_dim // 2
    # Both halves of every row apart: RoPE pairs them, so the dots run per half.
    lo, hi = pl.ds(h * head_dim, half), pl.ds(h * head_dim + half, half)
    gp = m_ref.shape[0]
    # `dtype` is the model's: an 8-bit pool is widened as each block loads, and the
    # fresh k and v are rounded through the pool's type, so this step attends to them as
    # later steps will read them from the cache (as the jnp reference does).
    narrow = k_ref.dtype != dtype
    # The dots' operand type. An 8-bit pool under a 16-bit model multiplies in float16: every
    # float8_e4m3fn value is a float16 value (one packed conversion on the GPU, where
    # bfloat16 took two through float32), and so is every bfloat16 query in float16's normal
    # range (queries are clipped to its largest value); probabilities round to float16.
    # Faster and more accurate than bfloat16 dots (docs/lab/2026-12.md).
    dot_dtype = jnp.float16 if narrow and jnp.dtype(dtype).itemsize == 2 else dtype

    def widen(x):
        return x.astype(dot_dtype) if narrow else x

    def through_pool(x):
        return widen(to_kv_dtype(x, k_ref.dtype)) if narrow else x

    q_off, k_off, v_off = offsets
    # The kv head's G query heads, padded to gp rows with zeros (masked, never read past H).
    head_live = lax.broadcasted_iota(jnp.int32, (gp,), 0) < group
    q_live = jnp.broadcast_to(head_live[:, None], (gp, half))
    q_rows = pl.ds(q_off + h * group, gp)

    def load(ref, rows, cols, mask=None):
        """Rows of the window's q/k/v."""
        return ref[w, rows, cols] if mask is None else plgpu.load(ref.at[w, rows, cols], mask=mask, other=0)

    q1 = load(q_ref, q_rows, pl.ds(0, half), q_live)
    q2 = load(q_ref, q_rows, pl.ds(half, half), q_live)
    fresh = pl.ds(k_off + h, 1)
    k1 = load(k_new_ref, fresh, pl.ds(0, half))  # [1, Dh/2]
    k2 = load(k_new_ref, fresh, pl.ds(half, half))
    if rope:
        angles = pos_ref[w].astype(jnp.float32) * inv_freq_ref[...][None, :]  # [1, Dh/2]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        q1, q2 = _rotate(q1, q2, cos, sin, dtype)
        k1, k2 = _rotate(k1, k2, cos, sin, dtype)
    else:
        q1, q2, k1, k2 = (a.astype(dtype) for a in (q1, q2, k1, k2))
    k1, k2 = through_pool(k1), through_pool(k2)
    dims = (((1,), (1,)), ((), ()))  # q @ k.T
    f16_max = float(jnp.finfo(jnp.float16).max)
    q1d, q2d = (
        (jnp.clip(x.astype(jnp.float32), -f16_max, f16_max).astype(dot_dtype) for x in (q1, q2))
        if dot_dtype != dtype
        else (q1, q2)
    )

    def body(b, carry):
        o, m, l = carry
        pos = (first_page + b * pages_per_block) * page_size + row  # cache positions of the block
        live = pos < length
        # A block may run past the bucket's last page: clamp the id (the rows are dead).
        page = pages_ref[w, jnp.minimum(lax.div(pos, page_size), n_ctx_pages - 1)]
        # Dead rows (past cached_len) read the trash page: cached, so no HBM traffic.
        page = jnp.where(live, page, _TRASH_PAGE)
        rows = layer_base + page * page_size + lax.rem(pos, page_size)
        logits = lax.dot_general(
            q1d, widen(k_ref[rows, lo]), dims, precision=precision, preferred_element_type=jnp.float32
        )
        logits += lax.dot_general(
            q2d, widen(k_ref[rows, hi]), dims, precision=precision, preferred_element_type=jnp.float32
        )
        logits = jnp.where(live[None, :], logits * scale, _MASKED)
        m_new = jnp.maximum(m, logits.max(axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])
        l_new = l * correction + p.sum(axis=1)
        # Zero dead values: a 0 weight times a non-finite stale value would still be nan.
        v = widen(v_ref[rows, pl.ds(h * head_dim, head_dim)])
        v = jnp.where(live[:, None], v, jnp.zeros_like(v))
        pv = lax.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        return o * correction[:, None] + pv, m_new, l_new

    # Split 0 starts from the fresh key (exact f32 products, no tensor-core rounding); the
    # others from an empty softmax.
    f32 = jnp.float32
    fresh_logit = (q1.astype(f32) * k1.astype(f32)).sum(axis=1) + (q2.astype(f32) * k2.astype(f32)).sum(axis=1)
    fresh_logit = fresh_logit * scale
    v_fresh = through_pool(load(v_new_ref, pl.ds(v_off + h, 1), pl.ds(0, head_dim)).astype(dtype))  # [1, Dh]
    v_fresh = v_fresh.astype(f32)
    first = s == 0
    init = (
        jnp.where(first, jnp.broadcast_to(v_fresh, (gp, head_dim)), 0.0),
        jnp.where(first, fresh_logit, _MASKED),
        jnp.where(first, 1.0, jnp.zeros((gp,), f32)),
    )
    o, m, l = lax.fori_loop(0, n_blocks, body, init)
    # Only the G real rows: the merge never reads the padding.
    o_live = jnp.broadcast_to(head_live[:, None], (gp, head_dim))
    plgpu.store(o_ref.at[w, h, s, pl.ds(0, gp), :], o, mask=o_live)
    m_ref[...] = m
    l_ref[...] = l


def _merge_kernel(
    live_ref,  # [W] i32: 0 = the window does not decode, its rows are zeros
    o_ref,  # [S, Dh] one query head's partials from every split
    m_ref,  # [S]
    l_ref,  # [S]
    out_ref,  # [Dh]
):
    m = m_ref[...]
    c = jnp.exp(m - m.max())  # the max is finite: split 0 holds the fresh key
    out = (o_ref[...] * c[:, None]).sum(axis=0) / (l_ref[...] * c).sum()
    out_ref[...] = jnp.where(live_ref[pl.program_id(0)] > 0, out, 0.0).astype(out_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("interpret", "_pages_per_block", "_n_splits", "_num_warps", "_num_stages", "_grid_order"),
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
    window_live: jax.Array | None = None,
    interpret: bool = False,
    _pages_per_block: int | None = None,
    _n_splits: int | None = None,
    _num_warps: int = 4,
    _num_stages: int = 2,
    _grid_order: str = "hsw",
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
      window_live: [W] bool/int, windows whose output rows are kept (default: all); the
        others come back as zeros.
      interpret: run the kernels in the Pallas interpreter (CPU tests).

    The underscored knobs are for tests and `benchmarks/paged_decode_check.py`'s sweeps, not
    part of the API:
      _pages_per_block: pages per loop step (default: 64 positions, at least 16 rows).
      _n_splits: programs per (window, kv head), rounded up to a power of two (default:
        enough to fill the GPU).
      _num_warps, _num_stages: Triton launch parameters of the main kernel.
      _grid_order: the grid's axes, fastest-varying first (the GPU launches blocks in x order):
        w = window, h = kv head, s = split. "hsw" runs a window's heads side by side, so
        the pool rows they share (K heads x Dh contiguous) are fetched together.

    Returns:
      [W, H, Dh] in q.dtype: softmax(q k / sqrt(Dh)) v over the live cache and the fresh key,
      accumulated in float32.
    """
    W, H, Dh = q.shape
    return _paged_decode(
        (q, k_new, v_new),
        (0, 0, 0),
        H,
        k_pages,
        v_pages,
        pages,
        cached_len,
        layer=layer,
        window_live=window_live,
        rope=None,
        interpret=interpret,
        pages_per_block=_pages_per_block,
        n_splits=_n_splits,
        num_warps=_num_warps,
        num_stages=_num_stages,
        grid_order=_grid_order,
    )


@functools.partial(jax.jit, static_argnames=("n_heads", "interpret"))
def paged_decode_attention_qkv(
    qkv: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    pages: jax.Array,
    cached_len: jax.Array,
    *,
    n_heads: int,
    layer: jax.Array | int | None = None,
    window_live: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`paged_decode_attention` straight from a fused projection's output, RoPE included.

    qkv: [W, H + 2K, Dh] the windows' queries, keys and values before RoPE (heads in that
    order, as `jaxllm.params` fuses them); positions: [W] i32 each window's position;
    inv_freq: [Dh/2] f32 RoPE frequencies. The kernel rotates q and the fresh k itself, so a
    decode layer runs no slicing or RoPE kernels before attention. Same result as rotating
    first and calling `paged_decode_attention`.
    """
    K = k_pages.shape[-2]
    return _paged_decode(
        (qkv, qkv, qkv),
        (0, n_heads, n_heads + K),
        n_heads,
        k_pages,
        v_pages,
        pages,
        cached_len,
        layer=layer,
        window_live=window_live,
        rope=(positions, inv_freq),
        interpret=interpret,
    )


def _paged_decode(
    qkv: tuple[jax.Array, jax.Array, jax.Array],
    offsets: tuple[int, int, int],
    H: int,
    k_pages: jax.Array,
    v_pages: jax.Array,
    pages: jax.Array,
    cached_len: jax.Array,
    *,
    layer: jax.Array | int | None,
    window_live: jax.Array | None,
    rope: tuple[jax.Array, jax.Array] | None,
    interpret: bool,
    pages_per_block: int | None = None,
    n_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    grid_order: str = "hsw",
) -> jax.Array:
    """Both kernels; q, k_new, v_new are rows of the three arrays from `offsets` (each
    [W, R, Dh])."""
    W, Dh = qkv[0].shape[-3], qkv[0].shape[-1]
    out_dtype = jnp.dtype(qkv[0].dtype)
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
        # 64 positions per loop step: 128 won alone over shuffled pages but lost inside the
        # engine's step over its mostly ordered pages (docs/lab/2026-12.md).
        pages_per_block = max(1, 64 // page_size)
    pages_per_block = max(pages_per_block, -(-MIN_DOT // page_size))
    if n_splits is None:
        n_splits = default_splits(W, K, n_ctx_pages, pages_per_block)
    n_splits = pl.next_power_of_2(n_splits)
    scale = Dh**-0.5
    # float32 dots would otherwise run as TF32 on the GPU (~1e-3 relative error).
    precision = lax.Precision.HIGHEST if out_dtype == jnp.float32 else None
    gp = max(MIN_DOT, pl.next_power_of_2(G))  # query rows per program (dots want >= 16)

    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    live = jnp.ones((W,), jnp.int32) if window_live is None else window_live.astype(jnp.int32)
    operands = [
        layer_arr,
        cached_len.astype(jnp.int32),
        pages.astype(jnp.int32),
        *qkv,
        k_pages.reshape(-1, K * Dh),
        v_pages.reshape(-1, K * Dh),
    ]
    if rope is not None:
        operands += [rope[0].astype(jnp.int32), rope[1].astype(jnp.float32)]
    kernel = functools.partial(
        _decode_kernel,
        offsets=offsets,
        rope=rope is not None,
        pool_rows=n_pool * page_size,
        page_size=page_size,
        pages_per_block=pages_per_block,
        n_splits=n_splits,
        n_ctx_pages=n_ctx_pages,
        group=G,
        head_dim=Dh,
        scale=scale,
        precision=precision,
        grid_order=grid_order,
        dtype=out_dtype,
    )
    sizes = dict(w=W, h=K, s=n_splits)

    def by_axes(index_map):
        """An index map of (w, h, s) over a grid laid out in `grid_order`."""
        return lambda *g: index_map(*(g[grid_order.index(axis)] for axis in "whs"))

    o_shape = jax.ShapeDtypeStruct((W, K, n_splits, gp, Dh), jnp.float32)
    o, m, l = pl.pallas_call(
        kernel,
        grid=tuple(sizes[axis] for axis in grid_order),
        in_specs=[whole_block(a) for a in operands],
        out_specs=[
            whole_block(o_shape),  # each program stores its G real rows (masked)
            pl.BlockSpec((None, None, None, gp), by_axes(lambda w, h, s: (w, h, s, 0))),
            pl.BlockSpec((None, None, None, gp), by_axes(lambda w, h, s: (w, h, s, 0))),
        ],
        out_shape=[
            o_shape,
            jax.ShapeDtypeStruct((W, K, n_splits, gp), jnp.float32),
            jax.ShapeDtypeStruct((W, K, n_splits, gp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=compiler_params(interpret=interpret, num_warps=num_warps, num_stages=num_stages),
        name="paged_decode_attention",
    )(*operands)

    # One program per query head: it reads only its own rows of the partials.
    out = pl.pallas_call(
        _merge_kernel,
        grid=(W, H),
        in_specs=[
            whole_block(live),
            pl.BlockSpec((None, None, n_splits, None, Dh), lambda w, q: (w, q // G, 0, q % G, 0)),
            pl.BlockSpec((None, None, n_splits, None), lambda w, q: (w, q // G, 0, q % G)),
            pl.BlockSpec((None, None, n_splits, None), lambda w, q: (w, q // G, 0, q % G)),
        ],
        out_specs=pl.BlockSpec((None, None, Dh), lambda w, q: (w, q, 0)),
        out_shape=jax.ShapeDtypeStruct((W, H, Dh), out_dtype),
        interpret=interpret,
        compiler_params=compiler_params(interpret=interpret, num_warps=1, num_stages=1),
        name="paged_decode_merge",
    )(live, o, m, l)
    return out
