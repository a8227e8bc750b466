"""Parity with Hugging Face transformers on tiny random models of every family.

The reference is transformers' own PyTorch model, built and saved by `tests/hf_tiny.py` and
loaded here through our safetensors loader. Checks: whole-prompt logits (scan and unrolled
layers), prefill + N decode steps against one full forward, and a mixed ragged batch against
each sequence run alone.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import make_tiny_hf_model
from jaxllm.api import prompt_logits
from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.loading import load_model
from jaxllm.sampling import SamplingParams
from jaxllm.runtime_options import RuntimeOptions

CASES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama3-rope-scaled", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("qwen3_moe", {}),
    ("qwen3_next", {}),
    ("qwen3_5_moe_text", {}),
    ("qwen3_5_text", {}),
]
HYBRID = ["qwen3_next", "qwen3_5_moe_text", "qwen3_5_text"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f"{fam}{'-tied' if kw else ''}": make_tiny_hf_model(fam, root, **kw) for fam, kw in CASES}


def hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


PROMPT = [3, 17, 99, 5, 64, 23, 23, 7, 120, 1, 45, 88, 12, 9, 31, 77, 2, 100, 54, 6]


@pytest.mark.parametrize("name", [f"{f}{'-tied' if kw else ''}" for f, kw in CASES])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_prompt_logits_match_transformers(tiny_models, name, scan_layers):
    cfg, params = load_model(tiny_models[name], options=RuntimeOptions(scan_layers=scan_layers), progress=False)
    ours = np.asarray(prompt_logits(params, cfg, jnp.asarray(PROMPT, jnp.int32)))
    ref = hf_logits(tiny_models[name], PROMPT)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text"])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_input_axes_last_weights_give_the_same_model(tiny_models, name, scan_layers):
    """The GPU's weight layout (RuntimeOptions.weight_layout "out_in": dense projections
    stored input-axes-last) forced on the CPU: transformers' logits, the same greedy tokens
    through the engine as the canonical layout, and the canonical tree back exactly."""
    from jaxllm.params import OutIn, canonical_params

    opts = RuntimeOptions(scan_layers=scan_layers, weight_layout="out_in")
    cfg, params = load_model(tiny_models[name], options=opts, progress=False)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, OutIn))
    assert any(isinstance(x, OutIn) for x in leaves)
    ours = np.asarray(prompt_logits(params, cfg, jnp.asarray(PROMPT, jnp.int32)))
    assert rel_err(ours, hf_logits(tiny_models[name], PROMPT)) < 1e-4

    _, plain = load_model(tiny_models[name], options=opts.replace(weight_layout="in_out"), progress=False)
    jax.tree.map(np.testing.assert_array_equal, canonical_params(params), canonical_params(plain))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = [
        _run_alone(_engine(cfg, p, options=o), PROMPT[:11], greedy).generated
        for p, o in ((params, opts), (plain, opts.replace(weight_layout="in_out")))
    ]
    assert runs[0] == runs[1]


def _engine(cfg, params, options: RuntimeOptions | None = None, **kw) -> Engine:
    config = EngineConfig(
        max_slots=4,
        kv_bytes=cfg.n_layers * 2 * 16 * cfg.n_kv_heads * cfg.head_dim * 4 * 64,
        max_seq_len=128,
        chunk_buckets=(8, 32),
        min_ctx_pages=2,
        decode_widths=(1, 2),
        **kw,
    )
    return Engine(cfg, params, eos_ids=[], config=config, options=options or RuntimeOptions())


def _run_alone(engine: Engine, prompt: list[int], params: SamplingParams):
    seq = engine.add(prompt, params)
    while seq.finish_reason is None:
        engine.step()
    engine.remove(seq)
    return seq


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3_moe", *HYBRID])
@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_prefill_then_decode_equals_full_forward(tiny_models, name, steps_per_call):
    """Greedy tokens and their logprobs equal a full forward over prompt + generated."""
    cfg, params = load_model(tiny_models[name], progress=False)
    engine = _engine(cfg, params, decode_steps_per_call=steps_per_call)
    seq = _run_alone(engine, PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    full = PROMPT + seq.generated
    ref = hf_logits(tiny_models[name], full)
    ref_logprobs = jax.nn.log_softmax(jnp.asarray(ref), axis=-1)
    for i, token in enumerate(seq.generated):
        row = np.asarray(ref[len(PROMPT) - 1 + i])
        assert token == int(np.argmax(row)) or np.sort(row)[-1] - np.sort(row)[-2] < 1e-4
        assert abs(seq.logprobs[i] - float(ref_logprobs[len(PROMPT) - 1 + i, token])) < 1e-4
    assert seq.finish_reason == "length"
    assert len(seq.generated) == 12


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5_moe_text"])
def test_mixed_ragged_batch_equals_each_alone(tiny_models, name):
    """Several prompts prefilled in chunks beside decoding neighbours give the alone result
    (for the hybrid: each slot's recurrent state carried across chunks, untouched by others)."""
    cfg, params = load_model(tiny_models[name], progress=False)
    prompts = [PROMPT[:3], PROMPT, PROMPT[5:] * 3, [7]]
    params_ = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    alone = [_run_alone(_engine(cfg, params, decode_steps_per_call=1), p, params_) for p in prompts]

    engine = _engine(cfg, params, decode_steps_per_call=1)
    seqs = [engine.add(prompts[0], params_)]
    engine.step(prefill_budget=5)
    seqs.append(engine.add(prompts[1], params_))
    engine.step(prefill_budget=5)
    seqs += [engine.add(p, params_) for p in prompts[2:]]
    while any(s.finish_reason is None for s in seqs):
        engine.step(prefill_budget=7)
    for a, b in zip(alone, seqs):
        assert a.generated == b.generated
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_moe_step_reports_tokens_per_expert(tiny_models):
    """Every token fed to the model is routed to top-k experts in every layer, and counted once."""
    cfg, params = load_model(tiny_models["qwen3_moe"], progress=False)
    engine = _engine(cfg, params, decode_steps_per_call=4)
    seq = _run_alone(engine, PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    fed = len(PROMPT) + len(seq.generated) - 1  # the last drawn token is never fed back
    counts = engine.expert_tokens
    assert counts.shape == (cfg.n_layers, cfg.n_experts)
    np.testing.assert_array_equal(counts.sum(axis=1), cfg.n_experts_per_token * fed)
    assert (counts > 0).sum() > cfg.n_experts_per_token  # routing spreads over experts


def test_moe_round_reports_distinct_experts_per_step(tiny_models):
    """A decode step of one sequence touches exactly top-k experts in every layer; a step of
    several touches between top-k and min(E, width * top-k), and the figure is per step."""
    cfg, params = load_model(tiny_models["qwen3_moe"], progress=False)
    k = cfg.n_experts_per_token
    engine = _engine(cfg, params, decode_steps_per_call=3)
    one = _run_alone(engine, PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    # The last round decoded `one` alone (steps past its max_tokens route nothing: 0).
    assert len(one.generated) == 4 and {d for d in engine.last_distinct_experts if d} == {k}
    prompts = (PROMPT, PROMPT[2:], [7, 8, 9])
    seqs = [engine.add(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for p in prompts]
    steps = []
    while any(s.finish_reason is None for s in seqs):
        decoding_only = all(s.prefilled >= len(s.prompt) for s in seqs)  # before the round: no prompt rows in it
        engine.step()
        steps += [d for d in engine.last_distinct_experts if d] if decoding_only else []
    assert steps and all(k <= d <= min(cfg.n_experts, 3 * k) for d in steps)
    assert max(steps) > k  # three different sequences do not share every expert
