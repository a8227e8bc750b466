"""Tiny random Hugging Face models (and llama.cpp-style GGUFs of them) for tests.

`make_tiny_hf_model` builds a transformers model of a family at toy sizes, perturbs every
weight (so norms are not all ones and biases not all zero, which would hide mapping bugs),
and saves it in float32 with `save_pretrained`. `hf_to_gguf` writes the same weights the
way llama.cpp's convert_hf_to_gguf.py does (permuted llama q/k rows, stacked experts,
`rope_freqs` for Llama-3 RoPE scaling; for the hybrid family its Qwen3Next / Qwen3.5
transforms, see `_hybrid_to_gguf`), optionally quantized.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = (
    "llama",
    "llama3-rope-scaled",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5_moe_text",
    "qwen3_5_text",
)
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_text")

# The hybrid family at toy sizes: two groups of (DeltaNet, gated attention) so the group scan
# and each kind's stacking order matter; two value heads per key head; partial RoPE.
_HYBRID: dict[str, Any] = dict(
    layer_types=["linear_attention", "full_attention"] * 2,
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    partial_rotary_factor=0.25,
)
_HYBRID_MOE: dict[str, Any] = dict(
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2
)

# Small but not degenerate: GQA (4 query heads on 2 kv heads), ffn rows a multiple of 32
# so Q8_0 / Q4_0 blocks fit, two layers so stacking order matters.
_COMMON: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)

# Llama-3 scaling with original context 64: for head_dim 16 and theta 1e4 two of the eight
# frequencies fall in the smoothed band, so every branch of the formula is exercised.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _config(family: str, overrides: dict[str, Any]) -> Any:
    import transformers

    kw = dict(_COMMON)
    if family in ("llama", "llama3-rope-scaled"):
        cls = transformers.LlamaConfig
        if family == "llama3-rope-scaled":
            kw["rope_scaling"] = dict(LLAMA3_ROPE)
    elif family == "qwen2":
        cls = transformers.Qwen2Config
    elif family == "qwen3":
        cls = transformers.Qwen3Config
    elif family == "qwen3_moe":
        cls = transformers.Qwen3MoeConfig
        kw.update(
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    elif family == "qwen3_next":
        cls = transformers.Qwen3NextConfig
        kw.update(_HYBRID, **_HYBRID_MOE, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif family == "qwen3_5_moe_text":
        cls = transformers.Qwen3_5MoeTextConfig
        kw.update(_HYBRID, **_HYBRID_MOE)
        kw.pop("intermediate_size")
    elif family == "qwen3_5_text":
        cls = transformers.Qwen3_5TextConfig
        kw.update(_HYBRID)
    else:
        raise ValueError(f"unknown tiny family {family!r}; known: {', '.join(FAMILIES)}")
    kw.update(overrides)
    # transformers 5 reads RoPE settings from `rope_parameters` (rope_theta inside it).
    scaling = kw.pop("rope_scaling", None)
    if scaling is not None or "rope_parameters" not in kw:
        params = dict(scaling or {"rope_type": "default"})
        params.setdefault("rope_theta", kw["rope_theta"])
        if "partial_rotary_factor" in kw:
            params["partial_rotary_factor"] = kw["partial_rotary_factor"]
        kw["rope_parameters"] = params
        kw["rope_scaling"] = params  # transformers 4.x spelling; 5.x aliases it
    return cls(**kw)


def make_tiny_hf_model(
    family: str, tmpdir: str | Path, *, seed: int = 0, noise: float = 0.05, **overrides: Any
) -> Path:
    """Builds, perturbs and saves a tiny random HF causal LM.

    Args:
      family: one of FAMILIES ("llama3-rope-scaled" is llama with Llama-3 RoPE scaling).
      tmpdir: parent directory; the model is saved to `tmpdir/<family>-<seed>`.
      seed: torch seed for the weights.
      noise: std of the normal noise added to every weight (norms become 1 + noise).
      **overrides: config fields, e.g. `tie_word_embeddings=True`, `num_hidden_layers=3`.

    Returns:
      The saved model directory (config.json + model.safetensors, float32).
    """
    import torch
    import transformers

    cfg = _config(family, overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # tied embed/lm_head is one Parameter, perturbed once
            p.add_(noise * torch.randn_like(p))
    tag = "tied" if cfg.tie_word_embeddings else "untied"
    out = Path(tmpdir) / f"{family}-{tag}-{seed}"
    model.eval()
    model.save_pretrained(out)
    return out


def read_hf_state(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a saved tiny model (one safetensors file), as float32 numpy."""
    from safetensors.numpy import load_file

    state: dict[str, np.ndarray] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update({k: v.astype(np.float32) for k, v in load_file(str(f)).items()})
    return state


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (rows of q/k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(rope: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` tensor for Llama-3 scaling (LlamaModel.generate_extra_tensors)."""
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_to_gguf(
    model_dir: str | Path,
    path: str | Path,
    *,
    qtype: str = "F32",
    raw_overrides: dict[str, tuple[np.ndarray, Any]] | None = None,
    legacy_qkvz: bool = False,
) -> Path:
    """Writes a saved tiny HF model as GGUF the way llama.cpp's converter lays it out.

    The hybrid family (qwen3_next, qwen3_5_text, qwen3_5_moe_text) goes through
    `_hybrid_to_gguf`, which applies that converter's transforms (see its docstring).

    Args:
      model_dir: a `make_tiny_hf_model` directory.
      path: the .gguf file to write.
      qtype: GGML type name for weight matrices ("F32", "F16", "BF16", "Q8_0", "Q4_0", ...);
        1-D tensors (norms, biases, rope_freqs) stay F32 as in llama.cpp.
      raw_overrides: GGUF tensor name -> (already quantized uint8 blocks, GGMLQuantizationType),
        written verbatim instead of the converted tensor (for types gguf-py cannot quantize).
      legacy_qkvz: qwen3_next only: write in_proj_qkvz whole as `ssm_in` (older converters)
        instead of split into attn_qkv + attn_gate.

    Returns:
      `path`.
    """
    import gguf

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    mt = hf["model_type"]
    if mt in _HYBRID_GGUF_ARCH:
        return _hybrid_to_gguf(
            hf,
            read_hf_state(model_dir),
            Path(path),
            gguf.GGMLQuantizationType[qtype],
            raw_overrides or {},
            legacy_qkvz=legacy_qkvz,
        )
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}[mt]
    n_head, n_kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    n_layers = hf["num_hidden_layers"]
    state = read_hf_state(model_dir)
    qt = gguf.GGMLQuantizationType[qtype]
    raw_overrides = raw_overrides or {}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if mt == "qwen3_moe":
        n_exp = hf.get("num_experts") or hf["num_local_experts"]
        w.add_expert_count(n_exp)
        w.add_expert_used_count(hf["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(hf["vocab_size"])])

    def add(name: str, x: np.ndarray) -> None:
        _add_tensor(w, name, x, qt, raw_overrides)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    if rope.get("rope_type") == "llama3":
        add("rope_freqs.weight", _llama3_rope_factors(rope, theta, head_dim))
    for i in range(n_layers):
        p = f"model.layers.{i}."
        q = state[p + "self_attn.q_proj.weight"]
        k = state[p + "self_attn.k_proj.weight"]
        if arch == "llama":  # only the llama arch is permuted (GGML's interleaved RoPE)
            q, k = _llama_permute(q, n_head), _llama_permute(k, n_kv)
        add(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", q)
        add(f"blk.{i}.attn_k.weight", k)
        add(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"])
        for proj in ("q", "k", "v"):
            if p + f"self_attn.{proj}_proj.bias" in state:
                add(f"blk.{i}.attn_{proj}.bias", state[p + f"self_attn.{proj}_proj.bias"])
        if p + "self_attn.q_norm.weight" in state:
            add(f"blk.{i}.attn_q_norm.weight", state[p + "self_attn.q_norm.weight"])
            add(f"blk.{i}.attn_k_norm.weight", state[p + "self_attn.k_norm.weight"])
        add(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        if mt == "qwen3_moe":
            add(f"blk.{i}.ffn_gate_inp.weight", state[p + "mlp.gate.weight"])
            for proj, name in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                experts = [state[p + f"mlp.experts.{e}.{proj}.weight"] for e in range(n_exp)]
                add(f"blk.{i}.ffn_{name}_exps.weight", np.stack(experts))
        else:
            add(f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"])
            add(f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"])
            add(f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    if not hf.get("tie_word_embeddings", False):
        add("output.weight", state["lm_head.weight"])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# ---------------------------------------------------------------- hybrid family as GGUF

_HYBRID_GGUF_ARCH = {"qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}


def _add_tensor(w: Any, name: str, x: np.ndarray, qt: Any, raw_overrides: dict[str, tuple[np.ndarray, Any]]) -> None:
    """Adds one tensor in `qt`, keeping F32 where llama.cpp's converter does: 1-D tensors,
    names not ending in .weight (ssm_a, ssm_dt.bias), routers (ffn_gate_inp, ffn_gate_inp_shexp)
    and ssm_conv1d; and rows whose width is not a whole number of quant blocks."""
    import gguf

    if name in raw_overrides:
        data, raw_type = raw_overrides[name]
        w.add_tensor(name, data, raw_dtype=raw_type)
        return
    x = np.ascontiguousarray(x, dtype=np.float32)
    block = gguf.GGML_QUANT_SIZES[qt][0]
    keep_f32 = not name.endswith(".weight") or name.endswith(
        ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")
    )
    if x.ndim == 1 or keep_f32 or qt == gguf.GGMLQuantizationType.F32 or x.shape[-1] % block:
        w.add_tensor(name, x)
    elif qt == gguf.GGMLQuantizationType.F16:
        w.add_tensor(name, x.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)


def tile_value_heads(x: np.ndarray, axis: int, n_k_heads: int, n_v_heads: int) -> np.ndarray:
    """llama.cpp `_LinearAttentionVReorderBase._reorder_v_heads`: value heads along `axis`
    from grouped ([Hk, r, d]: value head h served by key head h // r) to tiled ([r, Hk, d])."""
    axis = axis % x.ndim
    r = n_v_heads // n_k_heads
    n = x.shape[axis]
    shape = x.shape[:axis] + (n_k_heads, r, n // n_v_heads) + x.shape[axis + 1 :]
    return np.swapaxes(x.reshape(shape), axis, axis + 1).reshape(x.shape)


def _hybrid_transform(
    hf: dict[str, Any], arch: str, name: str, x: np.ndarray, legacy_qkvz: bool
) -> list[tuple[str, np.ndarray]]:
    """One HF tensor of the hybrid family -> [(HF-style name to map, tensor)], the way
    convert_hf_to_gguf.py transforms it: first Qwen3.5's value-head reorder
    (_LinearAttentionVReorderBase.modify_tensors), then Qwen3NextModel.modify_tensors."""
    Hk, Hv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    Dk, Dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    if arch != "qwen3next" and Hk != Hv and "linear_attn." in name:
        tile = lambda t, axis: tile_value_heads(t, axis, Hk, Hv)
        qk = 2 * Hk * Dk
        if ".in_proj_qkv." in name:
            x = np.concatenate([x[:qk], tile(x[qk:], 0)])
        elif any(p in name for p in (".in_proj_z.", ".in_proj_b.", ".in_proj_a.")) or name.endswith(
            (".A_log", ".dt_bias")
        ):
            x = tile(x, 0)
        elif ".conv1d" in name:
            x = x.squeeze()
            x = np.concatenate([x[:qk], tile(x[qk:], 0)])
        elif ".out_proj." in name:
            x = tile(x, 1)
    if name.endswith(".A_log"):
        x = -np.exp(x)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        x = x.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        x = x + 1  # zero-centred RMSNorms as plain scales
    if "in_proj_qkvz.weight" in name and not legacy_qkvz:
        # grouped [q, k, v, z] per key head -> all q, all k, all v (attn_qkv) and z (attn_gate)
        r = Hv // Hk
        q, k, v, z = np.split(x.reshape(Hk, -1, x.shape[-1]), np.cumsum([Dk, Dk, r * Dv])[:3], axis=1)
        D = x.shape[-1]
        qkv = np.concatenate([q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, D)])
        stem = name.removesuffix("in_proj_qkvz.weight")
        return [(stem + "in_proj_qkv.weight", qkv), (stem + "in_proj_z.weight", z.reshape(-1, D))]
    return [(name, x)]


def _interval(hf: dict[str, Any]) -> int:
    """full_attention_interval of a config; GGUF (gguf-py 0.19) stores layer kinds only as
    this interval, so other layer_types patterns cannot be written."""
    types = hf.get("layer_types")
    if not types:
        return int(hf.get("full_attention_interval", 4))
    every = types.index("full_attention") + 1
    want = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(len(types))]
    if list(types) != want:
        raise ValueError(
            f"layer_types {types} is not every-{every}th-layer full attention; "
            "GGUF's full_attention_interval cannot express it"
        )
    return every


def _hybrid_to_gguf(
    hf: dict[str, Any],
    state: dict[str, np.ndarray],
    path: Path,
    qt: Any,
    raw_overrides: dict[str, tuple[np.ndarray, Any]],
    *,
    legacy_qkvz: bool,
) -> Path:
    """Writes a tiny Qwen3-Next / Qwen3.5 (dense or MoE) as llama.cpp's converter does.

    Metadata: Qwen2MoeModel / Qwen3NextModel / _Qwen35MRopeMixin set_gguf_parameters (ssm.*
    dims, full_attention_interval, rope.dimension_count = head_dim * partial_rotary_factor,
    rope.dimension_sections for Qwen3.5). Tensors: `_hybrid_transform`, experts stacked per
    layer, names from gguf-py's own tensor map for the architecture.

    Raises:
      ValueError: a tensor gguf-py has no name for in this architecture (Qwen3.5's `mtp.*`
        head: newer converters write it as `blk.{n}.nextn.*`, which gguf-py 0.19 does not
        list for qwen35 / qwen35moe), or layer kinds no full_attention_interval expresses.
    """
    import gguf

    mt = hf["model_type"]
    arch = _HYBRID_GGUF_ARCH[mt]
    if legacy_qkvz and arch != "qwen3next":
        raise ValueError("legacy_qkvz applies to qwen3_next only")
    n_layers = hf["num_hidden_layers"]
    n_head = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    rope = hf.get("rope_parameters") or {}
    partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    moe = bool(hf.get("num_experts"))
    if arch == "qwen3next":  # Qwen3NextModel.filter_tensors: "ignore MTP layers for now"
        state = {k: v for k, v in state.items() if not k.startswith("mtp.")}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    if "intermediate_size" in hf:
        w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if moe:
        w.add_expert_count(hf["num_experts"])
        w.add_expert_used_count(hf["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(hf["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hf["linear_key_head_dim"])
    w.add_ssm_group_count(hf["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hf["linear_num_value_heads"])
    w.add_ssm_inner_size(hf["linear_value_head_dim"] * hf["linear_num_value_heads"])
    w.add_full_attention_interval(_interval(hf))
    w.add_rope_dimension_count(int(head_dim * partial))
    if arch != "qwen3next":
        w.add_rope_dimension_sections((list(rope.get("mrope_section", [11, 11, 10])) + [0] * 4)[:4])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(hf["vocab_size"])])

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    expert = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
    stacked: dict[str, list[tuple[int, np.ndarray]]] = {}
    for hf_name in sorted(state, key=_natural_key):
        x = state[hf_name]
        if m := expert.match(hf_name):  # Qwen2MoeModel: experts stacked per layer and projection
            stacked.setdefault(f"{m[1]}.{m[3]}.weight", []).append((int(m[2]), x))
            continue
        for name, t in _hybrid_transform(hf, arch, hf_name, x, legacy_qkvz):
            _add_tensor(w, _gguf_name(names, name, arch), t, qt, raw_overrides)
    for name, parts in stacked.items():
        _add_tensor(
            w,
            _gguf_name(names, name, arch),
            np.stack([t for _, t in sorted(parts, key=lambda p: p[0])]),
            qt,
            raw_overrides,
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _natural_key(name: str) -> list[Any]:
    """Sort key putting model.layers.10 after model.layers.9."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _gguf_name(names: Any, hf_name: str, arch: str) -> str:
    """gguf-py's GGUF name of an HF tensor name for `arch` (ValueError when it has none)."""
    from importlib.metadata import version

    out = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if out is None:
        raise ValueError(f"gguf-py {version('gguf')} has no {arch} tensor name for {hf_name!r}")
    return out
