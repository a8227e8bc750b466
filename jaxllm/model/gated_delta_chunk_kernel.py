"""The chunk-to-chunk state pass of the chunked gated delta rule as one Pallas (Triton) kernel.

`jaxllm.model.gated_delta.gated_delta_chunked` computes a prompt's per-chunk quantities for
all chunks at once (batched products and one triangular solve); what is left is sequential:
carry the state S [Dk, Dv] through the C = T / L chunks. As XLA ops that pass is four small
products and a few elementwise kernels per chunk, ~130 launches at 2k tokens, each too small
to fill the GPU: the launches, not the arithmetic, set its time. Here one program owns one
(segment, head, block of Dv columns), keeps its [Dk, BV] block of S in float32 registers and
walks the chunks in order, per chunk c (its rows i, cumulative log decay c_i, c_last the
chunk's last):

    delta = U_c - W_c S                                              # [L, BV]
    out_c = e^{c_i} (Q_c S) + intra_c delta                          # [L, BV]
    S     = e^{c_last} S + K_c^T (e^{c_last - c_i} delta)

writing each chunk's output and finally S. Columns of S are independent in the rule (every
product contracts over Dk or over the chunk's rows, never over Dv), so splitting Dv is exact.
The decays scale the [L, BV] products instead of the [L, Dk] q and k tiles, which then go
from memory into the dots as they lie, and XLA need not write decayed copies of q and k.

Products run on the tensor cores at the caller's precision (DEFAULT: TF32, as XLA's path asks
on GPUs; HIGHEST: exact float32 on the FMA units). A kernel doing the whole chunked rule with
float32 FMA products was retired as 8-12x slower than XLA's form (docs/lab/hybrid-h200.md):
the per-chunk quantities stay XLA's batched products here. Triton's dots want every
dimension a power of two >= `MIN_DOT`; the interpreter runs the same kernel on the CPU for
the tests, at any shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllm.pallas_triton import MIN_DOT, compiler_params, whole_block

# Launch defaults, chosen by `benchmarks/gated_delta_check.py --prefill-only`'s sweep (figures in
# docs/lab/hybrid-h200.md): 32 columns give a 32-head layer 128 programs at batch 1, about one
# per SM; two stages load the next chunk's tiles while this chunk's products run.
DEFAULT_BLOCK_V = 32
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2


def _dot_dims_ok(*dims: int) -> bool:
    """Every dot dimension a power of two >= `MIN_DOT`, as Triton wants."""
    return all(d >= MIN_DOT and d & (d - 1) == 0 for d in dims)


def _dot(a: jax.Array, b: jax.Array, precision: lax.Precision | None, *, trans_a: bool = False) -> jax.Array:
    """a @ b (a^T @ b with `trans_a`: Triton transposes the tile, no copy), float32 accumulation."""
    dims = (((0 if trans_a else 1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _state_pass_kernel(
    q_ref,  # [N, H, C, L, Dk] f32 q, prepared (normalised, scaled)
    k_ref,  # [N, H, C, L, Dk] f32 k, prepared
    uw_ref,  # [N, H, C, L, Dv + Dk] f32 U then W, the triangular solve's output as it lies
    intra_ref,  # [N, H, C, L, L] f32 (q_i . k_j) e^{c_i - c_j}, j <= i
    cum_ref,  # [N, H, C, L] f32 c_i
    state_ref,  # [N, H, Dk, Dv] f32 S before the first chunk
    out_ref,  # [N, C, L, H, Dv] f32, the caller's [N, T, H, Dv] layout cut into chunks
    new_state_ref,  # [N, H, Dk, Dv] f32
    *,
    block_v: int,
    precision: lax.Precision | None,
):
    n, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n_chunks, _, d_k = q_ref.shape[2:]
    d_v = state_ref.shape[-1]
    cols = pl.ds(pl.multiple_of(j * block_v, block_v), block_v)
    w_cols = pl.ds(d_v, d_k)  # W sits after U in the solve's output
    dot = functools.partial(_dot, precision=precision)

    def chunk_step(c, s):  # s [Dk, BV], the state before chunk c
        cum = cum_ref[n, h, c, :]  # [L]
        last = cum_ref[n, h, c, cum.shape[0] - 1]  # c_last as a scalar load: no register indexing in Triton
        delta = uw_ref[n, h, c, :, cols] - dot(uw_ref[n, h, c, :, w_cols], s)  # [L, BV]
        out = jnp.exp(cum)[:, None] * dot(q_ref[n, h, c, :, :], s) + dot(intra_ref[n, h, c, :, :], delta)
        out_ref[n, c, :, h, cols] = out
        return jnp.exp(last) * s + dot(k_ref[n, h, c, :, :], jnp.exp(last - cum)[:, None] * delta, trans_a=True)

    s = lax.fori_loop(0, n_chunks, chunk_step, state_ref[n, h, :, cols])
    new_state_ref[n, h, :, cols] = s


@functools.partial(jax.jit, static_argnames=("precision", "interpret", "_block_v", "_num_warps", "_num_stages"))
def chunk_state_pass(
    q: jax.Array,
    k: jax.Array,
    uw: jax.Array,
    intra: jax.Array,
    cum: jax.Array,
    state: jax.Array,
    *,
    precision: lax.Precision | None = lax.Precision.DEFAULT,
    interpret: bool = False,
    _block_v: int | None = None,
    _num_warps: int = DEFAULT_NUM_WARPS,
    _num_stages: int = DEFAULT_NUM_STAGES,
) -> tuple[jax.Array, jax.Array]:
    """Carries the state through every chunk of N segments; the per-chunk quantities are
    `gated_delta.chunk_terms`' (see there for their math), all float32.

    Args:
      q, k: [N, H, C, L, Dk] prepared q (normalised, scaled by Dk**-0.5) and k.
      uw: [N, H, C, L, Dv + Dk] U = (I + A)^-1 (beta v) then W = (I + A)^-1 (beta e^c k).
      intra: [N, H, C, L, L] (q_i . k_j) e^{c_i - c_j} on and below the diagonal, 0 above.
      cum: [N, H, C, L] cumulative log decay within each chunk.
      state: [N, H, Dk, Dv] S before the first chunk.
      precision: of the kernel's products (DEFAULT: TF32 on the tensor cores).
      interpret: run in the Pallas interpreter (CPU tests).

    The underscored knobs are for tests and `benchmarks/gated_delta_check.py`'s sweep, not
    part of the API:
      _block_v: Dv columns per program, dividing Dv (default min(Dv, DEFAULT_BLOCK_V)).
      _num_warps, _num_stages: Triton launch parameters (stages pipeline the next chunk's
        loads, which do not depend on S, behind this chunk's products).

    Returns:
      out: [N, C * L, H, Dv] float32, each chunk's output in the caller's token-major layout.
      new_state: [N, H, Dk, Dv] float32 after the last chunk.
    """
    N, H, C, L, Dk = q.shape
    Dv = state.shape[-1]
    block_v = _block_v or min(Dv, DEFAULT_BLOCK_V)
    if Dv % block_v:
        raise ValueError(f"_block_v={block_v} must divide Dv={Dv}")
    if not interpret and not _dot_dims_ok(L, Dk, block_v):
        raise ValueError(f"chunk={L}, Dk={Dk} and block_v={block_v} must be powers of two >= {MIN_DOT}")
    operands = [a.astype(jnp.float32) for a in (q, k, uw, intra, cum, state)]
    out_shapes = [
        jax.ShapeDtypeStruct((N, C, L, H, Dv), jnp.float32),
        jax.ShapeDtypeStruct((N, H, Dk, Dv), jnp.float32),
    ]
    out, new_state = pl.pallas_call(
        functools.partial(_state_pass_kernel, block_v=block_v, precision=precision),
        grid=(N, H, Dv // block_v),
        in_specs=[whole_block(a) for a in operands],
        out_specs=[whole_block(o) for o in out_shapes],
        out_shape=out_shapes,
        interpret=interpret,
        compiler_params=compiler_params(interpret=interpret, num_warps=_num_warps, num_stages=_num_stages),
        name="gated_delta_chunk_state",
    )(*operands)
    return out.reshape(N, C * L, H, Dv), new_state
