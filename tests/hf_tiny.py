"""Tiny random Hugging Face models (and llama.cpp-style GGUFs of them) for tests.

`make_tiny_hf_model` builds a transformers model of a family at toy sizes, perturbs every
weight (so norms are not all ones and biases not all zero, which would hide mapping bugs),
and saves it in float32 with `save_pretrained`. `hf_to_gguf` writes the same weights the
way llama.cpp's convert_hf_to_gguf.py does (permuted llama q/k rows, stacked experts,
`rope_freqs` for Llama-3 RoPE scaling), optionally quantized.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = ("llama", "llama3-rope-scaled", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text",
            "qwen3_5_text")
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
_HYBRID_MOE: dict[str, Any] = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                                   num_experts_per_tok=2)

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
        kw.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[])
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


def make_tiny_hf_model(family: str, tmpdir: str | Path, *, seed: int = 0, noise: float = 0.05, **overrides: Any) -> Path:
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
) -> Path:
    """Writes a saved tiny HF model as GGUF the way llama.cpp's converter lays it out.

    Args:
      model_dir: a `make_tiny_hf_model` directory.
      path: the .gguf file to write.
      qtype: GGML type name for weight matrices ("F32", "F16", "BF16", "Q8_0", "Q4_0", ...);
        1-D tensors (norms, biases, rope_freqs) stay F32 as in llama.cpp.
      raw_overrides: GGUF tensor name -> (already quantized uint8 blocks, GGMLQuantizationType),
        written verbatim instead of the converted tensor (for types gguf-py cannot quantize).

    Returns:
      `path`.
    """
    import gguf

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    mt = hf["model_type"]
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
        if name in raw_overrides:
            data, raw_type = raw_overrides[name]
            w.add_tensor(name, data, raw_dtype=raw_type)
            return
        x = np.ascontiguousarray(x, dtype=np.float32)
        block = gguf.GGML_QUANT_SIZES[qt][0]
        if x.ndim == 1 or qt == gguf.GGMLQuantizationType.F32 or x.shape[-1] % block:
            w.add_tensor(name, x)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)

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
