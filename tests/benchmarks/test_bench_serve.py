"""Smoke test of `python -m benchmarks.bench_serve` against the real tiny server (random llama, SmolLM2 tokenizer)."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from benchmarks import bench_serve
from benchmarks.bench_serve import build_parser, main
from tests.serving.launch import running_server

KEY = "bench-key"
CONFIG = """
[limits]
active_requests = 4
active_state_mib = 64
max_output_tokens = 64
[engine]
max_slots = 4
kv_mib = 8
max_seq_len = 256
chunk_buckets = [32]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_server")
    args = ["tests.serving.tiny_server", "--api-key", KEY, "--profile-dir", str(tmp / "trace")]
    with running_server(args, tmp, CONFIG, health_timeout=240, warmup=True) as s:  # it counts compilations
        yield s


def test_bench_serve_json(server, capsys):
    out = server["tmp"] / "result.json"
    rc = main(
        [
            "--port",
            str(server["port"]),
            "--api-key",
            KEY,
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--num-prompts",
            "6",
            "--concurrency",
            "3",
            "--request-rate",
            "50",
            "--vocab-size",
            "49152",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    r = json.loads(out.read_text())
    s = r["result"]
    assert s["successful_requests"] == 6 and s["failed_requests"] == 0
    assert s["total_input_tokens"] == 6 * 16 and s["total_output_tokens"] == 6 * 8
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert s[key]["mean"] is not None and s[key]["p99"] >= s[key]["p50"] >= 0
    assert s["output_throughput"] > 0 and s["total_token_throughput"] > s["output_throughput"]
    assert len(s["ttft_ms_each"]) == 6 and max(s["ttft_ms_each"]) == pytest.approx(s["ttft_ms"]["p99"], rel=0.05)
    # The server warmed every shape before /health, logging its progress: the requests
    # compiled nothing.
    log = server["log"].read_text()
    assert "warm-up 0/" in log and re.search(r"warm-up (\d+)/\1 ", log)
    assert r["compilations"] == 0
    # Every stream carried text, its headers no later than its first text.
    assert s["textless_requests"] == 0 and all(n > 0 for n in s["text_chunks_each"])
    assert all(h <= t for h, t in zip(s["headers_ms_each"], s["ttft_ms_each"]))
    # The pid listening on the port is found through /proc, so RSS comes from VmRSS.
    assert r["rss_source"] == f"/proc/{server['proc'].pid}/status VmRSS"
    assert r["rss_before"] > 10 << 20 and r["rss_after"] > 10 << 20


def test_profile_trace_and_utilisation(server):
    """--profile leaves a JAX profiler trace on the server side; MBU / MFU follow from the
    model's sizes (computed here from the same tiny model) and the measured latencies."""
    import jax

    from tests.serving.tiny_server import tiny_model

    out = server["tmp"] / "profiled.json"
    rc = main(
        [
            "--port",
            str(server["port"]),
            "--api-key",
            KEY,
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--num-prompts",
            "2",
            "--concurrency",
            "1",
            "--vocab-size",
            "49152",
            "--profile",
            "--peak-bandwidth",
            "100",
            "--peak-tflops",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    traces = list((server["tmp"] / "trace").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0

    r = json.loads(out.read_text())
    s, u = r["result"], r["utilisation"]
    model = tiny_model()
    cfg = model.cfg
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))  # tied embeddings: the head reads them all
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    step_bytes = weights + kv * (16 + 8 / 2)
    assert u["decode_mbu"] == pytest.approx(step_bytes / (s["tpot_ms"]["p50"] / 1e3) / 100e9, rel=1e-6)
    per_token = 2 * (
        cfg.n_layers
        * (cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * cfg.d_model * cfg.ffn_dim)
    )
    prefill = (
        per_token * 16 + 2 * cfg.vocab_size * cfg.d_model + 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 16 * 16 / 2
    )
    assert u["prefill_mfu"] == pytest.approx(prefill / (s["ttft_ms"]["p50"] / 1e3) / 2e12, rel=1e-6)
    assert 0 < u["run_mfu"] < 1


def test_parser():
    a = build_parser().parse_args(["--num-prompts", "3"])
    assert a.func is bench_serve.run_bench_serve and a.num_prompts == 3


def test_overhead_engine_vs_http(server):
    from tests.serving.tiny_server import tiny_model

    args = argparse.Namespace(
        input_len=16,
        output_len=8,
        vocab_size=49152,
        seed=0,
        overhead_repeats=1,
        config=str(server["config"]),
        serve_args="",
        api_key=KEY,
        timeout=60,
    )
    engine = bench_serve.overhead_engine(args, model=tiny_model())
    o = bench_serve.measure_overhead(args, f"http://127.0.0.1:{server['port']}", "tiny", engine)
    assert len(o["engine_runs_ms"]) == len(o["http_runs_ms"]) == 1
    assert o["engine_tpot_ms"] > 0 and o["http_tpot_ms"] > 0 and o["ratio"] > 0
