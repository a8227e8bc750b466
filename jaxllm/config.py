"""Model configuration: the architecture a checkpoint ships, one frozen, hashable dataclass,
static under `jit`. How a machine runs it (dtypes, kernels, scan or unroll) is
`jaxllm.runtime_options.RuntimeOptions`.

Axis letters used across the package (documented once, here):
  B slots, T tokens (flattened ragged batch), S cache positions, P pages, L layers,
  D model width, H query heads, K kv heads, Dh head dim, F ffn width, E experts, V vocab.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next"]
FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next")
# Layer kinds of hybrid families (HF `layer_types`).
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style frequency scaling (the only variant these families ship with)."""

    kind: Literal["llama3"] = "llama3"
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: Family
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_position: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts (qwen3_moe); ffn_dim is unused there.
    n_experts: int = 0
    n_experts_per_token: int = 0
    moe_ffn_dim: int = 0
    norm_topk_prob: bool = True
    # Hybrid family (qwen3_next: Qwen3-Next, Qwen3.5 dense and MoE). Gated DeltaNet layers
    # ("linear_attention") carry a fixed-size recurrent state per sequence; gated attention
    # layers ("full_attention") use the paged K/V cache. () means every layer is attention.
    layer_types: tuple[str, ...] = ()
    linear_n_k_heads: int = 0
    linear_n_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0
    # Leading dims of each attention head that RoPE rotates (partial RoPE); 0 = head_dim.
    rotary_dim: int = 0
    # The sigmoid-gated shared expert beside the routed ones (0 = none).
    shared_expert_ffn_dim: int = 0
    # Multi-token-prediction layers shipped with the checkpoint (0 = none).
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; known: {', '.join(FAMILIES)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.is_moe and not (0 < self.n_experts_per_token <= self.n_experts):
            raise ValueError("a MoE config needs 0 < n_experts_per_token <= n_experts")
        if self.family == "qwen3_moe" and not self.n_experts:
            raise ValueError("a qwen3_moe config needs n_experts > 0")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and within head_dim {self.head_dim}, got {self.rotary_dim}")
        if self.is_hybrid:
            self._check_hybrid()

    def _check_hybrid(self) -> None:
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model has {self.n_layers}")
        unknown = set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
        if unknown:
            raise ValueError(f"unknown layer types {sorted(unknown)}; known: {LINEAR_ATTENTION}, {FULL_ATTENTION}")
        p = self.layer_period
        if self.layer_types[:p] * (self.n_layers // p) != self.layer_types:
            raise ValueError("layer_types must repeat one pattern (scanned in groups)")
        if FULL_ATTENTION not in self.layer_types:
            raise ValueError("a hybrid model needs at least one full_attention layer")
        if LINEAR_ATTENTION in self.layer_types:
            dims = (
                self.linear_n_k_heads,
                self.linear_n_v_heads,
                self.linear_k_dim,
                self.linear_v_dim,
                self.conv_kernel,
            )
            if min(dims) < 1:
                raise ValueError("linear-attention layers need positive linear_* head counts, dims and conv_kernel")
            if self.linear_n_v_heads % self.linear_n_k_heads:
                raise ValueError("linear_n_v_heads must be a multiple of linear_n_k_heads")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def is_hybrid(self) -> bool:
        """Gated DeltaNet + gated attention layers (the Qwen3-Next / Qwen3.5 family)."""
        return self.family == "qwen3_next"

    @property
    def layer_period(self) -> int:
        """Length of the smallest repeating group of `layer_types` (1 for uniform models)."""
        n = len(self.layer_types)
        return next(
            (p for p in range(1, n + 1) if n % p == 0 and self.layer_types[:p] * (n // p) == self.layer_types), 1
        )

    @property
    def n_kv_layers(self) -> int:
        """Layers with a paged K/V cache (every layer but the linear-attention ones)."""
        return self.n_layers - self.n_linear_layers

    @property
    def n_linear_layers(self) -> int:
        return sum(t == LINEAR_ATTENTION for t in self.layer_types)

    @property
    def conv_dim(self) -> int:
        """Channels of the DeltaNet's causal conv: q, k (key heads) and v (value heads)."""
        return 2 * self.linear_n_k_heads * self.linear_k_dim + self.linear_n_v_heads * self.linear_v_dim

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def param_count(self) -> int:
        gate = self.n_heads if self.is_hybrid else 0  # gated attention's output gate
        attn = self.d_model * self.head_dim * (2 * self.n_heads + gate + 2 * self.n_kv_heads)
        attn += 2 * self.head_dim if self.qk_norm else 0
        Hv, Dv = self.linear_n_v_heads, self.linear_v_dim
        linear = self.d_model * (self.conv_dim + Hv * Dv + 2 * Hv) + Hv * Dv * self.d_model
        linear += self.conv_dim * self.conv_kernel + 2 * Hv + Dv  # conv, dt_bias, A_log, gated-norm scale
        if self.is_moe:
            mlp = self.n_experts * 3 * self.d_model * self.moe_ffn_dim + self.d_model * self.n_experts
            mlp += 3 * self.d_model * self.shared_expert_ffn_dim + (self.d_model if self.shared_expert_ffn_dim else 0)
        else:
            mlp = 3 * self.d_model * self.ffn_dim
        embed = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
        mixers = self.n_kv_layers * attn + self.n_linear_layers * linear
        return mixers + self.n_layers * (mlp + 2 * self.d_model) + embed + self.d_model


_HF_FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_5_text": "qwen3_next",
    "qwen3_5_moe_text": "qwen3_next",
}
# Multimodal wrappers whose language model is one of the above, under `text_config`.
_HF_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config.json (the vision tower's is skipped)."""
    model_type = hf.get("model_type", "")
    if model_type not in _HF_WRAPPERS:
        return hf
    text = dict(hf.get("text_config") or {})
    text.setdefault("model_type", _HF_WRAPPERS[model_type])
    if text["model_type"] == model_type:  # some exporters repeat the wrapper's name
        text["model_type"] = _HF_WRAPPERS[model_type]
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return text


def _hybrid_fields(hf: dict[str, Any], rope: dict[str, Any] | None) -> dict[str, Any]:
    """ModelConfig fields of the qwen3_next family (Qwen3-Next, Qwen3.5 dense and MoE)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if not types:  # older configs give only the interval of full-attention layers
        every = hf.get("full_attention_interval", 4)
        types = [FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(n)]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    partial = hf.get("partial_rotary_factor") or (rope or {}).get("partial_rotary_factor") or 1.0
    n_mtp = hf.get("mtp_num_hidden_layers", hf.get("num_nextn_predict_layers", 0)) or 0
    return dict(
        layer_types=tuple(types),
        linear_n_k_heads=hf.get("linear_num_key_heads", 16),
        linear_n_v_heads=hf.get("linear_num_value_heads", 32),
        linear_k_dim=hf.get("linear_key_head_dim", 128),
        linear_v_dim=hf.get("linear_value_head_dim", 128),
        conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        rotary_dim=int(head_dim * float(partial)),
        shared_expert_ffn_dim=hf.get("shared_expert_intermediate_size", 0) if hf.get("num_experts") else 0,
        mtp_layers=int(n_mtp),
    )


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Maps a Hugging Face `config.json` dictionary onto a ModelConfig."""
    hf = text_config(hf)
    model_type = hf.get("model_type", "")
    if model_type not in _HF_FAMILIES:
        known = ", ".join([*_HF_FAMILIES, *_HF_WRAPPERS])
        raise ValueError(f"unknown architecture {model_type!r} in config.json; known: {known}")
    family = _HF_FAMILIES[model_type]
    moe = family == "qwen3_moe" or (family == "qwen3_next" and bool(hf.get("num_experts")))
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    scaling = None
    if rope and rope.get("rope_type", rope.get("type")) == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope["original_max_position_embeddings"]),
        )
    theta = hf.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        ffn_dim=hf.get("intermediate_size", 0),
        max_position=hf.get("max_position_embeddings", 4096),
        rms_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe", "qwen3_next"),
        n_experts=(hf.get("num_experts") or hf.get("num_local_experts", 0)) if moe else 0,
        n_experts_per_token=hf.get("num_experts_per_tok", 0) if moe else 0,
        moe_ffn_dim=hf.get("moe_intermediate_size", 0) if moe else 0,
        # Qwen3.5-MoE's router always renormalises its top-k (the key is absent there).
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        **(_hybrid_fields(hf, rope) if family == "qwen3_next" else {}),
    )


def load_config_json(path: str | Path) -> ModelConfig:
    """Reads a shape preset (`configs/*.json`, HF `config.json` keys) into a ModelConfig."""
    with open(path) as f:
        return config_from_hf(json.load(f))
