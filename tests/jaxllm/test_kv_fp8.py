"""An 8-bit (float8_e4m3fn) K/V cache: every attention path widens what it reads.

The oracle is numpy on the float8 values widened to float64 (ml_dtypes does the 8-bit
rounding independently of XLA): attention over an 8-bit cache must equal full-precision
attention over exactly those rounded keys and values.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tiny_configs import TINY_DENSE
from jaxllm.attention.fused import fresh_causal_attention
from jaxllm.attention.paged_decode import paged_decode_attention, paged_decode_attention_qkv
from jaxllm.attention.reference import Windows, paged_attention, paged_decode_reference
from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.loading.dummy import dummy_params
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.loading.orbax_io import restore_pytree, save_pytree
from jaxllm.sampling import SamplingParams
from jaxllm.state import to_kv_dtype

FP8 = jnp.float8_e4m3fn
H, K, DH, PAGE, P = 4, 2, 16, 4, 12
G = H // K


def _fp8(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 2.0) -> jnp.ndarray:
    return to_kv_dtype(jnp.asarray(rng.normal(size=shape) * scale, jnp.float32), FP8)


def _wide(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _attend(q: np.ndarray, keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """One query token's heads [H, Dh] over keys/values [S, K, Dh] (grouped heads)."""
    out = np.zeros(q.shape)
    for h in range(H):
        logits = keys[:, h // G] @ q[h] / np.sqrt(DH)
        p = np.exp(logits - logits.max())
        out[h] = (p / p.sum()) @ vals[:, h // G]
    return out


def test_rounding_saturates_instead_of_overflowing_to_nan():
    x = jnp.asarray([1000.0, -1e6, 0.3, -2.5e-3, 448.0], jnp.float32)
    got = np.asarray(to_kv_dtype(x, FP8))
    want = np.clip(np.asarray(x), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert got.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    assert np.isfinite(got.astype(np.float32)).all()
    # Plain astype would have turned the overflow into nan: the reason for the clip.
    assert np.isnan(np.asarray(x.astype(FP8)).astype(np.float32)[0])


def test_chunk_attention_over_an_fp8_cache_matches_numpy():
    """Prompt chunks with cached context (the reference path) and without (the fused one)."""
    rng = np.random.default_rng(0)
    T = 16
    q = jnp.asarray(rng.normal(size=(T, H, DH)), jnp.float32)
    k_new, v_new = _fp8(rng, (T, K, DH)), _fp8(rng, (T, K, DH))
    k_pages, v_pages = _fp8(rng, (P, PAGE, K, DH)), _fp8(rng, (P, PAGE, K, DH))
    table = jnp.asarray([[3, 5, 7, 1], [0, 0, 0, 0]], jnp.int32)
    first = 6  # the chunk continues a sequence of 6 cached positions
    positions = jnp.asarray(first + np.arange(T), jnp.int32)
    windows = Windows(slot=jnp.asarray([0]), start=jnp.asarray([0]), length=jnp.asarray([10]))
    got = paged_attention(q, k_new, v_new, positions, k_pages, v_pages, table, windows, window_len=10, n_ctx_pages=4)
    kc = _wide(k_pages)[np.asarray(table[0])].reshape(-1, K, DH)[:first]
    vc = _wide(v_pages)[np.asarray(table[0])].reshape(-1, K, DH)[:first]
    for i in range(10):
        keys = np.concatenate([kc, _wide(k_new)[: i + 1]])
        vals = np.concatenate([vc, _wide(v_new)[: i + 1]])
        np.testing.assert_allclose(got[i], _attend(_wide(q)[i], keys, vals), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got)[10:])

    fresh = fresh_causal_attention(q, k_new, v_new, windows, window_len=10, implementation="xla")
    for i in range(10):
        want = _attend(_wide(q)[i], _wide(k_new)[: i + 1], _wide(v_new)[: i + 1])
        np.testing.assert_allclose(fresh[i], want, rtol=1e-5, atol=1e-5)


def _decode_inputs(seed: int):
    rng = np.random.default_rng(seed)
    cached = np.asarray([0, 1, PAGE, 2 * PAGE + 3], np.int32)
    W = len(cached)
    pages = np.stack([rng.permutation(np.arange(1, P))[:4] for _ in range(W)]).astype(np.int32)
    return rng, cached, pages, _fp8(rng, (P, PAGE, K, DH)), _fp8(rng, (P, PAGE, K, DH))


def _decode_oracle(q, k_fresh, v_fresh, k_pages, v_pages, pages, cached) -> np.ndarray:
    out = []
    for w in range(len(cached)):
        keys = np.concatenate([_wide(k_pages)[pages[w]].reshape(-1, K, DH)[: cached[w]], k_fresh[w][None]])
        vals = np.concatenate([_wide(v_pages)[pages[w]].reshape(-1, K, DH)[: cached[w]], v_fresh[w][None]])
        out.append(_attend(q[w], keys, vals))
    return np.stack(out)


def test_decode_paths_over_an_fp8_cache_match_numpy():
    """The jnp decode reference and the Pallas kernel (interpreted) on an 8-bit pool."""
    rng, cached, pages, k_pages, v_pages = _decode_inputs(1)
    W = len(cached)
    q = jnp.asarray(rng.normal(size=(W, H, DH)), jnp.float32)
    k_new, v_new = _fp8(rng, (W, K, DH)), _fp8(rng, (W, K, DH))
    want = _decode_oracle(_wide(q), _wide(k_new), _wide(v_new), k_pages, v_pages, pages, cached)

    windows = Windows(slot=jnp.arange(W), start=jnp.arange(W), length=jnp.ones((W,), jnp.int32))
    table = jnp.asarray(np.concatenate([pages, np.zeros((1, 4), np.int32)]))
    ref = paged_decode_reference(q, k_new, v_new, jnp.asarray(cached), k_pages, v_pages, table, windows, n_ctx_pages=4)
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)

    kernel = paged_decode_attention(
        q, k_new, v_new, k_pages, v_pages, jnp.asarray(pages), jnp.asarray(cached), interpret=True, _pages_per_block=4
    )
    assert kernel.dtype == jnp.float32
    np.testing.assert_allclose(kernel, want, rtol=1e-5, atol=1e-5)


def test_kernel_over_an_fp8_cache_with_bfloat16_queries():
    """A 16-bit model's kernel multiplies an 8-bit pool in float16: within bfloat16's
    rounding of the oracle on the same (bfloat16) queries, and finite for queries past
    float16's range (clipped to it)."""
    rng, cached, pages, k_pages, v_pages = _decode_inputs(2)
    W = len(cached)
    q = jnp.asarray(rng.normal(size=(W, H, DH)), jnp.bfloat16)
    k_new, v_new = _fp8(rng, (W, K, DH)), _fp8(rng, (W, K, DH))
    args = (k_new, v_new, k_pages, v_pages, jnp.asarray(pages), jnp.asarray(cached))
    got = paged_decode_attention(q, *args, interpret=True, _pages_per_block=4)
    assert got.dtype == jnp.bfloat16
    want = _decode_oracle(_wide(q.astype(jnp.float32)), _wide(k_new), _wide(v_new), k_pages, v_pages, pages, cached)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)
    huge = paged_decode_attention(q * 1e6, *args, interpret=True, _pages_per_block=4)
    assert np.isfinite(np.asarray(huge, np.float32)).all()


