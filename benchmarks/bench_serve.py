"""Load a running server over HTTP, in the style of `vllm bench serve`.

    python -m benchmarks.bench_serve --base-url http://127.0.0.1:8000 --input-len 128 --output-len 64 \\
        --num-prompts 32 --concurrency 8
    python -m benchmarks.bench_serve --launch --serve-args "--model smollm2" --overhead

Requests are random token-id prompts through streaming `/v1/completions` with
`ignore_eos` and `max_tokens = --output-len`, so every request generates exactly that many
tokens and a dummy model with the synthetic tokenizer works too. Reported per request:
TTFT (send -> first content chunk), TPOT ((latency - TTFT) / (tokens - 1)) and ITL (gaps
between content chunks; a chunk may carry several tokens, see "tokens per chunk").

`--overhead` times the same single-stream greedy decode in-process on the engine (same
model, same engine shapes as the server's settings file) and over HTTP, and prints
HTTP TPOT / engine TPOT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx2 as httpx  # the venv's httpx (openai's dependency) is published as httpx2
import numpy as np

from jaxllm.cli import main as cli_main

_LOW_TOKEN_ID = 100  # random prompts avoid the special tokens at the bottom of the vocabulary


# ---- command line ------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_serve",
        description="benchmark a running server over HTTP (TTFT, TPOT, ITL, throughput, RSS)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_bench_serve_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return cli_main(argv, build_parser())


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server URL (default http://127.0.0.1:PORT)")
    p.add_argument("--port", type=int, default=8000, help="port of the server (and of --launch)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $JAXLLM_API_KEY)")
    p.add_argument("--launch", action="store_true", help="start `jaxllm serve` itself and wait for /health")
    p.add_argument("--serve-args", default="", help="extra arguments for the launched `jaxllm serve`, one string")
    p.add_argument("--launch-timeout", type=float, default=600.0, help="seconds to wait for /health after --launch")
    p.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="pid for RSS from /proc (default: the launched server, else the local pid on the port)",
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals at this many requests/s (default: all at once, bounded by --concurrency)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=8192,
        help="prompt ids are drawn from [100, vocab-size); keep it within the model's vocabulary",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=1, help="untimed requests before the run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--overhead",
        action="store_true",
        help="also time single-stream decode on the engine in-process vs over HTTP (loads the model here)",
    )
    p.add_argument("--overhead-repeats", type=int, default=5, help="engine/HTTP run pairs, alternated")
    p.add_argument(
        "--model", default=None, help="model for --overhead (default: --model in --serve-args, else smollm2)"
    )
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--config",
        default=None,
        help="server settings TOML whose [engine] the --overhead engine copies (default configs/server.toml)",
    )
    p.add_argument(
        "--peak-bandwidth",
        type=float,
        default=4300.0,
        help="GB/s the MBU figure divides by (default: an H200's measured copy bandwidth, 4300)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=790.0,
        help="dense TFLOP/s the MFU figures divide by (default: an H200's measured bf16 matmul, 790)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="record a JAX profiler trace of the timed run (the server needs --profile-dir)",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write the result as JSON to PATH ('-' or no value: stdout instead of the table)",
    )
    p.set_defaults(func=run_bench_serve)


# ---- one request -------------------------------------------------------------------------
@dataclasses.dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # since send, content chunks only
    text_chunks: int = 0  # chunks that carried text (0: every token decoded to nothing)
    headers: float = 0.0  # since send: the response headers (the server sends them with its first frames)
    error: str = ""

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def completion_body(prompt: list[int], output_len: int, model: str | None) -> dict[str, Any]:
    """A streaming, greedy, fixed-length completion request."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    return body


