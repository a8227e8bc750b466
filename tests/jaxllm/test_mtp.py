"""The hybrid family's MTP head (`jaxllm.model.mtp`) against a reference built from
transformers' own modules.

transformers ignores `mtp.*` tensors, so the reference is assembled by hand from the pieces
vLLM's `Qwen3NextMultiTokenPredictor` / `Qwen3_5MultiTokenPredictor` use: the family's
zero-centred RMSNorm for the two pre-fc norms and the final one, a bias-free Linear(2D, D)
over [embedding ; hidden], the family's decoder layer built as a full-attention layer, and
the model's embedding and lm_head; float32 on the CPU. The random `mtp.*` tensors are written
next to a tiny saved model as a second safetensors shard and loaded with `load_model`.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from hf_tiny import make_tiny_hf_model
from jaxllm.config import config_from_hf
from jaxllm.loading import load_model
from jaxllm.loading.dummy import dummy_params
from jaxllm.model.mtp import mtp_draft, mtp_draft_slots, mtp_forward

FAMILIES = ("qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")
MTP_SHARD = "model-mtp.safetensors"


def _hf_model(model_dir: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _reference_modules(model: Any, seed: int) -> dict[str, Any]:
    """The head's torch modules with seeded random weights (transformers' in-memory names)."""
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["full_attention"]
    cfg._attn_implementation = "eager"
    full = next(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    layer_cls = type(model.model.layers[full])
    norm_cls = type(model.model.norm)
    D = cfg.hidden_size
    mods = {
        "layer": layer_cls(cfg, 0),
        "pre_fc_norm_embedding": norm_cls(D, eps=cfg.rms_norm_eps),
        "pre_fc_norm_hidden": norm_cls(D, eps=cfg.rms_norm_eps),
        "norm": norm_cls(D, eps=cfg.rms_norm_eps),
        "fc": torch.nn.Linear(2 * D, D, bias=False),
    }
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for mod in mods.values():
            mod.to(torch.float32).eval()
            for name, p in mod.named_parameters():
                if name.endswith("norm.weight") or (name == "weight" and p.ndim == 1):
                    w = 0.1 * rng.standard_normal(p.shape)  # zero-centred norms: scale 1 + w
                else:
                    w = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
                p.copy_(torch.from_numpy(w.astype(np.float32)))
    return mods


def _mtp_tensors(mods: dict[str, Any], experts: str) -> dict[str, np.ndarray]:
    """Checkpoint names of the head's tensors; routed experts one tensor per expert and
    projection (as transformers and the Qwen checkpoints save them) or fused as in memory."""
    out = {
        f"mtp.{k}.weight": mods[k].weight.detach().numpy()
        for k in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
    }
    for name, p in mods["layer"].state_dict().items():
        w = p.detach().numpy()
        if experts == "per_expert" and name == "mlp.experts.gate_up_proj":
            F = w.shape[1] // 2
            for e in range(w.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = w[e, :F]
                out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = w[e, F:]
        elif experts == "per_expert" and name == "mlp.experts.down_proj":
            for e in range(w.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = w[e]
        else:
            out[f"mtp.layers.0.{name}"] = w
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def _add_shard(model_dir: Path, tensors: dict[str, np.ndarray]) -> None:
    """Writes `tensors` as a second shard and the index that lists both shards."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    save_file(tensors, str(model_dir / MTP_SHARD))
    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    weight_map.update({k: MTP_SHARD for k in tensors})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _reference(mods: dict[str, Any], model: Any, hidden: Any, next_tokens: Any, positions: Any) -> tuple[Any, Any]:
    """(logits [T, V], head hidden [T, D]) of the head, vLLM's order of operations."""
    with torch.no_grad():
        emb = mods["pre_fc_norm_embedding"](model.model.embed_tokens(next_tokens))
        x = mods["fc"](torch.cat([emb, mods["pre_fc_norm_hidden"](hidden)], dim=-1))[None]  # [1, T, D]
        T = x.shape[1]
        cos_sin = model.model.rotary_emb(x, positions[None])
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        x = mods["layer"](x, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions[None])
        h = mods["norm"](x[0])
        return model.lm_head(h), h


