"""The Gated DeltaNet mixer (linear attention) over a flattened ragged batch.

A round's rows are one-token decode windows (the batch's first rows, one per slot) and
prompt-chunk segments (one slot each). Each sequence's recurrent state (conv window and
delta-rule matrix) is read from its slot's row, advanced over its tokens, and handed back as
new rows with their target slots; the caller scatters every layer's rows in one update after
the scan (the state is donated, so that update is in place).

Decode rows advance by the one-token recurrence, segments by the chunked (WY) form; both come
from `jaxllm.model.gated_delta` and agree with each other. Padding positions get decay 0 and
beta 0, which leaves the delta-rule matrix unchanged, and a zero length leaves the conv window
as it was.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxllm.config import ModelConfig
from jaxllm.model.forward import TokenBatch
from jaxllm.model.gated_delta import causal_conv, gated_delta_chunked, gated_delta_recurrent, gated_rms_norm
from jaxllm.model.gated_delta_kernel import gated_delta_decode_from_projections
from jaxllm.model.layers import project
from jaxllm.params import DeltaNetParams, delta_in_splits
from jaxllm.state import RecurrentState

# The chunk length of the WY form (the flash-linear-attention and transformers default).
_DELTA_CHUNK = 64


@struct.dataclass
class Segments:
    """Where each sequence of the round sits: decode rows first, then prompt segments."""

    slots: jax.Array  # [R] i32 slot whose state each sequence reads
    targets: jax.Array  # [R] i32 slot its new state goes to (the trash row when it has no tokens)
    rows: jax.Array  # [R, Tw] i32 flat batch row of each of its tokens (clipped; see `valid`)
    valid: jax.Array  # [R, Tw] bool
    lengths: jax.Array  # [R] i32 tokens it advances by
    # [R] bool: also keep its state after all but its last token (for the side row); None
    # for decode rows
    side: jax.Array | None = None


def round_segments(batch: TokenBatch, trash: int, chunk_len: int) -> tuple[Segments, Segments | None]:
    """(decode sequences, prompt segments or None) of a round."""
    d = batch.decode
    decode = Segments(
        slots=d.slot,
        targets=jnp.where(d.length > 0, d.slot, trash),
        rows=d.start[:, None],
        valid=(d.length > 0)[:, None],
        lengths=d.length,
    )
    c = batch.chunks
    if not c.slot.shape[0]:
        return decode, None
    offsets = jnp.arange(chunk_len)[None, :]
    valid = offsets < c.length[:, None]
    rows = jnp.minimum(c.start[:, None] + offsets, batch.tokens.shape[0] - 1)
    chunks = Segments(
        slots=jnp.minimum(c.slot, trash),
        targets=jnp.where(c.length > 0, c.slot, trash),
        rows=rows,
        valid=valid,
        lengths=c.length,
        side=(c.length > 0) & (False if batch.chunk_side is None else batch.chunk_side),
    )
    return decode, chunks


@struct.dataclass
class _RuleInputs:
    """A segment batch's inputs to the delta rule, after the conv (float32)."""

    q: jax.Array  # [R, Tw, Hv, Dk] (key heads repeated to the value heads)
    k: jax.Array  # [R, Tw, Hv, Dk]
    v: jax.Array  # [R, Tw, Hv, Dv]
    decay: jax.Array  # [R, Tw, Hv] log decay, 0 at padding
    beta: jax.Array  # [R, Tw, Hv], 0 at padding


