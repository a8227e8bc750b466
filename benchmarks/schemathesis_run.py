"""Schemathesis against a live server: requests generated from its /openapi.json, valid and
invalid, none of which may get a 5xx (nor a 200 stream that ends in a server error).

    python -m benchmarks.schemathesis_run --base http://127.0.0.1:8000 --requests 2000 [--api-key K]
    python -m benchmarks.schemathesis_run --tiny --requests 2000   # starts the tests' tiny server

Afterwards a greedy request must give the same tokens as before the run, and /v1/state must
show the server idle: no active requests, no reserved bytes, every slot free. Exits non-zero
otherwise. `fuzz` is also what tests/serving/test_schemathesis.py runs, with fewer requests.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import schemathesis
import hypothesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

# Share of the requests per operation: the generation routes take most (their bodies are large
# and reach the most code); the others have few distinct inputs.
_WEIGHTS = {"POST /v1/chat/completions": 8, "POST /v1/completions": 6, "POST /tokenize": 3, "POST /detokenize": 2}
GREEDY = {"model": None, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@dataclasses.dataclass
class Report:
    requests: int = 0
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    server_errors: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # 5xx and 5xx-in-stream
    seconds: float = 0.0

    @property
    def count_5xx(self) -> int:
        return len(self.server_errors)

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "5xx": self.count_5xx,
            "seconds": round(self.seconds, 1),
            "statuses": dict(sorted(self.statuses.items())),
            "first_5xx": self.server_errors[:5],
        }


def _stream_error(resp: Any) -> str | None:
    """A 200 event stream that carried a server error event (its type), else None."""
    kind = resp.headers.get("content-type") or ""
    if not (kind[0] if isinstance(kind, list) else kind).startswith("text/event-stream"):  # schemathesis: lists
        return None
    for line in resp.text.splitlines():
        if line.startswith('data: {"error"'):
            kind = json.loads(line[6:])["error"].get("type")
            if kind in ("server_error", "service_unavailable"):
                return kind
    return None


def fuzz(
    base: str,
    *,
    total: int,
    api_key: str | None = None,
    seed: int = 0,
    timeout: float = 60.0,
    deadline: float | None = None,
) -> Report:
    """Sends about `total` generated requests, split over the operations by weight and between
    schema-valid and schema-violating bodies; stops early at `deadline` (time.monotonic)."""
    doc = requests.get(f"{base}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(doc)
    operations = [r.ok() for r in schema.get_all_operations()]
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    weights = {op.label: _WEIGHTS.get(op.label, 1) for op in operations}
    report = Report()
    session = requests.Session()
    started = time.monotonic()
    rng = random.Random(seed)

    def send(case: Any) -> None:
        if deadline is not None and time.monotonic() > deadline:
            return
        resp = case.call(base_url=base, session=session, headers=headers, timeout=timeout)
        report.requests += 1
        report.statuses[resp.status_code] += 1
        in_stream = _stream_error(resp) if resp.status_code == 200 else None
        if resp.status_code >= 500 or in_stream:
            report.server_errors.append(
                {
                    "operation": case.operation.label,
                    "status": resp.status_code,
                    "stream_error": in_stream,
                    "body": case.body
                    if case.body is not None and not isinstance(case.body, bytes)
                    else repr(case.body)[:500],
                    "response": resp.text[:500],
                }
            )

    # Rounds until the budget is spent: hypothesis stops an operation early once it has run out
    # of distinct inputs, so the rest goes to the next round with a fresh seed.
    unit = total / sum(weights.values()) / 2  # per weight and generation mode, per round
    while report.requests < total and (deadline is None or time.monotonic() < deadline):
        before = report.requests
        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                left = total - report.requests
                n = min(left, max(1, round(unit * weights[op.label])))
                if n <= 0:
                    break
                run = hypothesis.seed(rng.getrandbits(64))(
                    settings(
                        max_examples=n,
                        deadline=None,
                        database=None,
                        phases=[Phase.generate],
                        suppress_health_check=list(HealthCheck),
                    )(given(case=op.as_strategy(generation_mode=mode))(send))
                )
                try:
                    run()
                except Exception as e:  # noqa: BLE001 - e.g. a schema no invalid body can violate
                    if "Unsatisfiable" not in type(e).__name__ and "Unsatisfiable" not in str(e):
                        raise
        if report.requests == before:
            break
    report.seconds = time.monotonic() - started
    return report


def greedy_tokens(base: str, api_key: str | None, model: str) -> list[str]:
    """The tokens of one greedy completion, for a before/after comparison."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    body = {**GREEDY, "model": model, "logprobs": 0}
    r = requests.post(f"{base}/v1/completions", json=body, headers=headers, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["tokens"]


def idle_state(base: str, api_key: str | None, timeout: float = 30.0) -> dict[str, Any]:
    """/v1/state once no request is active or queued (or after `timeout`), read again after
    the idle worker's next snapshot (it republishes about once a second), so the answer also
    shows what handlers did after the last round (a session deleted, say)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    end = time.monotonic() + timeout
    while True:
        s = requests.get(f"{base}/v1/state", headers=headers, timeout=30).json()
        if not s["active_requests"] and not s["queued_requests"] or time.monotonic() > end:
            break
        time.sleep(0.1)
    time.sleep(1.5)
    return requests.get(f"{base}/v1/state", headers=headers, timeout=30).json()


def check_idle(state: dict[str, Any], max_slots: int | None) -> list[str]:
    """What is still held although nothing runs (empty when the server is clean)."""
    problems = []
    if state["active_requests"] or state["queued_requests"]:
        problems.append(f"{state['active_requests']} active / {state['queued_requests']} queued requests")
    if state["reserved_state_bytes"] or state["reserved_pages"]:
        problems.append(f"{state['reserved_state_bytes']} reserved bytes, {state['reserved_pages']} reserved pages")
    if max_slots is not None and state["free_slots"] != max_slots:
        problems.append(f"{state['free_slots']} of {max_slots} slots free")
    if state.get("stuck") or state.get("dead"):
        problems.append(f"stuck={state.get('stuck')} dead={state.get('dead')}")
    return problems


TINY_CONFIG = """
[limits]
active_requests = 8
active_state_mib = 64
request_bytes = 65536
max_output_tokens = 16
max_schema_bytes = 16384
body_seconds = 5
[engine]
max_slots = 4
kv_mib = 8
max_seq_len = 512
chunk_buckets = [32, 128]
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="a running server (else --tiny)")
    p.add_argument("--tiny", action="store_true", help="start the tests' tiny-model server for the run")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-slots", type=int, default=None, help="the server's max_slots (all must be free after)")
    p.add_argument("--minutes", type=float, default=None, help="stop after this long whatever the count")
    a = p.parse_args()
    if a.tiny:
        a.max_slots = 4
        from tests.serving.launch import running_server

        with (
            tempfile.TemporaryDirectory() as tmp,
            running_server(["tests.serving.tiny_server"], Path(tmp), TINY_CONFIG) as s,
        ):
            return _run(s["base"], a)
    if not a.base:
        p.error("--base URL or --tiny")
    return _run(a.base, a)


def _run(base: str, a: argparse.Namespace) -> int:
    headers = {"authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    model = requests.get(f"{base}/v1/models", headers=headers, timeout=30).json()["data"][0]
    before = greedy_tokens(base, a.api_key, model["id"])
    deadline = time.monotonic() + a.minutes * 60 if a.minutes else None
    report = fuzz(base, total=a.requests, api_key=a.api_key, seed=a.seed, deadline=deadline)
    after = greedy_tokens(base, a.api_key, model["id"])
    state = idle_state(base, a.api_key)
    problems = check_idle(state, a.max_slots)
    out = {
        **report.summary(),
        "greedy_same": before == after,
        "idle_problems": problems,
        "requests_state": state["requests"],
    }
    print(json.dumps(out, indent=1, default=str))
    return 0 if report.count_5xx == 0 and before == after and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
