"""Gated DeltaNet math (jaxllm.model.gated_delta) against a naive numpy loop of the
definition and against transformers' torch reference functions for Qwen3-Next."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model.gated_delta import (
    causal_conv,
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_rms_norm,
    l2_normalize,
    unit_lower_solve,
)

H, DK, DV = 2, 8, 4
CHUNK = 16
RULES = {
    "recurrent": lambda *a, **kw: gated_delta_recurrent(*a, **kw),
    "chunked": lambda *a, **kw: gated_delta_chunked(*a, chunk=CHUNK, **kw),
    # the GPU's form of the per-chunk solve (unit_lower_solve), run here on the CPU
    "chunked_products": lambda *a, **kw: gated_delta_chunked(*a, chunk=CHUNK, solve="products", **kw),
}


# ---------------------------------------------------------------- references and inputs


def _naive_rule(q, k, v, g, beta, state, lengths, qk_l2norm=True):
    """The delta rule from its definition, float64, one token of one head at a time; tokens
    past a segment's length are skipped (their outputs left at zero)."""
    N, T = q.shape[:2]
    out = np.zeros(v.shape, np.float64)
    s_all = np.array(state, np.float64)
    for n in range(N):
        for h in range(q.shape[2]):
            s = s_all[n, h]  # [Dk, Dv]
            for t in range(int(lengths[n])):
                qt, kt = np.float64(q[n, t, h]), np.float64(k[n, t, h])
                if qk_l2norm:
                    qt = qt / np.sqrt(qt @ qt + 1e-6)
                    kt = kt / np.sqrt(kt @ kt + 1e-6)
                qt = qt / np.sqrt(len(qt))
                s = s * np.exp(np.float64(g[n, t, h]))
                delta = (v[n, t, h] - kt @ s) * beta[n, t, h]
                s = s + np.outer(kt, delta)
                out[n, t, h] = qt @ s
            s_all[n, h] = s
    return out, s_all


def _naive_conv(x, window, weight, lengths):
    """y[t] = silu(sum_j w[:, j] * u[t + j]) over u = window ++ x, and the new window, by loops."""
    N, T, C = x.shape
    K = weight.shape[1]
    y = np.zeros((N, T, C))
    new_window = np.zeros(window.shape)
    for n in range(N):
        u = np.concatenate([window[n], x[n]], axis=0).astype(np.float64)
        for t in range(T):
            z = sum(weight[:, j] * u[t + j] for j in range(K))
            y[n, t] = z / (1 + np.exp(-z))
        live = list(window[n]) + list(x[n, : lengths[n]])
        new_window[n] = np.array(live[len(live) - (K - 1) :])
    return y, new_window


def _rule_inputs(seed: int, N: int, T: int, lengths=None, g_low: float = -1.0, k_scale: float = 1.0):
    """Random q, k, v, g, beta, state (float32); positions past `lengths` get the padding
    convention g = 0, beta = 0 (and random q, k, v)."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    q, k, v = f(N, T, H, DK), f(N, T, H, DK) * k_scale, f(N, T, H, DV)
    g = rng.uniform(g_low, 0, size=(N, T, H)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, size=(N, T, H)).astype(np.float32)
    state = f(N, H, DK, DV)
    lengths = np.full((N,), T, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    live = (np.arange(T)[None, :] < lengths[:, None])[:, :, None]
    return q, k, v, np.where(live, g, 0).astype(np.float32), np.where(live, beta, 0).astype(np.float32), state, lengths


def _close(actual, expected, tol=1e-4):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol)


def _live(out, lengths):
    """out with positions past each segment's length zeroed (they are garbage by contract)."""
    out = np.array(out, np.float64)
    for n, length in enumerate(lengths):
        out[n, length:] = 0
    return out