async def stream_completion(client: httpx.AsyncClient, body: dict[str, Any]) -> RequestResult:
    """Sends one streaming request and timestamps its SSE chunks."""
    res = RequestResult(ok=False, prompt_tokens=len(body["prompt"]))
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            res.headers = time.perf_counter() - started
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                now = time.perf_counter() - started
                # Content chunks carry text; a text-less finish chunk counts only when no text
                # came at all (else it would add a ~0 ms gap to the ITL after the last token).
                choices = chunk.get("choices") or []
                if any(c.get("text") for c in choices):
                    res.chunk_times.append(now)
                    res.text_chunks += 1
                elif any(c.get("finish_reason") for c in choices) and not res.chunk_times:
                    res.chunk_times.append(now)
                if chunk.get("usage"):
                    res.output_tokens = int(chunk["usage"]["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - started
    if not res.chunk_times:
        res.error = "no content chunk"
        return res
    res.ttft = res.chunk_times[0]
    res.ok = True
    return res


# ---- the run -------------------------------------------------------------------------------
def make_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (so the prefix cache cannot skip prefill)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(_LOW_TOKEN_ID, vocab_size, size=length).tolist() for _ in range(n)]


async def run_requests(
    client: httpx.AsyncClient, bodies: list[dict[str, Any]], concurrency: int | None, request_rate: float, seed: int
) -> tuple[list[RequestResult], float]:
    """Sends every body (Poisson arrivals at `request_rate`, at most `concurrency` in flight)."""
    sem = asyncio.Semaphore(concurrency or len(bodies) or 1)
    rng = np.random.default_rng(seed + 1)

    async def one(body: dict[str, Any]) -> RequestResult:
        async with sem:
            return await stream_completion(client, body)

    started = time.perf_counter()
    tasks = []
    for i, body in enumerate(bodies):
        if i and request_rate != float("inf"):
            await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
        tasks.append(asyncio.create_task(one(body)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - started


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ms = np.asarray(values) * 1000.0
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "ttft_ms_each": [round(r.ttft * 1000.0, 2) for r in ok],  # in request order: which one was slow
        # A stream without text has its finish chunk as its "first token": TTFT = its latency.
        "textless_requests": sum(1 for r in ok if not r.text_chunks),
        "text_chunks_each": [r.text_chunks for r in ok],
        "headers_ms_each": [round(r.headers * 1000.0, 2) for r in ok],  # far below its TTFT: the text came late
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itls]),
        "e2el_ms": _stats_ms([r.latency for r in ok]),
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
    }


# ---- server memory -----------------------------------------------------------------------
def rss_from_proc(pid: int) -> int | None:
    """Resident bytes of `pid` (VmRSS), or None if it is gone or unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_from_metrics(client: httpx.Client) -> int | None:
    """`process_resident_memory_bytes` from /metrics, if the server exports it."""
    try:
        text = client.get("/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return int(float(line.split()[1]))
    return None


def local_pid_listening(port: int) -> int | None:
    """The pid of the local process listening on TCP `port` (via /proc/net/tcp), if visible."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # 0A: LISTEN
                inodes.add(f[9])
    if not inodes:
        return None
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for fd in (pid_dir / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid_dir.name)
        except OSError:
            continue
    return None


class RssProbe:
    """The server's RSS: /proc when we know a local pid, else /metrics."""

    def __init__(self, client: httpx.Client, pid: int | None):
        self.client = client
        self.pid = pid
        self.source = f"/proc/{pid}/status VmRSS" if pid else "/metrics process_resident_memory_bytes"

    def read(self) -> int | None:
        return rss_from_proc(self.pid) if self.pid else rss_from_metrics(self.client)


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


# ---- launching a server ------------------------------------------------------------------
def launch_server(port: int, serve_args: str, log_path: Path) -> subprocess.Popen:
    """Starts `jaxllm serve` on `port` with `serve_args`; its output goes to `log_path`."""
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--port", str(port), *shlex.split(serve_args)]
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(base_url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, timeout=2) as c:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before /health was ok")
            try:
                if c.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{base_url}/health not ok after {timeout:.0f}s")
            time.sleep(0.5)


# ---- engine vs HTTP overhead ---------------------------------------------------------------
def _serve_arg(args: argparse.Namespace, name: str) -> str | None:
    """The value of `name` in --serve-args, if given there."""
    words = shlex.split(args.serve_args)
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return None


def engine_config_from_settings(config: str | None) -> Any:
    """The EngineConfig the server builds from its settings file (same shapes, same step count)."""
    from serving.cli import default_settings_path
    from serving.settings import load_settings

    return load_settings(config or default_settings_path()).engine.engine_config()


