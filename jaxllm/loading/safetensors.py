"""Load a Hugging Face model directory (config.json + *.safetensors, sharded or not).

Tensors are read one at a time through memory-mapped `safe_open` (numpy framework, so no
torch at run time) and written into the stacked buffers of a `ParamAssembler`.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from jaxllm.config import ModelConfig, config_from_hf
from jaxllm.loading.assemble import ParamAssembler, heads_bias, heads_in, heads_out, linear
from jaxllm.loading.hf_hybrid import centred, hybrid_layer_tensor, mtp_tensor, without_absent_mtp
from jaxllm.loading.checks import check_dims, check_heads, check_positive_finite
from jaxllm.params import Params

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Multimodal wrappers (Qwen3.5) keep the language model under model.language_model.*.
_WRAPPED = re.compile(r"^model\.language_model\.")
_VISION = re.compile(r"^(model\.)?visual\.")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Buffers some exporters save that carry no weights.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """Reads `config.json`, normalising key spellings that differ across transformers versions.

    Args:
      model_dir: the Hugging Face model directory.

    Returns:
      The config dictionary, with `num_experts` set for MoE configs.

    Raises:
      FileNotFoundError: the directory has no config.json.
      ValueError: a MoE layout this runtime does not support (dense layers mixed in).
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    with open(path) as f:
        hf = json.load(f)
    if hf.get("model_type") in ("qwen3_moe", "qwen3_next"):
        # transformers 5 writes `num_local_experts`; 4.x wrote `num_experts`.
        if "num_experts" not in hf and "num_local_experts" in hf:
            hf["num_experts"] = hf["num_local_experts"]
        # Our params stack identical MoE layers; interleaved dense MLP layers would not fit.
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(
                f"{hf['model_type']} checkpoints with dense MLP layers (mlp_only_layers / decoder_sparse_step) are not supported"
            )
    return hf