def _rule_inputs(
    qkv: jax.Array,
    b: jax.Array,
    a: jax.Array,
    p: DeltaNetParams,
    conv0: jax.Array,
    seg: Segments,
    cfg: ModelConfig,
    *,
    snapshots: bool = False,
) -> tuple[_RuleInputs, jax.Array]:
    """The conv over the segments' tokens and the delta rule's inputs: (inputs, new conv
    windows), with `snapshots` the windows after each token ([R, Tw, Kc-1, C])."""
    Hk, Hv, Dk = cfg.linear_n_k_heads, cfg.linear_n_v_heads, cfg.linear_k_dim
    # Padding positions read other rows of the batch (idle ones among them); zeroed, whatever
    # those hold (a non-finite value times a zero beta would still be nan in the WY form).
    x = jnp.where(seg.valid[..., None], qkv[seg.rows].astype(jnp.float32), 0.0)  # [R, Tw, C]
    y, conv = causal_conv(x, conv0, p.conv.astype(jnp.float32), seg.lengths)
    if snapshots:  # the window after j + 1 tokens: the last Kc - 1 inputs of (window ++ x[:j + 1])
        both = jnp.concatenate([conv0.astype(jnp.float32), x], axis=1)
        width = conv0.shape[1]
        conv = jnp.stack([both[:, j + 1 : j + 1 + width] for j in range(x.shape[1])], axis=1)
    R, Tw = x.shape[:2]
    q, k, v = jnp.split(y, [Hk * Dk, 2 * Hk * Dk], axis=-1)
    # Each key head serves Hv / Hk consecutive value heads.
    q = jnp.repeat(q.reshape(R, Tw, Hk, Dk), Hv // Hk, axis=2)
    k = jnp.repeat(k.reshape(R, Tw, Hk, Dk), Hv // Hk, axis=2)
    v = v.reshape(R, Tw, Hv, cfg.linear_v_dim)
    beta = jax.nn.sigmoid(b[seg.rows].astype(jnp.float32))
    decay = -jnp.exp(p.a_log.astype(jnp.float32)) * jax.nn.softplus(
        a[seg.rows].astype(jnp.float32) + p.dt_bias.astype(jnp.float32)
    )
    # Padding positions must leave the delta-rule matrix as it is.
    beta = jnp.where(seg.valid[..., None], beta, 0.0)
    decay = jnp.where(seg.valid[..., None], decay, 0.0)
    return _RuleInputs(q=q, k=k, v=v, decay=decay, beta=beta), conv


def _advance(
    x: _RuleInputs,
    delta0: jax.Array,
    *,
    chunked: bool,
    snapshots: bool = False,
    kernel: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Runs the delta rule over the segments' tokens from their matrices `delta0`; `kernel`
    ("pallas" / "interpret") carries chunked segments' state from chunk to chunk in one
    Pallas kernel instead of XLA's scan (`gated_delta_chunked`).

    Returns: (core output [R, Tw, Hv, Dv], new delta matrices); with `snapshots` the matrices
    after each token instead ([R, Tw, ...]: index j holds the state after j + 1 tokens), for
    speculative verification to keep the one at the accepted length.
    """
    if snapshots:  # token by token, keeping every state (verification segments are short)
        outs, deltas, delta = [], [], delta0
        for j in range(x.q.shape[1]):
            s = slice(j, j + 1)
            out_j, delta = gated_delta_recurrent(x.q[:, s], x.k[:, s], x.v[:, s], x.decay[:, s], x.beta[:, s], delta)
            outs.append(out_j)
            deltas.append(delta)
        return jnp.concatenate(outs, axis=1), jnp.stack(deltas, axis=1)
    if chunked:
        # DEFAULT precision (TF32 on GPUs): much faster there, errors far below bfloat16's
        # (docs/lab/hybrid-h200.md); the CPU computes float32 dots in full precision regardless.
        return gated_delta_chunked(
            x.q, x.k, x.v, x.decay, x.beta, delta0, chunk=_DELTA_CHUNK, precision=lax.Precision.DEFAULT, kernel=kernel
        )
    return gated_delta_recurrent(x.q, x.k, x.v, x.decay, x.beta, delta0)


def _advance_keeping_side(
    x: _RuleInputs, delta0: jax.Array, lengths: jax.Array, side: jax.Array, kernel: str | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`_advance` of prompt segments, and where `side`, also each one's matrix after all but
    its last token: (core output [R, Tw, Hv, Dv], new matrices, side matrices [R, ...]).

    The chunked pass runs with a side segment's last token made state-neutral (decay 0, beta
    0), which gives the side matrix and every output before that token (the rule is causal);
    one recurrent step then takes the last token from there. The same work as one pass, so
    it runs for every segment and `side` only selects.
    """
    Tw = x.q.shape[1]
    last = jnp.maximum(lengths - 1, 0)  # [R] index of the last token
    cut = jnp.where(side, last, lengths)  # tokens the chunked pass takes
    keep = (jnp.arange(Tw)[None, :] < cut[:, None])[..., None]  # [R, Tw, 1]
    masked = x.replace(decay=jnp.where(keep, x.decay, 0.0), beta=jnp.where(keep, x.beta, 0.0))
    out, side_delta = _advance(masked, delta0, chunked=True, kernel=kernel)

    def at_last(a: jax.Array) -> jax.Array:  # [R, Tw, ...] -> [R, 1, ...]
        return jnp.take_along_axis(a, last.reshape(-1, 1, *([1] * (a.ndim - 2))), axis=1)

    out_last, full = gated_delta_recurrent(
        at_last(x.q), at_last(x.k), at_last(x.v), at_last(x.decay), at_last(x.beta), side_delta
    )
    is_last = (side[:, None] & (jnp.arange(Tw)[None, :] == last[:, None]))[..., None, None]  # [R, Tw, 1, 1]
    out = jnp.where(is_last, out_last.astype(out.dtype), out)
    return out, jnp.where(side[:, None, None, None], full, side_delta), side_delta


def _side_windows(qkv_rows: jax.Array, conv0: jax.Array, lengths: jax.Array) -> jax.Array:
    """Each segment's conv window after all but its last token: the last Kc - 1 inputs of
    (window ++ x[: length - 1]). qkv_rows [R, Tw, C] float32, conv0 [R, Kc - 1, C]."""
    both = jnp.concatenate([conv0.astype(jnp.float32), qkv_rows], axis=1)
    width = conv0.shape[1]
    start = jnp.maximum(lengths - 1, 0)
    return jax.vmap(lambda b, s: lax.dynamic_slice_in_dim(b, s, width, axis=0))(both, start)


def input_projections(
    h: jax.Array, p: DeltaNetParams, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The mixer's products of its input h [T, D]: (qkv [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
    if p.w_in is None:
        return project(h, p.w_qkv), project(h, p.w_z), project(h, p.w_b), project(h, p.w_a)
    # At one decode row each matmul is a kernel launch; one product of the shared input replaces four.
    C, Hv, Dv = cfg.conv_dim, cfg.linear_n_v_heads, cfg.linear_v_dim
    qkv, z, b, a = jnp.split(project(h, p.w_in), delta_in_splits(C, Hv, Dv), axis=-1)
    return qkv, z.reshape(h.shape[0], Hv, Dv), b, a


def delta_mixer(
    h: jax.Array,
    p: DeltaNetParams,
    recurrent: RecurrentState,
    layer_index: jax.Array | int,
    decode: Segments,
    chunks: Segments | None,
    cfg: ModelConfig,
    *,
    snapshots: bool = False,
    pool: jax.Array | None = None,
    kernel: str | None = None,
    chunk_kernel: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """One DeltaNet layer over the round.

    Args:
      h: [T, D] normed input.
      p: this layer's params.
      recurrent: the whole state; `layer_index` counts linear-attention layers only.
      decode, chunks: from `round_segments`.
      pool: with `kernel` ("pallas" / "interpret"), every layer's delta matrices [Ll, S, Hv,
        Dk, Dv] as the layer scan carries them: decode rows are advanced in it in place by
        `gated_delta_decode_from_projections` (conv, gates and rule in one kernel; their
        state is read once and written once), and chunk
        segments read their matrices from it. Without, both read `recurrent.delta`.
      chunk_kernel: "pallas" / "interpret" to carry prompt segments' state through their
        chunks in one Pallas kernel (`gated_delta_chunk_kernel`), None for XLA's scan.

    Returns:
      ([T, D] output, new conv windows [R, Kc-1, C], new delta matrices [R', Hv, Dk, Dv] or
      None, the pool or None). R = decode sequences + chunk segments + chunk segments again
      (their states after all but their last token, for the side row), in that order
      (targets: `decode.targets`, `chunks.targets`, then the side row where `chunks.side`
      and the trash row elsewhere); R' the same, or the chunk segments' two sets alone when
      the kernel advanced the decode rows in the pool. With `snapshots` (rounds without decode
      rows: verification), no side rows, and the segments' states after each of their tokens,
      [R, Tw, ...].
    """
    if snapshots and decode.slots.shape[0]:
        raise ValueError("snapshots are for rounds of segments only (no decode rows)")
    T = h.shape[0]
    qkv, z, b, a = input_projections(h, p, cfg)
    conv_all = recurrent.conv[layer_index]
    matrices = recurrent.delta if pool is None else pool
    segs = [
        (seg, chunked) for seg, chunked in ((decode, False), (chunks, True)) if seg is not None and seg.slots.shape[0]
    ]
    # Every segment reads its matrices before the decode kernel writes the pool (a slot never
    # decodes and prefills in one round, so the reads and the writes touch different rows).
    delta0 = [None if kernel is not None and not chunked else matrices[layer_index, seg.slots] for seg, chunked in segs]
    core = jnp.zeros((T, cfg.linear_n_v_heads, cfg.linear_v_dim), jnp.float32)
    convs, deltas, side_rows = [], [], []
    for (seg, chunked), d0 in zip(segs, delta0):
        if d0 is None:  # decode rows: conv, gates and rule in one kernel
            W = seg.slots.shape[0]  # decode window i is the batch's row i (`TokenBatch.decode`)
            out, pool, conv = gated_delta_decode_from_projections(
                qkv[:W],
                a[:W],
                b[:W],
                recurrent.conv,
                p.conv,
                p.a_log,
                p.dt_bias,
                pool,
                seg.slots,
                layer=layer_index,
                n_k_heads=cfg.linear_n_k_heads,
                live=seg.lengths > 0,
                interpret=kernel == "interpret",
            )
            out = out[:, None]
        else:
            inputs, conv = _rule_inputs(qkv, b, a, p, conv_all[seg.slots], seg, cfg, snapshots=snapshots)
            if chunked and not snapshots:
                assert seg.side is not None  # `round_segments` gives chunk segments theirs
                out, delta, side_delta = _advance_keeping_side(inputs, d0, seg.lengths, seg.side, chunk_kernel)
                x_rows = qkv[seg.rows].astype(jnp.float32)
                side_rows.append((_side_windows(x_rows, conv_all[seg.slots], seg.lengths), side_delta))
            else:
                out, delta = _advance(inputs, d0, chunked=chunked, snapshots=snapshots, kernel=chunk_kernel)
            deltas.append(delta)
        rows = jnp.where(seg.valid, seg.rows, T)  # padding rows drop out of the scatter
        core = core.at[rows].set(out, mode="drop")
        convs.append(conv)
    for conv, delta in side_rows:  # after every segment's own rows (`hybrid._targets`)
        convs.append(conv)
        deltas.append(delta)
    normed = gated_rms_norm(core, z, p.norm, cfg.rms_eps).astype(h.dtype)
    new_deltas = jnp.concatenate(deltas) if deltas else None
    return project(normed, p.w_out, 2), jnp.concatenate(convs), new_deltas, pool
