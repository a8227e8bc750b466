"""Loaders: safetensors / GGUF / orbax / dummy params against tiny transformers models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import chex
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ModelConfig, load_config_json
from jaxllm.loading import detect_format, load_model
from jaxllm.loading.dummy import dummy_params
from jaxllm.loading.gguf import load_gguf_model
from jaxllm.loading.orbax_io import restore_pytree, save_model, save_pytree
from jaxllm.loading.safetensors import load_safetensors_model
from jaxllm.params import OutIn, Params, canonical_params, layout_params, param_shapes
from jaxllm.runtime_options import RuntimeOptions

from hf_tiny import LLAMA3_ROPE, hf_to_gguf, make_tiny_hf_model, read_hf_state  # tests/ is on sys.path (conftest)
from tiny_configs import TINY_HYBRID_MOE  # tests/ is on sys.path (conftest)

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.json"))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny saved model per (family, tying) variant, built once for the module."""
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": make_tiny_hf_model("llama", root),
        "llama-tied": make_tiny_hf_model("llama", root, tie_word_embeddings=True),
        "llama3-rope-scaled": make_tiny_hf_model("llama3-rope-scaled", root),
        "qwen2": make_tiny_hf_model("qwen2", root, tie_word_embeddings=True),
        "qwen3": make_tiny_hf_model("qwen3", root),
        "qwen3_moe": make_tiny_hf_model("qwen3_moe", root),
    }


TINY_DENSE = ModelConfig(
    family="llama",
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=48,
    max_position=64,
)


TINY_HYBRID_MTP = dataclasses.replace(TINY_HYBRID_MOE, mtp_layers=1)


def assert_matches_hf(cfg: ModelConfig, params: Params, state: dict[str, np.ndarray], atol: float = 0.0) -> None:
    """Checks every param against the HF state dict through the einsum conventions."""
    params = canonical_params(params)  # load_model returns the runtime tree (fused, maybe unrolled)
    H, K, Dh, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    close = lambda got, want, what: np.testing.assert_allclose(
        np.asarray(got, np.float32), want, atol=atol, rtol=0, err_msg=what
    )
    x = np.random.default_rng(0).standard_normal((3, D)).astype(np.float32)
    a = np.random.default_rng(1).standard_normal((3, H, Dh)).astype(np.float32)
    p = params.layers
    f32 = lambda t: np.asarray(t, np.float32)
    close(params.embed, state["model.embed_tokens.weight"], "embed")
    close(params.final_norm, state["model.norm.weight"], "final_norm")
    if cfg.tie_embeddings:
        assert params.lm_head is None
    else:
        close(params.lm_head, state["lm_head.weight"].T, "lm_head")
    for i in range(cfg.n_layers):
        s = lambda n: state[f"model.layers.{i}.{n}"]
        close(p.attn_norm[i], s("input_layernorm.weight"), "attn_norm")
        close(p.mlp_norm[i], s("post_attention_layernorm.weight"), "mlp_norm")
        # Expected layouts, themselves checked against HF semantics: einsum('td,dhk->thk',
        # x, wq) must equal x @ q_proj.T split into heads, and likewise for wo.
        for ours, hf, n in ((p.attn.wq, "q", H), (p.attn.wk, "k", K), (p.attn.wv, "v", K)):
            w = s(f"self_attn.{hf}_proj.weight")
            want = w.T.reshape(D, n, Dh)
            semantic = np.einsum("td,dhk->thk", x, want).reshape(3, n * Dh)
            np.testing.assert_allclose(semantic, x @ w.T, rtol=1e-5, atol=1e-5)
            close(ours[i], want, f"w{hf}")
        w = s("self_attn.o_proj.weight")
        want = w.T.reshape(H, Dh, D)
        np.testing.assert_allclose(np.einsum("thk,hkd->td", a, want), a.reshape(3, H * Dh) @ w.T, rtol=1e-5, atol=1e-5)
        close(p.attn.wo[i], want, "wo")
        if cfg.qkv_bias:
            for ours, hf in ((p.attn.bq, "q"), (p.attn.bk, "k"), (p.attn.bv, "v")):
                close(f32(ours[i]).reshape(-1), s(f"self_attn.{hf}_proj.bias"), f"b{hf}")
        if cfg.qk_norm:
            close(p.attn.q_norm[i], s("self_attn.q_norm.weight"), "q_norm")
            close(p.attn.k_norm[i], s("self_attn.k_norm.weight"), "k_norm")
        if cfg.is_moe:
            close(p.mlp.router[i], s("mlp.gate.weight").T, "router")
            for e in range(cfg.n_experts):
                close(p.mlp.w_gate[i, e], s(f"mlp.experts.{e}.gate_proj.weight").T, "w_gate")
                close(p.mlp.w_up[i, e], s(f"mlp.experts.{e}.up_proj.weight").T, "w_up")
                close(p.mlp.w_down[i, e], s(f"mlp.experts.{e}.down_proj.weight").T, "w_down")
        else:
            close(p.mlp.w_gate[i], s("mlp.gate_proj.weight").T, "w_gate")
            close(p.mlp.w_up[i], s("mlp.up_proj.weight").T, "w_up")
            close(p.mlp.w_down[i], s("mlp.down_proj.weight").T, "w_down")


