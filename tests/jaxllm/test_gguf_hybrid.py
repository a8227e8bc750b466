"""GGUF files of the hybrid family (llama.cpp's qwen3next / qwen35 / qwen35moe) load like the
safetensors directory they were converted from.

Each tiny model is saved by transformers, written as GGUF by `hf_tiny.hf_to_gguf` (which
applies llama.cpp's converter transforms: +1 norms, -exp(A_log), tiled value heads for
Qwen3.5, split qkvz for Qwen3-Next) and loaded by our GGUF loader; the reference is our
safetensors load of the same directory and transformers' own forward.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import HYBRID_FAMILIES, hf_to_gguf, make_tiny_hf_model, tile_value_heads

from jaxllm.api import prompt_logits
from jaxllm.loading.gguf import load_gguf_model
from jaxllm.loading.gguf_hybrid import untile_value_heads
from jaxllm.loading.safetensors import load_safetensors_model
from jaxllm.params import canonical_params

PROMPT = [3, 17, 99, 5, 64, 23, 23, 7, 120, 1, 45, 88, 12, 9, 31, 77]
ARCH = {"qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {f: make_tiny_hf_model(f, root) for f in HYBRID_FAMILIES}


@pytest.fixture(scope="module")
def reference(tiny: dict[str, Path]) -> dict[str, tuple[Any, Any, np.ndarray, np.ndarray]]:
    """Per family: safetensors (cfg, params), our logits from them, and transformers' logits."""
    import torch
    import transformers

    out = {}
    for family, model_dir in tiny.items():
        cfg, params = load_safetensors_model(model_dir, progress=False)
        ours = np.asarray(prompt_logits(params, cfg, jnp.asarray(PROMPT, jnp.int32)))
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            hf = model(torch.tensor([PROMPT])).logits[0].numpy()
        out[family] = (cfg, params, ours, hf)
    return out


def _max_leaf_error(a: Any, b: Any) -> dict[str, float]:
    flat_a = jax.tree_util.tree_flatten_with_path(canonical_params(a))[0]
    flat_b = jax.tree_util.tree_flatten_with_path(canonical_params(b))[0]
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    return {jax.tree_util.keystr(p): float(jnp.max(jnp.abs(x - y))) for (p, x), (_, y) in zip(flat_a, flat_b)}


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_f32_gguf_equals_safetensors(tiny, reference, tmp_path: Path, family: str) -> None:
    path = hf_to_gguf(tiny[family], tmp_path / "m.gguf")
    assert gguf.GGUFReader(path).get_field("general.architecture").contents() == ARCH[family]
    cfg, params = load_gguf_model(path, progress=False)
    st_cfg, st_params, st_logits, hf_logits = reference[family]
    assert cfg == st_cfg.replace(max_position=cfg.max_position)
    errors = _max_leaf_error(params, st_params)
    assert max(errors.values()) < 1e-6, {k: e for k, e in errors.items() if e >= 1e-6}
    logits = np.asarray(prompt_logits(params, cfg, jnp.asarray(PROMPT, jnp.int32)))
    np.testing.assert_allclose(logits, st_logits, atol=1e-5, rtol=0)
    assert np.max(np.abs(logits - hf_logits)) / np.max(np.abs(hf_logits)) < 1e-4


def test_legacy_qwen3_next_ssm_in(tiny, reference, tmp_path: Path) -> None:
    """Older converters kept Qwen3-Next's grouped in_proj_qkvz whole as `ssm_in`."""
    path = hf_to_gguf(tiny["qwen3_next"], tmp_path / "m.gguf", legacy_qkvz=True)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.0.ssm_in.weight" in names and "blk.0.attn_qkv.weight" not in names
    _, params = load_gguf_model(path, progress=False)
    assert max(_max_leaf_error(params, reference["qwen3_next"][1]).values()) < 1e-6


def _q8_0_rounded_copy(src: Path, dst: Path) -> Path:
    """The model directory with every tensor llama.cpp's converter writes as Q8_0 rounded
    through Q8_0 (gguf-py's quantize + dequantize) in HF's layout.

    The converter's transforms before quantizing only reorder rows (qkvz split, Qwen3.5's
    value-head tiling, expert stacking) or whole head-aligned column groups (ssm_out), and a
    Q8_0 element depends only on itself and its 32-block's max |x|, so this is element for
    element the weights a Q8_0 GGUF holds. Kept in F32, as by the converter: 1-D tensors,
    names not ending in .weight, routers (mlp.gate, shared_expert_gate) and conv1d.
    """
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    state = load_file(str(path))
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, x in state.items():
        keep = (
            x.ndim < 2
            or not name.endswith(".weight")
            or x.shape[-1] % 32
            or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "conv1d.weight"))
        )
        if not keep:
            state[name] = gguf.quants.dequantize(gguf.quants.quantize(x, q8), q8).astype(x.dtype)
    save_file(state, str(path), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_q8_0_gguf_equals_rounded_safetensors(tiny, reference, tmp_path: Path, family: str) -> None:
    path = hf_to_gguf(tiny[family], tmp_path / "m.gguf", qtype="Q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.1.attn_q.weight"] == "Q8_0" and types["blk.0.ssm_out.weight"] == "Q8_0"
    assert types["blk.0.attn_qkv.weight"] == "Q8_0" and types["blk.0.ssm_conv1d.weight"] == "F32"
    cfg, params = load_gguf_model(path, progress=False)
    st_cfg, _, st_logits, _ = reference[family]
    assert cfg == st_cfg.replace(max_position=cfg.max_position)
    logits = np.asarray(prompt_logits(params, cfg, jnp.asarray(PROMPT, jnp.int32)))
    # Exactly the quantized weights, in our layout...
    _, rounded = load_safetensors_model(_q8_0_rounded_copy(tiny[family], tmp_path / "rounded"), progress=False)
    errors = _max_leaf_error(params, rounded)
    assert max(errors.values()) < 1e-6, {k: e for k, e in errors.items() if e >= 1e-6}
    want = np.asarray(prompt_logits(rounded, cfg, jnp.asarray(PROMPT, jnp.int32)))
    np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)
    # ...and near the float model (the MoE routers flip some near-tied choices).
    assert np.mean(np.abs(logits - st_logits)) / np.mean(np.abs(st_logits)) < 0.1


