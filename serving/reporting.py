"""What the worker tells people: the per-request report line, tool-call and drafting logs,
the /v1/state snapshot, the gauges, and why the worker is stuck.

Data in, text and gauges out: the worker gathers frozen views (`PoolUse`, `RequestView`,
`WorkerView`) and hands them here; nothing in this module reads the engine or the scheduler
(it never imports `serving.scheduler`), so each function is testable on its own
(`tests/serving/test_reporting.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from serving.choice_text import ChoiceEnd
from serving.metrics import Metrics
from serving.tool_calls import FallbackReason

log = logging.getLogger("jaxllm.serve")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolUse:
    """The engine's slots and KV pages, in use and in all, read at one moment."""

    max_slots: int
    free_slots: int
    usable_pages: int  # the pool's pages less the trash page
    free_pages: int
    live_sequences: int  # sequences the engine holds
    recurrent_bytes: int = 0  # per sequence (hybrid models' linear-attention state)
    max_context: int = 0

    @property
    def pages_in_use(self) -> int:
        return self.usable_pages - self.free_pages

    @property
    def held_slots(self) -> int:
        return self.max_slots - self.free_slots


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestView:
    """One admitted request as /v1/state and its report line show it."""

    id: str
    phase: str  # "prefill" | "decode"
    session: str | None
    n: int
    generation: int  # the settings generation it was admitted under
    reserved_state_bytes: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    context: int = 0  # its longest choice's positions in the cache
    parse_seconds: float | None = None  # the handler started -> arrival (body, parse, tokenize)
    queued_seconds: float | None = None  # arrival -> the first round carrying its prompt
    first_token_seconds: float | None = None  # arrival -> its first token handed to the handler
    first_written_seconds: float | None = None  # arrival -> the handler wrote its first chunk (streams)
    nan_tokens: int = 0  # tokens drawn from nan logits (a numerical fault)

    def state(self) -> dict[str, Any]:
        """Its entry in /v1/state's "active"."""
        return {
            "id": self.id,
            "phase": self.phase,
            "session": self.session,
            "n": self.n,
            "generation": self.generation,
            "reserved_state_bytes": self.reserved_state_bytes,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated_tokens,
            },
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "parse_seconds": self.parse_seconds,
            "queued_seconds": self.queued_seconds,
            "first_token_seconds": self.first_token_seconds,
            "first_written_seconds": self.first_written_seconds,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerView:
    """The worker's state after a round, as published to /v1/state and the gauges."""

    ready: bool
    dead: str | None
    stuck: str | None
    settings_generation: int
    queued: int  # waiting for admission, the inbox included
    waiting: int  # the pending list alone (the queued-requests gauge)
    active: tuple[RequestView, ...]
    reserved_bytes: int
    budget_bytes: int
    reserved_pages: int  # KV pages held by the active requests' live sequences
    pool: PoolUse
    prefill_chunk: int
    prefill_rate: float | None
    prefix_cache: dict[str, Any]
    sessions: dict[str, Any]
    compilations: int
    draft_stats: Any = None  # jaxllm.engine_records.DraftStats, or None without drafting
    expert_tokens: np.ndarray | None = None


def report_lines(r: RequestView, pool: PoolUse) -> list[str]:
    """The log lines of a finished request. `pool` is read before the request's pages go
    back, so KV fullness counts them."""
    prefill = r.prompt_tokens - r.cached_tokens
    decode = r.generated_tokens
    used, total = pool.pages_in_use, pool.usable_pages
    lines = [
        f"serve {r.id}: prefill {prefill} tok ({r.cached_tokens} cached) in {r.prefill_seconds:.2f}s "
        f"({_rate(prefill, r.prefill_seconds)} tok/s) | decode {decode} tok in {r.decode_seconds:.2f}s "
        f"({_rate(decode, r.decode_seconds)} tok/s) | ctx {r.context}/{pool.max_context} "
        f"({100 * r.context / max(pool.max_context, 1):.0f}% full) | kv cache {used}/{total} pages "
        f"({100 * used / max(total, 1):.0f}% full)"
        + (
            (f" | parsed in {1e3 * r.parse_seconds:.1f} ms" if r.parse_seconds is not None else "")
            + f" | first token {1e3 * r.first_token_seconds:.1f} ms (queued {1e3 * (r.queued_seconds or 0.0):.1f} ms"
            + (f", written {1e3 * r.first_written_seconds:.1f} ms)" if r.first_written_seconds is not None else ")")
            if r.first_token_seconds is not None
            else ""
        )
        + (f" | NAN LOGITS: {r.nan_tokens} tok" if r.nan_tokens else "")
    ]
    if pool.recurrent_bytes:
        live = pool.live_sequences
        lines.append(
            f"serve {r.id}: recurrent state {live}/{pool.max_slots} slots "
            f"({live * pool.recurrent_bytes / 2**20:.1f} MiB, {100 * live / max(pool.max_slots, 1):.0f}% full)"
        )
    return lines


def report(r: RequestView, pool: PoolUse) -> None:
    for line in report_lines(r, pool):
        log.info("%s", line)


def _rate(tokens: int, seconds: float) -> str:
    """Tokens per second for the report line; n/a when no measurable time was spent."""
    return f"{tokens / seconds:.1f}" if seconds > 1e-4 else "n/a"


