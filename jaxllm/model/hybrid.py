"""The hybrid family's forward (Qwen3-Next, Qwen3.5 dense and MoE) over a ragged batch.

Layers come in a repeating group (`ModelConfig.layer_period`, e.g. three Gated DeltaNet
blocks then one gated-attention block); `lax.scan` runs the groups, so compile time does not
grow with depth. Each block is pre-norm: x + mixer(norm(x)), then x + mlp(norm(x)), the MLP a
dense SwiGLU or routed experts plus a sigmoid-gated shared expert.

Attention layers read the paged K/V cache (indexed among attention layers only) and return
their fresh K/V, written after every layer as in `forward`; DeltaNet layers read their slots'
recurrent state and return new rows, scattered into the state after the scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxllm.config import LINEAR_ATTENTION, ModelConfig
from jaxllm.model.delta_mixer import Segments, delta_mixer, round_segments
from jaxllm.model.forward import DecodeLookups, TokenBatch, _after, write_kv
from jaxllm.model.gated_attention import gated_attention
from jaxllm.model.kernel_choice import add_rms_norm, decode_delta_kernel, norm_kernel, route_kernel_choice
from jaxllm.model.layers import dense_mlp, moe_mlp, project
from jaxllm.params import DenseMlpParams, HybridBlockParams, MoeParams, Params, moe_in_splits
from jaxllm.state import KVCache, RecurrentState
from jaxllm.runtime_options import RuntimeOptions


def block_mlp(
    h: jax.Array,
    p: DenseMlpParams | MoeParams,
    cfg: ModelConfig,
    valid: jax.Array,
    *,
    route_kernel: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The block's MLP on normed input: ([T, D] output, [E] tokens per expert or [0]).
    `route_kernel` routes the experts (see `moe_mlp`; `kernel_choice.route_kernel_choice`)."""
    if isinstance(p, DenseMlpParams):
        return dense_mlp(h, p), jnp.zeros((0,), jnp.int32)
    if p.shared is None:
        return moe_mlp(h, p, cfg, valid, route_kernel=route_kernel)
    if p.w_in is None:
        out, experts = moe_mlp(h, p, cfg, valid, route_kernel=route_kernel)
        shared = dense_mlp(h, p.shared)
        gate_logit = jnp.einsum("td,d->t", h, p.shared_gate)
    else:
        router, gate, up, gate_logit = _fused_products(h, p)
        out, experts = moe_mlp(h, p, cfg, valid, route_kernel=route_kernel, router_logits=router)
        shared = project(jax.nn.silu(gate) * up, p.shared.w_down)
    gate = jax.nn.sigmoid(gate_logit.astype(jnp.float32))
    out = out + (gate[:, None] * shared.astype(jnp.float32)).astype(out.dtype)
    return out, experts


def _fused_products(h: jax.Array, p: MoeParams) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """From `p.w_in`: (router logits [T, E] float32, shared gate and up [T, Fs], shared-gate
    logit [T]). At one decode row each matmul is a kernel launch; one product of the shared
    input replaces four."""
    E, Fs = p.w_gate.shape[-3], p.shared.w_down.shape[-2]
    router, gate, up, gate_logit = jnp.split(project(h, p.w_in), moe_in_splits(E, Fs), axis=-1)
    return router.astype(jnp.float32), gate, up, gate_logit[:, 0]


def router_logits(h: jax.Array, p: MoeParams) -> jax.Array:
    """[T, E] float32 router logits of the normed input h [T, D], in either layout."""
    return project(h, p.router).astype(jnp.float32) if p.w_in is None else _fused_products(h, p)[0]