def time_engine_decode(engine: Any, prompt: list[int], output_len: int) -> float:
    """TPOT (s) of one greedy stream on the engine: first token collected -> last, over n - 1.

    Same definition as the HTTP side (first content chunk -> end), so the ratio compares
    like with like; the step() loop is the engine's own synchronous launch + collect.
    """
    from jaxllm.sampling import SamplingParams

    seq = engine.add(prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    first = last = None
    try:
        while seq.finish_reason is None:
            engine.step()
            if seq.generated and first is None:
                first = time.perf_counter()
        last = time.perf_counter()
    finally:
        engine.remove(seq)
    if len(seq.generated) != output_len:
        raise RuntimeError(f"engine generated {len(seq.generated)} tokens, expected {output_len}")
    return (last - first) / (output_len - 1)


def overhead_engine(args: argparse.Namespace, model: Any = None) -> Any:
    """An in-process engine shaped like the server's, compiled for this stream (one untimed run)."""
    if model is None:
        from jaxllm.api import load

        name = args.model or _serve_arg(args, "--model") or "smollm2"
        model = load(
            name,
            load_format=_serve_arg(args, "--load-format") or args.load_format,
            dtype=_serve_arg(args, "--dtype") or args.dtype,
        )
    engine = model.engine(engine_config_from_settings(args.config or _serve_arg(args, "--config")))
    (warm,) = make_prompts(1, args.input_len, args.vocab_size, args.seed + 99)
    time_engine_decode(engine, warm, args.output_len)
    return engine


def measure_overhead(args: argparse.Namespace, base_url: str, model: str | None, engine: Any) -> dict[str, Any]:
    """Alternates engine and HTTP runs of the same stream; ratio of the median TPOTs.

    Alternating (rather than all engine runs, then all HTTP runs) makes both sides see the
    same background load on a shared machine, which otherwise drifts more than the overhead.
    """
    n = args.overhead_repeats
    prompts = make_prompts(2 * n + 1, args.input_len, args.vocab_size, args.seed + 200)
    eng: list[float] = []
    results: list[RequestResult] = []

    async def go() -> None:
        async with httpx.AsyncClient(base_url=base_url, headers=_headers(args.api_key), timeout=args.timeout) as c:
            await stream_completion(c, completion_body(prompts[-1], args.output_len, model))  # untimed
            for i in range(n):
                eng.append(time_engine_decode(engine, prompts[2 * i], args.output_len))
                results.append(await stream_completion(c, completion_body(prompts[2 * i + 1], args.output_len, model)))

    asyncio.run(go())
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"overhead request failed: {bad[0]}")
    http = [r.tpot for r in results]
    return {
        "engine_tpot_ms": statistics.median(eng) * 1e3,
        "engine_runs_ms": [round(x * 1e3, 3) for x in eng],
        "http_tpot_ms": statistics.median(http) * 1e3,
        "http_runs_ms": [round(x * 1e3, 3) for x in http],
        "http_ttft_ms": statistics.median(r.ttft for r in results) * 1e3,
        "http_tokens_per_chunk": statistics.mean(r.output_tokens / len(r.chunk_times) for r in results),
        "ratio": statistics.median(http) / statistics.median(eng),
    }


# ---- main ----------------------------------------------------------------------------------
def _headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(client: httpx.Client) -> str | None:
    try:
        data = client.get("/v1/models", timeout=10).json()["data"]
        return data[0]["id"] if data else None
    except (httpx.HTTPError, KeyError, ValueError):
        return None


async def _run_load(args: argparse.Namespace, base_url: str, model: str | None) -> tuple[list[RequestResult], float]:
    prompts = make_prompts(args.warmup_requests + args.num_prompts, args.input_len, args.vocab_size, args.seed)
    bodies = [completion_body(p, args.output_len, model) for p in prompts]
    limits = httpx.Limits(max_connections=max(args.concurrency or args.num_prompts, 1) + 4)
    async with httpx.AsyncClient(
        base_url=base_url, headers=_headers(args.api_key), timeout=args.timeout, limits=limits
    ) as client:
        for body in bodies[: args.warmup_requests]:
            r = await stream_completion(client, body)
            if not r.ok:
                raise RuntimeError(f"warm-up request failed: {r.error}")
        if args.profile:
            (await client.post("/start_profile")).raise_for_status()
        try:
            return await run_requests(
                client, bodies[args.warmup_requests :], args.concurrency, args.request_rate, args.seed
            )
        finally:
            if args.profile:
                (await client.post("/stop_profile", timeout=max(args.timeout, 300))).raise_for_status()