# ---------------------------------------------------------------- the naive definition


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T,short", [(5, 3), (16, 0), (33, 17), (70, 48)])  # chunk boundaries at 16, 32, 64
def test_rule_matches_naive_loop(rule, T, short):
    """Outputs at live positions and final states, one full and one shorter segment."""
    q, k, v, g, beta, state, lengths = _rule_inputs(T, 2, T, lengths=[T, short])
    out, new_state = RULES[rule](q, k, v, g, beta, state)
    ref_out, ref_state = _naive_rule(q, k, v, g, beta, state, lengths)
    assert out.shape == v.shape and out.dtype == jnp.float32
    assert new_state.shape == state.shape and new_state.dtype == jnp.float32
    _close(_live(out, lengths), ref_out)
    _close(new_state, ref_state)


@pytest.mark.parametrize("rule", RULES)
def test_rule_without_l2norm(rule):
    """qk_l2norm=False uses q, k as given (small k keeps the rule contractive)."""
    q, k, v, g, beta, state, lengths = _rule_inputs(1, 2, 21, k_scale=0.2)
    out, new_state = RULES[rule](q, k, v, g, beta, state, qk_l2norm=False)
    ref_out, ref_state = _naive_rule(q, k, v, g, beta, state, lengths, qk_l2norm=False)
    _close(out, ref_out)
    _close(new_state, ref_state)
    normed, _ = _naive_rule(q, k, v, g, beta, state, lengths)
    assert not np.allclose(np.asarray(out), normed, rtol=1e-2, atol=1e-2)


def test_chunked_with_strong_decay_stays_finite():
    """Cumulative decays far below float32's exp range inside a chunk: no inf - inf."""
    q, k, v, g, beta, state, lengths = _rule_inputs(2, 2, 40, g_low=-60.0)
    out, new_state = RULES["chunked"](q, k, v, g, beta, state)
    ref_out, ref_state = _naive_rule(q, k, v, g, beta, state, lengths)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(new_state)).all()
    _close(out, ref_out)
    _close(new_state, ref_state)


def test_chunked_agrees_with_recurrent_at_default_chunk():
    """chunk=64 (the default) across two chunks, relative ~1e-4 as the runtime relies on."""
    q, k, v, g, beta, state, _ = _rule_inputs(3, 2, 100, g_low=-0.3)
    out_c, s_c = gated_delta_chunked(q, k, v, g, beta, state)
    out_r, s_r = gated_delta_recurrent(q, k, v, g, beta, state)
    np.testing.assert_allclose(out_c, out_r, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s_c, s_r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("L", [16, 64])
def test_unit_lower_solve_forms_match_numpy(L):
    """Both forms of the per-chunk solve against numpy's dense solve of (I + strict_lower(A)),
    with a diagonal and upper part that must not be read."""
    rng = np.random.default_rng(L)
    system = rng.uniform(-1, 1, size=(3, L, L)).astype(np.float32)  # |entries| <= 1, as beta (k.k) e^(c_i - c_j)
    rhs = rng.normal(size=(3, L, 5)).astype(np.float32)
    lower = np.tril(system.astype(np.float64), -1) + np.eye(L)
    ref = np.linalg.solve(lower, rhs.astype(np.float64))
    for solve in ("triangular", "products"):
        got = np.asarray(unit_lower_solve(jnp.asarray(system), jnp.asarray(rhs), solve=solve), np.float64)
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max(), err_msg=solve)
    with pytest.raises(ValueError, match="power-of-two"):
        unit_lower_solve(jnp.ones((2, 12, 12)), jnp.ones((2, 12, 1)), solve="products")


# ---------------------------------------------------------------- padding and splits


@pytest.mark.parametrize("rule", RULES)
def test_padding_leaves_state_unchanged(rule):
    """g = 0, beta = 0 everywhere: the state comes back bit for bit, whatever q, k, v are."""
    q, k, v, g, beta, state, _ = _rule_inputs(4, 2, 19, lengths=[0, 0])
    assert np.all(g == 0) and np.all(beta == 0)
    _, new_state = RULES[rule](q * 100, k * 100, v * 100, g, beta, state)
    np.testing.assert_array_equal(new_state, state)


