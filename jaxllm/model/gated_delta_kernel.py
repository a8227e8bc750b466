"""One decode step of the gated delta rule for many slots as a Pallas (Triton) kernel.

A decode round gives each live slot one token. Its update touches the slot's whole state
S [H, Dk, Dv] (float32, 64 KiB per head at Qwen3-Next's 128 x 128), which dwarfs the token's
q, k, v: the step is memory bound, and the cost that matters is moving S. As XLA ops the
step is a gather of the slots' states, a handful of elementwise kernels and reductions, and a
scatter back, each pass over S a round trip through HBM. Here one program owns one
(window, head, block of Dv columns): it loads that block of S once, applies

    S <- exp(g) S;  delta = beta (v - k^T S);  S <- S + k delta^T;  out = q^T S

in registers, and stores it once, into the same buffer (the state operand is aliased to the
new state, so with a donated pool the update is in place and untouched slots cost nothing).
Columns of S are independent in this rule (k^T S and q^T S are per column), so splitting
Dv into blocks is exact and gives the grid more programs than windows x heads.

The pool is indexed by slot inside the kernel (`slots`), like the paged KV pool: the
caller passes the whole [S, H, Dk, Dv] pool, or every layer's [L, S, H, Dk, Dv] with
`layer`, never a gathered copy. Block sizes (Dk, _block_v) must be powers of two on the GPU;
the interpreter runs the same kernel on the CPU for the tests. Launch parameters are
untuned (no GPU measurement yet).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllm.pallas_triton import compiler_params, whole_block


def _rule_block(q, k, v, g, beta, state_ref, new_state_ref, out_ref, at_state, at_out, qk_l2norm: bool) -> None:
    """One token of the rule on one block of a slot's state: q, k [Dk], v [BV] float32, g and
    beta scalars; reads the block at `at_state`, writes it back there and the output at `at_out`."""
    f32 = jnp.float32
    if qk_l2norm:  # HF's l2norm: eps inside the root
        q = q * lax.rsqrt((q * q).sum() + 1e-6)
        k = k * lax.rsqrt((k * k).sum() + 1e-6)
    q = q * (q.shape[0] ** -0.5)
    s = state_ref[at_state].astype(f32)  # [Dk, BV]
    s = s * jnp.exp(g.astype(f32))
    delta = (v - (s * k[:, None]).sum(axis=0)) * beta.astype(f32)  # [BV]
    s = s + k[:, None] * delta[None, :]
    new_state_ref[at_state] = s.astype(new_state_ref.dtype)
    out_ref[at_out] = (s * q[:, None]).sum(axis=0).astype(out_ref.dtype)


def _decode_kernel(
    layer_ref,  # [1] i32 layer of a stacked pool (0 for one layer's)
    slots_ref,  # [W] i32 pool row of each window's slot
    live_ref,  # [W] i32 0 = the window does not decode: state untouched, output zeros
    q_ref,  # [W, H, Dk]
    k_ref,  # [W, H, Dk]
    v_ref,  # [W, H, Dv]
    g_ref,  # [W, H] f32 log decay
    beta_ref,  # [W, H] f32
    state_ref,  # [L * S, H, Dk, Dv] the whole pool (read)
    out_ref,  # [W, H, Dv]
    new_state_ref,  # [L * S, H, Dk, Dv] the same buffer (written)
    *,
    n_slots: int,
    block_v: int,
    qk_l2norm: bool,
):
    w, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    live = live_ref[w] > 0
    cols = pl.ds(j * block_v, block_v)

    # A dead window (an idle slot of a wide decode part, a prompt round's decode rows) reads
    # nothing: loading its state block would cost as much as a live one's (a 64-wide part
    # with 16 live slots read 48 states it left unchanged, 2 MB each at 32 heads of 128 x 128).
    @pl.when(live)
    def _():
        # Dead windows may name any slot (even one a live window updates): they never touch it.
        slot = jnp.clip(slots_ref[w], 0, n_slots - 1)
        row = layer_ref[0] * n_slots + slot
        q = q_ref[w, h, :].astype(f32)  # [Dk]
        k = k_ref[w, h, :].astype(f32)
        v = v_ref[w, h, cols].astype(f32)  # [BV]
        _rule_block(
            q,
            k,
            v,
            g_ref[w, h],
            beta_ref[w, h],
            state_ref,
            new_state_ref,
            out_ref,
            (row, h, slice(None), cols),
            (w, h, cols),
            qk_l2norm,
        )

    @pl.when(~live)
    def _():
        out_ref[w, h, cols] = jnp.zeros((block_v,), out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("qk_l2norm", "interpret", "_block_v", "_num_warps"))
def gated_delta_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    slots: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    live: jax.Array | None = None,
    qk_l2norm: bool = True,
    interpret: bool = False,
    _block_v: int | None = None,
    _num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule per window, each on its slot's state in the pool.

    Same arithmetic as `jaxllm.model.gated_delta.gated_delta_recurrent` with T = 1 (float32
    inside; q, k l2-normalised when `qk_l2norm`, q scaled by Dk**-0.5).

    Args:
      q, k: [W, H, Dk] one token per window (k heads already repeated to H).
      v: [W, H, Dv].
      g: [W, H] log decay (<= 0).
      beta: [W, H] in (0, 1).
      state: [S, H, Dk, Dv] one layer's pool of slot states, or [L, S, H, Dk, Dv] every
        layer's with `layer` picking one (pass the stack inside a layer loop: a slice fed to
        the kernel would be copied first). float32 (other float dtypes are widened on load).
      slots: [W] i32 pool row of each window; live windows must name distinct slots.
      layer: i32 scalar, the layer of a stacked pool (required with one).
      live: [W] bool/int, windows that decode (default all); the others leave every slot as
        it was and return zeros, whatever slot they name.
      qk_l2norm: l2-normalise q and k first (Qwen3-Next does).
      interpret: run in the Pallas interpreter (CPU tests).

    The underscored knobs are for tests and launch sweeps, not part of the API:
      _block_v: Dv columns per program, a power of two dividing Dv (default min(Dv, 32)).
      _num_warps: Triton launch parameter.

    Returns:
      out: [W, H, Dv] in q's dtype.
      new_state: the pool, same shape and dtype as `state`, with the live windows' slots
        advanced by one token and every other row unchanged. The kernel writes into the
        state's buffer: donate `state` (or the pytree holding it) to the enclosing jit for an
        in-place update, else XLA copies the pool first.
    """
    W, H, Dk = q.shape
    Dv = v.shape[-1]
    block_v = _block_v or min(Dv, 32)
    if Dv % block_v:
        raise ValueError(f"_block_v={block_v} must divide Dv={Dv}")
    if state.ndim == 5:
        if layer is None:
            raise ValueError("a stacked [L, S, H, Dk, Dv] pool needs `layer`")
    else:
        layer = 0
    pool_shape = state.shape
    n_slots = pool_shape[-4]
    pool = state.reshape((-1,) + pool_shape[-3:])  # [L * S, H, Dk, Dv], a free reshape
    live = jnp.ones((W,), jnp.int32) if live is None else live.astype(jnp.int32)
    operands = [
        jnp.asarray(layer, jnp.int32).reshape(1),
        slots.astype(jnp.int32),
        live,
        q,
        k,
        v,
        g.astype(jnp.float32),
        beta.astype(jnp.float32),
        pool,
    ]
    out_shapes = [jax.ShapeDtypeStruct((W, H, Dv), q.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)]
    out, new_pool = pl.pallas_call(
        functools.partial(_decode_kernel, n_slots=n_slots, block_v=block_v, qk_l2norm=qk_l2norm),
        grid=(W, H, Dv // block_v),
        in_specs=[whole_block(a) for a in operands],
        out_specs=[whole_block(o) for o in out_shapes],
        out_shape=out_shapes,
        input_output_aliases={len(operands) - 1: 1},  # the pool is updated where it lies
        interpret=interpret,
        compiler_params=compiler_params(interpret=interpret, num_warps=_num_warps, num_stages=1),
        name="gated_delta_decode",
    )(*operands)
    return out, new_pool.reshape(pool_shape)


def _from_projections_kernel(
    layer_ref,  # [1] i32 layer of the stacked pools
    slots_ref,  # [W] i32 pool row of each window's slot
    live_ref,  # [W] i32
    x_ref,  # [W, C] the mixer's qkv projection of each window's token (before the conv)
    a_ref,  # [W, H] decay input
    b_ref,  # [W, H] beta logit
    conv_ref,  # [L * S, Kc - 1, C] every layer's conv windows (read)
    cw_ref,  # [C, Kc] conv weights
    alog_ref,  # [H] f32
    dtb_ref,  # [H] f32
    state_ref,  # [L * S, H, Dk, Dv] (read)
    out_ref,  # [W, H, Dv]
    new_state_ref,  # [L * S, H, Dk, Dv] the same buffer as state_ref (written)
    win_ref,  # [W, Kc - 1, C] each window's new conv window
    *,
    n_slots: int,
    block_v: int,
    n_k_heads: int,
    taps: int,
):
    w, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    live = live_ref[w] > 0
    H, Dk, Dv = alog_ref.shape[0], state_ref.shape[2], state_ref.shape[3]
    hk = h // (H // n_k_heads)  # each key head serves H / Hk consecutive value heads
    v0 = 2 * n_k_heads * Dk + h * Dv + j * block_v
    # q and k channels are shared by a key head's value heads and column blocks: one program
    # of them writes their new windows (reads come from conv_ref, a different buffer).
    writes_qk = (h % (H // n_k_heads) == 0) & (j == 0)
    channel_sets = ((hk * Dk, Dk), (n_k_heads * Dk + hk * Dk, Dk), (v0, block_v))

    @pl.when(live)
    def _():
        slot = jnp.clip(slots_ref[w], 0, n_slots - 1)
        row = layer_ref[0] * n_slots + slot
        conv_out = []
        for n_set, (c0, n) in enumerate(channel_sets):
            chans = pl.ds(c0, n)
            x = x_ref[w, chans].astype(f32)  # [n]
            window = [conv_ref[row, i, chans].astype(f32) for i in range(taps - 1)]  # oldest first
            acc = x * cw_ref[chans, taps - 1].astype(f32)
            for i in range(taps - 1):
                acc = acc + window[i] * cw_ref[chans, i].astype(f32)
            conv_out.append(acc * jax.nn.sigmoid(acc))  # silu, as `gated_delta.causal_conv`

            def store(window=window, x=x, chans=chans):
                for i, value in enumerate(window[1:] + [x]):
                    win_ref[w, i, chans] = value.astype(win_ref.dtype)

            if n_set == 2:
                store()
            else:
                pl.when(writes_qk)(store)
        q, k, v = conv_out
        beta = jax.nn.sigmoid(b_ref[w, h].astype(f32))
        a = a_ref[w, h].astype(f32) + dtb_ref[h]
        softplus = jnp.maximum(a, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(a)))
        g = -jnp.exp(alog_ref[h]) * softplus
        cols = pl.ds(j * block_v, block_v)
        _rule_block(
            q, k, v, g, beta, state_ref, new_state_ref, out_ref, (row, h, slice(None), cols), (w, h, cols), True
        )

    @pl.when(~live)
    def _():
        out_ref[w, h, pl.ds(j * block_v, block_v)] = jnp.zeros((block_v,), out_ref.dtype)
        for n_set, (c0, n) in enumerate(channel_sets):

            def zero(chans=pl.ds(c0, n), n=n):
                for i in range(taps - 1):
                    win_ref[w, i, chans] = jnp.zeros((n,), win_ref.dtype)

            if n_set == 2:
                zero()
            else:
                pl.when(writes_qk)(zero)


@functools.partial(jax.jit, static_argnames=("n_k_heads", "interpret", "_block_v", "_num_warps"))
def gated_delta_decode_from_projections(
    qkv: jax.Array,
    a: jax.Array,
    b: jax.Array,
    conv: jax.Array,
    conv_weight: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    state: jax.Array,
    slots: jax.Array,
    *,
    layer: jax.Array | int,
    n_k_heads: int,
    live: jax.Array | None = None,
    interpret: bool = False,
    _block_v: int | None = None,
    _num_warps: int = 4,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A Gated DeltaNet layer's decode step from its input projections: the causal conv + SiLU
    over each window's saved conv inputs, beta = sigmoid(b), the decay g = -exp(a_log)
    softplus(a + dt_bias), then `gated_delta_decode`'s rule (q, k l2-normalised). At one
    decode row each of those small steps is a launch of its own in XLA, as long as the rule
    itself; here they are the prologue of the rule's programs, which load only their own
    channels.

    Same arithmetic as `delta_mixer`'s `_rule_inputs` followed by `gated_delta_decode`.

    Args:
      qkv: [W, C] each window's token's qkv projection, C = 2 Hk Dk + H Dv (conv channels).
      a, b: [W, H] its decay input and beta logit.
      conv: [L, S, Kc - 1, C] every layer's conv windows (read only).
      conv_weight: [C, Kc]; a_log, dt_bias: [H] this layer's.
      state: [L, S, H, Dk, Dv] float32 every layer's delta matrices, advanced in place as in
        `gated_delta_decode` (donate it).
      slots, layer, live: as in `gated_delta_decode`.
      n_k_heads: Hk (each serves H / Hk value heads).

    Returns:
      (out [W, H, Dv] float32, the pool, each window's new conv window [W, Kc - 1, C] in
      `conv`'s dtype: zeros for windows that are not live).
    """
    W, C = qkv.shape
    L, n_slots, H, Dk, Dv = state.shape
    taps = conv_weight.shape[1]
    if C != 2 * n_k_heads * Dk + H * Dv or H % n_k_heads:
        raise ValueError(
            f"qkv has {C} channels; {n_k_heads} key heads of {Dk} and {H} value heads of {Dv} need {2 * n_k_heads * Dk + H * Dv}"
        )
    block_v = _block_v or min(Dv, 32)
    if Dv % block_v:
        raise ValueError(f"_block_v={block_v} must divide Dv={Dv}")
    live = jnp.ones((W,), jnp.int32) if live is None else live.astype(jnp.int32)
    pool = state.reshape((L * n_slots, H, Dk, Dv))
    operands = [
        jnp.asarray(layer, jnp.int32).reshape(1),
        slots.astype(jnp.int32),
        live,
        qkv,
        a,
        b,
        conv.reshape((-1,) + conv.shape[-2:]),
        conv_weight,
        a_log.astype(jnp.float32),
        dt_bias.astype(jnp.float32),
        pool,
    ]
    out_shapes = [
        jax.ShapeDtypeStruct((W, H, Dv), jnp.float32),
        jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        jax.ShapeDtypeStruct((W, taps - 1, C), conv.dtype),
    ]
    out, new_pool, windows = pl.pallas_call(
        functools.partial(_from_projections_kernel, n_slots=n_slots, block_v=block_v, n_k_heads=n_k_heads, taps=taps),
        grid=(W, H, Dv // block_v),
        in_specs=[whole_block(x) for x in operands],
        out_specs=[whole_block(o) for o in out_shapes],
        out_shape=out_shapes,
        input_output_aliases={len(operands) - 1: 1},
        interpret=interpret,
        compiler_params=compiler_params(interpret=interpret, num_warps=_num_warps, num_stages=1),
        name="gated_delta_decode_from_projections",
    )(*operands)
    return out, new_pool.reshape(state.shape), windows