def server_state(client: httpx.Client) -> dict[str, Any]:
    """The server's /v1/state snapshot (empty if it publishes none)."""
    try:
        r = client.get("/v1/state")
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def model_costs(state: dict[str, Any]) -> dict[str, int] | None:
    """The served model's per-token costs (see `jaxllm.costs`), if published."""
    return (state.get("model") or {}).get("costs")


def compilations_between(before: dict[str, Any], after: dict[str, Any]) -> int | None:
    """XLA compilations the server ran between two snapshots (warm-up requests included):
    after the server's own warm-up this should be 0, or some request shape compiled."""
    if before.get("compilations") is None or after.get("compilations") is None:
        return None
    return int(after["compilations"]) - int(before["compilations"])


def utilisation(
    summary: dict[str, Any], costs: dict[str, int] | None, args: argparse.Namespace
) -> dict[str, Any] | None:
    """MBU of decode and MFU of prefill and of the whole run, from the measured latencies.

    Approximations, stated in the report: a decode step of c concurrent requests reads the
    weights once (of a MoE's routed experts, those c uniformly routed tokens are expected to
    touch) plus each request's K/V at its mean decode context (input + output / 2) and lasts
    one TPOT; a prompt's prefill lasts its TTFT (so MFU of prefill is meaningful at
    concurrency 1, where no queueing is in it).
    """
    if not costs or not summary["successful_requests"]:
        return None
    from jaxllm.costs import ModelCosts

    model = ModelCosts(**costs)
    n_in, n_out = args.input_len, args.output_len
    c = min(args.concurrency or args.num_prompts, args.num_prompts)
    ctx = n_in + n_out / 2
    out: dict[str, Any] = {"concurrency": c, "peak_GBps": args.peak_bandwidth, "peak_TFLOPs": args.peak_tflops}
    tpot = summary["tpot_ms"]["p50"]
    if tpot:
        step_bytes = model.decode_step_bytes(c * ctx, rows=c)  # weights (experts c tokens touch), every K/V
        out["decode_mbu"] = step_bytes / (tpot / 1e3) / (args.peak_bandwidth * 1e9)
    ttft = summary["ttft_ms"]["p50"]
    prefill = model.prefill_flops(n_in)
    if ttft:
        out["prefill_mfu"] = prefill / (ttft / 1e3) / (args.peak_tflops * 1e12)
    per_request = prefill + n_out * model.decode_flops(ctx)
    out["run_mfu"] = summary["successful_requests"] * per_request / summary["duration_s"] / (args.peak_tflops * 1e12)
    return out


def run_bench_serve(args: argparse.Namespace) -> int:
    args.api_key = args.api_key or os.environ.get("JAXLLM_API_KEY")
    base_url = (args.base_url or f"http://127.0.0.1:{args.port}").rstrip("/")
    report: dict[str, Any] = {
        "machine": machine_info(),
        "base_url": base_url,
        "args": {k: v for k, v in vars(args).items() if k != "func" and k != "api_key"},
    }
    engine = None
    if args.overhead:
        # Load and compile in-process first, so that never shares the CPU with a warming server.
        engine = overhead_engine(args)
    proc = None
    if args.launch:
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"jaxllm-bench-serve-{args.port}.log"
        proc = launch_server(args.port, args.serve_args, log_path)
        report["server_log"] = str(log_path)
    try:
        if proc is not None:
            wait_healthy(base_url, args.launch_timeout, proc)
        with httpx.Client(base_url=base_url, headers=_headers(args.api_key)) as sync:
            model = served_model(sync)
            pid = args.server_pid or (proc.pid if proc else None)
            if pid is None and urlparse(base_url).hostname in ("127.0.0.1", "localhost", "::1"):
                pid = local_pid_listening(urlparse(base_url).port or 80)
            probe = RssProbe(sync, pid)
            report.update(model=model, rss_source=probe.source, rss_before=probe.read(), load_before=load_average())
            state_before = server_state(sync)
            results, duration = asyncio.run(_run_load(args, base_url, model))
            report.update(rss_after=probe.read(), load_after=load_average())
            report["compilations"] = compilations_between(state_before, server_state(sync))
            report["result"] = summarize(results, duration)
            report["utilisation"] = utilisation(report["result"], model_costs(state_before), args)
            if args.overhead:
                report["overhead"] = measure_overhead(args, base_url, model, engine)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.json is not None and args.json != "-":
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0 if report["result"]["failed_requests"] == 0 else 1


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next(
            (
                l.split(":", 1)[1].strip()
                for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")
            ),
            "",
        )
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


