"""Counters and gauges (Prometheus text at /metrics) and the JSON state snapshot.

Each count is kept once, in its Prometheus counter (thread-safe: a handler counts its
refusals, the worker everything else); `totals()` reads them back under the names of
/v1/state's "requests". The worker publishes a fresh `state` dict every round (a reference
swap, so a handler reading it never sees half an update and never touches device arrays).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes etc., for remote benchmarks
        self.requests = Counter("jaxllm_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.http_errors = Counter("jaxllm_http_errors", "Error responses by status", ["status"], registry=r)
        self.prompt_tokens = Counter("jaxllm_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.cached_tokens = Counter("jaxllm_cached_tokens", "Prompt tokens restored from the prefix cache", registry=r)
        self.prefilled_tokens = Counter("jaxllm_prefilled_tokens", "Prompt tokens run through the model", registry=r)
        self.generated_tokens = Counter("jaxllm_generated_tokens", "Tokens generated", registry=r)
        self.prefill_seconds = Counter("jaxllm_prefill_seconds", "Seconds of rounds carrying prompt chunks", registry=r)
        self.decode_seconds = Counter("jaxllm_decode_seconds", "Seconds of decode-only rounds", registry=r)
        self.reconcile_errors = Counter(
            "jaxllm_reconcile_errors", "Streamed text differed from the final decode", registry=r
        )
        self.round_failures = Counter("jaxllm_round_failures", "Compiled rounds that raised", registry=r)
        self.nan_tokens = Counter(
            "jaxllm_nan_logit_tokens",
            "Tokens drawn from nan logits (a numerical fault: not the model's text)",
            registry=r,
        )
        self.queued_requests = Counter("jaxllm_queued", "Requests handed to the worker", registry=r)
        self.admitted_requests = Counter("jaxllm_admitted", "Requests admitted", registry=r)
        self.rounds = Counter("jaxllm_rounds", "Rounds collected", registry=r)
        self.host_errors = Counter("jaxllm_host_errors", "Requests failed by an error in host code", registry=r)
        self.tool_fallbacks = Counter(
            "jaxllm_tool_call_fallbacks", "Tool-call parses that fell back", ["reason"], registry=r
        )
        self.tool_schema_mismatches = Counter(
            "jaxllm_tool_call_schema_mismatches", "Calls whose arguments failed the schema", registry=r
        )
        self.tool_empty_arguments = Counter(
            "jaxllm_tool_call_empty_arguments", "Calls with empty arguments omitted", registry=r
        )
        self.draft_acceptance = Gauge(
            "jaxllm_draft_acceptance_rate", "Share of drafts accepted, by draft position", ["position"], registry=r
        )
        # MoE models: each step's distinct routed experts (mean over layers), so a user sees why
        # a wider round costs more (the seed's expert statistics).
        self.distinct_experts = Histogram(
            "jaxllm_moe_distinct_experts",
            "Distinct experts a step touched, mean over layers",
            buckets=(1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512),
            registry=r,
        )
        # Worker-side latencies (vLLM's request_queue_time / time_to_first_token): arrival at
        # the worker to the first launch carrying the prompt, and to the first frame flushed.
        latency_buckets = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
        self.queue_time = Histogram(
            "jaxllm_request_queue_seconds",
            "Arrival to the first round carrying the prompt",
            buckets=latency_buckets,
            registry=r,
        )
        self.first_token_time = Histogram(
            "jaxllm_time_to_first_token_seconds",
            "Arrival to the first token handed to the handler",
            buckets=latency_buckets,
            registry=r,
        )
        self.queued = Gauge("jaxllm_queued_requests", "Requests waiting for admission", registry=r)
        self.active = Gauge("jaxllm_active_requests", "Requests admitted", registry=r)
        self.reserved_bytes = Gauge("jaxllm_reserved_state_bytes", "Bytes reserved by admitted requests", registry=r)
        self.reserved_pages = Gauge("jaxllm_reserved_pages", "KV pages held by admitted requests", registry=r)
        self.prefix_cache_bytes = Gauge("jaxllm_prefix_cache_bytes", "Bytes held by the prefix cache", registry=r)
        self.prefix_cache_entries = Gauge("jaxllm_prefix_cache_entries", "Prefix cache entries", registry=r)
        self.sessions = Gauge("jaxllm_sessions", "Live sessions", registry=r)
        self.prefill_chunk = Gauge("jaxllm_prefill_chunk_tokens", "Prompt tokens per round (pacer)", registry=r)
        self.state: dict[str, Any] = {"ready": False}

    def count_outcome(self, outcome: str, n: int = 1) -> None:
        self.requests.labels(outcome=outcome).inc(n)

    def totals(self) -> dict[str, float]:
        """The counts since start, by the names of /v1/state's "requests"."""
        out = {"queued": _total(self.queued_requests), "admitted": _total(self.admitted_requests)}
        out |= {key: _total(self.requests, outcome=outcome) for key, outcome in _OUTCOMES.items()}
        counters = {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "reconcile_errors": self.reconcile_errors,
            "rounds": self.rounds,
            "failed_rounds": self.round_failures,
            "host_errors": self.host_errors,
        }
        out |= {key: _total(counter) for key, counter in counters.items()}
        return {k: v if k.endswith("_seconds") else int(v) for k, v in out.items()}

    def count_http_error(self, status: int) -> None:
        self.http_errors.labels(status=str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


# totals() key -> the outcome label of jaxllm_requests
_OUTCOMES = {
    "finished": "finished",
    "failed": "failed",
    "rejected": "rejected",
    "cancelled": "cancelled",
    "cancelled_queued": "cancelled_before_admission",
}


def _total(counter: Counter, **labels: str) -> float:
    """A counter's value (for `labels`), read through its public `collect` (this counter alone)."""
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