def _group_stack(tree, groups: int):
    """[n, ...] leaves -> [groups, n / groups, ...] (scan's xs)."""
    return jax.tree.map(lambda w: w.reshape(groups, w.shape[0] // groups, *w.shape[1:]), tree)


def hybrid_forward(
    params: Params,
    cfg: ModelConfig,
    batch: TokenBatch,
    kv: KVCache,
    recurrent: RecurrentState | None,
    page_table: jax.Array,
    *,
    opts: RuntimeOptions,
    chunk_len: int,
    n_ctx_pages: int,
    snapshots: bool = False,
) -> tuple[jax.Array, KVCache, RecurrentState | StateSnapshots | None, jax.Array]:
    """Runs every layer, then writes the round's K/V and recurrent state.

    Returns:
      (final-normed hidden [T, D], the cache, the recurrent state, tokens per expert
      [L, E] or [L, 0], in layer order). With `snapshots` (a round of segments only, see
      `delta_mixer`) the recurrent state is left as it was and the third item holds each
      segment's states after every one of its tokens, for the caller to pick from.
    """
    layers = params.layers
    x = params.embed[batch.tokens].astype(opts.jnp_dtype)
    trash = page_table.shape[0] - 1
    valid = batch.slots < trash
    W = batch.decode.slot.shape[0]
    lookups = DecodeLookups(
        pages=page_table[batch.decode.slot, :n_ctx_pages],
        cached=jnp.where(batch.decode.length > 0, batch.positions[:W], 0),
    )
    decode, chunks = round_segments(batch, trash, chunk_len)
    pattern = cfg.layer_types[: cfg.layer_period]
    groups = cfg.n_layers // cfg.layer_period
    n_lin = sum(t == LINEAR_ATTENTION for t in pattern)
    n_full = len(pattern) - n_lin
    # Decode rows of DeltaNet layers advance in place in the state pool, which the layer scan
    # carries (a kernel that updates it needs it as a value, not as a constant of the body).
    # Prompt segments' state pass takes the same choice, whether or not the round decodes.
    chunk_kernel = decode_delta_kernel(opts)
    decodes_in_pool = recurrent is not None and n_lin and W and not snapshots
    delta_kernel = chunk_kernel if decodes_in_pool else None
    pool = recurrent.delta if delta_kernel is not None else None

    # The residual stream is x + pending: each block adds its predecessor's MLP output inside
    # its first norm, as `forward` does (one kernel per add + norm in decode rounds).
    norm = norm_kernel(opts, x.shape[0])
    route = route_kernel_choice(opts, x.shape[0])

    def block(x, pending, lp: HybridBlockParams, mix):
        x, h = add_rms_norm(x, pending, lp.attn_norm, cfg.rms_eps, kernel=norm)
        out, *state = mix(h)
        x, h = add_rms_norm(x, out, lp.mlp_norm, cfg.rms_eps, kernel=norm)
        out, experts = block_mlp(h, lp.mlp, cfg, valid, route_kernel=route)
        return x, out, state, experts

    def group(x, pending, pool, lin_block, full_block, g):
        """The `layer_period` layers of group `g`; `lin_block(i)` / `full_block(i)` give its
        i-th block of each kind."""
        new_conv, new_delta, ks, vs, experts = [], [], [], [], []
        i_lin = i_full = 0
        for kind in pattern:
            if kind == LINEAR_ATTENTION:
                lp = lin_block(i_lin)
                index = g * n_lin + i_lin
                x, pending, (conv, delta, pool), e = block(
                    x,
                    pending,
                    lp,
                    lambda h, pool=pool: delta_mixer(
                        h,
                        lp.mixer,
                        recurrent,
                        index,
                        decode,
                        chunks,
                        cfg,
                        snapshots=snapshots,
                        pool=pool,
                        kernel=delta_kernel,
                        chunk_kernel=chunk_kernel,
                    ),
                )
                new_conv.append(conv)
                if delta is not None:
                    new_delta.append(delta)
                i_lin += 1
            else:
                lp = full_block(i_full)
                index = g * n_full + i_full
                table = _after(page_table, x)  # read this layer's context only once its input exists
                x, pending, (k, v), e = block(
                    x,
                    pending,
                    lp,
                    lambda h: gated_attention(
                        h,
                        lp.mixer,
                        kv,
                        index,
                        batch,
                        table,
                        lookups,
                        cfg,
                        opts=opts,
                        chunk_len=chunk_len,
                        n_ctx_pages=n_ctx_pages,
                    ),
                )
                ks.append(k)
                vs.append(v)
                i_full += 1
            experts.append(e)
        stack = lambda xs: jnp.stack(xs) if xs else None  # noqa: E731
        return (x, pending, pool), (stack(new_conv), stack(new_delta), jnp.stack(ks), jnp.stack(vs), jnp.stack(experts))

    if isinstance(layers.full, tuple):
        # Unrolled (the GPU layout): every block's weights are their own buffers, so a kernel
        # (the MoE experts') takes them as they lie; a slice of a stacked weight inside the
        # step would be copied before each custom call.
        # The groups share one jitted body, so a round traces and lowers one group, not all of
        # them (warm-up lowers every round shape serially); XLA inlines the calls, so the
        # compiled round is the same as with the groups written out.
        def one_group(x, pending, pool, lin, full, g):
            return group(x, pending, pool, lambda i: lin[i], lambda i: full[i], g)

        run_group = jax.jit(one_group)
        outs, pending = [], None
        for g in range(groups):
            lin = None if layers.linear is None else layers.linear[g * n_lin : (g + 1) * n_lin]
            full = layers.full[g * n_full : (g + 1) * n_full]
            (x, pending, pool), out = run_group(x, pending, pool, lin, full, jnp.int32(g))
            outs.append(out)
        conv, delta, k_new, v_new, experts = (None if o[0] is None else jnp.stack(o) for o in zip(*outs))
    else:

        def body(carry, xs):
            lin, full, g = xs
            return group(
                *carry, lambda i: jax.tree.map(lambda w: w[i], lin), lambda i: jax.tree.map(lambda w: w[i], full), g
            )

        xs = (
            None if layers.linear is None else _group_stack(layers.linear, groups),
            _group_stack(layers.full, groups),
            jnp.arange(groups),
        )
        carry = (x, jnp.zeros_like(x), pool)  # scan's carry needs an array from the start
        (x, pending, pool), (conv, delta, k_new, v_new, experts) = jax.lax.scan(body, carry, xs)
    x, hidden = add_rms_norm(x, pending, params.final_norm, cfg.rms_eps, kernel=norm)

    # [groups, per-group, ...] -> one axis in layer order (within a kind, for states and K/V)
    flat = lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])  # noqa: E731
    # The writes must follow every read of the cache and the state; see `forward._after`.
    batch = batch.replace(positions=_after(batch.positions, hidden))
    kv = write_kv(kv, flat(k_new), flat(v_new), batch, page_table)
    if snapshots:
        return (
            hidden,
            kv,
            StateSnapshots(
                targets=_targets(decode, chunks, trash, side_rows=False), conv=flat(conv), delta=flat(delta)
            ),
            flat(experts),
        )
    if recurrent is not None and conv is not None:
        targets = _after(_targets(decode, chunks, trash, side_rows=True), hidden)
        matrices = recurrent.delta if pool is None else pool
        if delta is not None:  # with the kernel, only chunk segments' matrices are rows to write
            rows_of = targets if pool is None else targets[decode.targets.shape[0] :]
            matrices = matrices.at[:, rows_of].set(flat(delta))
        recurrent = RecurrentState(
            conv=recurrent.conv.at[:, targets].set(flat(conv).astype(recurrent.conv.dtype)), delta=matrices
        )
    return hidden, kv, recurrent, flat(experts)


