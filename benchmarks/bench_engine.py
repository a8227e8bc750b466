"""Prompt and decode speed of the engine on this machine.

    python -m benchmarks.bench_engine --llama-cpp

Measures, for one model:

* warm-up (compile) time of an engine (`Engine.warmup`);
* prompt tokens/s: prefill of one prompt, timed after warm-up;
* decode tokens/s at each requested concurrency (greedy, `ignore_eos`, so every stream has
  an exact length), timed from the round in which the last prompt finished prefilling;
* the bound that memory bandwidth sets on decode: one pass over every weight is timed, and
  `bandwidth / weight bytes` is the most single-stream tokens/s any weight-streaming decoder
  can reach here;
* optionally (`--llama-cpp`), llama-cpp-python on the same GGUF in the same run.

llama-cpp-python is imported lazily and only when asked for: it is never a dependency.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxllm.cli import add_model_args, load_from_args
from jaxllm.cli import main as cli_main

_LOW_TOKEN_ID = 100  # prompts avoid the special tokens at the bottom of the vocabulary


# ---- CLI -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_engine",
        description="engine benchmark: prompt/decode tok/s vs the memory-bandwidth bound",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_args(p)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,8", help="comma-separated numbers of concurrent sequences")
    p.add_argument(
        "--steps-per-call",
        type=int,
        default=None,
        help="decode steps per engine call (EngineConfig.decode_steps_per_call); default: engine's",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions of each measurement (best is kept)")
    p.add_argument("--llama-cpp", action="store_true", help="also measure llama-cpp-python on the same GGUF")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    return cli_main(argv, build_parser())


def run_bench(args: argparse.Namespace) -> int:
    """Runs every measurement and prints the report; returns the exit code."""
    concurrency = _parse_concurrency(args.concurrency)
    if args.prompt_tokens < 1 or args.decode_tokens < 2:
        raise ValueError("--prompt-tokens must be >= 1 and --decode-tokens >= 2")
    log = _stderr_logger(quiet=False)
    log(f"loading {args.model} ({args.dtype})")
    model = load_from_args(args)
    log("timing one pass over the weights")
    bandwidth = measure_bandwidth(model.params, repeats=max(5, args.repeats))
    runs = [bench_engine(model, c, args, log) for c in concurrency]
    llama = None
    if args.llama_cpp:
        llama = bench_llama_cpp(args, concurrency, log)
    report = build_report(args, bandwidth, runs, llama)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _parse_concurrency(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError("--concurrency must be a comma-separated list of positive integers")
    return values


def _stderr_logger(quiet: bool) -> Callable[[str], None]:
    import sys

    # Progress goes to stderr so `--json` output stays parseable on stdout.
    return (lambda _: None) if quiet else (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))


# ---- memory bandwidth bound --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """One pass over all weights: its bytes and the best time of two ways to stream them."""

    weight_bytes: int
    reduce_s: float  # jitted sum over every leaf
    matvec_s: float  # jitted vector @ matrix over every leaf (what decode does)

    @property
    def best_s(self) -> float:
        return min(self.reduce_s, self.matvec_s)

    @property
    def bytes_per_s(self) -> float:
        return self.weight_bytes / self.best_s

    @property
    def max_decode_tok_s(self) -> float:
        """Single-stream decode must read every weight once per token: this is its ceiling."""
        return self.bytes_per_s / self.weight_bytes


def measure_bandwidth(params: Any, repeats: int = 7) -> Bandwidth:
    """Times one pass over every param leaf (best of `repeats`) in two ways; keeps the faster.

    Both passes read each weight exactly once, so the faster is the best streaming rate this
    machine reached on these very arrays: the honest ceiling for a weight-bound decode step.
    """
    import jax
    import jax.numpy as jnp

    leaves = [leaf for leaf in jax.tree.leaves(params) if hasattr(leaf, "nbytes")]
    weight_bytes = sum(int(leaf.nbytes) for leaf in leaves)

    reduce_all = jax.jit(lambda ls: sum(jnp.sum(leaf, dtype=jnp.float32) for leaf in ls))
    # The vectors are arguments (not constants) so XLA cannot fold the product into a reduction.
    vectors = [jnp.ones((leaf.shape[0],), leaf.dtype) for leaf in leaves]
    matvec_all = jax.jit(
        lambda ls, vs: sum(jnp.sum(v @ leaf.reshape(leaf.shape[0], -1), dtype=jnp.float32) for leaf, v in zip(ls, vs))
    )
    return Bandwidth(
        weight_bytes=weight_bytes,
        reduce_s=_best_time(lambda: reduce_all(leaves), repeats),
        matvec_s=_best_time(lambda: matvec_all(leaves, vectors), repeats),
    )


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    """Best wall time of `fn` (blocked until ready) after one untimed call that compiles it."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - started)
    return min(times)


