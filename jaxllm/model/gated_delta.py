"""Gated DeltaNet math for the hybrid Qwen3-Next / Qwen3.5 layers, as pure jnp functions.

A linear-attention layer keeps two pieces of per-sequence state instead of a KV cache:

  * the conv window: the last K-1 inputs of the depthwise causal conv1d that mixes q, k, v
    along time (`causal_conv`);
  * the recurrent state S [H, Dk, Dv] of the gated delta rule (float32).

The delta rule per token (q, k l2-normalised, q scaled by Dk**-0.5):

    S <- exp(g) * S                      # gated decay, g <= 0
    delta = beta * (v - k^T S)            # what S mispredicts for k, scaled by beta
    S <- S + k delta^T                    # rank-one correction
    out = q^T S

`gated_delta_recurrent` runs it token by token (decode, and the oracle);
`gated_delta_chunked` computes the same in the chunked WY form (prefill). Both take a batch of
N segments of T tokens with an initial state each, so a prompt can be cut into pieces.

Padding convention: a position with g = 0 and beta = 0 decays S by exp(0) = 1 and adds
0 * k (...), i.e. leaves S exactly unchanged; the caller gives positions past a segment's
length those values (with finite q, k, v) and ignores their outputs. The conv takes the
lengths itself, since its window must skip padding.

Axis letters: N segments, T tokens, H value heads (q and k already repeated to H by the
caller), Dk key dim, Dv value dim, C conv channels, K conv kernel width, L chunk length
(inside `gated_delta_chunked`, C counts chunks instead).
All arithmetic is float32; `precision` sets the matrix products' precision. It defaults to
HIGHEST (full float32) for the oracle use in tests; prompt chunks in the model ask for DEFAULT
(`delta_mixer._advance`), which on GPUs rounds the operands to TF32 on the tensor cores (on
the CPU float32 dots are computed in full float32 either way).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxllm.model.gated_delta_chunk_kernel import chunk_state_pass

_HIGHEST = lax.Precision.HIGHEST


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in float32 (HF's `l2norm`, FLA's
    semantics: eps inside the root, so a zero vector stays zero)."""
    x32 = x.astype(jnp.float32)
    return x32 * lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def causal_conv(x: jax.Array, window: jax.Array, weight: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv1d + SiLU over segments that continue from a saved window.

    y[n, t] = silu(sum_j weight[:, j] * u[n, t + j]) with u = window[n] ++ x[n], which is
    HF's prefill conv (`causal_conv1d_fn`, zero left padding = a zero window) followed by its
    cached updates (`causal_conv1d_update`, whose K-wide state is our window with one extra,
    unused, oldest column). No bias: Qwen3-Next's conv has none.

    Args:
      x: [N, T, C] inputs; positions t >= lengths[n] are padding (their y is garbage).
      window: [N, K-1, C] the K-1 inputs before x[n, 0] (zeros for a fresh sequence).
      weight: [C, K] HF's Conv1d weight [C, 1, K] squeezed; weight[:, K-1] meets the newest
        input.
      lengths: [N] int32 live tokens per segment, 0..T.

    Returns:
      y: [N, T, C] in x's dtype.
      new_window: [N, K-1, C] in window's dtype, the last K-1 inputs of
        window ++ x[n, :lengths[n]]: a length-0 segment keeps its window, one shorter than
        K-1 shifts the old window along.
    """
    N, T, C = x.shape
    K = weight.shape[1]
    u = jnp.concatenate([window.astype(jnp.float32), x.astype(jnp.float32)], axis=1)  # [N, K-1+T, C]
    w = weight.astype(jnp.float32)
    # K is tiny (4): K shifted multiply-adds beat a general conv and fuse into one kernel.
    acc = u[:, 0:T, :] * w[:, 0]
    for j in range(1, K):
        acc = acc + u[:, j : j + T, :] * w[:, j]
    y = jax.nn.silu(acc).astype(x.dtype)
    # window ++ x[:len] ends at u index K-2+len, so its last K-1 inputs are u[len : len+K-1].
    idx = lengths.astype(jnp.int32)[:, None] + jnp.arange(K - 1, dtype=jnp.int32)[None, :]  # [N, K-1]
    new_window = jnp.take_along_axis(u, idx[:, :, None], axis=1).astype(window.dtype)
    return y, new_window


def _prepare_qk(q: jax.Array, k: jax.Array, qk_l2norm: bool) -> tuple[jax.Array, jax.Array]:
    """float32 q, k, optionally l2-normalised, q scaled by Dk**-0.5 (HF's order)."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * (q.shape[-1] ** -0.5), k


@functools.partial(jax.jit, static_argnames=("qk_l2norm", "precision"))
def gated_delta_recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    qk_l2norm: bool = True,
    precision: lax.Precision | None = _HIGHEST,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token (`lax.scan` over T): the decode path and the
    oracle for the chunked form.

    Args:
      q, k: [N, T, H, Dk].
      v: [N, T, H, Dv].
      g: [N, T, H] log decay (<= 0); 0 at padding positions.
      beta: [N, T, H] write strength in (0, 1); 0 at padding positions.
      state: [N, H, Dk, Dv] float32 state before x[:, 0].
      qk_l2norm: l2-normalise q and k first (Qwen3-Next does).
      precision: of the state contractions.

    Returns:
      out: [N, T, H, Dv] in q's dtype (HF casts back the same way).
      new_state: [N, H, Dk, Dv] float32 after the last position (padding leaves it as is).
    """
    qf, kf = _prepare_qk(q, k, qk_l2norm)
    vf, gf, bf = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)

    def step(s, xs):  # s [N, H, Dk, Dv]
        q_t, k_t, v_t, g_t, b_t = xs  # [N, H, Dk], [N, H, Dk], [N, H, Dv], [N, H], [N, H]
        s = s * jnp.exp(g_t)[:, :, None, None]
        kv = jnp.einsum("nhkv,nhk->nhv", s, k_t, precision=precision)
        delta = (v_t - kv) * b_t[:, :, None]
        s = s + k_t[:, :, :, None] * delta[:, :, None, :]
        return s, jnp.einsum("nhkv,nhk->nhv", s, q_t, precision=precision)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (qf, kf, vf, gf, bf))  # time first for the scan
    new_state, out = lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(out, 0, 1).astype(q.dtype), new_state


class ChunkTerms(NamedTuple):
    """What the chunked WY form computes for all chunks at once, before the sequential state
    pass (see `gated_delta_chunked` for the math); float32, chunk-major per head."""

    q: jax.Array  # [N, H, C, L, Dk] q prepared (`_prepare_qk`)
    k: jax.Array  # [N, H, C, L, Dk] k prepared
    uw: jax.Array  # [N, H, C, L, Dv + Dk] U = (I + A)^-1 beta v, then W = (I + A)^-1 beta e^c k
    intra: jax.Array  # [N, H, C, L, L] (q_i . k_j) e^{c_i - c_j} for j <= i, 0 above
    cum: jax.Array  # [N, H, C, L] c_i, the cumulative log decay within each chunk


def chunk_terms(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    chunk: int,
    qk_l2norm: bool,
    precision: lax.Precision | None,
    solve: str = "auto",
) -> ChunkTerms:
    """The state-free part of `gated_delta_chunked` (same q, k, v, g, beta), T padded up to a
    multiple of `chunk` with g = 0, beta = 0 (state-neutral); `solve` as `unit_lower_solve`."""
    N, T, H, Dk = k.shape
    L = chunk
    pad = -T % L
    C = (T + pad) // L  # chunks
    qf, kf = _prepare_qk(q, k, qk_l2norm)
    vf, gf, bf = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)

    def to_chunks(a: jax.Array) -> jax.Array:  # [N, T, H, ...] -> [N, H, C, L, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape((N, C, L) + a.shape[2:])
        return jnp.moveaxis(a, 3, 1)

    qc, kc, vc, gc, bc = (to_chunks(a) for a in (qf, kf, vf, gf, bf))  # [N, H, C, L(, D)]
    cum = jnp.cumsum(gc, axis=-1)  # [N, H, C, L] c_i
    causal = jnp.tril(jnp.ones((L, L), dtype=bool))  # j <= i
    # e^{c_i - c_j} for j <= i, 0 above the diagonal (masked before exp: c_i - c_j > 0 there).
    diff = cum[..., :, None] - cum[..., None, :]  # [N, H, C, L, L]
    decay_ij = jnp.exp(jnp.where(causal, diff, -jnp.inf))

    dot = functools.partial(jnp.einsum, precision=precision)
    kk = dot("nhcid,nhcjd->nhcij", kc, kc)
    # I + A, [N, H, C, L, L]: the unit-diagonal solve reads only the strict lower triangle
    # of this, so neither the diagonal nor the (zero) upper part needs masking.
    system = bc[..., :, None] * kk * decay_ij
    rhs = jnp.concatenate([bc[..., None] * vc, (bc * jnp.exp(cum))[..., None] * kc], axis=-1)  # [.., L, Dv+Dk]
    uw = unit_lower_solve(system, rhs, solve=solve)
    intra = dot("nhcid,nhcjd->nhcij", qc, kc) * decay_ij  # [N, H, C, L, L] (diagonal included)
    return ChunkTerms(q=qc, k=kc, uw=uw, intra=intra, cum=cum)


def unit_lower_solve(system: jax.Array, rhs: jax.Array, *, solve: str = "auto") -> jax.Array:
    """(I + A)^-1 rhs for A the strict lower triangle of `system` [..., L, L] (the diagonal
    and upper part are not read), in full float32.

    solve: "triangular" (a batched triangular solve: cuBLAS trsm on a GPU), "products" (the
    inverse as products: N = -A is nilpotent, so (I - N)^-1 = I + N + ... + N^(L-1) =
    (I + N)(I + N^2)(I + N^4)...(I + N^(L/2)), 2 log2(L) - 1 batched L x L products and one
    with rhs; L a power of two), or "auto": products on a GPU, where at the 35B shape's prompt
    sizes they took 0.65 ms against trsm's 1.11 at 2,048 tokens (`gated_delta_check.py
    --solve-only`, docs/lab/hybrid-h200.md), the triangular solve elsewhere (on the CPU the
    products were ~1.5x slower).
    """
    if solve == "auto":
        solve = "products" if jax.default_backend() == "gpu" else "triangular"
    if solve == "triangular":
        return lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
    if solve != "products":
        raise ValueError(f"solve must be 'auto', 'triangular' or 'products', got {solve!r}")
    L = system.shape[-1]
    if L & (L - 1):
        raise ValueError(f"the product form needs a power-of-two chunk, got {L}")
    mm = functools.partial(jnp.matmul, precision=_HIGHEST)
    n = -jnp.tril(system, -1)
    inv, power = jnp.eye(L, dtype=system.dtype) + n, n
    for _ in range(L.bit_length() - 2):  # inv = (I + N)(I + N^2)...(I + N^(2^j)), through N^(L/2)
        power = mm(power, power)
        inv = inv + mm(inv, power)
    return mm(inv, rhs)


def _scan_state_pass(
    terms: ChunkTerms, state: jax.Array, precision: lax.Precision | None
) -> tuple[jax.Array, jax.Array]:
    """The chunk-to-chunk pass as XLA ops: (out [N, C * L, H, Dv] float32, new state)."""
    N, H, C, L, Dk = terms.k.shape
    Dv = state.shape[-1]
    u, w = terms.uw[..., :Dv], terms.uw[..., Dv:]  # [N, H, C, L, Dv], [N, H, C, L, Dk]
    q_dec = jnp.exp(terms.cum)[..., None] * terms.q  # [N, H, C, L, Dk] reads S0
    k_dec = jnp.exp(terms.cum[..., -1:] - terms.cum)[..., None] * terms.k  # [N, H, C, L, Dk] writes S_end
    chunk_decay = jnp.exp(terms.cum[..., -1])  # [N, H, C]
    dot = functools.partial(jnp.einsum, precision=precision)

    def step(s, xs):  # s [N, H, Dk, Dv]
        u_c, w_c, intra_c, q_c, k_c, d_c = xs
        delta = u_c - dot("nhlk,nhkv->nhlv", w_c, s)
        out = dot("nhlk,nhkv->nhlv", q_c, s) + dot("nhij,nhjv->nhiv", intra_c, delta)
        s = d_c[:, :, None, None] * s + dot("nhlk,nhlv->nhkv", k_c, delta)
        return s, out

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (u, w, terms.intra, q_dec, k_dec, chunk_decay))  # chunks first
    # Fully unrolled: it beat or tied the rolled loop on the H200 and the CPU, and a parallel
    # prefix over the chunks' affine maps lost on both (docs/lab/hybrid-h200.md).
    new_state, out = lax.scan(step, state.astype(jnp.float32), xs, unroll=C)  # out [C, N, H, L, Dv]
    out = jnp.moveaxis(out, 0, 2).reshape(N, H, C * L, Dv)
    return jnp.moveaxis(out, 1, 2), new_state


@functools.partial(jax.jit, static_argnames=("chunk", "qk_l2norm", "precision", "kernel", "solve"))
def gated_delta_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    chunk: int = 64,
    qk_l2norm: bool = True,
    precision: lax.Precision | None = _HIGHEST,
    kernel: str | None = None,
    solve: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in chunks of L = `chunk` tokens (the WY / UT form): same
    arguments and results as `gated_delta_recurrent`, with the sequential part cut from T
    steps to T / L, so prefill is matrix products instead of a long chain of rank-one updates.

    Within a chunk, with cumulative log decay c_i = g_0 + ... + g_i and the chunk's initial
    state S0, unrolling the rule gives for the deltas

        delta_i + beta_i sum_{j<i} e^{c_i - c_j} (k_i . k_j) delta_j
            = beta_i v_i - beta_i e^{c_i} S0^T k_i,

    a unit lower-triangular system (I + A) delta = B solved once per chunk for both right-
    hand sides: delta = U - W S0 with U = (I + A)^-1 (beta v), W = (I + A)^-1 (beta e^c k).
    Then

        out_i = e^{c_i} S0^T q_i + sum_{j<=i} e^{c_i - c_j} (q_i . k_j) delta_j
        S_end = e^{c_last} S0 + sum_j e^{c_last - c_j} k_j delta_j^T.

    Everything but S0 is computed for all chunks at once (`chunk_terms`); the state is carried
    from chunk to chunk by a fully unrolled `lax.scan` (kernel None), or by one Pallas kernel
    launch ("pallas", or "interpret" for its interpreter: `gated_delta_chunk_kernel`), which
    on a GPU replaces the scan's ~4 launches per chunk. T is padded up to a multiple of L with
    g = 0, beta = 0 (state-neutral). Memory: the per-chunk [L, L] matrices are N x H x T x L
    floats. `solve`: how (I + A)^-1 is applied (`unit_lower_solve`).
    """
    T = k.shape[1]
    terms = chunk_terms(q, k, v, g, beta, chunk=chunk, qk_l2norm=qk_l2norm, precision=precision, solve=solve)
    if kernel is None:
        out, new_state = _scan_state_pass(terms, state, precision)
    else:
        out, new_state = chunk_state_pass(
            terms.q,
            terms.k,
            terms.uw,
            terms.intra,
            terms.cum,
            state,
            precision=precision,
            interpret=kernel == "interpret",
        )
    return out[:, :T].astype(q.dtype), new_state


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3-Next's `RMSNormGated` (also Qwen3.5's): RMS-normalise x over the last axis in
    float32, round to x's dtype, scale by weight (initialised to ones, *not* zero-centred
    like the model's other norms in Qwen3-Next), times silu(gate) in float32, back to x's
    dtype. The rounding points follow HF so bfloat16 runs agree with it.

    Args:
      x: [..., Dv] the delta rule's output.
      gate: [..., Dv] z, the gate projection.
      weight: [Dv].
      eps: the config's rms_norm_eps.

    Returns:
      [..., Dv] in x's dtype.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scaled = weight * normed.astype(x.dtype)
    return (scaled.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
