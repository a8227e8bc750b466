"""Soak: N concurrent clients for T minutes of mixed traffic, every response checked, then the
server must be back to idle with its memory where it was.

    python -m benchmarks.soak --tiny --clients 16 --minutes 3          # the tests' tiny model
    python -m benchmarks.soak --default --clients 16 --minutes 3       # `jaxllm serve` (SmolLM2)
    python -m benchmarks.soak --base http://127.0.0.1:8000 --pid PID --max-slots 8 --clients 64 --minutes 10

Each client loops over: completions and chat, streamed and not (n > 1 included), forced tool
calls, `response_format` JSON schemas, two-turn sessions (then deleted), a greedy reference
request, and disconnects at every phase (half-sent headers, half-sent body, right after the
request, during prefill, mid-stream). Every answer must be a correct response or a clear error
(4xx / 503 with the OpenAI error body, or a stream error event that is not a server error).

Afterwards /v1/state and /metrics must show 0 active and queued requests, 0 reserved bytes and
pages, every slot free, no reconcile or host errors; the greedy request must give what it gave
before; and the server's RSS may have grown by at most 5% beyond what the prefix cache holds
more than at the baseline (taken after a warm-up phase). Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import requests

from benchmarks.schemathesis_run import check_idle, idle_state

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}}
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CLEAR_ERRORS = {400, 404, 408, 409, 413, 429, 499, 503}
WORDS = "the a river city model token cache light stone paper green quick slow north".split()


class Failure(Exception):
    """A response that is neither correct nor a clear error."""


class Client:
    """One soak client: a requests session and the checks of each kind of request."""

    def __init__(self, base: str, key: str | None, model: str, max_tokens: int, rng: random.Random, greedy: str | None):
        self.base, self.model, self.max_tokens, self.rng, self.greedy = base, model, max_tokens, rng, greedy
        self.key = key
        self.s = requests.Session()
        if key:
            self.s.headers["authorization"] = f"Bearer {key}"
        self.greedy_mismatches = 0

    # ---- helpers ---------------------------------------------------------------------------
    def _prompt(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def _post(self, path: str, body: dict, **kw) -> requests.Response:
        return self.s.post(self.base + path, json=body, timeout=300, **kw)

    @staticmethod
    def _clear_error(r: requests.Response) -> str:
        if r.status_code not in CLEAR_ERRORS:
            raise Failure(f"status {r.status_code}: {r.text[:300]}")
        err = r.json().get("error") or {}
        if not err.get("message") or not err.get("type"):
            raise Failure(f"error without message/type: {r.text[:300]}")
        return f"error_{r.status_code}"

    def _json_response(self, path: str, body: dict) -> tuple[str, dict | None]:
        r = self._post(path, body)
        if r.status_code != 200:
            return self._clear_error(r), None
        out = r.json()
        n = body.get("n", 1)
        if len(out["choices"]) != n:
            raise Failure(f"{len(out['choices'])} choices for n={n}")
        for c in out["choices"]:
            if c["finish_reason"] not in ("stop", "length", "tool_calls"):
                raise Failure(f"finish_reason {c['finish_reason']}")
        if out["usage"]["completion_tokens"] > n * body["max_tokens"]:
            raise Failure(f"usage {out['usage']} over max_tokens {body['max_tokens']} x {n}")
        return "ok", out

    def _stream(self, path: str, body: dict, *, hang_up_after: int | None = None) -> tuple[str, list[dict]]:
        with self.s.post(self.base + path, json={**body, "stream": True}, timeout=300, stream=True) as r:
            if r.status_code != 200:
                return self._clear_error(r), []
            chunks, finishes, done = [], collections.Counter(), False
            for i, line in enumerate(r.iter_lines()):
                if hang_up_after is not None and i >= hang_up_after:
                    return "hung_up_mid_stream", chunks  # closing the response drops the connection
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    if chunk["error"]["type"] in ("server_error",):
                        raise Failure(f"stream error event {chunk['error']}")
                    return f"stream_error_{chunk['error']['type']}", chunks
                chunks.append(chunk)
                for c in chunk.get("choices", []):
                    if c.get("finish_reason"):
                        finishes[c["index"]] += 1
        if not done:
            raise Failure("stream ended without [DONE]")
        n = body.get("n", 1)
        if sorted(finishes) != list(range(n)) or any(v != 1 for v in finishes.values()):
            raise Failure(f"finish chunks per choice {dict(finishes)} for n={n}")
        return "ok", chunks

    # ---- the kinds of request --------------------------------------------------------------
    def completion(self) -> str:
        body = {
            "model": self.model,
            "prompt": self._prompt(self.rng.randint(3, 60)),
            "max_tokens": self.max_tokens,
            "n": self.rng.choice([1, 1, 2]),
            "temperature": self.rng.choice([0, 0.7, 1.0]),
            "seed": 7,
        }
        if self.rng.random() < 0.5:
            return self._stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})[0]
        return self._json_response("/v1/completions", body)[0]

    def chat(self) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": self._prompt(self.rng.randint(2, 40))}],
            "max_tokens": self.max_tokens,
            "temperature": 0.8,
        }
        if self.rng.random() < 0.5:
            return self._stream("/v1/chat/completions", body)[0]
        return self._json_response("/v1/chat/completions", body)[0]

    def tools(self) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Weather in " + self._prompt(2) + "?"}],
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": max(self.max_tokens, 40),
            "temperature": 0.5,
        }
        outcome, out = self._json_response("/v1/chat/completions", body)
        if out is not None and out["choices"][0]["finish_reason"] == "tool_calls":
            for call in out["choices"][0]["message"]["tool_calls"]:
                if call["function"]["name"] != "get_weather":
                    raise Failure(f"forced call to {call['function']['name']}")
                jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
        return outcome

    def structured(self) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "A person as JSON: " + self._prompt(3)}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
            "max_tokens": max(self.max_tokens, 48),
            "temperature": 0.7,
        }
        outcome, out = self._json_response("/v1/chat/completions", body)
        if out is not None and out["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), PERSON)
        return outcome

    def session(self) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": self._prompt(8)}],
            "max_tokens": self.max_tokens,
            "session": "new",
        }
        r = self._post("/v1/chat/completions", body)
        if r.status_code != 200:
            return self._clear_error(r)
        sid = r.headers.get("x-session-id")
        if not sid:
            raise Failure("no x-session-id for session: new")
        try:
            r2 = self._post(
                "/v1/chat/completions",
                {**body, "session": sid, "messages": [{"role": "user", "content": self._prompt(4)}]},
            )
            if r2.status_code != 200:
                return self._clear_error(r2)
            got = self.s.get(f"{self.base}/v1/sessions/{sid}", timeout=60)
            if got.status_code != 200 or len(got.json().get("messages", [])) < 4:
                raise Failure(f"session after two turns: {got.status_code} {got.text[:200]}")
            return "ok"
        finally:
            d = self.s.delete(f"{self.base}/v1/sessions/{sid}", timeout=60)
            if d.status_code != 200:
                raise Failure(f"session delete: {d.status_code} {d.text[:200]}")

    def greedy_check(self) -> str:
        text = greedy_text(self.s, self.base, self.model)
        if self.greedy is not None and text != self.greedy:
            # Under load the batch differs; on a random-weight model a near-tie may then flip.
            # Counted, and the strict check runs once the server is idle again.
            self.greedy_mismatches += 1
        return "ok"

    def disconnect(self) -> str:
        phase = self.rng.choice(["headers", "body", "queued", "prefill", "stream"])
        body = {
            "model": self.model,
            "prompt": self._prompt(300 if phase == "prefill" else 20),
            "max_tokens": self.max_tokens,
        }
        if phase == "stream":
            return self._stream("/v1/completions", body, hang_up_after=self.rng.randint(0, 6))[0]
        raw = json.dumps(body).encode()
        u = urlparse(self.base)
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {u.hostname}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(raw)}\r\n" + (f"authorization: Bearer {self.key}\r\n" if self.key else "") + "\r\n"
        ).encode()
        with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
            if phase == "headers":
                sock.sendall(head[: self.rng.randint(1, len(head) - 1)])
            elif phase == "body":
                sock.sendall(head + raw[: self.rng.randint(0, len(raw) - 1)])
            else:
                sock.sendall(head + raw)
                time.sleep(self.rng.uniform(0, 0.005 if phase == "queued" else 0.2))
        return f"hung_up_{phase}"


def greedy_text(s: requests.Session, base: str, model: str) -> str:
    r = s.post(
        base + "/v1/completions",
        json={"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        timeout=300,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


KINDS = {"completion": 4, "chat": 3, "tools": 1, "structured": 1, "session": 1, "greedy_check": 1, "disconnect": 2}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def metrics_values(base: str) -> dict[str, float]:
    out = {}
    for line in requests.get(base + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def run_phase(
    base: str,
    key: str | None,
    model: str,
    *,
    clients: int,
    seconds: float,
    max_tokens: int,
    seed: int,
    greedy: str | None,
) -> tuple[collections.Counter, list[str], int]:
    """`clients` threads loop over the request kinds for `seconds`; returns outcome counts,
    failures and greedy mismatches seen under load."""
    outcomes: collections.Counter = collections.Counter()
    failures: list[str] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds
    mismatches = [0]

    def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        c = Client(base, key, model, max_tokens, rng, greedy)
        kinds, weights = list(KINDS), list(KINDS.values())
        while time.monotonic() < end:
            kind = rng.choices(kinds, weights)[0]
            try:
                outcome = getattr(c, kind)()
            except (
                Failure,
                jsonschema.ValidationError,
                json.JSONDecodeError,
                KeyError,
                requests.RequestException,
                OSError,
            ) as e:
                outcome = "FAILED"
                with lock:
                    failures.append(f"{kind}: {type(e).__name__}: {e}"[:400])
            with lock:
                outcomes[f"{kind}:{outcome}"] += 1
        with lock:
            mismatches[0] += c.greedy_mismatches

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(loop, range(clients)))
    return outcomes, failures, mismatches[0]


def soak(
    base: str,
    pid: int | None,
    *,
    key: str | None,
    clients: int,
    minutes: float,
    warmup_seconds: float,
    max_tokens: int,
    max_slots: int | None,
    seed: int,
) -> dict[str, Any]:
    s = requests.Session()
    if key:
        s.headers["authorization"] = f"Bearer {key}"
    model = s.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    greedy = greedy_text(s, base, model)
    # Warm-up: the same traffic, so first-use allocations (grammars, buffers, caches) are in the baseline.
    run_phase(
        base, key, model, clients=clients, seconds=warmup_seconds, max_tokens=max_tokens, seed=seed + 1, greedy=greedy
    )
    state0 = idle_state(base, key, timeout=120)
    rss0 = rss_bytes(pid) if pid else None
    started = time.monotonic()
    rss_series: list[float] = []
    sampling = threading.Event()

    def sample_rss() -> None:  # every ~10% of the run: does it level off or keep climbing?
        while pid and not sampling.wait(minutes * 6):
            rss_series.append(round(rss_bytes(pid) / 2**20, 1))

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    outcomes, failures, mismatches = run_phase(
        base, key, model, clients=clients, seconds=minutes * 60, max_tokens=max_tokens, seed=seed, greedy=greedy
    )
    sampling.set()
    elapsed = time.monotonic() - started
    state = idle_state(base, key, timeout=120)
    problems = check_idle(state, max_slots)
    m = metrics_values(base)
    for gauge in (
        "jaxllm_active_requests",
        "jaxllm_reserved_state_bytes",
        "jaxllm_reserved_pages",
        "jaxllm_queued_requests",
    ):
        if m.get(gauge, 0.0) != 0.0:
            problems.append(f"/metrics {gauge} = {m[gauge]}")
    if state["sessions"]["active"] > state0["sessions"]["active"]:  # every client deletes its sessions
        problems.append(f"{state['sessions']['active'] - state0['sessions']['active']} sessions left behind")
    for counter in ("reconcile_errors", "host_errors"):
        if state["requests"][counter]:
            problems.append(f"{counter} = {state['requests'][counter]}")
    after = greedy_text(s, base, model)
    if after != greedy:
        problems.append(f"greedy text changed: {greedy!r} -> {after!r}")
    result: dict[str, Any] = {
        "clients": clients,
        "minutes": round(elapsed / 60, 2),
        "requests": sum(outcomes.values()),
        "failed": len(failures),
        "outcomes": dict(sorted(outcomes.items())),
        "first_failures": failures[:10],
        "greedy_mismatches_under_load": mismatches,
        "server_totals": state["requests"],
        "idle_problems": problems,
        "compilations_during_soak": state["compilations"] - state0["compilations"],
    }
    if rss0 is not None:
        rss1 = rss_bytes(pid)
        cache_growth = state["prefix_cache"]["bytes"] - state0["prefix_cache"]["bytes"]
        excess = (rss1 - rss0 - max(cache_growth, 0)) / rss0
        result.update(
            rss_before_mib=round(rss0 / 2**20, 1),
            rss_after_mib=round(rss1 / 2**20, 1),
            rss_series_mib=rss_series,
            prefix_cache_growth_mib=round(cache_growth / 2**20, 1),
            rss_excess_growth=round(excess, 4),
        )
        if excess >= 0.05:
            problems.append(f"RSS grew {excess:.1%} beyond the prefix cache's growth")
    result["ok"] = not failures and not problems
    return result


TINY_CONFIG = """
[limits]
active_requests = 8
active_state_mib = 128
max_output_tokens = 64
body_seconds = 5
prefix_cache_mib = 32
[engine]
max_slots = 8
kv_mib = 16
max_seq_len = 1024
chunk_buckets = [32, 128]
"""
DEFAULT_CONFIG = """
[limits]
active_requests = 8
active_state_mib = 512
max_output_tokens = 64
body_seconds = 5
prefix_cache_mib = 64
[engine]
max_slots = 8
kv_mib = 64
max_seq_len = 1024
chunk_buckets = [64, 256]
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base", help="a running server")
    where.add_argument("--tiny", action="store_true", help="start the tests' tiny random-weight model")
    where.add_argument("--default", action="store_true", help="start `jaxllm serve` on the default model")
    p.add_argument("--pid", type=int, default=None, help="the --base server's process id (for its RSS)")
    p.add_argument("--max-slots", type=int, default=None, help="the --base server's max_slots")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-seconds", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    kw = dict(
        clients=a.clients, minutes=a.minutes, warmup_seconds=a.warmup_seconds, max_tokens=a.max_tokens, seed=a.seed
    )
    if a.base:
        result = soak(a.base, a.pid, key=a.api_key, max_slots=a.max_slots, **kw)
    else:
        from tests.serving.launch import running_server

        key = "soak-key"
        if a.tiny:
            args, config = ["tests.serving.tiny_server", "--api-key", key], TINY_CONFIG
        else:
            from jaxllm.loading.default_model import default_model_path

            args = [
                "serving.cli",
                "serve",
                "--model",
                str(default_model_path()),
                "--served-model-name",
                "smollm2",
                "--api-key",
                key,
            ]
            config = DEFAULT_CONFIG
        with tempfile.TemporaryDirectory() as tmp, running_server(args, Path(tmp), config, health_timeout=600) as s:
            result = soak(s["base"], s["proc"].pid, key=key, max_slots=8, **kw)
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
