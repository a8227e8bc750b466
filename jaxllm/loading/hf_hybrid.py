"""Hugging Face tensor names of the hybrid family (Qwen3-Next, Qwen3.5 dense and MoE) -> our
layout (`jaxllm.params.HybridLayers`, `MtpParams`).

Differences from the dense families that change numbers, all resolved here at load time:
- RMSNorms outside the DeltaNet mixer are zero-centred (`x * (1 + w)`): we store `1 + w`, so
  the runtime has one RMSNorm (llama.cpp's converter does the same).
- Gated attention's q_proj holds, per head, the query then its output gate.
- Qwen3-Next packs q, k, v, z (and b, a) per key-head group in `in_proj_qkvz` / `in_proj_ba`;
  Qwen3.5 stores them apart. Both become Qwen3.5's layout (value heads in order, value head h
  served by key head h // (Hv / Hk)).
- A layer index is the index within its kind: layer i of kind t is the n-th of that kind.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import numpy as np

from jaxllm.config import LINEAR_ATTENTION, ModelConfig
from jaxllm.loading.assemble import ParamAssembler, heads_in, heads_out, linear

_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
# Zero-centred norms (stored as 1 + w).
_CENTRED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)


def centred(w: np.ndarray) -> np.ndarray:
    """A zero-centred RMSNorm weight as the plain scale the runtime multiplies by."""
    return w.astype(np.float32) + 1.0


def kind_index(cfg: ModelConfig, layer: int) -> tuple[str, int]:
    """("linear" | "full", index within that kind's stack) of HF layer `layer`."""
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer {layer} out of range 0..{cfg.n_layers - 1}")
    kind = cfg.layer_types[layer]
    index = sum(t == kind for t in cfg.layer_types[:layer])
    return ("linear" if kind == LINEAR_ATTENTION else "full"), index


def _split_qkvz(cfg: ModelConfig, w: np.ndarray) -> dict[str, np.ndarray]:
    """Qwen3-Next's grouped in_proj_qkvz [Hk*(2Dk + 2rDv), D] -> w_qkv [D, C], w_z [D, Hv, Dv]."""
    Hk, Dk, Dv, r = (
        cfg.linear_n_k_heads,
        cfg.linear_k_dim,
        cfg.linear_v_dim,
        cfg.linear_n_v_heads // cfg.linear_n_k_heads,
    )
    g = w.reshape(Hk, 2 * Dk + 2 * r * Dv, -1)
    q, k, v, z = np.split(g, [Dk, 2 * Dk, 2 * Dk + r * Dv], axis=1)
    D = w.shape[-1]
    qkv = np.concatenate([q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, D)])  # heads in order
    return {"w_qkv": linear(qkv), "w_z": heads_in(z.reshape(-1, D), cfg.linear_n_v_heads)}


def _split_ba(cfg: ModelConfig, w: np.ndarray) -> dict[str, np.ndarray]:
    """Qwen3-Next's grouped in_proj_ba [Hk*2r, D] -> w_b, w_a [D, Hv]."""
    Hk, r = cfg.linear_n_k_heads, cfg.linear_n_v_heads // cfg.linear_n_k_heads
    b, a = np.split(w.reshape(Hk, 2 * r, -1), 2, axis=1)
    D = w.shape[-1]
    return {"w_b": linear(b.reshape(-1, D)), "w_a": linear(a.reshape(-1, D))}


def _mlp_tensor(asm: ParamAssembler, cfg: ModelConfig, prefix: str, i: int, name: str, w: np.ndarray) -> bool:
    """One `mlp.*` tensor of a block (dense, routed experts, shared expert)."""
    F = cfg.moe_ffn_dim
    simple: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
        "mlp.gate_proj.weight": ("mlp.w_gate", linear),
        "mlp.up_proj.weight": ("mlp.w_up", linear),
        "mlp.down_proj.weight": ("mlp.w_down", linear),
        "mlp.gate.weight": ("mlp.router", linear),
        "mlp.shared_expert.gate_proj.weight": ("mlp.shared.w_gate", linear),
        "mlp.shared_expert.up_proj.weight": ("mlp.shared.w_up", linear),
        "mlp.shared_expert.down_proj.weight": ("mlp.shared.w_down", linear),
        "mlp.shared_expert_gate.weight": ("mlp.shared_gate", lambda x: x.reshape(-1)),
    }
    if name in simple:
        key, fn = simple[name]
        asm.put(f"{prefix}.{key}", fn(w), layer=i)
        return True
    if m := _EXPERT.match(name):
        key = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}[m[2]]
        asm.put(f"{prefix}.mlp.{key}", linear(w), layer=i, expert=int(m[1]))
        return True
    if name in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj.weight"):
        asm.put(f"{prefix}.mlp.w_gate", linear(w[:, :F, :]), layer=i)
        asm.put(f"{prefix}.mlp.w_up", linear(w[:, F:, :]), layer=i)
        return True
    if name in ("mlp.experts.down_proj", "mlp.experts.down_proj.weight"):
        asm.put(f"{prefix}.mlp.w_down", linear(w), layer=i)
        return True
    return False