def _rotate_half(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def test_kernel_from_the_projection_rounds_the_fresh_kv_through_the_pool():
    """The fused-projection kernel rotates the fresh key itself: it must attend to the key and
    value as the 8-bit cache will hold them, saturated."""
    rng, cached, pages, k_pages, v_pages = _decode_inputs(2)
    W = len(cached)
    qkv = rng.normal(size=(W, H + 2 * K, DH)) * 3
    qkv[0, H, 0] = 5000.0  # a raw key past float8's range: saturates at 448, not nan
    positions = cached.copy()
    inv_freq = 1.0 / (10000 ** (np.arange(0, DH, 2) / DH))
    angles = positions[:, None, None].astype(np.float64) * inv_freq[None, None, :]
    q = _rotate_half(qkv[:, :H], angles)
    k_rot = _rotate_half(qkv[:, H : H + K], angles)
    k_fresh = np.clip(k_rot, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    v_fresh = np.clip(qkv[:, H + K :], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    want = _decode_oracle(q, _wide(k_fresh), _wide(v_fresh), k_pages, v_pages, pages, cached)

    out = paged_decode_attention_qkv(
        jnp.asarray(qkv, jnp.float32),
        jnp.asarray(positions),
        jnp.asarray(inv_freq, jnp.float32),
        k_pages,
        v_pages,
        jnp.asarray(pages),
        jnp.asarray(cached),
        n_heads=H,
        interpret=True,
    )
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


TINY = TINY_DENSE
ENGINE = EngineConfig(
    max_slots=4,
    kv_bytes=1 << 20,
    max_seq_len=64,
    chunk_buckets=(8, 16),
    min_ctx_pages=2,
    decode_steps_per_call=4,
    decode_widths=(4,),
)
PROMPTS = [list(range(3, 8)), list(range(10, 21))]


@pytest.fixture(scope="module")
def tiny_params():
    return dummy_params(TINY, seed=3)


def _prefill_and_decode(opts: RuntimeOptions, params, max_tokens: int) -> tuple[Engine, list]:
    engine = Engine(TINY, params, eos_ids=[], config=ENGINE, options=opts)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    seqs = [engine.add(p, greedy) for p in PROMPTS]
    while any(s.finish_reason is None for s in seqs):
        engine.step()
    return engine, seqs


def test_engine_with_an_fp8_cache(tiny_params):
    """The cache is 8-bit (4x the positions of a float32 one in the same bytes); the first
    layer's cached keys are the float32 engine's rounded (they depend on nothing attention
    computed); the Pallas kernel (interpreted) and the jnp reference decode the same; the
    outputs stay close to the float32 cache's."""
    f32, f32_seqs = _prefill_and_decode(RuntimeOptions(), tiny_params, 1)
    fp8, fp8_seqs = _prefill_and_decode(RuntimeOptions(kv_dtype="float8_e4m3fn"), tiny_params, 1)
    assert fp8.state.kv.k.dtype == FP8 and fp8.layout.n_pages == 4 * f32.layout.n_pages
    for a, b in zip(f32_seqs, fp8_seqs):
        rows = np.asarray(f32.layout.pages_for(len(a.prompt)))
        k32 = np.asarray(f32.state.kv.k[0])[a.pages[:rows]].reshape(-1, K, 4 * 2)[: len(a.prompt)]
        k8 = _wide(fp8.state.kv.k[0])[b.pages[:rows]].reshape(-1, K, 4 * 2)[: len(b.prompt)]
        want = np.clip(k32, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        np.testing.assert_array_equal(k8, want)
        # The first token's log-probability: within float8's rounding of the float32 cache's.
        assert abs(a.logprobs[0] - b.logprobs[0]) < 0.05, (a.logprobs[0], b.logprobs[0])

    ref_engine, ref = _prefill_and_decode(
        RuntimeOptions(kv_dtype="float8_e4m3fn", decode_attention="reference"), tiny_params, 6
    )
    _, kern = _prefill_and_decode(
        RuntimeOptions(kv_dtype="float8_e4m3fn", decode_attention="interpret"), tiny_params, 6
    )
    for a, b in zip(ref, kern):
        assert a.generated == b.generated
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)

    # An 8-bit checkpoint (a cached prefix, a paused request) round-trips through orbax.
    ckpt = ref_engine.extract(ref[1])
    back = restore_pytree(_save(ckpt), like=ckpt)
    assert back.k.dtype == FP8
    np.testing.assert_array_equal(_wide(back.k), _wide(ckpt.k))


def _save(tree) -> str:
    import tempfile

    path = tempfile.mkdtemp() + "/ckpt"
    save_pytree(path, tree)
    return path


def test_cli_spellings():
    from jaxllm.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["generate", "--prompt", "x", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "float8_e4m3fn"
    assert parse(["generate", "--prompt", "x"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parse(["generate", "--prompt", "x", "--kv-cache-dtype", "int4"])
    with pytest.raises(ValueError, match="kv_dtype"):
        RuntimeOptions(kv_dtype="int8")
