"""How this machine runs a model: one frozen, hashable record, static under `jit`.

`ModelConfig` (jaxllm.config) describes the architecture a checkpoint ships; everything here
is a choice of the machine that runs it (compute and cache element types, scanned or unrolled
layers, which kernels run a round, the sampler's variant). The same checkpoint runs with
different options on a CPU test and on a GPU server; the jitted steps take both records as
static arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

KV_DTYPES: tuple[str, ...] = ("auto", "float8_e4m3fn")
_CHOICES: dict[str, tuple[str, ...]] = {
    "decode_attention": ("auto", "reference", "interpret"),
    "decode_matmul": ("auto", "xla"),
    "decode_norm": ("auto", "xla", "interpret"),
    "decode_route": ("auto", "xla", "interpret"),
    "decode_delta": ("auto", "reference", "interpret"),
    "weight_layout": ("auto", "in_out", "out_in"),
    "sampler_branches": ("auto", "cond", "select"),
    "kv_dtype": KV_DTYPES,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    """Execution choices for one model on one machine (never part of the checkpoint)."""

    # Compute dtype of activations and weights ("float32" keeps parity, "bfloat16" for speed).
    dtype: str = "float32"
    # lax.scan over layers compiles fast; unrolled layers run faster on the GPU. Decides the
    # params' layout (`params.layout_params`); the model follows the layout it is given.
    scan_layers: bool = True
    # Element type of the K/V cache: "auto" is `dtype`; "float8_e4m3fn" stores keys and values
    # in 8 bits (vLLM's `--kv-cache-dtype fp8`, unscaled: values saturate at +-448). Decode
    # at many slots reads more K/V than weights, so this halves a bfloat16 step's largest
    # read and doubles the positions a memory budget holds; attention still computes in
    # `dtype` (each path widens what it reads; the GPU decode kernel multiplies an 8-bit pool
    # in float16 under a 16-bit model, exactly), and the rounding changes the outputs.
    kv_dtype: str = "auto"
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
    # MoE routing (softmax, top-k, renormalisation, tokens per expert) of rounds of up to 16
    # tokens: "auto" runs the one Pallas kernel (jaxllm.model.route_kernel) where it compiles
    # (GPU), XLA's ops (a softmax, a sort, a scatter: launch-bound at batch 1) elsewhere;
    # "xla" always XLA's; "interpret" the Pallas kernel in its interpreter (CPU tests of the wiring).
    decode_route: str = "auto"
    # The gated delta rule's Pallas kernels (hybrid family): the one-token step of decode rows
    # (jaxllm.model.gated_delta_kernel: each slot's state read once and written once, in place)
    # and the state pass of prompt chunks (jaxllm.model.gated_delta_chunk_kernel: one launch
    # carries the state through every chunk of 64 tokens). "auto" runs them where they compile
    # (GPU), the jnp recurrence and XLA's chunk scan elsewhere; "reference" forces the jnp
    # paths; "interpret" runs the Pallas kernels in their interpreter (CPU tests of the wiring).
    decode_delta: str = "auto"
    # The sampler's cheap optional parts (random draws, grammar mask): "cond" runs each only
    # when some row needs it (`lax.cond`); "select" always runs them and selects the results.
    # On the GPU every conditional makes the host wait for the device to read its predicate,
    # so within a multi-step decode call the host cannot queue the next step's launch while
    # the device runs this one; "auto" is "select" where the default backend is a GPU, "cond"
    # elsewhere (a CPU pays for every random draw). The costly parts (filters, top logprobs)
    # are compiled out of decode calls whose requests need neither (`sample`'s `full`).
    sampler_branches: str = "auto"
    # How dense projection matrices are stored (`params.OutIn`): "in_out" as checkpoints hold
    # them ([D, out]: XLA makes a one-row product a column reduction), "out_in" with the input
    # axes last (each output a contiguous dot) for matrices under `params.OUT_IN_MAX_ELEMENTS`
    # (the MoE and hybrid models' attention, DeltaNet, router and shared-expert matrices; on an
    # H100 their one-row products ran 1.85-3.1x faster so, an 8B's larger ones 4% slower).
    # "auto" is "out_in" where the default backend is a GPU, "in_out" elsewhere (the C++ CPU
    # kernels read [in, out]).
    weight_layout: str = "auto"

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        try:
            jnp.dtype(self.dtype)
        except TypeError:
            raise ValueError(f"dtype must name a floating type (float32, bfloat16, ...), got {self.dtype!r}") from None

    @property
    def jnp_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def kv_jnp_dtype(self) -> Any:
        """The K/V cache's element type (see `kv_dtype`)."""
        return self.jnp_dtype if self.kv_dtype == "auto" else jnp.dtype(self.kv_dtype)

    def replace(self, **changes: Any) -> "RuntimeOptions":
        return dataclasses.replace(self, **changes)
