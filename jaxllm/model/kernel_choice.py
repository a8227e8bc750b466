"""Which kernel runs each part of a round: XLA's ops, the Pallas (Triton) kernels on a GPU,
their interpreted form in CPU tests, or the C++ kernels on a CPU. Chosen per round from the
model config and the round's token count; everything here is static (trace-time) Python."""

from __future__ import annotations

import os

import jax

from jaxllm.attention import paged_decode_cpu
from jaxllm.config import ModelConfig
from jaxllm.model import matvec_cpu, rms_norm_kernel
from jaxllm.model.layers import rms_norm
from jaxllm.pallas_triton import kernels_available


# The one debug hook for kernel choices: ModelConfig fields forced for A/B runs and bug hunts,
# e.g. JAXLLM_DEBUG_KERNELS="decode_attention=reference,decode_matmul=xla".
DEBUG_ENV = "JAXLLM_DEBUG_KERNELS"
_DEBUG_FIELDS = ("decode_attention", "decode_matmul", "decode_norm", "decode_delta", "sampler_branches")
# Items of the same hook read elsewhere: "faults=on" injects test faults (serving/faults.py).
_OTHER_ITEMS = ("faults",)


def debug_overrides(text: str | None = None) -> dict[str, str]:
    """The kernel choices `$JAXLLM_DEBUG_KERNELS` (or `text`) forces, as ModelConfig fields;
    {} when unset. Values are checked by ModelConfig."""
    text = os.environ.get(DEBUG_ENV, "") if text is None else text
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if name.strip() in _OTHER_ITEMS:
            continue
        if not sep or name.strip() not in _DEBUG_FIELDS:
            raise ValueError(f"{DEBUG_ENV}: expected name=value with name in {', '.join(_DEBUG_FIELDS)}, got {item!r}")
        out[name.strip()] = value.strip()
    return out


# Rounds of at most this many tokens run the residual add and RMSNorm as one Pallas kernel
# where it compiles (GPU): decode rounds, where XLA's two or three kernels per norm are
# launch-bound slivers. Longer rounds keep XLA's fusions.
NORM_KERNEL_MAX_ROWS = 64


def norm_kernel(cfg: ModelConfig, n_tokens: int) -> str | None:
    """Which kernel runs a round's add + RMSNorm (see ModelConfig.decode_norm): "pallas",
    "interpret" (the Pallas kernel in its interpreter), or None for XLA's fusions."""
    if n_tokens > NORM_KERNEL_MAX_ROWS or cfg.decode_norm == "xla":
        return None
    if cfg.decode_norm == "interpret":
        return "interpret"
    return "pallas" if kernels_available(cfg.dtype) else None


def add_rms_norm(
    x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float, *, kernel: str | None
) -> tuple[jax.Array, jax.Array]:
    """(x + delta, rms_norm(x + delta)) by the Pallas kernel or by XLA (`norm_kernel`)."""
    if kernel is not None:
        return rms_norm_kernel.add_rms_norm(x, delta, weight, eps=eps, interpret=kernel == "interpret")
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps)


def matmul_kernel(cfg: ModelConfig, n_tokens: int) -> str:
    """Which `project` kernel this round's projections use (see ModelConfig.decode_matmul):
    "cpu" (the C++ kernel) or "xla"."""
    if cfg.decode_matmul == "auto" and n_tokens <= matvec_cpu.MAX_ROWS and matvec_cpu.available(cfg.dtype):
        return "cpu"
    return "xla"


def decode_attention_kernel(cfg: ModelConfig) -> str | None:
    """Which kernel runs decode tokens' attention (see ModelConfig.decode_attention): "pallas",
    "interpret" (Pallas in its interpreter), "cpu" (C++), or None for the jnp reference."""
    if cfg.decode_attention == "auto":
        if kernels_available(cfg.dtype) and (cfg.kv_dtype == "auto" or fp8_loads_compile()):
            return "pallas"
        # The C++ kernel reads float32 pools only.
        return "cpu" if cfg.kv_dtype == "auto" and paged_decode_cpu.available(cfg.dtype) else None
    return "interpret" if cfg.decode_attention == "interpret" else None


def decode_delta_kernel(cfg: ModelConfig) -> str | None:
    """Which kernel advances decode rows of Gated DeltaNet layers (see ModelConfig.decode_delta):
    "pallas", "interpret" (Pallas in its interpreter), or None for the jnp recurrence."""
    if cfg.decode_delta == "auto":
        return "pallas" if kernels_available(cfg.dtype) else None
    return "interpret" if cfg.decode_delta == "interpret" else None


def fp8_loads_compile() -> bool:
    """Triton converts float8_e4m3fn on compute capability 8.9 and later (Ada, Hopper)."""
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    return tuple(int(x) for x in str(capability).split(".")[:2]) >= (8, 9)


def sampler_branches(cfg: ModelConfig) -> str:
    """How the sampler's optional parts run (see ModelConfig.sampler_branches): "select"
    (always computed, no host sync) on a GPU, "cond" elsewhere, unless the config says."""
    if cfg.sampler_branches != "auto":
        return cfg.sampler_branches
    return "select" if jax.default_backend() == "gpu" else "cond"


def plain_sampler_pays(cfg: ModelConfig) -> bool:
    """Whether decode calls get a plain-sampler variant (`steps.decode_steps(full_sampler=
    False)`): with "select" branches (GPU) it is the variant without any conditional, so the
    host never waits mid-call; with `lax.cond` (CPU) the parts it leaves out already cost
    nothing when unused, and the variant would only add compile time at start-up."""
    return sampler_branches(cfg) == "select"