# ---------------------------------------------------------------- safetensors


@pytest.mark.parametrize("variant", ["llama", "llama-tied", "llama3-rope-scaled", "qwen2", "qwen3", "qwen3_moe"])
def test_safetensors_matches_hf(hf_dirs: dict[str, Path], variant: str) -> None:
    cfg, params = load_safetensors_model(hf_dirs[variant], progress=False)
    assert cfg.family == variant.split("-")[0].replace("llama3", "llama")
    assert cfg.tie_embeddings == (variant in ("llama-tied", "qwen2"))
    assert cfg.qkv_bias == (variant == "qwen2")
    assert cfg.qk_norm == variant.startswith("qwen3")
    if variant == "qwen3_moe":
        assert (cfg.n_experts, cfg.n_experts_per_token, cfg.moe_ffn_dim) == (4, 2, 32)
    if variant == "llama3-rope-scaled":
        assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
        assert cfg.rope_scaling.original_max_position == 64
    assert_matches_hf(cfg, params, read_hf_state(hf_dirs[variant]))


def test_safetensors_sharded_and_bfloat16(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Shards listed in model.safetensors.index.json load like one file."""
    from safetensors.numpy import save_file

    src = hf_dirs["qwen3"]
    state = read_hf_state(src)
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    cfg, params = load_model(str(tmp_path), options=RuntimeOptions(dtype="bfloat16"))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    assert_matches_hf(cfg, params, state, atol=2e-2)


def test_fused_expert_tensors(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """transformers 5's in-memory MoE layout (experts.gate_up_proj / experts.down_proj) loads too."""
    from safetensors.numpy import save_file

    src = hf_dirs["qwen3_moe"]
    state = read_hf_state(src)
    fused = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for i in range(2):
        e = lambda n: np.stack([state[f"model.layers.{i}.mlp.experts.{j}.{n}.weight"] for j in range(4)])
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate([e("gate_proj"), e("up_proj")], axis=1)
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = e("down_proj")
    save_file(fused, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    cfg, params = load_safetensors_model(tmp_path, progress=False)
    assert_matches_hf(cfg, params, state)


# ---------------------------------------------------------------- GGUF


@pytest.mark.parametrize(
    "variant,qtype,atol",
    [
        ("llama", "F32", 0.0),
        ("llama", "Q8_0", 2e-3),
        ("llama-tied", "F16", 1e-3),
        ("llama", "BF16", 2e-2),
        ("llama", "Q4_0", 5e-2),
        ("qwen2", "F32", 0.0),
        ("qwen3", "Q8_0", 2e-3),
        ("qwen3_moe", "F32", 0.0),
    ],
)
def test_gguf_matches_hf(hf_dirs: dict[str, Path], tmp_path: Path, variant: str, qtype: str, atol: float) -> None:
    path = hf_to_gguf(hf_dirs[variant], tmp_path / "m.gguf", qtype=qtype)
    cfg, params = load_model(str(path), options=RuntimeOptions(dtype="float32"), progress=False)
    hf_cfg, _ = load_safetensors_model(hf_dirs[variant], progress=False)
    assert cfg == hf_cfg.replace(max_position=cfg.max_position)
    assert_matches_hf(cfg, params, read_hf_state(hf_dirs[variant]), atol=atol)


def test_gguf_llama3_rope_freqs_recovered(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The converter stores Llama-3 scaling only as a rope_freqs tensor; it must round-trip."""
    path = hf_to_gguf(hf_dirs["llama3-rope-scaled"], tmp_path / "m.gguf")
    cfg, _ = load_gguf_model(path, progress=False)
    s = cfg.rope_scaling
    assert s is not None and s.original_max_position == 8192  # not in the file: Llama-3 default
    # Equivalent parameters: factor exact, the smoothing band rescaled by 8192 / 64.
    assert s.factor == pytest.approx(LLAMA3_ROPE["factor"])
    assert s.low_freq_factor == pytest.approx(LLAMA3_ROPE["low_freq_factor"] * 8192 / 64, rel=1e-4)
    assert s.high_freq_factor == pytest.approx(LLAMA3_ROPE["high_freq_factor"] * 8192 / 64, rel=1e-4)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_gguf_k_quants_dequantized(hf_dirs: dict[str, Path], tmp_path: Path, qtype: str) -> None:
    """gguf-py cannot quantize K-quants; write random valid blocks and compare to its dequantize."""
    t = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[t]
    src = make_tiny_hf_model("llama", tmp_path, hidden_size=256, head_dim=64, intermediate_size=96, num_hidden_layers=1)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(128, 256 // block, nbytes), dtype=np.uint8)
    # Make the float16 super-block scales finite and small (random bytes could be inf/nan).
    nb = 256 // block
    scales = rng.uniform(1e-4, 1e-3, size=(128, nb, 2)).astype(np.float16).view(np.uint8)  # [128, nb, 4]
    if qtype == "Q4_K":  # d, dmin (float16) lead the block
        raw[..., 0:4] = scales
    else:  # Q6_K: d (float16) trails the block
        raw[..., -2:] = scales[..., :2]
    raw = raw.reshape(128, -1)
    path = hf_to_gguf(src, tmp_path / "k.gguf", raw_overrides={"token_embd.weight": (raw, t)})
    _, params = load_gguf_model(path, progress=False)
    want = gguf.quants.dequantize(raw, t)
    assert want.shape == (128, 256) and np.isfinite(want).all()
    np.testing.assert_array_equal(np.asarray(params.embed), want)


def test_gguf_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_model(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(bad))
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf_model(truncated)
    other = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gpt2"):
        load_gguf_model(other)


def test_unknown_hf_architecture_and_format(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="gpt_neox"):
        load_model(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot tell"):
        detect_format(tmp_path / "config.json")
    with pytest.raises(ValueError, match="unknown model format"):
        load_model(str(tmp_path), fmt="onnx")


def test_real_default_gguf(request: pytest.FixtureRequest) -> None:
    """SmolLM2-135M-Instruct (the default model) loads with the preset's shapes."""
    try:
        path = request.getfixturevalue("smollm2_gguf_path")
    except pytest.FixtureLookupError:
        pytest.skip("no smollm2_gguf_path fixture in tests/conftest.py")
    cfg, params = load_gguf_model(path, progress=False)
    preset = load_config_json(Path(__file__).resolve().parents[2] / "configs" / "smollm2-135m.json")
    assert cfg.replace(max_position=preset.max_position) == preset.replace(rms_eps=cfg.rms_eps)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


# ---------------------------------------------------------------- orbax


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_model_round_trip(hf_dirs: dict[str, Path], tmp_path: Path, dtype: str) -> None:
    cfg, params = load_safetensors_model(hf_dirs["qwen2"], dtype=dtype, progress=False)
    # What a user holds after `load_model` is the runtime tree (fused, maybe unrolled); it is
    # stored as the canonical one.
    _, runtime = load_model(str(hf_dirs["qwen2"]), options=RuntimeOptions(dtype=dtype, scan_layers=False))
    save_model(tmp_path / "ckpt", cfg, runtime)
    assert detect_format(tmp_path / "ckpt") == "orbax"
    cfg2, params2 = load_model(str(tmp_path / "ckpt"), options=RuntimeOptions(dtype=dtype))
    assert cfg2 == cfg
    chex.assert_trees_all_equal(canonical_params(params2), params)
    chex.assert_trees_all_equal_dtypes(canonical_params(params2), params)


def test_orbax_model_keeps_tokenizer_template_and_defaults(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    """A model saved with `Model.save` loads back with its tokenizer, chat template and
    sampling defaults, not a synthetic tokenizer."""
    from jaxllm.api import Model, load
    from jaxllm.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf_path)
    model = Model(
        cfg=TINY_DENSE,
        params=dummy_params(TINY_DENSE, seed=1),
        tokenizer=tok,
        generation_defaults={"temperature": 0.6, "top_p": 0.9},
    )
    model.save(str(tmp_path / "m"))
    back = load(str(tmp_path / "m"))
    assert back.tokenizer.chat_template == tok.chat_template and back.tokenizer.eos_ids == tok.eos_ids
    assert back.tokenizer.encode("<|im_start|>user hi") == tok.encode("<|im_start|>user hi")
    assert back.generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    chex.assert_trees_all_equal(canonical_params(back.params), model.params)


def test_generation_defaults_of_each_format(tmp_path: Path) -> None:
    from jaxllm.loading.generation import generation_defaults

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_k": 20, "top_p": None, "do_sample": True, "eos_token_id": [1, 2]})
    )
    assert generation_defaults(tmp_path) == {"temperature": 0.7, "top_k": 20}
    assert generation_defaults(tmp_path / "missing") == {}
    path = tmp_path / "s.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_float32("general.sampling.temp", 0.5)
    w.add_int32("general.sampling.top_k", 40)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert generation_defaults(path) == {"temperature": 0.5, "top_k": 40}


def test_orbax_pytree_round_trip(tmp_path: Path) -> None:
    tree = {"a": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3), "b": [jnp.ones(4, jnp.int32), None]}
    save_pytree(tmp_path / "t", tree)
    chex.assert_trees_all_equal(restore_pytree(tmp_path / "t"), tree)
    chex.assert_trees_all_equal(restore_pytree(tmp_path / "t", like=tree), tree)
    with pytest.raises(FileNotFoundError):
        restore_pytree(tmp_path / "missing")


# ---------------------------------------------------------------- dummy


@pytest.mark.parametrize("preset", CONFIGS, ids=lambda p: p.stem)
def test_dummy_shapes_for_presets(preset: Path) -> None:
    cfg = load_config_json(preset)
    abstract = jax.eval_shape(lambda: dummy_params(cfg, dtype="bfloat16"))  # no allocation of 8B+ params
    chex.assert_trees_all_equal_shapes_and_dtypes(abstract, param_shapes(cfg, "bfloat16"))


def test_preset_values() -> None:
    by_name = {p.stem: load_config_json(p) for p in CONFIGS}
    assert set(by_name) >= {"llama3-8b", "qwen3-8b", "qwen3-30b-a3b", "smollm2-135m"}
    assert by_name["llama3-8b"].rope_scaling is not None
    assert round(by_name["llama3-8b"].param_count() / 1e9, 2) == 8.03
    assert round(by_name["qwen3-8b"].param_count() / 1e9, 1) == 8.2
    assert round(by_name["qwen3-30b-a3b"].param_count() / 1e9, 1) == 30.5
    assert round(by_name["smollm2-135m"].param_count() / 1e6) == 135
    for p in CONFIGS:
        assert json.loads(p.read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("scan_layers", [True, False])
def test_runtime_layout_round_trips(scan_layers: bool) -> None:
    """The runtime tree (fused q/k/v and gate/up, maybe unrolled) converts back exactly."""
    for cfg in (TINY_DENSE, TINY_DENSE.replace(family="qwen2", qkv_bias=True)):
        params = dummy_params(cfg, seed=2)
        runtime = layout_params(params, scan_layers, fuse=True)
        layer = runtime.layers if scan_layers else runtime.layers[0]
        assert layer.attn.wq is None and layer.attn.wqkv is not None and layer.mlp.w_gate_up is not None
        chex.assert_trees_all_equal(canonical_params(runtime), params)
        chex.assert_trees_all_equal(canonical_params(layout_params(params, scan_layers, fuse=False)), params)
        out_in = layout_params(params, scan_layers, fuse=True, out_in=True)  # the GPU's layout
        layer = out_in.layers if scan_layers else out_in.layers[0]
        assert isinstance(layer.attn.wqkv, OutIn) and isinstance(layer.mlp.w_down, OutIn)
        canonical_wo = params.layers.attn.wo.shape if scan_layers else params.layers.attn.wo.shape[1:]
        assert layer.attn.wo.shape == canonical_wo and layer.attn.wo.t.shape[-2:] == canonical_wo[-3:-1]
        chex.assert_trees_all_equal(canonical_params(out_in), params)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_hybrid_runtime_layout_fuses_and_round_trips(scan_layers: bool) -> None:
    """Hybrid blocks run fused: DeltaNet's w_qkv|w_z|w_b|w_a as one w_in, gated attention's
    q|gate|k|v as one w_qgkv, the router with the shared expert's gate/up and gate as the
    MoE's w_in (a dense MLP's gate/up as w_gate_up; the MTP block stays as loaded). The
    canonical tree comes back exactly, and the logits are those of one matrix a projection."""
    from jaxllm.api import prompt_logits

    dense_mlp = TINY_HYBRID_MTP.replace(n_experts=0, moe_ffn_dim=0, shared_expert_ffn_dim=0, ffn_dim=24, mtp_layers=0)
    ids = jnp.asarray([5, 9, 33, 2, 61, 14, 14, 40, 3, 44, 12], jnp.int32)
    for cfg in (TINY_HYBRID_MTP, dense_mlp):
        # Larger weights than the dummy's, so the logits are far from uniform.
        params = jax.tree.map(lambda x: x * 8 if x.ndim > 1 else x, dummy_params(cfg, seed=2))
        runtime = layout_params(params, scan_layers)
        lin, full = (runtime.layers.linear, runtime.layers.full)
        lin, full = (lin, full) if scan_layers else (lin[0], full[0])
        d, a = lin.mixer, full.mixer
        assert d.w_in is not None and d.w_qkv is None and d.w_z is None and d.w_b is None and d.w_a is None
        assert a.w_qgkv is not None and a.wq is None and a.w_gate is None and a.wk is None and a.wv is None
        for mlp in (lin.mlp, full.mlp):
            if cfg.is_moe:
                assert mlp.w_in is not None and mlp.router is None and mlp.shared_gate is None
                assert mlp.shared.w_gate is None and mlp.shared.w_up is None and mlp.shared.w_down is not None
            else:
                assert mlp.w_gate_up is not None and mlp.w_gate is None and mlp.w_up is None
        if cfg.mtp_layers:
            chex.assert_trees_all_equal(runtime.mtp, params.mtp)
        chex.assert_trees_all_equal(canonical_params(runtime), params)
        out_in = layout_params(params, scan_layers, out_in=True)  # the GPU's layout
        fused = out_in.layers.full if scan_layers else out_in.layers.full[0]
        assert isinstance(fused.mixer.w_qgkv, OutIn) and fused.mixer.w_qgkv.shape == a.w_qgkv.shape
        chex.assert_trees_all_equal(canonical_params(out_in), params)

        want = np.asarray(prompt_logits(layout_params(params, scan_layers, fuse=False), cfg, ids))
        for laid_out in (runtime, out_in):
            got = np.asarray(prompt_logits(laid_out, cfg, ids))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_large_dummy_leaves_draw_slice_by_slice(monkeypatch) -> None:
    """Leaves over `_SLICED_DRAW_BYTES` of float32 are drawn one leading slice at a time (so
    a 30B's expert stack never needs its whole float32 draw); the sharded one-call path
    draws the same values, and the scale stays the dummy's."""
    from jaxllm.loading import dummy

    monkeypatch.setattr(dummy, "_SLICED_DRAW_BYTES", 4 * 500)
    params = dummy_params(TINY_DENSE, seed=3)
    sharded = dummy_params(TINY_DENSE, seed=3, out_shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    chex.assert_trees_all_equal(params, sharded)
    w = np.asarray(params.layers.mlp.w_gate, np.float32)
    assert w.size * 4 > 4 * 500 and abs(float(w.std()) - 0.02) < 0.002
    assert not np.array_equal(w[0], w[1])  # each slice its own draw


@pytest.mark.parametrize("cfg", [TINY_DENSE, TINY_HYBRID_MTP], ids=["dense", "hybrid"])
def test_dummy_layers_drawn_unrolled_equal_the_stack_unstacked(monkeypatch, cfg: ModelConfig) -> None:
    """`dummy_params(unrolled=True)` draws layer by layer (a 30B's stacked experts beside
    the model did not fit an 80 GB card) yet gives the stacked tree's values, in
    `unstack_layers`' layout, for leaves drawn whole and slice by slice alike; the loader
    draws dummy weights in the runtime's layout."""
    from jaxllm.loading import dummy
    from jaxllm.params import unstack_layers

    monkeypatch.setattr(dummy, "_SLICED_DRAW_BYTES", 4 * 500)  # the larger layer leaves draw per slice
    stacked = dummy_params(cfg, seed=5)
    unrolled = dummy_params(cfg, seed=5, unrolled=True)
    chex.assert_trees_all_equal(unrolled, unstack_layers(stacked))
    layers = unrolled.layers.full if cfg.is_hybrid else unrolled.layers
    assert isinstance(layers, tuple) and len(layers) == (2 if cfg.is_hybrid else cfg.n_layers)
    if cfg.mtp_layers:
        assert unrolled.mtp.block.attn_norm.shape[0] == cfg.mtp_layers  # the MTP block stays stacked


def _llama_preset(tmp_path: Path, n_layers: int) -> Path:
    """A tiny llama preset JSON (HF config keys) for `--load-format dummy`."""
    preset = tmp_path / "tiny.json"
    config = dict(model_type="llama", vocab_size=32, hidden_size=16, num_attention_heads=2, intermediate_size=24)
    preset.write_text(json.dumps({**config, "num_hidden_layers": n_layers}))
    return preset


def test_the_dummy_loader_draws_the_runtime_layout(tmp_path: Path) -> None:
    preset = _llama_preset(tmp_path, n_layers=2)
    options = RuntimeOptions(dtype="float32", scan_layers=False, weight_layout="in_out")
    cfg, loaded = load_model(str(preset), fmt="dummy", options=options)
    assert isinstance(loaded.layers, tuple)
    chex.assert_trees_all_equal(loaded, layout_params(dummy_params(cfg), scan_layers=False))


def test_dummy_allocates_tiny(tmp_path: Path) -> None:
    cfg = ModelConfig(
        family="qwen3_moe",
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        ffn_dim=0,
        max_position=64,
        qk_norm=True,
        n_experts=4,
        n_experts_per_token=2,
        moe_ffn_dim=16,
    )
    params = dummy_params(cfg, seed=1)
    chex.assert_trees_all_equal_shapes_and_dtypes(params, param_shapes(cfg))
    assert float(jnp.std(params.layers.attn.wq)) == pytest.approx(0.02, rel=0.2)
    assert bool(jnp.all(params.layers.attn_norm == 1)) and bool(jnp.all(params.final_norm == 1))
    chex.assert_trees_all_equal(dummy_params(cfg, seed=1), params)  # deterministic per seed
    preset = _llama_preset(tmp_path, n_layers=1)
    cfg2, p2 = load_model(str(preset), fmt="dummy", options=RuntimeOptions(dtype="bfloat16"))
    assert cfg2.vocab_size == 32 and p2.embed.dtype == jnp.bfloat16


def _gguf_with(path: Path, **meta: object) -> Path:
    """A llama GGUF with sane shape metadata, `meta` overriding it, and two blocks' tensors."""
    from jaxllm.loading.gguf import gguf_config, open_gguf  # noqa: F401 - the readers under test

    values = {
        "embedding_length": 32,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "block_count": 2,
        "feed_forward_length": 48,
        "context_length": 64,
        "attention.layer_norm_rms_epsilon": 1e-6,
        **meta,
    }
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in values.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"llama.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((64, 32), np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones((32,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "meta,key",
    [
        ({"attention.head_count": 0}, "head_count"),
        ({"block_count": 100000}, "block_count"),
        ({"block_count": 3}, "block_count"),
        ({"attention.head_count_kv": 3}, "key/value heads"),
        ({"embedding_length": 0}, "embedding_length"),
        ({"attention.layer_norm_rms_epsilon": float("nan")}, "epsilon"),
        ({"context_length": 0}, "context_length"),
    ],
)
def test_gguf_shape_metadata_is_checked_on_load(tmp_path: Path, meta: dict, key: str) -> None:
    from jaxllm.loading.gguf import gguf_config, open_gguf

    assert gguf_config(open_gguf(_gguf_with(tmp_path / "ok.gguf"))).n_layers == 2
    with pytest.raises(ValueError, match=key):
        gguf_config(open_gguf(_gguf_with(tmp_path / "bad.gguf", **meta)))


@pytest.mark.parametrize(
    "override,key",
    [
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_hidden_layers": 100000}, "num_hidden_layers"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ],
)
def test_config_json_shapes_are_checked_on_load(
    hf_dirs: dict[str, Path], tmp_path: Path, override: dict, key: str
) -> None:
    import shutil

    model = tmp_path / "m"
    shutil.copytree(hf_dirs["llama"], model)
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, **override}))
    with pytest.raises(ValueError, match=key):
        load_safetensors_model(model, progress=False)


def test_cli_reports_a_damaged_safetensors_file_in_one_line(hf_dirs: dict[str, Path], tmp_path: Path, capsys) -> None:
    import shutil

    from jaxllm.cli import main

    model = tmp_path / "m"
    shutil.copytree(hf_dirs["llama"], model)
    for f in model.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])
    assert main(["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxllm: error: invalid safetensors file") and "Traceback" not in err


def test_no_loading_bar_when_stderr_is_not_a_terminal(hf_dirs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    load_model(str(hf_dirs["qwen2"]))  # progress unset: a bar only on a terminal (capsys' stderr is none)
    assert "loading safetensors" not in capsys.readouterr().err
    load_model(str(hf_dirs["qwen2"]), progress=True)
    assert "loading safetensors" in capsys.readouterr().err