@pytest.mark.parametrize("rule", RULES)
def test_padded_tail_equals_unpadded_segment(rule):
    """A segment padded from 11 to 29 tokens ends in the state of the 11 tokens alone."""
    q, k, v, g, beta, state, _ = _rule_inputs(5, 1, 29, lengths=[11])
    out_pad, s_pad = RULES[rule](q, k, v, g, beta, state)
    out, s = RULES[rule](q[:, :11], k[:, :11], v[:, :11], g[:, :11], beta[:, :11], state)
    np.testing.assert_allclose(out_pad[:, :11], out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s_pad, s, rtol=1e-5, atol=1e-6)


def _layer(x, window, state, lengths, weight, rule):
    """conv then the delta rule on a padded batch of segments, as the model will chain them:
    the conv's channels are q ++ k ++ v, g and beta come with x."""
    xc, gates = x[..., : -2 * H], x[..., -2 * H :]
    y, window = causal_conv(xc, window, weight, lengths)
    N, T = y.shape[:2]
    q = y[..., : H * DK].reshape(N, T, H, DK)
    k = y[..., H * DK : 2 * H * DK].reshape(N, T, H, DK)
    v = y[..., 2 * H * DK :].reshape(N, T, H, DV)
    live = (jnp.arange(T)[None, :] < lengths[:, None])[:, :, None]
    g = jnp.where(live, -jnp.abs(gates[..., :H]), 0)
    beta = jnp.where(live, 1 / (1 + jnp.exp(-gates[..., H:])), 0)
    out, state = RULES[rule](q, k, v, g, beta, state)
    return out, window, state


