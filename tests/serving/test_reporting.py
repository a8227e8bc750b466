"""The worker's reports from data alone: the report line, /v1/state and the gauges, stuck."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from serving.choice_text import ChoiceEnd
from serving.metrics import Metrics
from serving.reporting import (
    PoolUse,
    RequestView,
    WorkerView,
    draft_totals,
    publish,
    report_lines,
    stuck_reason,
    tool_call_diagnostics,
)
from serving.tool_calls import Diagnostics, FallbackReason

POOL = PoolUse(max_slots=4, free_slots=3, usable_pages=64, free_pages=48, live_sequences=1, max_context=1000)
REQ = RequestView(
    id="r1",
    phase="decode",
    session=None,
    n=1,
    generation=0,
    reserved_state_bytes=100,
    prompt_tokens=40,
    cached_tokens=8,
    generated_tokens=20,
    prefill_seconds=0.5,
    decode_seconds=2.0,
    context=60,
)


def test_report_line_by_hand():
    (line,) = report_lines(REQ, POOL)
    assert line == (
        "serve r1: prefill 32 tok (8 cached) in 0.50s (64.0 tok/s) | decode 20 tok in 2.00s (10.0 tok/s) "
        "| ctx 60/1000 (6% full) | kv cache 16/64 pages (25% full)"
    )
    fast = RequestView(**{**REQ.__dict__, "prefill_seconds": 0.0})
    assert "(n/a tok/s) | decode" in report_lines(fast, POOL)[0]


def test_report_line_of_a_hybrid_model_adds_the_recurrent_state():
    pool = PoolUse(**{**POOL.__dict__, "recurrent_bytes": 3 << 20, "live_sequences": 2})
    assert report_lines(REQ, pool)[1] == "serve r1: recurrent state 2/4 slots (6.0 MiB, 50% full)"


def test_stuck_only_when_idle_with_something_held():
    assert stuck_reason(POOL, busy=True) is None
    assert stuck_reason(POOL, busy=False) == "1 of 4 sequence slots and 16 KV pages are held by no request"
    empty = PoolUse(max_slots=4, free_slots=4, usable_pages=64, free_pages=64, live_sequences=0)
    assert stuck_reason(empty, busy=False) is None


def test_publish_sets_the_gauges_and_the_snapshot():
    m = Metrics()
    stats = SimpleNamespace(
        max_drafts=2, proposed=np.array([4, 2]), accepted=np.array([3, 1]), acceptance=lambda: [0.75, 0.5]
    )
    view = WorkerView(
        ready=True,
        dead=None,
        stuck=None,
        settings_generation=3,
        queued=2,
        waiting=1,
        active=(REQ,),
        reserved_bytes=100,
        budget_bytes=1000,
        reserved_pages=16,
        pool=POOL,
        prefill_chunk=64,
        prefill_rate=500.0,
        prefix_cache={"bytes": 10, "entries": 1},
        sessions={"active": 0},
        compilations=7,
        draft_stats=stats,
        expert_tokens=np.array([[1, 0]]),
    )
    publish(m, view)
    s = m.state
    assert s["queued_requests"] == 2 and s["active_requests"] == 1 and s["pages_in_use"] == 16
    assert s["pages_total"] == 64 and s["free_slots"] == 3 and s["settings_generation"] == 3
    assert s["active"][0]["usage"] == {"prompt_tokens": 40, "cached_tokens": 8, "generated_tokens": 20}
    assert s["speculative"]["acceptance_by_position"] == [0.75, 0.5]
    assert s["expert_activity"]["idle_experts"] == 1 and s["requests"]["finished"] == 0
    text = m.text().decode()
    assert "jaxllm_queued_requests 1.0" in text and "jaxllm_reserved_pages 16.0" in text
    assert 'jaxllm_draft_acceptance_rate{position="2"} 0.5' in text


def test_tool_call_diagnostics_are_counted():
    m = Metrics()
    end = ChoiceEnd(
        frames=(),
        reason="tool_calls",
        content="",
        tool_calls=({"id": "a"},),
        diagnostics=Diagnostics(fallback_reason=FallbackReason.UNKNOWN_TOOL, schema_mismatch_arguments=1),
    )
    tool_call_diagnostics(m, "r1", end)
    tool_call_diagnostics(m, "r1", ChoiceEnd(frames=(), reason="stop", content="", tool_calls=(), diagnostics=None))
    text = m.text().decode()
    assert 'jaxllm_tool_call_fallbacks_total{reason="unknown_tool"} 1.0' in text
    assert "jaxllm_tool_call_schema_mismatches_total 1.0" in text


def test_draft_totals():
    assert draft_totals("r", []) is None
    d = [SimpleNamespace(proposed=4, accepted=3), SimpleNamespace(proposed=2, accepted=0)]
    assert draft_totals("r", d) == (6, 3)
