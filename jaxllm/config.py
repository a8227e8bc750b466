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

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]
FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe")
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
    # the weights ~20% slower) and XLA's dot elsewhere; "xla" always XLA's; "pallas" runs the
    # hand-written Pallas matvec (jaxllm.model.matvec) for one-row rounds where it compiles
    # (GPU), on unrolled dense layers as a chain of Pallas kernels passing split partials
    # (jaxllm.model.decode_chain); "interpret" runs those kernels in the Pallas interpreter
    # (CPU tests of the wiring).
    # On the GPU "auto" is XLA's because in the 8B step on an H200 the Pallas kernel measured
    # slower (5.18 vs 4.79 ms per token) although alone its chain beat XLA's (4.37 vs 4.66 ms);
    # the one-token chain measured 6.61-6.90 ms against 4.61-4.74 (its down product, fed the
    # gate|up partials through SwiGLU, took 84 us per layer against XLA's 29; its add + RMSNorm
    # kernels summing 14-16 split partials in one program, 8-9 us each: docs/benchmarks.md).
    decode_matmul: str = "auto"
    # Residual add + RMSNorm of rounds of up to 64 tokens: "auto" runs the Pallas kernel
    # (jaxllm.model.rms_norm_kernel) where it compiles (GPU), XLA's fusions elsewhere; "xla"
    # always XLA's; "interpret" the Pallas kernel in its interpreter (CPU tests of the wiring).
    decode_norm: str = "auto"
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
        if self.decode_matmul not in ("auto", "xla", "pallas", "interpret"):
            raise ValueError(f"decode_matmul must be auto, xla, pallas or interpret, got {self.decode_matmul!r}")
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
            raise ValueError("a qwen3_moe config needs 0 < n_experts_per_token <= n_experts")

    @property
    def is_moe(self) -> bool:
        return self.family == "qwen3_moe"

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
        attn = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.is_moe:
            mlp = self.n_experts * 3 * self.d_model * self.moe_ffn_dim + self.d_model * self.n_experts
        else:
            mlp = 3 * self.d_model * self.ffn_dim
        embed = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + mlp + 2 * self.d_model) + embed + self.d_model


_HF_FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
}


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32", scan_layers: bool = True) -> ModelConfig:
    """Maps a Hugging Face `config.json` dictionary onto a ModelConfig."""
    model_type = hf.get("model_type", "")
    if model_type not in _HF_FAMILIES:
        raise ValueError(f"unknown architecture {model_type!r} in config.json; known: {', '.join(_HF_FAMILIES)}")
    family = _HF_FAMILIES[model_type]
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
        qk_norm=family in ("qwen3", "qwen3_moe"),
        n_experts=(hf.get("num_experts") or hf.get("num_local_experts", 0)) if family == "qwen3_moe" else 0,
        n_experts_per_token=hf.get("num_experts_per_tok", 0) if family == "qwen3_moe" else 0,
        moe_ffn_dim=hf.get("moe_intermediate_size", 0) if family == "qwen3_moe" else 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        dtype=dtype,
        scan_layers=scan_layers,
    )


def load_config_json(path: str | Path, **overrides: Any) -> ModelConfig:
    """Reads a shape preset (`configs/*.json`, HF `config.json` keys) into a ModelConfig."""
    with open(path) as f:
        return config_from_hf(json.load(f), **overrides)
