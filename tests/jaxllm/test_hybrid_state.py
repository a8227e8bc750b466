"""A hybrid model's sequence state is data: pause / resume into another slot, prefix
checkpoints at chunk stops, an orbax round trip, all continuing with the tokens of a fresh
prefill. (Parity of the numbers themselves with transformers: test_model_parity.py.)"""

from __future__ import annotations

import tempfile

import chex
import jax
import numpy as np
import pytest

from jaxllm.config import load_config_json
from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.loading.dummy import dummy_params
from jaxllm.loading.orbax_io import load_orbax_model, restore_pytree, save_model, save_pytree
from jaxllm.params import layout_params, param_shapes
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.sampling import SamplingParams
from jaxllm.state import recurrent_bytes_per_sequence
from tiny_configs import TINY_HYBRID_MOE  # tests/ is on sys.path (conftest)

CFG = TINY_HYBRID_MOE
PROMPT = [5, 9, 33, 2, 71, 14, 14, 60, 3, 44, 12, 87, 6, 6, 19, 50, 23]
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def params():
    # Larger weights than the loader's default so the distribution is not near uniform.
    return jax.tree.map(lambda x: x * 8 if x.ndim > 1 else x, dummy_params(CFG, seed=1))


def make_engine(params, **kw) -> Engine:
    config = EngineConfig(
        max_slots=3,
        kv_bytes=1 << 20,
        max_seq_len=64,
        chunk_buckets=(8, 32),
        min_ctx_pages=2,
        decode_widths=(1, 2),
        **kw,
    )
    return Engine(CFG, params, eos_ids=[0], config=config)


def run(engine: Engine, seqs) -> None:
    while any(s.finish_reason is None for s in seqs):
        engine.step()


def fresh(params, prompt, sampling=SAMPLED, **kw) -> list[int]:
    engine = make_engine(params, **kw)
    seq = engine.add(prompt, sampling)
    run(engine, [seq])
    return seq.generated


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_pause_and_resume_in_another_slot_equals_never_paused(params, steps_per_call):
    ref = fresh(params, PROMPT, decode_steps_per_call=steps_per_call)
    engine = make_engine(params, decode_steps_per_call=steps_per_call)
    seq = engine.add(PROMPT, SAMPLED)
    for _ in range(3):
        engine.step()
    paused = engine.pause(seq)
    assert paused.checkpoint.delta is not None and paused.checkpoint.conv is not None
    other = engine.add([8, 8, 8], SamplingParams(temperature=0, max_tokens=4))  # takes the old slot
    resumed = engine.resume(paused)
    assert resumed.slot != seq.slot
    run(engine, [resumed, other])
    assert resumed.generated == ref


def test_prefix_checkpoint_at_a_stop_continues_like_a_fresh_prefill(params):
    """Chunks end at the requested stop; the checkpoint taken there serves a longer prompt
    with the same prefix, which then samples exactly what a fresh prefill samples."""
    stop = 11
    engine = make_engine(params)
    donor = engine.add(PROMPT, SAMPLED, stops=[stop])
    engine.step()  # the largest chunk bucket would cover the whole prompt; the stop cuts it
    assert donor.prefilled == stop
    assert engine.can_extract(donor, stop) and not engine.can_extract(donor, stop - 1)
    ckpt = engine.extract(donor, stop)
    with pytest.raises(ValueError, match="no state of exactly"):
        engine.extract(donor, stop - 1)
    run(engine, [donor])
    assert not engine.can_extract(donor, len(PROMPT))  # decode steps moved the recurrent state on

    longer = PROMPT[:stop] + [70, 71, 72, 1, 2]
    engine = make_engine(params)
    seq = engine.add(longer, SAMPLED, checkpoint=ckpt, cached_tokens=stop)
    run(engine, [seq])
    assert seq.generated == fresh(params, longer)
    with pytest.raises(ValueError, match="exactly"):
        engine.add(longer, SAMPLED, checkpoint=ckpt, cached_tokens=stop - 2)
    assert len(engine.free_slots) == 2  # the refused add gave its slot back


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT + PROMPT[::-1] + [8, 9]], ids=["one-chunk", "two-chunks"])
def test_exact_repeat_from_the_last_but_one_position(params, prompt):
    """The exact-repeat checkpoint (prompt[:-1]) costs no round of its own: the chunk that ends
    the prompt also keeps the state one token earlier in the side row, and that checkpoint
    holds what prefilling prompt[:-1] alone holds."""
    engine = make_engine(params)
    donor = engine.add(prompt, SAMPLED, stops=[len(prompt) - 1])
    while donor.prefilled < len(prompt) - 1:
        engine.step()
    assert donor.prefilled == len(prompt) and len(donor.generated) == 1  # the whole prompt, first token drawn
    assert engine.can_extract(donor, len(prompt) - 1)
    ckpt = engine.extract(donor, len(prompt) - 1)
    run(engine, [donor])
    assert engine.can_extract(donor, len(prompt) - 1)  # decode rounds leave the side row alone

    reference = make_engine(params)
    alone = reference.add(prompt[:-1], SAMPLED)
    while alone.prefilled < len(prompt) - 1:
        reference.step()
    expected = reference.extract(alone, len(prompt) - 1)
    np.testing.assert_allclose(ckpt.delta, expected.delta, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ckpt.conv, expected.conv, rtol=1e-6, atol=1e-6)
    n = len(prompt) - 1  # K/V of the prefix's positions (pages hold more)
    got_k = np.asarray(ckpt.k).reshape(ckpt.k.shape[0], -1, *ckpt.k.shape[3:])[:, :n]
    want_k = np.asarray(expected.k).reshape(expected.k.shape[0], -1, *expected.k.shape[3:])[:, :n]
    np.testing.assert_allclose(got_k, want_k, rtol=1e-4, atol=1e-5)

    again = engine.add(prompt, SAMPLED, checkpoint=ckpt, cached_tokens=len(prompt) - 1)
    run(engine, [again])
    assert again.generated == donor.generated
    assert not engine.can_extract(donor, len(prompt) - 1)  # the next chunk took the side row