@struct.dataclass
class StateSnapshots:
    """Recurrent states of a round's segments after each of their tokens."""

    targets: jax.Array  # [R] slot of each segment (the trash row where it has no tokens)
    conv: jax.Array  # [Ll, R, Tw, Kc - 1, C]
    delta: jax.Array  # [Ll, R, Tw, Hv, Dk, Dv]

    def keep(self, recurrent: RecurrentState, n_tokens: jax.Array) -> RecurrentState:
        """`recurrent` with each segment's state after its first `n_tokens[r]` (>= 1) tokens."""
        pick = lambda a: jnp.take_along_axis(  # noqa: E731
            a, (n_tokens - 1).reshape(1, -1, *([1] * (a.ndim - 2))), axis=2
        )[:, :, 0]
        return RecurrentState(
            conv=recurrent.conv.at[:, self.targets].set(pick(self.conv).astype(recurrent.conv.dtype)),
            delta=recurrent.delta.at[:, self.targets].set(pick(self.delta)),
        )


def _targets(decode: Segments, chunks: Segments | None, trash: int, *, side_rows: bool) -> jax.Array:
    """Where the mixer's state rows go, in its order (see `delta_mixer`): decode rows' slots,
    chunk segments' slots, then with `side_rows` the side row (trash + 1) for each segment's
    state after all but its last token where it keeps one, the trash row elsewhere."""
    if chunks is None:
        return decode.targets
    parts = [decode.targets, chunks.targets]
    if side_rows:
        assert chunks.side is not None
        parts.append(jnp.where(chunks.side, trash + 1, trash))
    return jnp.concatenate(parts)