# ---- the report ----------------------------------------------------------------------------
def _mib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def format_report(r: dict[str, Any]) -> str:
    s, a = r["result"], r["args"]
    rate = "inf" if a["request_rate"] == float("inf") else a["request_rate"]
    lines = [
        "{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="),
        f"{'Model / URL:':<44}{r.get('model')} @ {r['base_url']}",
        f"{'Input / output tokens per request:':<44}{a['input_len']} / {a['output_len']}",
        f"{'Concurrency / request rate:':<44}{a['concurrency'] or 'unbounded'} / {rate}",
        f"{'Successful requests:':<44}{s['successful_requests']}",
        f"{'Requests whose stream had no text:':<44}{s['textless_requests']}",
        f"{'Failed requests:':<44}{s['failed_requests']}",
        f"{'Benchmark duration (s):':<44}{s['duration_s']:.2f}",
        f"{'Total input tokens:':<44}{s['total_input_tokens']}",
        f"{'Total generated tokens:':<44}{s['total_output_tokens']}",
        f"{'Request throughput (req/s):':<44}{s['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<44}{s['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<44}{s['total_token_throughput']:.2f}",
        f"{'Tokens per content chunk (mean):':<44}{_f(s['tokens_per_chunk'])}",
    ]
    for key, title in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "Inter-token Latency (between chunks)"),
        ("e2el_ms", "End-to-end Latency"),
    ):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "p50", "p99"):
            lines.append(
                f"{stat.upper() if stat != 'mean' else 'Mean'} {key[:-3].upper()} (ms):".ljust(44) + _f(s[key][stat])
            )
    u = r.get("utilisation")
    if u:
        lines.append("{s:{c}^60}".format(s=" Hardware utilisation (approx.) ", c="-"))
        lines += [
            f"{'Decode MBU (p50 TPOT, ' + str(u['concurrency']) + ' streams):':<44}{_pct(u.get('decode_mbu'))} of {u['peak_GBps']:.0f} GB/s",
            f"{'Prefill MFU (p50 TTFT):':<44}{_pct(u.get('prefill_mfu'))} of {u['peak_TFLOPs']:.0f} TFLOP/s",
            f"{'Whole-run MFU (all tokens / duration):':<44}{_pct(u.get('run_mfu'))}",
        ]
    lines.append("{s:{c}^60}".format(s=" Server memory / machine ", c="-"))
    before, after = r.get("rss_before"), r.get("rss_after")
    delta = None if before is None or after is None else after - before
    lines += [
        f"{'Server RSS before / after (MiB):':<44}{_mib(before)} / {_mib(after)}"
        + ("" if delta is None else f" (delta {delta / 2**20:+.1f})"),
        f"{'RSS source:':<44}{r.get('rss_source')}",
        f"{'Load average before / after (1, 5, 15 min):':<44}{r.get('load_before')} / {r.get('load_after')}",
        f"{'Machine:':<44}{r['machine']['cpus']} CPUs, {r['machine']['cpu_model']}",
    ]
    lines.append(f"{'Server compilations (warm-up requests incl.):':<44}{r.get('compilations')}")
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    if "overhead" in r:
        o = r["overhead"]
        lines.append("{s:{c}^60}".format(s=" Engine vs HTTP overhead (1 stream, greedy) ", c="-"))
        lines += [
            f"{'Engine TPOT, median of runs (ms):':<44}{o['engine_tpot_ms']:.2f}  runs {o['engine_runs_ms']}",
            f"{'HTTP TPOT, median of runs (ms):':<44}{o['http_tpot_ms']:.2f}  runs {o['http_runs_ms']}",
            f"{'HTTP TTFT median (ms):':<44}{o['http_ttft_ms']:.2f}",
            f"{'Ratio HTTP / engine TPOT:':<44}{o['ratio']:.3f}",
        ]
    lines.append("=" * 60)
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
