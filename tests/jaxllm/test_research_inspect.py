"""Inspection against transformers on tiny random models: per-layer hidden states, attention
weights (eager attention), MoE router choices; the plain forward's logits equal the paged
path's (`Model.logits`); the logit lens of the last layer is the model's own prediction."""

from __future__ import annotations

import numpy as np
import pytest

from hf_tiny import make_tiny_hf_model
from jaxllm.api import Model
from jaxllm.loading import load_model
from jaxllm.research.inspection import logit_lens, logit_lens_table, trace
from jaxllm.tokenizer import Tokenizer
from jaxllm.runtime_options import RuntimeOptions

PROMPT = [3, 17, 99, 5, 64, 23, 23, 7, 120, 1, 45, 88]


def _hf(model_dir, ids):
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    )
    m.eval()
    kwargs = {"output_router_logits": True} if getattr(m.config, "num_experts", 0) else {}
    with torch.no_grad():
        out = m(torch.tensor([ids]), output_hidden_states=True, output_attentions=True, **kwargs)
    return m, out


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_trace_matches_transformers(tmp_path, family):
    import torch

    path = make_tiny_hf_model(family, tmp_path)
    cfg, params = load_model(path, progress=False)
    model = Model(cfg=cfg, params=params, tokenizer=Tokenizer.synthetic(cfg.vocab_size))
    t = trace(model, PROMPT)
    hf, out = _hf(path, PROMPT)
    L = cfg.n_layers
    # transformers' hidden_states: the input of each layer, then the final-normed output.
    for i in range(L):
        assert rel_err(t.residual[i], out.hidden_states[i][0].numpy()) < 1e-4, i
    assert rel_err(t.logits, out.logits[0].numpy()) < 1e-4
    assert rel_err(t.logits, model.logits(PROMPT)) < 1e-4  # the serving (paged) path
    for i in range(L):
        assert rel_err(t.attention[i], out.attentions[i][0].numpy()) < 1e-4, i
    np.testing.assert_allclose(t.attention.sum(-1), 1, atol=1e-5)
    assert t.hidden_norms.shape == (L + 1, len(PROMPT))
    if family == "qwen3_moe":
        k = cfg.n_experts_per_token
        for i in range(L):
            probs = torch.softmax(out.router_logits[i].float(), -1).numpy()
            want = np.sort(np.argsort(-probs, axis=-1, kind="stable")[:, :k], axis=-1)
            assert (np.sort(t.router_experts[i], axis=-1) == want).all()
        np.testing.assert_allclose(t.router_weights.sum(-1), 1, atol=1e-5)
    else:
        assert t.router_experts is None
    # The logit lens at the last layer reads the model's own next-token argmax.
    ids, probs = logit_lens(model, t, top=3)
    assert ids.shape == (L + 1, len(PROMPT), 3)
    assert (ids[-1, :, 0] == t.logits.argmax(-1)).all()
    assert (np.diff(probs, axis=-1) <= 0).all()
    table = logit_lens_table(model, t)
    assert table.shape == (L + 1, len(PROMPT))
    if family == "qwen3":  # unrolled layers (a tuple) trace the same as scanned ones
        cfg_u, params_u = load_model(path, options=RuntimeOptions(scan_layers=False), progress=False)
        t_u = trace(Model(cfg=cfg_u, params=params_u, tokenizer=model.tokenizer), PROMPT)
        np.testing.assert_allclose(t_u.residual, t.residual, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(t_u.attention, t.attention, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_hybrid_trace_matches_transformers(tmp_path, family):
    """Hybrid models: hidden states, attention weights of the full-attention layers and router
    choices as transformers gives them; DeltaNet layers expose their state norms instead,
    which equal the norms of transformers' cached recurrent state after each prefix."""
    import torch

    path = make_tiny_hf_model(family, tmp_path)
    cfg, params = load_model(path, progress=False)
    model = Model(cfg=cfg, params=params, tokenizer=Tokenizer.synthetic(cfg.vocab_size))
    t = trace(model, PROMPT)
    hf, out = _hf(path, PROMPT)
    L, T = cfg.n_layers, len(PROMPT)
    for i in range(L):
        assert rel_err(t.residual[i], out.hidden_states[i][0].numpy()) < 1e-4, i
    assert rel_err(t.logits, out.logits[0].numpy()) < 1e-4
    assert rel_err(t.logits, model.logits(PROMPT)) < 1e-4  # the serving (paged, chunked delta rule) path
    linear = [i for i, kind in enumerate(cfg.layer_types) if kind == "linear_attention"]
    assert t.recurrent_layers == tuple(linear) and linear
    assert t.attention_layers == tuple(i for i in range(L) if i not in linear)
    # transformers records attention weights of the attention layers only, in layer order.
    assert len(out.attentions) == len(t.attention_layers)
    for j, i in enumerate(t.attention_layers):
        assert rel_err(t.attention_of(i), out.attentions[j][0].numpy()) < 1e-4, i
    with pytest.raises(ValueError, match="recurrent_norms"):
        t.attention_of(linear[0])
    assert t.recurrent_norms.shape == (len(linear), T, cfg.linear_n_v_heads)
    for n in (3, T):  # the state after n tokens: transformers' cache after a forward over them
        with torch.no_grad():
            cache = hf(torch.tensor([PROMPT[:n]]), use_cache=True).past_key_values
        for j, i in enumerate(linear):
            state = cache.layers[i].recurrent_states[0].float()  # state 0: [1, Hv, Dk, Dv]
            want = torch.linalg.vector_norm(state, dim=(-2, -1))[0].numpy()
            np.testing.assert_allclose(t.recurrent_norms[j, n - 1], want, rtol=1e-4)
    if cfg.is_moe:
        k = cfg.n_experts_per_token
        for i in range(L):
            probs = torch.softmax(out.router_logits[i].float(), -1).numpy()
            want = np.sort(np.argsort(-probs, axis=-1, kind="stable")[:, :k], axis=-1)
            assert (np.sort(t.router_experts[i], axis=-1) == want).all()
    else:
        assert t.router_experts is None
    ids, _ = logit_lens(model, t, top=2)
    assert (ids[-1, :, 0] == t.logits.argmax(-1)).all()