@pytest.mark.parametrize("rule", RULES)
def test_split_into_pieces_equals_whole(rule):
    """Two sequences of 41 and 30 tokens, fed as one call, or as rounds of padded pieces of
    different lengths (a round where one sequence sits idle with length 0), carrying the
    conv window and the state: the same outputs and final window and state."""
    Kw, C = 4, 2 * H * DK + H * DV
    rng = np.random.default_rng(6)
    totals = [41, 30]
    x = rng.normal(size=(2, 41, C + 2 * H)).astype(np.float32)
    weight = rng.normal(size=(C, Kw)).astype(np.float32) * 0.5
    window0 = rng.normal(size=(2, Kw - 1, C)).astype(np.float32)
    state0 = rng.normal(size=(2, H, DK, DV)).astype(np.float32)
    whole, w_whole, s_whole = _layer(x, window0, state0, jnp.asarray(totals), weight, rule)
    # Rounds of piece lengths per sequence; each round is padded to 18 tokens.
    rounds = [(13, 1), (1, 0), (2, 18), (18, 11), (7, 0)]
    assert [sum(r[i] for r in rounds) for i in range(2)] == totals
    window, state, starts, pieces = window0, state0, [0, 0], [[], []]
    for lens in rounds:
        xr = np.zeros((2, 18, C + 2 * H), np.float32) + 3.0  # padding holds junk
        for n in range(2):
            xr[n, : lens[n]] = x[n, starts[n] : starts[n] + lens[n]]
        out, window, state = _layer(xr, window, state, jnp.asarray(lens, jnp.int32), weight, rule)
        for n in range(2):
            pieces[n].append(np.asarray(out[n, : lens[n]]))
            starts[n] += lens[n]
    for n in range(2):
        np.testing.assert_allclose(np.concatenate(pieces[n]), whole[n, : totals[n]], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(window, w_whole, rtol=0, atol=0)
    np.testing.assert_allclose(state, s_whole, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the conv


@pytest.mark.parametrize("Kw", [4, 2])
def test_conv_matches_naive_loop(Kw):
    """Segments of length 0 (window kept), 2 (< K-1 when K = 4: the window shifts) and T."""
    rng = np.random.default_rng(Kw)
    N, T, C = 3, 9, 5
    x = rng.normal(size=(N, T, C)).astype(np.float32)
    window = rng.normal(size=(N, Kw - 1, C)).astype(np.float32)
    weight = rng.normal(size=(C, Kw)).astype(np.float32)
    lengths = np.asarray([0, 2, T], np.int32)
    y, new_window = causal_conv(x, window, weight, lengths)
    ref_y, ref_window = _naive_conv(x, window, weight, lengths)
    assert y.shape == x.shape and new_window.shape == window.shape
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new_window, ref_window)
    np.testing.assert_array_equal(new_window[0], window[0])


# ---------------------------------------------------------------- transformers' torch functions


def _hf():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    return torch, hf


def test_conv_matches_hf_prefill_then_updates():
    """HF's prefill conv on 7 tokens, then 4 cached one-token updates (its state is the last
    K inputs), against our conv on the 11 tokens at once and on pieces 7, 1, 1, 2."""
    torch, hf = _hf()
    rng = np.random.default_rng(8)
    Kw, C, T0, T = 4, 6, 7, 11
    x = rng.normal(size=(1, T, C)).astype(np.float32)
    weight = rng.normal(size=(C, Kw)).astype(np.float32)
    xt, wt = torch.from_numpy(x).transpose(1, 2), torch.from_numpy(weight)  # [1, C, T]
    with torch.no_grad():
        ys = [hf.causal_conv1d_fn(xt[:, :, :T0], wt, None, activation="silu")]
        conv_state = torch.nn.functional.pad(xt[:, :, :T0], (Kw, 0))[:, :, -Kw:].clone()
        for t in range(T0, T):
            ys.append(hf.causal_conv1d_update(xt[:, :, t : t + 1], conv_state, wt, None, activation="silu"))
    ref = torch.cat(ys, dim=-1).transpose(1, 2).numpy()

    zeros = np.zeros((1, Kw - 1, C), np.float32)
    y, window = causal_conv(x, zeros, weight, np.asarray([T], np.int32))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(window, conv_state[:, :, 1:].transpose(1, 2).numpy(), rtol=0, atol=0)

    window, parts = zeros, []
    for lo, hi in [(0, 7), (7, 8), (8, 9), (9, 11)]:
        piece = x[:, lo:hi]
        yp, window = causal_conv(piece, window, weight, np.asarray([hi - lo], np.int32))
        parts.append(np.asarray(yp))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", RULES)
def test_rule_matches_hf(rule):
    """Against HF's torch_chunk_gated_delta_rule (chunk 16) and torch_recurrent_gated_delta_rule,
    with one key head serving both value heads: the caller repeat-interleaves q and k."""
    torch, hf = _hf()
    q, k, v, g, beta, state, _ = _rule_inputs(9, 2, 37)
    q1, k1 = q[:, :, :1], k[:, :, :1]  # [N, T, 1, Dk]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    kw = dict(initial_state=t(state), output_final_state=True, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        if rule == "chunked":
            ref_out, ref_state = hf.torch_chunk_gated_delta_rule(
                t(q1), t(k1), t(v), t(g), t(beta), chunk_size=CHUNK, **kw
            )
        else:
            ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(t(q1), t(k1), t(v), t(g), t(beta), **kw)
    qr, kr = np.repeat(q1, H, axis=2), np.repeat(k1, H, axis=2)
    out, new_state = RULES[rule](qr, kr, v, g, beta, state)
    np.testing.assert_allclose(out, ref_out.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new_state, ref_state.numpy(), rtol=1e-4, atol=1e-5)


def test_l2_normalize_matches_hf():
    torch, hf = _hf()
    x = np.random.default_rng(10).normal(size=(3, 5, DK)).astype(np.float32)
    x[0, 0] = 0  # a zero vector stays zero (eps inside the root)
    np.testing.assert_allclose(l2_normalize(x), hf.l2norm(torch.from_numpy(x)).numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_rms_norm_matches_hf(dtype):
    torch, hf = _hf()
    rng = np.random.default_rng(11)
    x = rng.normal(size=(3, 4, 16)).astype(np.float32) * 3
    z = rng.normal(size=(3, 4, 16)).astype(np.float32)
    w = rng.normal(size=(16,)).astype(np.float32)
    tdt = getattr(torch, dtype)
    norm = hf.Qwen3NextRMSNormGated(16, eps=1e-6).to(tdt)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        ref = norm(torch.from_numpy(x).to(tdt), torch.from_numpy(z).to(tdt)).float().numpy()
    jdt = jnp.dtype(dtype)
    ours = gated_rms_norm(jnp.asarray(x, jdt), jnp.asarray(z, jdt), jnp.asarray(w, jdt), 1e-6)
    assert ours.dtype == jdt
    tol = 1e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(ours, np.float32), ref, rtol=tol, atol=tol)


# ---------------------------------------------------------------- the Pallas decode kernel (interpreter)


def _decode_inputs(seed: int, W: int, S: int, Dv: int = 8, dtype=np.float32):
    """One token per window ([W, H, ...]) and a pool of S slot states."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(W, H, d)).astype(dtype) for d in (DK, DK, Dv))
    g = rng.uniform(-1, 0, size=(W, H)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, size=(W, H)).astype(np.float32)
    pool = rng.normal(size=(S, H, DK, Dv)).astype(np.float32)
    return q, k, v, g, beta, pool


def _decode_reference(q, k, v, g, beta, pool, slots, qk_l2norm=True):
    """gated_delta_recurrent on the windows' gathered states, T = 1."""
    out, states = gated_delta_recurrent(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], pool[np.asarray(slots)], qk_l2norm=qk_l2norm
    )
    return out[:, 0], states


