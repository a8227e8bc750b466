"""How an engine is shaped: `EngineConfig` (slots, the K/V budget, shape buckets, warm-up,
drafting, batch-invariant rounds), checked when it is built, and the widths its rounds can
take.

`VERIFY_COST_STEPS` sits here, beside the field it is the default of
(`EngineConfig.verify_cost`): someone reading what that setting means finds the measured
figures in the same file. `jaxllm.engine.Engine` picks the entry for its backend and model
kind when the field is None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


# A verification round of 1 + 3 tokens a sequence, in steps of a plain multi-step decode
# call, by backend and model kind (`EngineConfig.verify_cost`), as measured
# (docs/benchmarks.md, docs/lab/spec-load.md, docs/lab/hybrid-h200.md): GPU dense on the 8B,
# GPU MoE on the 35B-A3B shape with its MTP head drafting (four tokens route to ~4x the
# experts one does, and the head drafts three times), CPU on the SmolLM2-135M shape (bound by
# arithmetic, so dearer at width); the CPU's MoE cost is not measured apart.
# Values: (at one decoding sequence, at several).
VERIFY_COST_STEPS: dict[tuple[str, bool], tuple[float, float]] = {
    ("gpu", False): (1.94, 2.0),
    ("gpu", True): (4.01, 4.01),
    ("cpu", False): (2.07, 3.8),
    ("cpu", True): (2.07, 3.8),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_slots: int = 8
    kv_bytes: int = 256 << 20
    max_seq_len: int = 2048
    page_size: int = 16
    # Padding to the bucket is compute thrown away (a CPU prefill is compute-bound): each bucket
    # at most doubles the one below (the 256 bucket's gain: docs/lab/2026-12.md).
    chunk_buckets: tuple[int, ...] = (32, 128, 256, 512)
    min_ctx_pages: int = 8
    decode_steps_per_call: int = 4
    # Widths of a round's decode part (slots [0, width) ); rounds use the smallest that
    # covers every decoding slot, so a lone request does not pay for idle slots. Each width
    # multiplies the compiled variants; () means just max_slots.
    decode_widths: tuple[int, ...] = ()
    # The narrowest decode part of rounds that carry a prompt chunk (0 = no floor). Chunk
    # rounds then compile only for widths >= this, not for every width x chunk bucket: with
    # max_slots it is one width, and the 8B server's warm-up compiles 24 variants instead of
    # 30. The extra decode rows are a few percent of a chunk round's tokens.
    chunk_decode_width: int = 0
    # Prompts a round's chunk may carry side by side (packed prefill). Each segment is a
    # window of the chunk bucket's length in attention, so this multiplies its cost on the
    # reference path; worth it where fused attention runs (GPU), 1 elsewhere.
    chunk_segments: int = 1
    # Threads compiling shape variants during warm-up (XLA compiles release the GIL); 0 = one
    # per CPU core.
    compile_threads: int = 0
    # Whether warm-up also runs every compiled round once, on idle inputs (None: where the
    # default backend is not the CPU). On a GPU an executable's first run pays once-only
    # costs (loading its kernels, recording its command buffers, each `lax.cond` branch's
    # first pass), which would otherwise fall on the first request of each round shape; on
    # the CPU there are none worth the seconds the runs take.
    warmup_runs: bool | None = None
    # The research samplers (jaxllm.samplers_extra: typical, epsilon, eta, top-nσ, DRY, XTC,
    # mirostat, user logits processors) get per-slot rows in the state; off, they cost nothing.
    extra_samplers: bool = False
    # The user functions requests may name as `SamplingParams.logits_processor` (traced into
    # the rounds, so fixed per engine); needs extra_samplers.
    logits_processors: tuple[Callable, ...] = ()
    # Speculative decoding: drafts verified per decoding sequence and round (0 = off). Each
    # round then feeds up to this many + 1 tokens per sequence (`jaxllm.steps.verify`).
    max_drafts: int = 0
    # Batch-invariant rounds: a sequence's logits are bitwise the same whatever else is in the
    # batch (docs/research.md, "Batch-invariant mode"). Every decode token is computed by one
    # program (all `max_slots` rows, `decode_steps_per_call` steps, the largest context
    # bucket, the full sampler, XLA's dot: no C++ matvec); every prompt token by one chunk
    # program (the largest chunk bucket within max_seq_len, one prompt, chunks aligned to
    # multiples of that size, the context bucket of the chunk's end), alternating with decode
    # calls; no drafts. A prefix checkpoint counts only up to a chunk boundary (`add`). Costs:
    # decode rows padded to every slot and the whole context, prompts padded to the chunk, no
    # overlap of prefill and decode, no speculative decoding (docs/research.md).
    batch_invariant: bool = False
    # A verification round's cost in steps of a plain multi-step decode call, which decides
    # whether drafts pay (`Engine._verify_pays`); None: the figure measured on the default
    # backend for the model's kind, dense or MoE (`VERIFY_COST_STEPS`).
    verify_cost: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_slots", "page_size", "decode_steps_per_call", "chunk_segments"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_drafts <= 16:
            raise ValueError(f"max_drafts must be in [0, 16], got {self.max_drafts}")
        if self.verify_cost is not None and self.verify_cost <= 0:
            raise ValueError(f"verify_cost must be > 0, got {self.verify_cost}")
        if (
            not self.chunk_buckets
            or list(self.chunk_buckets) != sorted(set(self.chunk_buckets))
            or self.chunk_buckets[0] < 1
        ):
            raise ValueError(f"chunk_buckets must be positive and ascending, got {list(self.chunk_buckets)}")

    def widths(self) -> tuple[int, ...]:
        return tuple(sorted({w for w in self.decode_widths if 0 < w < self.max_slots} | {self.max_slots}))

    def chunk_widths(self) -> tuple[int, ...]:
        """The decode widths a round with a prompt chunk can have."""
        return tuple(w for w in self.widths() if w >= min(self.chunk_decode_width, self.max_slots))

    def verify_widths(self) -> tuple[int, ...]:
        """The widths a verification round can have: the smallest decode width (a lone
        sequence's rounds, where drafts pay most) and every slot; each one compiles."""
        return tuple(sorted({self.widths()[0], self.max_slots}))
