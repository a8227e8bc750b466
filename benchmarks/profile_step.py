"""Where a decode call's time goes: a JAX profiler trace of back-to-back decode calls of the
engine (batch 1, 1k context), summarized by kernel.

    python benchmarks/profile_step.py --config configs/smollm2-135m.json --dtype float32 --steps 16 --out DIR

Writes DIR/trace.json.gz (Perfetto) and prints the device kernels that take the most time
per decode step, how many kernels run per step, and the step's wall time. `--layers N` keeps
N layers of the config (the per-layer kernels are the same; a large model then fits a smaller
card); `--explain` dumps the optimized HLO and names what each top XLA fusion computes (its
ops and the JAX source lines they came from).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import shutil
import sys
import time

import jax
import numpy as np

from gpu_engine import CTX, GREEDY, engine_for, prefill  # noqa: E402  (benchmarks/ is on sys.path when run)
from jaxllm.config import load_config_json
from jaxllm.loading import runtime_layout
from jaxllm.model.kernel_choice import debug_overrides
from jaxllm.loading.dummy import dummy_params

from jaxllm.runtime_options import RuntimeOptions


def _dump_dir(argv: list[str]) -> str | None:
    """With --explain, where XLA dumps the optimized HLO (set before jax starts its backend)."""
    if "--explain" not in argv:
        return None
    out = argv[argv.index("--out") + 1] if "--out" in argv else "/tmp/jaxllm-profile"
    dump = out + "/hlo"
    shutil.rmtree(dump, ignore_errors=True)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
    )
    return dump


DUMP = _dump_dir(sys.argv)


def explain(kernel: str, dump: str, lines: int = 6) -> list[str]:
    """What the fusion a trace kernel name stands for computes: its instruction's calls= target,
    that computation's non-trivial ops, and the source lines its ops came from."""
    hlo_name = re.sub(r"_(\d+)$", r".\1", kernel)
    for path in sorted(glob.glob(dump + "/*after_optimizations.txt")):
        text = open(path).read()
        m = re.search(rf"%{re.escape(hlo_name)} = [^\n]*calls=%([\w.\-]+)", text)
        if not m:
            continue
        body = re.search(rf"%{re.escape(m.group(1))} [^\n]*{{\n(.*?)\n}}", text, re.S)
        if not body:
            continue
        ops, sources = [], collections.Counter()
        for line in body.group(1).splitlines():
            op = re.search(r"= (\S+) (\w[\w\-]*)\(", line)
            if op and op.group(2) not in ("parameter", "constant", "bitcast", "broadcast", "convert", "reshape"):
                ops.append(f"{op.group(2)}:{op.group(1)}")
            src = re.search(r'source_file="([^"]+)" source_line=(\d+)', line)
            name = re.search(r'op_name="([^"]+)"', line)
            if src:
                sources[f"{os.path.basename(src.group(1))}:{src.group(2)}"] += 1
            elif name:  # stack frames only: the op's path in the traced function says where
                sources["/".join(name.group(1).split("/")[-3:])] += 1
        head = f"    = {' '.join(ops[:lines])}{' ...' if len(ops) > lines else ''}"
        return [
            head,
            f"    from {', '.join(s for s, _ in sources.most_common(3)) or '?'} ({os.path.basename(path)[:60]})",
        ]
    return []


def summarize(trace_path: str, n_steps: int, top: int) -> None:
    events = json.load(gzip.open(trace_path))["traceEvents"]
    names = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = [
        e
        for e in events
        if e.get("ph") == "X"
        and "/device:GPU" in procs.get(e["pid"], "")
        and "Stream" in names.get((e["pid"], e.get("tid")), "Stream")
    ]
    if not device:
        print("no device events found; processes:", sorted(set(procs.values()))[:20])
        return
    total = collections.Counter()
    count = collections.Counter()
    for e in device:
        total[e["name"]] += e["dur"]
        count[e["name"]] += 1
    busy = sum(total.values())
    span = max(e["ts"] + e["dur"] for e in device) - min(e["ts"] for e in device)
    print(
        f"device events: {len(device) / n_steps:.0f} per step; busy {busy / n_steps:.1f} us/step; "
        f"span {span / n_steps:.1f} us/step (busy {busy / span:.0%})"
    )
    for name, us in total.most_common(top):
        print(f"{us / n_steps:9.1f} us/step {count[name] / n_steps:6.1f}x  {name[:110]}")
        if DUMP and "fusion" in name:
            for line in explain(name, DUMP):
                print(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/smollm2-135m.json")
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=16, help="decode steps per call")
    ap.add_argument("--calls", type=int, default=4, help="traced decode calls")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default="/tmp/jaxllm-profile")
    ap.add_argument("--decode-matmul", default="auto", choices=["auto", "xla"])
    ap.add_argument("--sampler-branches", default="auto", choices=["auto", "cond", "select"])
    ap.add_argument("--batch", type=int, default=1, help="decode steps of this many sequences (slots)")
    ap.add_argument("--layers", type=int, default=0, help="keep this many layers (0: the config's)")
    ap.add_argument("--explain", action="store_true", help="name what each top fusion computes (HLO dump)")
    ap.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="trace prompt rounds of this many tokens instead (a fresh prompt each, at the GPU "
        "server's derived shapes for --slots slots: doubling chunk buckets, packed segments, a "
        "full-width decode part)",
    )
    ap.add_argument("--slots", type=int, default=64, help="with --prefill: the server's slots")
    ap.add_argument(
        "--verify",
        type=int,
        default=0,
        help="trace synchronous verification rounds of 1 + this many drafts instead (batch 1, drafting "
        "forced as benchmarks/spec_gpu.py does; an MTP model drafts with its head inside the round)",
    )
    args = ap.parse_args()

    cfg = load_config_json(args.config)
    if args.layers:
        types = cfg.layer_types[: args.layers] if cfg.layer_types else ()
        cfg = dataclasses.replace(cfg, n_layers=args.layers, layer_types=types)
    opts = RuntimeOptions(
        dtype=args.dtype, scan_layers=False, decode_matmul=args.decode_matmul, sampler_branches=args.sampler_branches
    ).replace(**debug_overrides())  # e.g. JAXLLM_DEBUG_KERNELS=weight_layout=in_out
    params = runtime_layout(dummy_params(cfg, dtype=opts.dtype, unrolled=not opts.scan_layers), opts)
    if args.prefill:
        profile_prefill(cfg, opts, params, args)
        return
    if args.verify:
        profile_verify(cfg, opts, params, args)
        return
    eng = engine_for(cfg, opts, params, slots=args.batch, max_seq_len=2048, chunk=1024, steps=args.steps)
    rng = np.random.default_rng(0)
    prefill(eng, [rng.integers(0, cfg.vocab_size, CTX).tolist() for _ in range(args.batch)], max_tokens=1000)
    for _ in range(3):  # warm: every decode shape of the traced calls is compiled
        jax.block_until_ready(eng.launch().output)
    shutil.rmtree(args.out + "/raw", ignore_errors=True)
    jax.profiler.start_trace(args.out + "/raw", create_perfetto_trace=True)
    t = time.perf_counter()
    handles = [eng.launch() for _ in range(args.calls)]
    jax.block_until_ready(handles[-1].output)
    wall = time.perf_counter() - t
    jax.profiler.stop_trace()
    n_steps = args.calls * args.steps
    print(
        f"{args.config} {args.dtype} batch {args.batch}: {wall / n_steps * 1e3:.3f} ms/step traced ({args.steps} steps per call)"
    )
    trace = sorted(glob.glob(args.out + "/raw/**/*.trace.json.gz", recursive=True))[-1]
    shutil.copy(trace, args.out + "/trace.json.gz")
    summarize(trace, n_steps, args.top)