# ---- prompts -------------------------------------------------------------------------------
def make_prompts(n: int, length: int, vocab_size: int) -> list[list[int]]:
    """`n` distinct deterministic prompts of random (non-special) token ids.

    Distinct prompts keep any prefix reuse (ours or llama.cpp's) from skipping work.
    """
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(_LOW_TOKEN_ID, vocab_size, size=length).tolist() for _ in range(n)]


# ---- our engine ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EngineRun:
    """Figures of one engine with `concurrency` slots."""

    concurrency: int
    steps_per_call: int
    warmup_s: float
    warmup_variants: int
    prefill_tok_s: float  # one prompt alone (best of repeats)
    decode_tok_s: float  # all streams together, decode rounds only (best of repeats)
    decode_calls_per_s: float  # engine.step() calls per second in the decode window
    e2e_tok_s: float  # generated tokens / (add -> all finished), prefill included


def engine_config(model: Any, concurrency: int, args: argparse.Namespace) -> Any:
    """An EngineConfig sized for `concurrency` streams of prompt + decode tokens."""
    from jaxllm.engine_config import EngineConfig
    from jaxllm.state import kv_bytes_per_page

    defaults = EngineConfig()
    steps_per_call = args.steps_per_call or defaults.decode_steps_per_call
    # Headroom of a few pages: the multi-step decode may plan past max_tokens by steps_per_call.
    max_seq_len = _round_up(args.prompt_tokens + args.decode_tokens + steps_per_call, 64)
    pages = concurrency * (max_seq_len // defaults.page_size + 1) + 2
    return EngineConfig(
        max_slots=concurrency,
        max_seq_len=max_seq_len,
        kv_bytes=pages * kv_bytes_per_page(model.cfg, defaults.page_size, model.options),
        decode_steps_per_call=steps_per_call,
    )


def bench_engine(model: Any, concurrency: int, args: argparse.Namespace, log: Callable[[str], None]) -> EngineRun:
    """Warm-up, prefill and decode figures of an engine with `concurrency` slots."""
    engine = model.engine(engine_config(model, concurrency, args))
    log(f"engine x{concurrency}: warm-up (compiling every bucket)")
    started = time.perf_counter()
    variants = engine.warmup()
    warmup_s = time.perf_counter() - started
    prompts = make_prompts(concurrency, args.prompt_tokens, model.cfg.vocab_size)
    log(f"engine x{concurrency}: prefill")
    prefill_s = min(_time_prefill(engine, prompts[0]) for _ in range(args.repeats))
    log(f"engine x{concurrency}: decode {concurrency} x {args.decode_tokens} tokens")
    decodes = [_time_generation(engine, prompts, args.decode_tokens) for _ in range(args.repeats)]
    best = max(decodes, key=lambda d: d.decode_tok_s)
    return EngineRun(
        concurrency=concurrency,
        steps_per_call=engine.config.decode_steps_per_call,
        warmup_s=warmup_s,
        warmup_variants=variants,
        prefill_tok_s=args.prompt_tokens / prefill_s,
        decode_tok_s=best.decode_tok_s,
        decode_calls_per_s=best.calls_per_s,
        e2e_tok_s=max(d.e2e_tok_s for d in decodes),
    )


def _greedy(max_tokens: int) -> Any:
    from jaxllm.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _time_prefill(engine: Any, prompt: list[int]) -> float:
    """Seconds from `add` until the prompt is prefilled and its first token is sampled."""
    started = time.perf_counter()
    seq = engine.add(prompt, _greedy(1))
    while seq.finish_reason is None:
        engine.step()
    elapsed = time.perf_counter() - started
    engine.remove(seq)
    return elapsed


@dataclasses.dataclass(frozen=True)
class _Generation:
    decode_tok_s: float
    calls_per_s: float
    e2e_tok_s: float


def _time_generation(engine: Any, prompts: list[list[int]], decode_tokens: int) -> _Generation:
    """Runs every prompt to exactly `decode_tokens` tokens at once, with the step() loop.

    The decode window opens after the round in which the last prompt finished prefilling;
    tokens sampled before (first tokens, and decode tokens riding in prefill rounds) are
    left out of it, so it measures decode rounds only.
    """
    started = time.perf_counter()
    seqs = [engine.add(p, _greedy(decode_tokens)) for p in prompts]
    while any(s.prefilled < len(s.prompt) for s in seqs):
        engine.step()
    window_start = time.perf_counter()
    before = sum(len(s.generated) for s in seqs)
    calls = 0
    while any(s.finish_reason is None for s in seqs):
        engine.step()
        calls += 1
    finished = time.perf_counter()
    total = sum(len(s.generated) for s in seqs)
    if total != len(seqs) * decode_tokens:
        raise RuntimeError(f"expected {len(seqs) * decode_tokens} tokens, got {total}")
    for s in seqs:
        engine.remove(s)
    window = finished - window_start
    return _Generation(
        decode_tok_s=(total - before) / window,
        calls_per_s=calls / window,
        e2e_tok_s=total / (finished - started),
    )


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ---- llama-cpp-python ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LlamaCppRun:
    """llama-cpp-python figures on the same GGUF (its own quantization, not float32)."""

    version: str
    threads: int
    file_bytes: int
    prefill_tok_s: float
    decode_tok_s: float  # single stream
    sequential_decode_tok_s: float  # n streams one after another, decode time only
    sequential_e2e_tok_s: float  # n streams one after another, prefill included
    sequential_n: int


def bench_llama_cpp(args: argparse.Namespace, concurrency: list[int], log: Callable[[str], None]) -> LlamaCppRun | None:
    """Measures llama-cpp-python when it imports and the model is a GGUF; else None."""
    try:
        import llama_cpp
    except ImportError:
        log("llama_cpp does not import: skipping the llama-cpp-python comparison")
        return None
    path = _gguf_path(args.model)
    if path is None:
        log("model is not a GGUF file: skipping the llama-cpp-python comparison")
        return None
    threads = args.threads or os.cpu_count() or 1
    n_seq = max(concurrency)
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=_round_up(args.prompt_tokens + args.decode_tokens + 8, 64),
        n_batch=max(512, args.prompt_tokens),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    prompts = make_prompts(n_seq, args.prompt_tokens, llm.n_vocab())
    log("llama.cpp: warm-up")
    _llama_generate(llm, prompts[0], 8)
    log("llama.cpp: prefill and single-stream decode")
    single = [_llama_generate(llm, prompts[0], args.decode_tokens) for _ in range(args.repeats)]
    log(f"llama.cpp: {n_seq} sequences one after another")
    sequential = [_llama_sequential(llm, prompts, args.decode_tokens) for _ in range(args.repeats)]
    return LlamaCppRun(
        version=llama_cpp.__version__,
        threads=threads,
        file_bytes=path.stat().st_size,
        prefill_tok_s=args.prompt_tokens / min(s.prefill_s for s in single),
        decode_tok_s=(args.decode_tokens - 1) / min(s.decode_s for s in single),
        sequential_decode_tok_s=max(s[0] for s in sequential),
        sequential_e2e_tok_s=max(s[1] for s in sequential),
        sequential_n=n_seq,
    )


def _gguf_path(model: str) -> Path | None:
    from jaxllm.loading.default_model import resolve_model

    path = Path(resolve_model(model))
    return path if path.is_file() and path.suffix == ".gguf" else None


@dataclasses.dataclass(frozen=True)
class _LlamaTiming:
    prefill_s: float
    decode_s: float  # decode_tokens - 1 evals (the first token comes from the prefill logits)


def _llama_generate(llm: Any, prompt: list[int], decode_tokens: int) -> _LlamaTiming:
    """Greedy generation with the low-level eval loop, mirroring our engine's work.

    The first token is taken from the prefill's logits (as our prefill round samples it);
    the rest take one `eval` each, so decode time covers `decode_tokens - 1` tokens.
    """
    import numpy as np

    llm.reset()  # a fresh context: no prefix reuse across repeats
    started = time.perf_counter()
    llm.eval(prompt)
    token = _llama_argmax(llm, np)
    prefilled = time.perf_counter()
    for _ in range(decode_tokens - 1):
        llm.eval([token])
        token = _llama_argmax(llm, np)
    return _LlamaTiming(prefill_s=prefilled - started, decode_s=time.perf_counter() - prefilled)


def _llama_argmax(llm: Any, np: Any) -> int:
    # Llama.eval no longer copies logits unless logits_all; read the last row directly.
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def _llama_sequential(llm: Any, prompts: list[list[int]], decode_tokens: int) -> tuple[float, float]:
    """(decode tok/s, end-to-end tok/s) of the prompts generated one after another."""
    timings = [_llama_generate(llm, p, decode_tokens) for p in prompts]
    decode_s = sum(t.decode_s for t in timings)
    total_s = sum(t.prefill_s + t.decode_s for t in timings)
    n = len(prompts)
    return n * (decode_tokens - 1) / decode_s, n * decode_tokens / total_s


# ---- report --------------------------------------------------------------------------------
def build_report(args: argparse.Namespace, bw: Bandwidth, runs: list[EngineRun], llama: LlamaCppRun | None) -> dict:
    """Every figure as one JSON-able dict."""
    return {
        "machine": machine_info(),
        "model": args.model,
        "dtype": args.dtype,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "bandwidth": {
            "weight_bytes": bw.weight_bytes,
            "reduce_pass_s": bw.reduce_s,
            "matvec_pass_s": bw.matvec_s,
            "bytes_per_s": bw.bytes_per_s,
            "max_decode_tok_s": bw.max_decode_tok_s,
        },
        # A batched step still reads every weight once, so the bound applies to steps/s
        # (= tok/s per stream), not to the total tok/s of several streams.
        "engine": [
            dataclasses.asdict(r) | {"fraction_of_bound": r.decode_tok_s / r.concurrency / bw.max_decode_tok_s}
            for r in runs
        ],
        "llama_cpp": None if llama is None else dataclasses.asdict(llama),
    }


def machine_info() -> dict:
    """CPU model and core count, for the record."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # Other processes sharing these cores skew every figure; the load average records it.
    return {"cpus": os.cpu_count(), "cpu_model": model, "load_average_1m": os.getloadavg()[0]}


def format_report(r: dict) -> str:
    """The report as plain-text tables (Markdown-compatible)."""
    bw = r["bandwidth"]
    lines = [
        f"machine: {r['machine']['cpu_model']}, {r['machine']['cpus']} CPUs, "
        f"load average (1 min) at the end: {r['machine']['load_average_1m']:.2f}",
        f"model: {r['model']} ({r['dtype']}), prompt {r['prompt_tokens']} tokens, "
        f"decode {r['decode_tokens']} tokens, best of {r['repeats']}",
        "",
        f"weights: {bw['weight_bytes'] / 1e6:.1f} MB; one pass: sum {bw['reduce_pass_s'] * 1e3:.1f} ms, "
        f"matvec {bw['matvec_pass_s'] * 1e3:.1f} ms -> {bw['bytes_per_s'] / 1e9:.1f} GB/s",
        f"bandwidth bound on single-stream decode: {bw['max_decode_tok_s']:.1f} tok/s",
        "",
    ]
    lines += _table(["metric", "jaxllm", "llama-cpp-python"], _rows(r))
    return "\n".join(lines)


def _rows(r: dict) -> list[list[str]]:
    llama = r["llama_cpp"]
    na = "-"
    rows: list[list[str]] = []
    for run in r["engine"]:
        c = run["concurrency"]
        rows.append([f"warm-up / compile, x{c} engine (s)", f"{run['warmup_s']:.1f}", na])
        rows.append([f"steps per call, x{c} engine", str(run["steps_per_call"]), na])
    first = r["engine"][0]
    rows.append(
        [
            f"prompt tok/s ({r['prompt_tokens']}-token prefill, x{first['concurrency']} engine)",
            f"{first['prefill_tok_s']:.0f}",
            f"{llama['prefill_tok_s']:.0f}" if llama else na,
        ]
    )
    for run in r["engine"]:
        c = run["concurrency"]
        theirs = na
        if llama and c == 1:
            theirs = f"{llama['decode_tok_s']:.1f}"
        elif llama and c == llama["sequential_n"]:
            theirs = f"{llama['sequential_decode_tok_s']:.1f} (one after another)"
        rows.append([f"decode tok/s, {c} stream(s), total", f"{run['decode_tok_s']:.1f}", theirs])
        rows.append(
            [
                "  decode steps/s as % of bandwidth bound",
                f"{100 * run['fraction_of_bound']:.0f}%",
                f"{100 * llama['decode_tok_s'] / r['bandwidth']['max_decode_tok_s']:.0f}% (of f32 bound)"
                if llama and c == 1
                else na,
            ]
        )
        e2e_theirs = (
            f"{llama['sequential_e2e_tok_s']:.1f} (one after another)" if llama and c == llama["sequential_n"] else na
        )
        rows.append([f"end-to-end tok/s, {c} stream(s) incl. prefill", f"{run['e2e_tok_s']:.1f}", e2e_theirs])
    if llama:
        rows.append(
            [
                "weights read per token (MB)",
                f"{r['bandwidth']['weight_bytes'] / 1e6:.0f}",
                f"~{llama['file_bytes'] / 1e6:.0f} (GGUF file, quantized)",
            ]
        )
        rows.append(["threads", "XLA default", str(llama["threads"])])
    return rows


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    fmt = lambda row: "| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |"  # noqa: E731
    return [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *[fmt(row) for row in rows]]


if __name__ == "__main__":
    raise SystemExit(main())