def _shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory, in index order when sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [model_dir / n for n in names]
        for p in files:
            if not p.is_file():
                raise FileNotFoundError(f"shard {p} listed in {index} is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def _iter_tensors(files: list[Path], progress: bool) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """Yields (name, loader) over all tensors of all shards, with one tqdm bar overall."""
    handles = [safe_open(str(p), framework="numpy") for p in files]
    names = [(h, k) for h in handles for k in h.keys()]
    for h, k in tqdm(names, desc="loading safetensors", unit="tensor", disable=not progress):
        yield k, lambda h=h, k=k: h.get_tensor(k)


def _layer_tensor(asm: ParamAssembler, cfg: ModelConfig, i: int, name: str, w: np.ndarray) -> bool:
    """Stores one `model.layers.{i}.*` tensor; returns False when the name is not known."""
    H, K, F = cfg.n_heads, cfg.n_kv_heads, cfg.moe_ffn_dim
    simple: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
        "input_layernorm.weight": ("layers.attn_norm", lambda x: x),
        "post_attention_layernorm.weight": ("layers.mlp_norm", lambda x: x),
        "self_attn.q_proj.weight": ("layers.attn.wq", lambda x: heads_in(x, H)),
        "self_attn.k_proj.weight": ("layers.attn.wk", lambda x: heads_in(x, K)),
        "self_attn.v_proj.weight": ("layers.attn.wv", lambda x: heads_in(x, K)),
        "self_attn.o_proj.weight": ("layers.attn.wo", lambda x: heads_out(x, H)),
        "self_attn.q_proj.bias": ("layers.attn.bq", lambda x: heads_bias(x, H)),
        "self_attn.k_proj.bias": ("layers.attn.bk", lambda x: heads_bias(x, K)),
        "self_attn.v_proj.bias": ("layers.attn.bv", lambda x: heads_bias(x, K)),
        "self_attn.q_norm.weight": ("layers.attn.q_norm", lambda x: x),
        "self_attn.k_norm.weight": ("layers.attn.k_norm", lambda x: x),
        "mlp.gate_proj.weight": ("layers.mlp.w_gate", linear),
        "mlp.up_proj.weight": ("layers.mlp.w_up", linear),
        "mlp.down_proj.weight": ("layers.mlp.w_down", linear),
        "mlp.gate.weight": ("layers.mlp.router", linear),
    }
    if name in simple:
        key, fn = simple[name]
        asm.put(key, fn(w), layer=i)
        return True
    if m := _EXPERT.match(name):
        key = {"gate_proj": "layers.mlp.w_gate", "up_proj": "layers.mlp.w_up", "down_proj": "layers.mlp.w_down"}[m[2]]
        asm.put(key, linear(w), layer=i, expert=int(m[1]))
        return True
    # Fused expert tensors (transformers >= 5 in-memory layout): gate_up_proj [E, 2F, D]
    # with gate rows first (the forward pass does `.chunk(2, dim=-1)`), down_proj [E, D, F].
    if name in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj.weight"):
        asm.put("layers.mlp.w_gate", linear(w[:, :F, :]), layer=i)
        asm.put("layers.mlp.w_up", linear(w[:, F:, :]), layer=i)
        return True
    if name in ("mlp.experts.down_proj", "mlp.experts.down_proj.weight"):
        asm.put("layers.mlp.w_down", linear(w), layer=i)
        return True
    return False


def check_hf_config(hf: dict[str, Any]) -> None:
    """The shape keys config.json has, before config_from_hf divides by them (see loading.checks)."""
    src = "config.json"
    roles = {
        "num_attention_heads": "heads",
        "num_key_value_heads": "kv_heads",
        "hidden_size": "width",
        "num_hidden_layers": "layers",
        "vocab_size": "vocab",
        "intermediate_size": "ffn",
        "max_position_embeddings": "context",
        "head_dim": "head_dim",
    }
    for key, role in roles.items():
        if hf.get(key) is not None:
            check_dims(src, **{role: (key, hf[key])})
    heads, kv = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if heads and kv:
        check_heads(src, int(heads), int(kv))
    if "rms_norm_eps" in hf:
        check_positive_finite(src, "rms_norm_eps", hf["rms_norm_eps"])


def load_safetensors_model(
    model_dir: str | Path, *, dtype: str = "float32", progress: bool = True
) -> tuple[ModelConfig, Params]:
    """Loads a Hugging Face checkpoint directory into (config, params).

    Args:
      model_dir: directory with config.json and model*.safetensors (optionally sharded
        with model.safetensors.index.json).
      dtype: dtype of the returned params.
      progress: show a tqdm bar over tensors.

    Returns:
      The ModelConfig and the Params on the default device.

    Raises:
      FileNotFoundError: missing directory, config.json or shards.
      ValueError: unknown architecture, missing tensors or shape mismatches.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    hf = read_hf_config(model_dir)
    check_hf_config(hf)
    cfg = config_from_hf(hf)
    files = _shard_files(model_dir)
    cfg = without_absent_mtp(cfg, (k for p in files for k in safe_open(str(p), framework="numpy").keys()))
    asm = ParamAssembler(cfg, dtype)
    unknown: list[str] = []
    layer_tensor = hybrid_layer_tensor if cfg.is_hybrid else _layer_tensor
    for name, get in _iter_tensors(files, progress):
        name = _WRAPPED.sub("model.", name)
        if _VISION.match(name):
            continue  # the vision tower of a multimodal checkpoint: text only here
        if name == "model.embed_tokens.weight":
            asm.put("embed", get())
        elif name == "model.norm.weight":
            asm.put("final_norm", centred(get()) if cfg.is_hybrid else get())
        elif name == "lm_head.weight":
            # Tied checkpoints sometimes still save lm_head; the embedding is authoritative.
            if asm.wants("lm_head"):
                asm.put("lm_head", linear(get()))
        elif (m := _LAYER.match(name)) and layer_tensor(asm, cfg, int(m[1]), m[2], get()):
            pass
        elif name.startswith("mtp.") and mtp_tensor(asm, cfg, name, get()):
            pass
        elif not _IGNORED.search(name):
            unknown.append(name)
    if unknown:
        warnings.warn(f"ignored {len(unknown)} unknown tensors, e.g. {unknown[:3]}", stacklevel=2)
    return cfg, asm.finish()