def profile_verify(cfg, opts: RuntimeOptions, params, args: argparse.Namespace) -> None:
    """Traces `--calls` synchronous verification rounds (launch, then collect) of one sequence
    at CTX positions with `--verify` drafts: where a round's time goes, and how much of its
    span the device idles (the host's share)."""
    from spec_gpu import ForcedDraft, spec_engine

    eng = spec_engine(cfg, opts, params, slots=1, drafts=args.verify, steps=1, forced=not cfg.mtp_layers)
    (seq,) = prefill(eng, [np.random.default_rng(0).integers(0, cfg.vocab_size, CTX).tolist()], max_tokens=1000)
    seq.drafting = ForcedDraft(most=args.verify)
    for _ in range(4):  # compiles the verification round
        eng.step()
    shutil.rmtree(args.out + "/raw", ignore_errors=True)
    jax.profiler.start_trace(args.out + "/raw", create_perfetto_trace=True)
    t = time.perf_counter()
    for _ in range(args.calls):
        eng.step()
    wall = time.perf_counter() - t
    jax.profiler.stop_trace()
    print(
        f"{args.config} {args.dtype}: verification round of 1 + {args.verify}: {wall / args.calls * 1e3:.2f} ms traced"
    )
    trace = sorted(glob.glob(args.out + "/raw/**/*.trace.json.gz", recursive=True))[-1]
    shutil.copy(trace, args.out + "/trace.json.gz")
    summarize(trace, args.calls, args.top)


def profile_prefill(cfg, opts: RuntimeOptions, params, args: argparse.Namespace) -> None:
    """Traces `--calls` prompt rounds of `--prefill` tokens, each a fresh sequence, on an engine
    shaped as `jaxllm serve` derives it on a GPU (serving/settings.py, derive_engine)."""
    from jaxllm.state import kv_bytes_per_page
    from jaxllm.engine import Engine
    from jaxllm.sampling import SamplingParams
    from serving.settings import derive_engine

    context = 2176
    config = derive_engine(
        slots=args.slots,
        context=context,
        kv_mib=0,
        backend="gpu",
        recurrent=bool(cfg.n_linear_layers),
        kv_bytes_per_position=kv_bytes_per_page(cfg, 16, opts) // 16,
    )
    eng = Engine(cfg, params, eos_ids=[], config=config, options=opts)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prefill).tolist()

    def one_round():
        # The server asks for the prompt's last-but-one position (its exact-repeat checkpoint).
        seq = eng.add(prompt, SamplingParams(max_tokens=1, **GREEDY), stops=[len(prompt) - 1])
        handle = eng.launch()
        eng.collect(handle)
        eng.remove(seq)

    for _ in range(3):
        one_round()
    shutil.rmtree(args.out + "/raw", ignore_errors=True)
    jax.profiler.start_trace(args.out + "/raw", create_perfetto_trace=True)
    t = time.perf_counter()
    for _ in range(args.calls):
        one_round()
    wall = time.perf_counter() - t
    jax.profiler.stop_trace()
    print(
        f"{args.config} {args.dtype}: prompt round of {args.prefill} tokens (buckets {config.chunk_buckets}, "
        f"{args.slots} slots): {wall / args.calls * 1e3:.2f} ms a round traced"
    )
    trace = sorted(glob.glob(args.out + "/raw/**/*.trace.json.gz", recursive=True))[-1]
    shutil.copy(trace, args.out + "/trace.json.gz")
    summarize(trace, args.calls, args.top)


if __name__ == "__main__":
    main()