@pytest.mark.parametrize("block_v,qk_l2norm", [(None, True), (4, True), (2, False)])
def test_decode_kernel_matches_recurrent(block_v, qk_l2norm):
    """Three windows on slots 3, 0, 4 of a 6-slot pool: their rows advance one token like the
    recurrent rule, the other slots stay bit for bit."""
    from jaxllm.model.gated_delta_kernel import gated_delta_decode

    q, k, v, g, beta, pool = _decode_inputs(12, 3, 6)
    if not qk_l2norm:
        k = k * 0.2
    slots = np.asarray([3, 0, 4], np.int32)
    out, new_pool = gated_delta_decode(
        q, k, v, g, beta, pool, slots, qk_l2norm=qk_l2norm, _block_v=block_v, interpret=True
    )
    ref_out, ref_states = _decode_reference(q, k, v, g, beta, pool, slots, qk_l2norm)
    assert out.shape == v.shape and new_pool.shape == pool.shape and new_pool.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new_pool)[slots], ref_states, rtol=1e-5, atol=1e-6)
    others = [1, 2, 5]
    np.testing.assert_array_equal(np.asarray(new_pool)[others], pool[others])


def test_decode_kernel_dead_windows_touch_nothing():
    """A dead window naming a live window's slot (and one naming an idle slot) neither writes
    the pool nor returns anything but zeros."""
    from jaxllm.model.gated_delta_kernel import gated_delta_decode

    q, k, v, g, beta, pool = _decode_inputs(13, 4, 5)
    slots = np.asarray([2, 2, 0, 1], np.int32)
    live = np.asarray([1, 0, 1, 0], np.int32)
    out, new_pool = gated_delta_decode(q, k, v, g, beta, pool, slots, live=live, _block_v=4, interpret=True)
    keep = np.asarray([0, 2])
    ref_out, ref_states = _decode_reference(q[keep], k[keep], v[keep], g[keep], beta[keep], pool, slots[keep])
    np.testing.assert_allclose(np.asarray(out)[keep], ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out)[[1, 3]], 0)
    np.testing.assert_allclose(np.asarray(new_pool)[[2, 0]], ref_states, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(new_pool)[[1, 3, 4]], pool[[1, 3, 4]])