@pytest.fixture(scope="module", params=FAMILIES)
def mtp_model(request, tmp_path_factory) -> dict[str, Any]:
    """A tiny model saved with `mtp_num_hidden_layers: 1`, its MTP shard added, loaded both
    ways; plus the target's final-normed hidden states of a random sequence."""
    family = request.param
    tmp = tmp_path_factory.mktemp(f"mtp-{family}")
    plain = make_tiny_hf_model(family, tmp, mtp_num_hidden_layers=1)
    model = _hf_model(plain)
    mods = _reference_modules(model, seed=1)
    with_mtp = tmp / "with-mtp"
    shutil.copytree(plain, with_mtp)
    tensors = _mtp_tensors(mods, "per_expert")
    _add_shard(with_mtp, tensors)
    cfg, params = load_model(with_mtp, progress=False)
    tokens = torch.from_numpy(np.random.default_rng(2).integers(0, cfg.vocab_size, 9))
    with torch.no_grad():
        hidden = model.model(tokens[None]).last_hidden_state[0]  # [9, D] final-normed
    return dict(
        family=family,
        dir=plain,
        model=model,
        mods=mods,
        tensors=tensors,
        cfg=cfg,
        params=params,
        tokens=tokens,
        hidden=hidden,
    )


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("T", [1, 7])
def test_mtp_forward_matches_reference(mtp_model, T):
    m = mtp_model
    cfg, params = m["cfg"], m["params"]
    assert cfg.mtp_layers == 1 and params.mtp is not None
    start = 8 - T  # rows t = start .. 7 hold hidden(t); the token at t + 1 comes next
    hidden, next_tokens = m["hidden"][start:8], m["tokens"][start + 1 : 9]
    positions = torch.arange(start, 8)
    want_logits, want_hidden = _reference(m["mods"], m["model"], hidden, next_tokens, positions)
    fn = jax.jit(mtp_forward, static_argnums=1)
    logits, head_hidden = fn(
        params, cfg, jnp.asarray(hidden.numpy()), jnp.asarray(next_tokens.numpy()), jnp.asarray(positions.numpy())
    )
    assert logits.shape == (T, cfg.vocab_size) and logits.dtype == jnp.float32
    assert _rel_err(np.asarray(logits), want_logits.numpy()) < 1e-4
    assert _rel_err(np.asarray(head_hidden), want_hidden.numpy()) < 1e-4