def _attention_tensor(asm: ParamAssembler, cfg: ModelConfig, prefix: str, i: int, name: str, w: np.ndarray) -> bool:
    H, K = cfg.n_heads, cfg.n_kv_heads
    if name == "self_attn.q_proj.weight":
        q_and_gate = heads_in(w, H)  # [D, H, 2Dh]: per head the query, then its gate
        q, gate = np.split(q_and_gate, 2, axis=-1)
        asm.put(f"{prefix}.mixer.wq", q, layer=i)
        asm.put(f"{prefix}.mixer.w_gate", gate, layer=i)
        return True
    simple: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
        "self_attn.k_proj.weight": ("wk", lambda x: heads_in(x, K)),
        "self_attn.v_proj.weight": ("wv", lambda x: heads_in(x, K)),
        "self_attn.o_proj.weight": ("wo", lambda x: heads_out(x, H)),
        "self_attn.q_norm.weight": ("q_norm", centred),
        "self_attn.k_norm.weight": ("k_norm", centred),
    }
    if name in simple:
        key, fn = simple[name]
        asm.put(f"{prefix}.mixer.{key}", fn(w), layer=i)
        return True
    return False


def _delta_tensor(asm: ParamAssembler, cfg: ModelConfig, i: int, name: str, w: np.ndarray) -> bool:
    Hv = cfg.linear_n_v_heads
    p = "layers.linear.mixer"
    parts: dict[str, np.ndarray] = {}
    if name == "linear_attn.in_proj_qkvz.weight":
        parts = _split_qkvz(cfg, w)
    elif name == "linear_attn.in_proj_ba.weight":
        parts = _split_ba(cfg, w)
    else:
        simple: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
            "linear_attn.in_proj_qkv.weight": ("w_qkv", linear),
            "linear_attn.in_proj_z.weight": ("w_z", lambda x: heads_in(x, Hv)),
            "linear_attn.in_proj_b.weight": ("w_b", linear),
            "linear_attn.in_proj_a.weight": ("w_a", linear),
            "linear_attn.conv1d.weight": ("conv", lambda x: x.reshape(x.shape[0], -1)),
            "linear_attn.dt_bias": ("dt_bias", lambda x: x),
            "linear_attn.A_log": ("a_log", lambda x: x),
            "linear_attn.norm.weight": ("norm", lambda x: x),  # plain scale (not centred)
            "linear_attn.out_proj.weight": ("w_out", lambda x: heads_out(x, Hv)),
        }
        if name not in simple:
            return False
        key, fn = simple[name]
        parts = {key: fn(w)}
    for key, value in parts.items():
        asm.put(f"{p}.{key}", value, layer=i)
    return True


def _block_tensor(
    asm: ParamAssembler, cfg: ModelConfig, prefix: str, kind: str, i: int, name: str, w: np.ndarray
) -> bool:
    if name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        key = "attn_norm" if name.startswith("input") else "mlp_norm"
        asm.put(f"{prefix}.{key}", centred(w), layer=i)
        return True
    if name.startswith("mlp."):
        return _mlp_tensor(asm, cfg, prefix, i, name, w)
    if kind == "full":
        return _attention_tensor(asm, cfg, prefix, i, name, w)
    return _delta_tensor(asm, cfg, i, name, w)


def hybrid_layer_tensor(asm: ParamAssembler, cfg: ModelConfig, layer: int, name: str, w: np.ndarray) -> bool:
    """Stores one `model.layers.{layer}.*` tensor; False when the name is not known."""
    kind, i = kind_index(cfg, layer)
    return _block_tensor(asm, cfg, f"layers.{kind}", kind, i, name, w)


def without_absent_mtp(cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """The config with `mtp_layers` = 0 when the checkpoint ships no `mtp.*` tensor at all.

    Configs of the family declare their MTP head (`mtp_num_hidden_layers`), but transformers
    drops `mtp.*` on load, so anything re-saved through it (and some quantized exports) keeps
    the key without the weights: those load as before, without the head (`params.mtp` None).
    A head that is only partly there still fails in `ParamAssembler.finish`, naming the
    missing tensors.
    """
    if cfg.mtp_layers and not any(n.startswith("mtp.") for n in names):
        return cfg.replace(mtp_layers=0)
    return cfg


def mtp_tensor(asm: ParamAssembler, cfg: ModelConfig, name: str, w: np.ndarray) -> bool:
    """Stores one `mtp.*` tensor (multi-token-prediction head); False when not known."""
    if not cfg.mtp_layers:
        return False
    if name == "mtp.fc.weight":
        asm.put("mtp.fc", linear(w))
        return True
    norms = {
        "mtp.pre_fc_norm_embedding.weight": "mtp.norm_embedding",
        "mtp.pre_fc_norm_hidden.weight": "mtp.norm_hidden",
        "mtp.norm.weight": "mtp.final_norm",
    }
    if name in norms:
        asm.put(norms[name], centred(w))
        return True
    if m := _MTP_LAYER.match(name):
        return _block_tensor(asm, cfg, "mtp.block", "full", int(m[1]), m[2], w)
    return False
