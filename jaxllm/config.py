"""Model configuration: one frozen, hashable dataclass, static under `jit`.

Axis letters used across the package (documented once, here):
  B slots, T tokens (flattened ragged batch), S cache positions, P pages, L layers,
  D model width, H query heads, K kv heads, Dh head dim, F ffn width, E experts, V vocab.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next"]
FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next")
# Layer kinds of hybrid families (HF `layer_types`).
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
KV_DTYPES: tuple[str, ...] = ("auto", "float8_e4m3fn")


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
    # Compute dtype of activations and weights ("float32" keeps parity, "bfloat16" for speed).
    dtype: str = "float32"
    # lax.scan over layers compiles fast; unrolled layers run faster on the GPU.
    scan_layers: bool = True
    # Decode-token attention: "auto" runs the Pallas paged kernel where it compiles (GPU), the
    # C++ one on the CPU for float32 (jaxllm.attention.paged_decode_cpu, where a compiler
    # builds it) and the jnp reference elsewhere; "reference" forces the reference;
    # "interpret" runs the Pallas kernel in its interpreter (CPU tests of the wiring; slow).
    decode_attention: str = "auto"
    # Projections (and the lm_head) of decode rounds: "auto" runs the C++ kernels on the CPU
    # for float32 rounds of up to 8 rows (jaxllm.model.matvec_cpu; XLA's CPU dot streamed
    # the weights slower) and XLA's dot elsewhere; "xla" always XLA's. A Pallas matvec on the
    # GPU lost to XLA's dot inside the step and was retired (docs/lab/2026-12.md).
    decode_matmul: str = "auto"
    # Residual add + RMSNorm of rounds of up to 64 tokens: "auto" runs the Pallas kernel
    # (jaxllm.model.rms_norm_kernel) where it compiles (GPU), XLA's fusions elsewhere; "xla"
    # always XLA's; "interpret" the Pallas kernel in its interpreter (CPU tests of the wiring).
    decode_norm: str = "auto"
    # The one-token gated delta rule of decode rounds (hybrid family): "auto" runs the Pallas
    # kernel (jaxllm.model.gated_delta_kernel: each slot's state read once and written once,
    # in place) where it compiles (GPU), the jnp recurrence elsewhere; "reference" forces the
    # jnp path; "interpret" runs the Pallas kernel in its interpreter (CPU tests of the wiring).
    decode_delta: str = "auto"
    # The sampler's cheap optional parts (random draws, grammar mask): "cond" runs each only
    # when some row needs it (`lax.cond`); "select" always runs them and selects the results.
    # On the GPU every conditional makes the host wait for the device to read its predicate,
    # so within a multi-step decode call the host cannot queue the next step's launch while
    # the device runs this one; "auto" is "select" where the default backend is a GPU, "cond"
    # elsewhere (a CPU pays for every random draw). The costly parts (filters, top logprobs)
    # are compiled out of decode calls whose requests need neither (`sample`'s `full`).
    sampler_branches: str = "auto"
    # Element type of the K/V cache: "auto" is `dtype`; "float8_e4m3fn" stores keys and values
    # in 8 bits (vLLM's `--kv-cache-dtype fp8`, unscaled: values saturate at +-448). Decode
    # at many slots reads more K/V than weights, so this halves a bfloat16 step's largest
    # read and doubles the positions a memory budget holds; attention still computes in
    # `dtype` (each path widens what it reads; the GPU decode kernel multiplies an 8-bit pool
    # in float16 under a 16-bit model, exactly), and the rounding changes the outputs.
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.decode_attention not in ("auto", "reference", "interpret"):
            raise ValueError(f"decode_attention must be auto, reference or interpret, got {self.decode_attention!r}")
        if self.decode_matmul not in ("auto", "xla"):
            raise ValueError(f"decode_matmul must be auto or xla, got {self.decode_matmul!r}")
        if self.decode_delta not in ("auto", "reference", "interpret"):
            raise ValueError(f"decode_delta must be auto, reference or interpret, got {self.decode_delta!r}")
        if self.decode_norm not in ("auto", "xla", "interpret"):
            raise ValueError(f"decode_norm must be auto, xla or interpret, got {self.decode_norm!r}")
        if self.sampler_branches not in ("auto", "cond", "select"):
            raise ValueError(f"sampler_branches must be auto, cond or select, got {self.sampler_branches!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
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
            dims = (self.linear_n_k_heads, self.linear_n_v_heads, self.linear_k_dim, self.linear_v_dim, self.conv_kernel)
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
        return next((p for p in range(1, n + 1) if n % p == 0 and self.layer_types[:p] * (n // p) == self.layer_types), 1)

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

    @property
    def jnp_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def kv_jnp_dtype(self) -> Any:
        """The K/V cache's element type (see `kv_dtype`)."""
        return self.jnp_dtype if self.kv_dtype == "auto" else jnp.dtype(self.kv_dtype)

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


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32", scan_layers: bool = True) -> ModelConfig:
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
        dtype=dtype,
        scan_layers=scan_layers,
        **(_hybrid_fields(hf, rope) if family == "qwen3_next" else {}),
    )


def load_config_json(path: str | Path, **overrides: Any) -> ModelConfig:
    """Reads a shape preset (`configs/*.json`, HF `config.json` keys) into a ModelConfig."""
    with open(path) as f:
        return config_from_hf(json.load(f), **overrides)