def test_value_head_untiling_inverts_the_converter() -> None:
    """Tiled order serves value head j from key head j % Hk; untiling restores HF's j // r."""
    Hk, Hv, d = 2, 6, 3
    grouped = np.arange(Hv * d * 5, dtype=np.float32).reshape(Hv * d, 5)
    tiled = tile_value_heads(grouped, 0, Hk, Hv)
    key_of_grouped = np.repeat(np.arange(Hv) // (Hv // Hk), d)
    key_of_tiled = tile_value_heads(key_of_grouped[:, None], 0, Hk, Hv)[:, 0]
    np.testing.assert_array_equal(key_of_tiled, np.repeat(np.arange(Hv) % Hk, d))
    assert not np.array_equal(tiled, grouped)
    np.testing.assert_array_equal(untile_value_heads(tiled, 0, Hk, Hv), grouped)
    np.testing.assert_array_equal(untile_value_heads(tile_value_heads(grouped.T, 1, Hk, Hv), 1, Hk, Hv), grouped.T)


def _copy_gguf(
    src: Path,
    dst: Path,
    *,
    fields: dict[str, int] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    """Rewrites a GGUF with some integer metadata replaced or added, the tensors named in
    `drop` left out and `extra` F32 tensors added."""
    reader = gguf.GGUFReader(src)
    arch = reader.get_field("general.architecture").contents()
    w = gguf.GGUFWriter(str(dst), arch)
    fields = dict(fields or {})
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in fields:
            w.add_uint32(key, fields.pop(key))
        elif f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), f.types[0])
    for key, value in fields.items():
        w.add_uint32(key, value)
    for t in reader.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, x in (extra or {}).items():
        w.add_tensor(name, x.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_mtp_blocks_are_skipped_with_a_warning(tiny, reference, tmp_path: Path) -> None:
    """Newer converters append Qwen3.5's MTP head as blk.{n}.* + nextn.*; the main model loads."""
    src = hf_to_gguf(tiny["qwen3_5_text"], tmp_path / "m.gguf")
    reader = gguf.GGUFReader(src)
    n = reader.get_field("qwen35.block_count").contents()
    rng = np.random.default_rng(0)
    extra = {
        f"blk.{n}.{t.name.split('.', 2)[2]}": rng.standard_normal(np.asarray(t.data).shape)
        for t in reader.tensors
        if t.name.startswith("blk.1.")
    }  # a full-attention block's tensors
    extra[f"blk.{n}.nextn.eh_proj.weight"] = rng.standard_normal((64, 128))
    path = _copy_gguf(
        src, tmp_path / "mtp.gguf", fields={"qwen35.block_count": n + 1, "qwen35.nextn_predict_layers": 1}, extra=extra
    )
    with pytest.warns(UserWarning, match="multi-token-prediction"):
        cfg, params = load_gguf_model(path, progress=False)
    assert cfg.n_layers == n and cfg.mtp_layers == 0
    assert max(_max_leaf_error(params, reference["qwen3_5_text"][1]).values()) < 1e-6


def test_fused_gate_up_experts(tiny, reference, tmp_path: Path) -> None:
    """`--fuse-gate-up-exps` files hold ffn_gate_up_exps [E, 2F, D], the gate rows first."""
    src = hf_to_gguf(tiny["qwen3_5_moe_text"], tmp_path / "m.gguf")
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(src).tensors}
    fused = {
        f"blk.{i}.ffn_gate_up_exps.weight": np.concatenate(
            [tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"]], axis=1
        )
        for i in range(4)
    }
    drop = tuple(f"blk.{i}.ffn_{p}_exps.weight" for i in range(4) for p in ("gate", "up"))
    _, params = load_gguf_model(_copy_gguf(src, tmp_path / "fused.gguf", extra=fused, drop=drop), progress=False)
    assert max(_max_leaf_error(params, reference["qwen3_5_moe_text"][1]).values()) < 1e-6


def test_errors(tiny, tmp_path: Path) -> None:
    src = hf_to_gguf(tiny["qwen3_5_moe_text"], tmp_path / "m.gguf")
    # The layer kinds come from the blocks' tensors and must agree with the interval.
    bad = _copy_gguf(src, tmp_path / "interval.gguf", fields={"qwen35moe.full_attention_interval": 4})
    with pytest.raises(ValueError, match="full_attention_interval 4 disagrees"):
        load_gguf_model(bad, progress=False)
    # gguf-py 0.19 names no MTP tensors for qwen35 / qwen35moe: the converter refuses them.
    from safetensors.numpy import load_file, save_file

    mtp_dir = tmp_path / "with-mtp"
    shutil.copytree(tiny["qwen3_5_text"], mtp_dir)
    st = mtp_dir / "model.safetensors"
    state = load_file(str(st))
    state["mtp.fc.weight"] = np.zeros((64, 128), np.float32)
    save_file(state, str(st), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no qwen35 tensor name for 'mtp.fc.weight'"):
        hf_to_gguf(mtp_dir, tmp_path / "mtp.gguf")
