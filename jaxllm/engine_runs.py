"""Running rows of (prompt, sampling) on an engine and sizing engines for them: shared by
`jaxllm.api`, `jaxllm.sequence_state` and `jaxllm.research`, which import it (never the
reverse), so none of them has to import another back."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxllm.config import ModelConfig
from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.state import kv_bytes_per_page

# `model` arguments are `jaxllm.api.Model` (which imports this module): anything with cfg,
# tokenizer and engine(config).
Model = Any


@dataclasses.dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float]


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def kv_bytes(cfg: ModelConfig, n_seqs: int, length: int, page_size: int = 16, *, opts: RuntimeOptions) -> int:
    """A K/V budget holding `n_seqs` sequences of `length` positions (plus a trash page each)."""
    pages = n_seqs * (-(-length // page_size) + 1) + 2
    return pages * kv_bytes_per_page(cfg, page_size, opts)


def research_engine(
    model: Model,
    n_rows: int,
    longest: int,
    *,
    max_slots: int = 32,
    logits_processors: tuple = (),
    max_drafts: int = 0,
    batch_invariant: bool = False,
    verify_cost: float | None = None,
) -> Engine:
    """An engine sized for `n_rows` sequences of up to `longest` positions, research samplers
    on; `max_drafts` > 0: sequences draft by prompt lookup (see `EngineConfig.max_drafts`,
    `EngineConfig.verify_cost`).

    `batch_invariant`: `EngineConfig.batch_invariant`, with a shape that does not follow the
    run (`max_slots` slots, `longest` rounded up to a power of two, at least 256): a row's
    logits are then bitwise the same in any run of such engines whatever the other rows."""
    slots = max(1, min(n_rows, max_slots))
    longest = round_up(longest, 64)  # engines of similar runs share shapes, so compilations
    if batch_invariant:
        slots, longest = max_slots, max(256, 1 << (longest - 1).bit_length())
    # Prompts are packed side by side into prefill chunks: on the CPU a comparison's many
    # short prompts would otherwise take a round each.
    return model.engine(
        EngineConfig(
            max_slots=slots,
            max_seq_len=longest,
            kv_bytes=kv_bytes(model.cfg, slots, longest, opts=model.options),
            chunk_buckets=(64, 256),
            chunk_segments=4,
            extra_samplers=True,
            logits_processors=tuple(logits_processors),
            max_drafts=max_drafts,
            batch_invariant=batch_invariant,
            verify_cost=verify_cost,
        )
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """A finished row: the completion and the model's entropy at each of its steps."""

    completion: Completion
    entropies: list[float]


def run_rows(model: Model, engine: Engine, rows: Sequence[tuple]) -> list[Sample]:
    """Generates every (prompt ids, params) or (prompt ids, params, checkpoint of all but the
    prompt's last token) row, admitting rows as slots free up."""
    pending = list(enumerate(rows))
    running: dict[int, object] = {}
    results: dict[int, Sample] = {}
    while pending or running:
        while pending and engine.can_admit(len(pending[0][1][0]) + pending[0][1][1].max_tokens):
            index, (ids, params, *rest) = pending.pop(0)
            ckpt = rest[0] if rest else None
            running[index] = engine.add(
                ids, params, checkpoint=ckpt, cached_tokens=len(ids) - 1 if ckpt is not None else 0
            )
        engine.step()
        for index, seq in list(running.items()):
            if seq.finish_reason is not None:
                completion = Completion(
                    prompt_token_ids=seq.prompt,
                    token_ids=list(seq.generated),
                    text=model.tokenizer.decode(seq.generated),
                    finish_reason=seq.finish_reason,
                    logprobs=list(seq.logprobs),
                )
                results[index] = Sample(completion=completion, entropies=list(seq.entropies))
                engine.remove(seq)
                del running[index]
    return [results[i] for i in range(len(rows))]