def test_mtp_forward_fused_expert_tensors(mtp_model, tmp_path):
    """Routed experts stored fused ([E, 2F, D] gate_up, [E, D, F] down) load the same."""
    m = mtp_model
    if not m["cfg"].is_moe:
        pytest.skip("dense MLP")
    d = tmp_path / "fused"
    shutil.copytree(m["dir"], d)
    _add_shard(d, _mtp_tensors(m["mods"], "fused"))
    cfg, params = load_model(d, progress=False)
    for a, b in zip(jax.tree.leaves(params.mtp), jax.tree.leaves(m["params"].mtp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_without_mtp_tensors(mtp_model, tmp_path):
    m = mtp_model
    # transformers saved the config key but dropped the head: it loads without it
    assert json.loads((m["dir"] / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    cfg, params = load_model(m["dir"], progress=False)
    assert cfg.mtp_layers == 0 and params.mtp is None
    with pytest.raises(ValueError, match="no MTP head"):
        mtp_forward(params, cfg, jnp.zeros((1, cfg.d_model)), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32))
    # and a config without the key, as before
    d = tmp_path / "no-key"
    shutil.copytree(m["dir"], d)
    hf = json.loads((d / "config.json").read_text())
    del hf["mtp_num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(hf))
    cfg, params = load_model(d, progress=False)
    assert cfg.mtp_layers == 0 and params.mtp is None


@pytest.mark.parametrize("drop", ["mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.self_attn.k_norm.weight"])
def test_missing_mtp_tensor_is_an_error(mtp_model, tmp_path, drop):
    m = mtp_model
    d = tmp_path / "partial"
    shutil.copytree(m["dir"], d)
    _add_shard(d, {k: v for k, v in m["tensors"].items() if k != drop})
    leaf = {
        "mtp.pre_fc_norm_hidden.weight": r"mtp\.norm_hidden",
        "mtp.layers.0.self_attn.k_norm.weight": r"mtp\.block\.mixer\.k_norm\[0\]",
    }[drop]
    with pytest.raises(ValueError, match=f"lacks tensors: {leaf}"):
        load_model(d, progress=False)


@pytest.mark.parametrize("context", [1, 4])
def test_mtp_draft_chains_forward(mtp_model, context):
    """k = 3 drafts equal three `mtp_forward` calls on the growing rows, each appending the
    head's hidden and the argmax of the call before."""
    m = mtp_model
    cfg, params = m["cfg"], m["params"]
    k = 3
    hidden = jnp.asarray(m["hidden"][8 - context : 8].numpy())
    tokens = jnp.asarray(m["tokens"][9 - context : 9].numpy())
    positions = jnp.arange(8 - context, 8, dtype=jnp.int32)
    args = (hidden, tokens, positions) if context > 1 else (hidden[0], tokens[0], positions[0])
    drafts, draft_logits = jax.jit(mtp_draft, static_argnums=(1, 5))(params, cfg, *args, k)
    assert drafts.shape == (k,) and draft_logits.shape == (k, cfg.vocab_size)

    fwd = jax.jit(mtp_forward, static_argnums=1)
    want = []
    for j in range(k):
        logits, head_hidden = fwd(params, cfg, hidden, tokens, positions)
        np.testing.assert_allclose(np.asarray(draft_logits[j]), np.asarray(logits[-1]), rtol=1e-5, atol=1e-5)
        want.append(int(jnp.argmax(logits[-1])))
        hidden = jnp.concatenate([hidden, head_hidden[-1:]])
        tokens = jnp.concatenate([tokens, jnp.array([want[-1]], jnp.int32)])
        positions = jnp.concatenate([positions, positions[-1:] + 1])
    assert np.asarray(drafts).tolist() == want


def test_mtp_draft_slots_equal_one_sequence_at_a_time(mtp_model):
    """A verification round's drafts for all its slots at once: each live row drafts what
    `mtp_draft` drafts for that sequence alone, whatever sits in the other rows."""
    m = mtp_model
    cfg, params = m["cfg"], m["params"]
    k = 3
    picks = [7, 3, 5, 0]  # each row: the hidden at position t and the token at t + 1
    hidden = jnp.asarray(m["hidden"].numpy()[picks])
    tokens = jnp.asarray(m["tokens"].numpy()[[t + 1 for t in picks]])
    positions = jnp.asarray(picks, jnp.int32)
    live = jnp.asarray([True, True, False, True])
    got = jax.jit(mtp_draft_slots, static_argnums=(1, 6))(params, cfg, hidden, tokens, positions, live, k)
    assert got.shape == (len(picks), k)
    one = jax.jit(mtp_draft, static_argnums=(1, 5))
    for s in np.flatnonzero(np.asarray(live)):
        want, _ = one(params, cfg, hidden[s], tokens[s], positions[s], k)
        assert np.asarray(got[s]).tolist() == np.asarray(want).tolist(), s


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dummy_params_have_unit_mtp_norms(mtp_model, dtype):
    """Random weights for a config with an MTP head: its norms are ones, the head runs finite."""
    cfg = config_from_hf(json.loads((mtp_model["dir"] / "config.json").read_text()))
    assert cfg.mtp_layers == 1
    params = dummy_params(cfg, dtype=dtype)
    for name in ("norm_embedding", "norm_hidden", "final_norm"):
        np.testing.assert_array_equal(np.asarray(getattr(params.mtp, name)), 1.0)
    np.testing.assert_array_equal(np.asarray(params.mtp.block.attn_norm), 1.0)
    logits, head_hidden = mtp_forward(params, cfg, jnp.ones((3, cfg.d_model)), jnp.arange(3), jnp.arange(3))
    assert logits.dtype == jnp.float32 and head_hidden.dtype == jnp.dtype(dtype)
    assert bool(jnp.all(jnp.isfinite(logits)))