def test_decode_kernel_stacked_layers_and_bfloat16():
    """An [L, S, ...] stack with a traced layer index updates that layer only; bfloat16
    q, k, v give a bfloat16 output close to the float32 rule on the same values."""
    import jax

    from jaxllm.model.gated_delta_kernel import gated_delta_decode

    q, k, v, g, beta, pool = _decode_inputs(14, 2, 3)
    stack = np.stack([pool + 1, pool, pool - 1])  # [3, S, H, Dk, Dv]
    slots = np.asarray([2, 0], np.int32)
    qb, kb, vb = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
    run = jax.jit(lambda *a, layer: gated_delta_decode(*a, layer=layer, interpret=True))
    out, new_stack = run(qb, kb, vb, g, beta, stack, slots, layer=jnp.int32(1))
    assert out.dtype == jnp.bfloat16 and new_stack.shape == stack.shape
    f32 = [np.asarray(a, np.float32) for a in (qb, kb, vb)]
    ref_out, ref_states = _decode_reference(*f32, g, beta, pool, slots)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(new_stack)[1][slots], ref_states, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(new_stack)[1][1], pool[1])
    np.testing.assert_array_equal(np.asarray(new_stack)[[0, 2]], stack[[0, 2]])


@pytest.mark.parametrize("block_v", [None, 4])
def test_decode_kernel_from_projections_matches_conv_gates_and_rule(block_v):
    """The kernel that also runs the conv and the gates: two live windows and a dead one on a
    stacked pool, two key heads serving four value heads. Outputs, advanced matrices and new
    conv windows as `causal_conv` + the gates + `gated_delta_recurrent`; other rows untouched,
    the dead window's output and window zeros."""
    from jaxllm.model.gated_delta_kernel import gated_delta_decode_from_projections

    rng = np.random.default_rng(21)
    Hk, Hv, Dk, Dv, Kc, L, S, W = 2, 4, 8, 8, 4, 2, 5, 3
    C = 2 * Hk * Dk + Hv * Dv
    qkv = rng.normal(size=(W, C)).astype(np.float32)
    a, b = rng.normal(size=(W, Hv)).astype(np.float32), rng.normal(size=(W, Hv)).astype(np.float32)
    conv = rng.normal(size=(L, S, Kc - 1, C)).astype(np.float32)
    conv_w = rng.normal(size=(C, Kc)).astype(np.float32) * 0.5
    a_log, dt_bias = rng.normal(size=Hv).astype(np.float32), rng.normal(size=Hv).astype(np.float32)
    pool = rng.normal(size=(L, S, Hv, Dk, Dv)).astype(np.float32)
    slots, live, layer = np.asarray([3, 0, 1], np.int32), np.asarray([1, 1, 0]), 1

    out, new_pool, windows = gated_delta_decode_from_projections(
        qkv, a, b, conv, conv_w, a_log, dt_bias, pool, slots, layer=layer, n_k_heads=Hk, live=live,
        interpret=True, _block_v=block_v,
    )  # fmt: skip
    keep = np.asarray([0, 1])
    y, ref_windows = causal_conv(qkv[keep, None], conv[layer, slots[keep]], conv_w, np.ones(2, np.int32))
    q, k, v = np.split(np.asarray(y)[:, 0], [Hk * Dk, 2 * Hk * Dk], axis=-1)
    q = np.repeat(q.reshape(2, Hk, Dk), Hv // Hk, axis=1)
    k = np.repeat(k.reshape(2, Hk, Dk), Hv // Hk, axis=1)
    beta = 1 / (1 + np.exp(-b[keep]))
    g = -np.exp(a_log) * np.logaddexp(a[keep] + dt_bias, 0)
    ref_out, ref_states = _decode_reference(q, k, v.reshape(2, Hv, Dv), g, beta, pool[layer], slots[keep])
    np.testing.assert_allclose(np.asarray(out)[keep], ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new_pool)[layer][slots[keep]], ref_states, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(windows)[keep], ref_windows, rtol=1e-6, atol=1e-6)
    assert not np.asarray(out)[2].any() and not np.asarray(windows)[2].any()
    untouched = np.ones((L, S), bool)
    untouched[layer, slots[keep]] = False
    np.testing.assert_array_equal(np.asarray(new_pool)[untouched], pool[untouched])
