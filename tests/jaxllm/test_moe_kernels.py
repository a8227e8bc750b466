"""The MoE grouped-matmul kernels (Pallas interpreter, on the CPU) against the plain-jnp
MoE: `moe_ffn_reference` (float32, full-precision products) and `layers.moe_mlp`'s
`ragged_dot` path."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ModelConfig
from jaxllm.model import moe_kernels
from jaxllm.model.layers import moe_mlp
from jaxllm.model.moe_kernels import (
    WIDE_BLOCK_M,
    default_block_m,
    grouped_blocks,
    moe_ffn,
    moe_ffn_reference,
    moe_layout,
)
from jaxllm.params import MoeParams

# Small tiles, so the tiny shapes still take several K steps and column tiles.
SMALL = (("gu_block_k", 32), ("gu_block_n", 16), ("dn_block_k", 16), ("dn_block_n", 32))


def _weights(rng, E: int, D: int, F: int, dtype=jnp.float32):
    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), dtype)

    return w(E, D, F), w(E, D, F), w(E, F, D)


def _routing(rng, T: int, E: int, k: int, skew: bool):
    """Top-k distinct experts per token; `skew` sends most tokens to the same few experts, so
    an expert spans several grouped blocks."""
    if skew:
        top_e = np.stack([rng.permutation(min(E, k + 1))[:k] for _ in range(T)])
    else:
        top_e = np.stack([rng.permutation(E)[:k] for _ in range(T)])
    top_w = rng.random((T, k)).astype(np.float32)
    return jnp.asarray(top_e, jnp.int32), jnp.asarray(top_w / top_w.sum(1, keepdims=True))


# (T, E, k, layout, block_m, skew)
CASES = [
    (1, 8, 2, "pairs", None, False),
    (3, 8, 2, "pairs", None, False),  # three tokens, some expert likely shared
    (1, 8, 2, "grouped", 16, False),
    (9, 8, 2, "grouped", 16, False),
    (40, 4, 2, "grouped", 16, True),  # ~27 rows per expert: two or three blocks each
    (20, 16, 4, "grouped", 32, False),  # more experts than pairs per expert: many unused
]


@pytest.mark.parametrize("T,E,k,layout,block_m,skew", CASES)
def test_kernels_match_reference(T, E, k, layout, block_m, skew):
    rng = np.random.default_rng(T * 100 + E * 10 + k)
    D, F = 64, 32
    wg, wu, wd = _weights(rng, E, D, F)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    top_e, top_w = _routing(rng, T, E, k, skew)
    ours = moe_ffn(x, top_e, top_w, wg, wu, wd, _layout=layout, _block_m=block_m, interpret=True, _config=SMALL)
    ref = moe_ffn_reference(x, top_e, top_w, wg, wu, wd)
    assert ours.shape == (T, D) and ours.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_bfloat16_close_to_float32_reference():
    rng = np.random.default_rng(7)
    T, E, k, D, F = 6, 8, 2, 64, 32
    wg, wu, wd = _weights(rng, E, D, F, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    top_e, top_w = _routing(rng, T, E, k, False)
    ref = np.asarray(moe_ffn_reference(x, top_e, top_w, wg, wu, wd))
    for layout in ("pairs", "grouped"):
        ours = moe_ffn(x, top_e, top_w, wg, wu, wd, _layout=layout, interpret=True, _config=SMALL)
        assert ours.dtype == jnp.bfloat16
        err = np.linalg.norm(np.asarray(ours, np.float32) - ref) / np.linalg.norm(ref)
        assert err < 1e-2, (layout, err)


def test_grouped_blocks_place_every_pair_once_in_its_experts_block():
    rng = np.random.default_rng(3)
    T, E, k, bm = 37, 6, 3, 16
    top_e, _ = _routing(rng, T, E, k, True)
    b = grouped_blocks(top_e, E, bm)
    out_row, rows = np.asarray(b.out_row), np.asarray(b.rows)
    block_expert, used = np.asarray(b.block_expert), int(b.used[0])
    flat = np.asarray(top_e).reshape(-1)
    assert len(set(out_row.tolist())) == T * k  # no two pairs share a row
    assert (out_row // bm < used).all() and used <= b.n_blocks
    np.testing.assert_array_equal(block_expert[out_row // bm], flat)  # each row in its expert's block
    np.testing.assert_array_equal(rows[out_row], np.arange(T * k) // k)  # and reads its token
    sizes = np.bincount(flat, minlength=E)
    assert used == (-(-sizes // bm)).sum()


@pytest.mark.parametrize("T,E,k,bm,skew", [(16, 256, 8, 16, False), (37, 6, 3, 16, True), (9, 16, 2, 32, False)])
def test_grouped_layout_by_counting_equals_the_sorted_one(monkeypatch, T, E, k, bm, skew):
    """Decode rounds lay rows out by comparisons (no sort, no scatter); prompt rounds by a
    stable sort. Both give the same rows, blocks and row weights, idle tokens included."""
    rng = np.random.default_rng(T + E)
    top_e, top_w = _routing(rng, T, E, k, skew)
    valid = jnp.asarray(rng.random(T) < 0.7)
    counted = grouped_blocks(top_e, E, bm, valid)
    assert T * k <= moe_kernels.COUNTING_LAYOUT_MAX_PAIRS
    monkeypatch.setattr(moe_kernels, "COUNTING_LAYOUT_MAX_PAIRS", 0)
    sorted_ = grouped_blocks(top_e, E, bm, valid)
    for name in ("rows", "block_expert", "used"):
        np.testing.assert_array_equal(getattr(counted, name), getattr(sorted_, name), err_msg=name)
    n_rows = counted.n_blocks * bm
    live = np.repeat(np.asarray(valid), k)  # idle pairs: any row past the last
    np.testing.assert_array_equal(np.asarray(counted.out_row)[live], np.asarray(sorted_.out_row)[live])
    assert (np.asarray(counted.out_row)[~live] >= n_rows).all() and (np.asarray(sorted_.out_row)[~live] >= n_rows).all()
    w = jnp.asarray(top_w).reshape(-1).astype(jnp.float32)
    by_scatter = moe_kernels.on_kernel_rows(counted.out_row, w, n_rows)
    monkeypatch.setattr(moe_kernels, "COUNTING_LAYOUT_MAX_PAIRS", 512)
    np.testing.assert_array_equal(moe_kernels.on_kernel_rows(counted.out_row, w, n_rows), by_scatter)


def test_layout_per_round_width():
    assert moe_layout(1) == "pairs" and moe_layout(2) == "pairs" and moe_layout(8) == "grouped"


@pytest.mark.parametrize("dtype,T", [("float32", 1), ("float32", 2), ("float32", 7), ("bfloat16", 5)])
def test_moe_mlp_kernel_matches_ragged_dot_path(dtype, T):
    """The dispatch in `moe_mlp`: routing, normalisation and the expert counts unchanged, the
    output equal to the ragged_dot path's within the dtype's rounding."""
    cfg = ModelConfig(
        family="qwen3_moe",
        vocab_size=32,
        d_model=64,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=96,
        max_position=64,
        n_experts=8,
        n_experts_per_token=2,
        moe_ffn_dim=32,
        norm_topk_prob=True,
    )
    rng = np.random.default_rng(T)
    jdt = jnp.dtype(dtype)
    wg, wu, wd = _weights(rng, 8, 64, 32, jdt)
    p = MoeParams(router=jnp.asarray(rng.standard_normal((64, 8)), jdt), w_gate=wg, w_up=wu, w_down=wd)
    x = jnp.asarray(rng.standard_normal((T, 64)), jdt)
    n_valid = max(T - 1, 1)  # the last token is padding, except in a round of one
    valid = jnp.arange(T) < n_valid
    ref, ref_counts = moe_mlp(x, p, cfg, valid, kernel=None)
    ours, counts = moe_mlp(x, p, cfg, valid, kernel="interpret")
    np.testing.assert_array_equal(counts, ref_counts)
    assert int(counts.sum()) == 2 * n_valid
    r, o = np.asarray(ref, np.float32), np.asarray(ours, np.float32)
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert np.linalg.norm(o - r) / np.linalg.norm(r) < tol
    assert not o[~np.asarray(valid)].any() and not r[~np.asarray(valid)].any()  # padding rows: zeros


def test_grouped_blocks_give_padding_tokens_no_rows():
    """Idle tokens (valid False) take no kernel rows, so no block reads an expert for them;
    the others are laid out as without them."""
    rng = np.random.default_rng(5)
    T, E, k, bm = 24, 16, 2, 16
    top_e, top_w = _routing(rng, T, E, k, False)
    valid = np.arange(T) % 3 == 0
    b = grouped_blocks(top_e, E, bm, jnp.asarray(valid))
    live = np.repeat(valid, k)
    out_row, used = np.asarray(b.out_row), int(b.used[0])
    assert (out_row[~live] >= b.n_blocks * bm).all()
    flat = np.asarray(top_e).reshape(-1)
    assert used == (-(-np.bincount(flat[live], minlength=E) // bm)).sum()
    np.testing.assert_array_equal(np.asarray(b.block_expert)[out_row[live] // bm], flat[live])
    # The outputs: the valid tokens' as without the mask, zeros for the others.
    wg, wu, wd = _weights(rng, E, 64, 32)
    x = jnp.asarray(rng.standard_normal((T, 64)), jnp.float32)
    masked = moe_ffn(x, top_e, top_w, wg, wu, wd, valid=jnp.asarray(valid), _layout="grouped", interpret=True)
    full = moe_ffn(x, top_e, top_w, wg, wu, wd, _layout="grouped", interpret=True)
    np.testing.assert_allclose(np.asarray(masked)[valid], np.asarray(full)[valid], rtol=1e-6, atol=1e-6)
    assert not np.asarray(masked)[~valid].any()


def test_prompt_rounds_take_wide_blocks_and_match_the_reference():
    """From 64 rows an expert the default blocks are 64 rows with 128-wide down tiles
    (`WIDE_BLOCK_TILES`, the prompt-round launch): same results as the reference."""
    rng = np.random.default_rng(3)
    T, E, k, D, F = 128, 4, 2, 128, 32
    assert default_block_m(T * k, E) == WIDE_BLOCK_M
    wg, wu, wd = _weights(rng, E, D, F)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    top_e, top_w = _routing(rng, T, E, k, False)
    ours = moe_ffn(x, top_e, top_w, wg, wu, wd, _layout="grouped", interpret=True)
    ref = moe_ffn_reference(x, top_e, top_w, wg, wu, wd)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=2e-5, atol=2e-5)