def tool_call_diagnostics(metrics: Metrics, request_id: str, end: ChoiceEnd) -> None:
    """Counts and logs how a choice's tool calls were recovered (nothing without tools)."""
    d = end.diagnostics
    if d is None:
        return
    calls = len(end.tool_calls)
    if d.fallback_reason != FallbackReason.NONE:
        metrics.tool_fallbacks.labels(reason=d.fallback_reason.value).inc()
        log.info("serve %s: tool calls %dx (recovered: %s)", request_id, calls, d.fallback_reason.value)
    if d.schema_mismatch_arguments or d.empty_arguments_omitted:
        metrics.tool_schema_mismatches.inc(d.schema_mismatch_arguments)
        metrics.tool_empty_arguments.inc(d.empty_arguments_omitted)
        log.info(
            "serve %s: tool calls %dx (%d schema mismatches, %d empty arguments omitted)",
            request_id,
            calls,
            d.schema_mismatch_arguments,
            d.empty_arguments_omitted,
        )


def draft_totals(request_id: str, drafting: Iterable[Any]) -> tuple[int, int] | None:
    """(proposed, accepted) drafts over a request's choices (each a sequence's `drafting`
    record), logged; None when none of them drafted."""
    drafting = list(drafting)
    if not drafting:
        return None
    proposed, accepted = sum(d.proposed for d in drafting), sum(d.accepted for d in drafting)
    if proposed:
        log.info("serve %s: drafts %d, accepted %d (%.0f%%)", request_id, proposed, accepted, 100 * accepted / proposed)
    return proposed, accepted


def stuck_reason(pool: PoolUse, *, busy: bool) -> str | None:
    """Slots or pages held while no request runs (`busy` false): they leaked, and what leaked
    never comes back."""
    if busy:
        return None
    if pool.held_slots or pool.pages_in_use or pool.live_sequences:
        return (
            f"{pool.held_slots} of {pool.max_slots} sequence slots and {pool.pages_in_use} KV pages "
            "are held by no request"
        )
    return None


def publish(metrics: Metrics, view: WorkerView) -> None:
    """Sets the gauges and swaps in a fresh /v1/state snapshot (one reference swap)."""
    m, pool = metrics, view.pool
    m.queued.set(view.waiting)
    m.active.set(len(view.active))
    m.reserved_bytes.set(view.reserved_bytes)
    m.reserved_pages.set(view.reserved_pages)
    m.prefix_cache_bytes.set(view.prefix_cache["bytes"])
    m.prefix_cache_entries.set(view.prefix_cache["entries"])
    m.sessions.set(view.sessions["active"])
    m.prefill_chunk.set(view.prefill_chunk)
    stats = view.draft_stats
    for j, rate in enumerate(stats.acceptance() if stats is not None else []):
        if rate is not None:
            m.draft_acceptance.labels(position=str(j + 1)).set(rate)
    m.state = {
        "ready": view.ready,
        "dead": view.dead,
        "stuck": view.stuck,
        "settings_generation": view.settings_generation,
        "queued_requests": view.queued,
        "active_requests": len(view.active),
        "requests": m.totals(),
        "reserved_state_bytes": view.reserved_bytes,
        "state_budget_bytes": view.budget_bytes,
        "reserved_pages": view.reserved_pages,
        "pages_in_use": pool.pages_in_use,
        "pages_total": pool.usable_pages,
        "free_slots": pool.free_slots,
        # Hybrid models: linear-attention layers hold a fixed-size state per live sequence.
        "recurrent_state_bytes_in_use": pool.recurrent_bytes * pool.live_sequences,
        "recurrent_state_bytes_total": pool.recurrent_bytes * pool.max_slots,
        "prefill_chunk_tokens": view.prefill_chunk,
        "prefill_rate_tokens_per_s": view.prefill_rate,
        "active": [r.state() for r in view.active],
        "prefix_cache": view.prefix_cache,
        "sessions": view.sessions,
        "compilations": view.compilations,
        "speculative": draft_state(view.draft_stats),
        "expert_activity": expert_activity(view.expert_tokens),
    }


def draft_state(stats: Any) -> dict[str, Any] | None:
    """Drafts verified and accepted at each draft position since start (None: drafting off)."""
    if stats is None or not stats.max_drafts:
        return None
    return {
        "proposed": stats.proposed.tolist(),
        "accepted": stats.accepted.tolist(),
        "acceptance_by_position": stats.acceptance(),
    }


def expert_activity(tokens: np.ndarray | None) -> dict | None:
    """Expert load for MoE models: tokens routed per expert (summed over layers) and balance."""
    if tokens is None or tokens.size == 0:
        return None
    per_expert = tokens.sum(axis=0)
    total = int(per_expert.sum())
    per_layer = tokens.sum(axis=1)
    return {
        "tokens_routed": total,
        "per_expert": per_expert.tolist(),
        "idle_experts": int((per_expert == 0).sum()),
        # Max/mean load per layer: 1.0 is perfectly balanced routing.
        "max_over_mean_per_layer": [float(row.max() / max(row.mean(), 1e-9)) for row in tokens]
        if per_layer.any()
        else [],
    }