def test_checkpoint_and_model_round_trip_through_orbax(params):
    engine = make_engine(params)
    seq = engine.add(PROMPT, SAMPLED)
    for _ in range(3):
        engine.step()
    ckpt = engine.extract(seq)
    path = tempfile.mkdtemp() + "/ckpt"
    save_pytree(path, ckpt)
    chex.assert_trees_all_equal(restore_pytree(path, like=ckpt), ckpt)

    model_dir = tempfile.mkdtemp() + "/model"
    save_model(model_dir, CFG, params)
    cfg, back = load_orbax_model(model_dir)
    assert cfg == CFG and hash(cfg) == hash(CFG)
    chex.assert_trees_all_equal(back, params)


def test_recurrent_state_is_a_fixed_size_per_slot(params):
    per_seq = (
        4 * 2 * ((CFG.conv_kernel - 1) * CFG.conv_dim + CFG.linear_n_v_heads * CFG.linear_k_dim * CFG.linear_v_dim)
    )
    assert recurrent_bytes_per_sequence(CFG) == per_seq
    engine = make_engine(params)
    # linear layers, slots + trash row + side row, Hv, Dk, Dv
    assert engine.state.recurrent.delta.shape == (2, 5, 4, 8, 8)
    assert engine.state.kv.k.shape[0] == CFG.n_kv_layers == 2


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "qwen3.5-0.8b"])
def test_presets_have_the_published_shapes(name):
    cfg = load_config_json(f"configs/{name}.json")
    shapes = param_shapes(cfg)  # no allocation
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    mtp = 0 if shapes.mtp is None else sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes.mtp))
    assert n - mtp == cfg.param_count()
    expected = {"qwen3.5-35b-a3b": 35e9, "qwen3-next-80b-a3b": 80e9, "qwen3.5-0.8b": 0.8e9}[name]
    assert abs(cfg.param_count() / expected - 1) < 0.07
    assert cfg.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)


@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_decode_kernel_and_unrolled_layers_match_the_scanned_jnp_recurrence(params, steps_per_call):
    """The Pallas decode kernel (interpreted) advances decode rows in place in the pool the
    layer scan carries, while a prompt prefills beside them, with the add + RMSNorm kernel
    (interpreted) between blocks; unrolled layers (the GPU layout) run the same blocks: the
    same tokens and states as the scanned jnp recurrence with XLA's norms."""
    greedy = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    runs = []
    for kernel, unrolled in (("reference", False), ("interpret", False), ("interpret", True)):
        config = EngineConfig(
            max_slots=3,
            kv_bytes=1 << 20,
            max_seq_len=64,
            chunk_buckets=(8, 32),
            min_ctx_pages=2,
            decode_widths=(1, 2),
            decode_steps_per_call=steps_per_call,
        )
        norm = "xla" if kernel == "reference" else "interpret"
        opts = RuntimeOptions(decode_delta=kernel, decode_norm=norm, scan_layers=not unrolled)
        engine = Engine(CFG, layout_params(params, opts.scan_layers), eos_ids=[0], config=config, options=opts)
        first = engine.add(PROMPT, greedy)
        engine.step()
        engine.step()  # `first` decodes from here on
        second = engine.add(PROMPT[3:14], SAMPLED)  # prefills in rounds beside `first`'s decode rows
        run(engine, [first, second])
        runs.append((first.generated, second.generated, np.asarray(engine.state.recurrent.delta)))
    (a_ref, b_ref, state_ref), *others = runs
    for a, b, state in others:
        assert a == a_ref and b == b_ref
        # Slot rows only: the trash and side rows (the last two) are scratch.
        np.testing.assert_allclose(state[:, :-2], state_ref[:, :-2], rtol=1e-4, atol=1e-5)
