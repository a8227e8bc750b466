"""Which kernel runs each part of a round: XLA's ops, the Pallas (Triton) kernels on a GPU,
their interpreted form in CPU tests, or the C++ kernels on a CPU. Chosen per round from the
runtime options and the round's token count; everything here is static (trace-time) Python."""

from __future__ import annotations

import os

import jax

from jaxllm.attention import paged_decode_cpu
from jaxllm.model import matvec_cpu, rms_norm_kernel
from jaxllm.model.layers import rms_norm
from jaxllm.pallas_triton import kernels_available
from jaxllm.runtime_options import RuntimeOptions


# The one debug hook for kernel choices: RuntimeOptions fields forced for A/B runs and bug hunts,
# e.g. JAXLLM_DEBUG_KERNELS="decode_attention=reference,decode_matmul=xla".
DEBUG_ENV = "JAXLLM_DEBUG_KERNELS"
_DEBUG_FIELDS = (
    "decode_attention",
    "decode_matmul",
    "decode_norm",
    "decode_route",
    "decode_delta",
    "sampler_branches",
    "weight_layout",
)
# Items of the same hook read elsewhere: "faults=on" injects test faults (serving/faults.py).
_OTHER_ITEMS = ("faults",)


def debug_overrides(text: str | None = None) -> dict[str, str]:
    """The kernel choices `$JAXLLM_DEBUG_KERNELS` (or `text`) forces, as RuntimeOptions
    fields; {} when unset. Values are checked by RuntimeOptions."""
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


def norm_kernel(opts: RuntimeOptions, n_tokens: int) -> str | None:
    """Which kernel runs a round's add + RMSNorm (see RuntimeOptions.decode_norm): "pallas",
    "interpret" (the Pallas kernel in its interpreter), or None for XLA's fusions."""
    return _small_round_kernel(opts.decode_norm, n_tokens, NORM_KERNEL_MAX_ROWS, opts)


def _small_round_kernel(choice: str, n_tokens: int, max_rows: int, opts: RuntimeOptions) -> str | None:
    """A decode-round kernel's choice ("auto" / "xla" / "interpret") for a round of
    `n_tokens`: the Pallas kernel up to `max_rows` where it compiles, else XLA's ops (None)."""
    if n_tokens > max_rows or choice == "xla":
        return None
    if choice == "interpret":
        return "interpret"
    return "pallas" if kernels_available(opts.dtype) else None


# Rounds of at most this many tokens route their MoE layers with the Pallas kernel where it
# compiles (GPU): its one program walks the rows block by block, so it is for decode rounds,
# where XLA's routing is a handful of launch-bound slivers; it won at 1 and 16 tokens and lost
# at 64 (benchmarks/route_check.py, docs/lab/hybrid-h200.md), so wider rounds keep XLA's ops.
ROUTE_KERNEL_MAX_ROWS = 16


def route_kernel_choice(opts: RuntimeOptions, n_tokens: int) -> str | None:
    """Which kernel routes a round's tokens to experts (see RuntimeOptions.decode_route):
    "pallas", "interpret" (the Pallas kernel in its interpreter), or None for XLA's ops."""
    return _small_round_kernel(opts.decode_route, n_tokens, ROUTE_KERNEL_MAX_ROWS, opts)


def add_rms_norm(
    x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float, *, kernel: str | None
) -> tuple[jax.Array, jax.Array]:
    """(x + delta, rms_norm(x + delta)) by the Pallas kernel or by XLA (`norm_kernel`)."""
    if kernel is not None:
        return rms_norm_kernel.add_rms_norm(x, delta, weight, eps=eps, interpret=kernel == "interpret")
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps)


def out_in_weights(opts: RuntimeOptions) -> bool:
    """Whether dense projections are stored input-axes-last (see RuntimeOptions.weight_layout)."""
    if opts.weight_layout == "auto":
        return jax.default_backend() == "gpu"
    return opts.weight_layout == "out_in"


def matmul_kernel(opts: RuntimeOptions, n_tokens: int) -> str:
    """Which `project` kernel this round's projections use (see RuntimeOptions.decode_matmul):
    "cpu" (the C++ kernel, which reads the canonical layout) or "xla"."""
    if out_in_weights(opts):
        return "xla"
    if opts.decode_matmul == "auto" and n_tokens <= matvec_cpu.MAX_ROWS and matvec_cpu.available(opts.dtype):
        return "cpu"
    return "xla"


def decode_attention_kernel(opts: RuntimeOptions) -> str | None:
    """Which kernel runs decode tokens' attention (see RuntimeOptions.decode_attention): "pallas",
    "interpret" (Pallas in its interpreter), "cpu" (C++), or None for the jnp reference."""
    if opts.decode_attention == "auto":
        if kernels_available(opts.dtype) and (opts.kv_dtype == "auto" or fp8_loads_compile()):
            return "pallas"
        # The C++ kernel reads float32 pools only.
        return "cpu" if opts.kv_dtype == "auto" and paged_decode_cpu.available(opts.dtype) else None
    return "interpret" if opts.decode_attention == "interpret" else None


def decode_delta_kernel(opts: RuntimeOptions) -> str | None:
    """Which kernel advances decode rows of Gated DeltaNet layers (see RuntimeOptions.decode_delta):
    "pallas", "interpret" (Pallas in its interpreter), or None for the jnp recurrence."""
    if opts.decode_delta == "auto":
        return "pallas" if kernels_available(opts.dtype) else None
    return "interpret" if opts.decode_delta == "interpret" else None


def fp8_loads_compile() -> bool:
    """Triton converts float8_e4m3fn on compute capability 8.9 and later (Ada, Hopper)."""
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    return tuple(int(x) for x in str(capability).split(".")[:2]) >= (8, 9)


def sampler_branches(opts: RuntimeOptions) -> str:
    """How the sampler's optional parts run (see RuntimeOptions.sampler_branches): "select"
    (always computed, no host sync) on a GPU, "cond" elsewhere, unless the options say."""
    if opts.sampler_branches != "auto":
        return opts.sampler_branches
    return "select" if jax.default_backend() == "gpu" else "cond"


def plain_sampler_pays(opts: RuntimeOptions) -> bool:
    """Whether decode calls get a plain-sampler variant (`steps.decode_steps(full_sampler=
    False)`): with "select" branches (GPU) it is the variant without any conditional, so the
    host never waits mid-call; with `lax.cond` (CPU) the parts it leaves out already cost
    nothing when unused, and the variant would only add compile time at start-up."""
    return sampler_branches(opts) == "select"
