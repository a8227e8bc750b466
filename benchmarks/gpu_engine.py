"""Engine-level GPU benchmark: the issue's cases on random weights at real shapes.

Prints one table: device ceilings (copy bandwidth, bf16 matmul), decode step time at batch 1
and 1k context (MBU), prefill of one 2k prompt (MFU), and 64-concurrent decode throughput.
Run on the GPU machine through `benchmarks/gpu.sh`; every figure is a median of timed calls
after a warm-up call of the same shape (so compilation is excluded and reported apart).

    python benchmarks/gpu_engine.py --config configs/llama3-8b.json [--cases a,b,c] [--scan]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import load_config_json
from jaxllm.costs import model_costs
from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.loading import runtime_layout
from jaxllm.model.kernel_choice import debug_overrides
from jaxllm.loading.dummy import dummy_params
from jaxllm.params import OutIn, in_out_weights, out_in_weights, unfuse_projections
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.sampling import SamplingParams
from jaxllm.state import kv_bytes_per_page

GREEDY = dict(temperature=0.0, ignore_eos=True)


def timed(fn, repeats: int = 10) -> float:
    """Median seconds of `fn()` (which must block) after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ceilings() -> dict[str, float]:
    x = jax.random.normal(jax.random.PRNGKey(0), (1 << 31,), jnp.bfloat16)  # 4 GiB
    copy = jax.jit(lambda a: a * 1.0001)
    copy_s = timed(lambda: copy(x).block_until_ready())
    n = 8192
    a = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(2), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    mm_s = timed(lambda: mm(a, b).block_until_ready())
    return {"copy_GBps": 2 * x.nbytes / copy_s / 1e9, "matmul_TFLOPs": 2 * n**3 / mm_s / 1e12}


def kernel_parity() -> dict[str, float]:
    """cuDNN chunk attention against the plain-jnp reference at real shapes (bf16)."""
    from jaxllm.attention.fused import fresh_causal_attention
    from jaxllm.attention.reference import Windows, paged_attention

    T, H, K, Dh, page = 2048, 32, 8, 128, 16
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(keys[0], (T, H, Dh), jnp.bfloat16)
    k = jax.random.normal(keys[1], (T, K, Dh), jnp.bfloat16)
    v = jax.random.normal(keys[2], (T, K, Dh), jnp.bfloat16)
    pages = jnp.zeros((T // page + 1, page, K, Dh), jnp.bfloat16)
    table = jnp.arange(1, T // page + 1, dtype=jnp.int32)[None]
    w = Windows(slot=jnp.zeros((1,), jnp.int32), start=jnp.zeros((1,), jnp.int32), length=jnp.full((1,), T, jnp.int32))
    pos = jnp.arange(T, dtype=jnp.int32)
    ref = jax.jit(lambda: paged_attention(q, k, v, pos, pages, pages, table, w, window_len=T, n_ctx_pages=T // page))()
    got = jax.jit(lambda: fresh_causal_attention(q, k, v, w, window_len=T, implementation="cudnn"))()
    r, g = ref.astype(jnp.float32), got.astype(jnp.float32)
    return {"cudnn_vs_reference_rel_err": float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))}


def engine_config(
    cfg, opts: RuntimeOptions, *, slots: int, max_seq_len: int, chunk: int, steps: int, **kw
) -> EngineConfig:
    """Pages for every slot's whole context, one chunk size, `steps` decode steps a call."""
    pages = slots * (-(-max_seq_len // 16) + 1) + 4
    return EngineConfig(
        max_slots=slots,
        kv_bytes=pages * kv_bytes_per_page(cfg, 16, opts),
        max_seq_len=max_seq_len,
        chunk_buckets=(chunk,),
        min_ctx_pages=8,
        decode_steps_per_call=steps,
        **kw,
    )


def unfused(params):
    """`params` with one matrix per projection, in the same weight layout."""
    flat = unfuse_projections(in_out_weights(params))
    return out_in_weights(flat) if flat is not params and _has_out_in(params) else flat


def _has_out_in(params) -> bool:
    return any(isinstance(x, OutIn) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, OutIn)))


def engine_for(cfg, opts: RuntimeOptions, params, *, slots: int, max_seq_len: int, chunk: int, steps: int) -> Engine:
    config = engine_config(cfg, opts, slots=slots, max_seq_len=max_seq_len, chunk=chunk, steps=steps)
    return Engine(cfg, params, eos_ids=[], config=config, options=opts)


def prefill(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list:
    seqs = [engine.add(p, SamplingParams(max_tokens=max_tokens, **GREEDY)) for p in prompts]
    while any(not s.generated for s in seqs):
        engine.step()
    return seqs


# Prompt length for the "1k context" cases: with the timed decode steps the context stays
# under 1024 positions, so every timed call uses one context bucket.
CTX = 860


def decode_seconds_per_call(engine: Engine, calls: int = 5) -> float:
    """Median seconds of one decode call, dispatched back to back (no host sync between)."""

    def run():
        handles = [engine.launch() for _ in range(calls)]
        jax.block_until_ready(handles[-1].output)
        return handles

    run()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/llama3-8b.json")
    ap.add_argument("--cases", default="ceil,parity,a,aref,a_unfused,b,c")
    ap.add_argument("--scan", action="store_true", help="lax.scan over layers instead of unrolled")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per call")
    ap.add_argument("--out", default=None, help="write the results as JSON here too")
    ap.add_argument(
        "--kv-dtype", default="auto", help="RuntimeOptions.kv_dtype of every case (float8_e4m3fn: an 8-bit cache)"
    )
    ap.add_argument("--c-slots", default="64", help="case C's concurrent sequences, comma-separated (e.g. 16,64)")
    ap.add_argument(
        "--c-context",
        type=int,
        default=CTX,
        help="prompt length of case C (1536: the mean context of 64 x 1k-in/1k-out requests)",
    )
    args = ap.parse_args()
    cases = args.cases.split(",")
    results: dict[str, object] = {
        "device": str(jax.devices()[0]),
        "scan_layers": args.scan,
        "steps_per_call": args.steps,
    }

    if "ceil" in cases:
        results.update(ceilings())
        print("ceilings", results, flush=True)
    if "parity" in cases:
        results.update(kernel_parity())
        print("kernel parity", results["cudnn_vs_reference_rel_err"], flush=True)

    cfg = load_config_json(args.config)
    opts = RuntimeOptions(dtype=args.dtype, scan_layers=args.scan, kv_dtype=args.kv_dtype).replace(**debug_overrides())
    results["kv_dtype"] = args.kv_dtype
    t = time.perf_counter()
    params = runtime_layout(dummy_params(cfg, dtype=opts.dtype, unrolled=not opts.scan_layers), opts)
    jax.block_until_ready(params)
    results["load_s"] = time.perf_counter() - t
    costs = model_costs(cfg, params, opts)
    rng = np.random.default_rng(0)

    # (steps per call, decode attention, decode matmul, fused projections, decode norm, sampler branches)
    runs = [(steps, "auto", "xla", True, "auto", "auto") for steps in sorted({1, args.steps})] if "a" in cases else []
    runs += (
        [(args.steps, "auto", "xla", True, "auto", "auto")] if "a_steps" in cases else []
    )  # "a" without the 1-step call
    runs += (
        [(args.steps, "reference", "xla", True, "auto", "auto")] if "aref" in cases else []
    )  # before the Pallas decode kernel
    runs += (
        [(args.steps, "auto", "xla", False, "auto", "auto")] if "a_unfused" in cases else []
    )  # one matmul per projection
    runs += (
        [(args.steps, "auto", "xla", True, "xla", "auto")] if "anorm" in cases else []
    )  # XLA's norms, not the kernel's
    runs += [(args.steps, "auto", "xla", True, "auto", "cond")] if "acond" in cases else []  # the sampler's lax.conds
    runs += (
        [(args.steps, "auto", "xla", "in_out", "auto", "auto")] if "a_inout" in cases else []
    )  # projections in the canonical [in, out] layout (RuntimeOptions.weight_layout)
    for steps, attention, matmul, fused, norm, branches in runs:
        run_params = params if fused is True else unfused(params) if fused is False else in_out_weights(params)
        run_opts = opts.replace(
            decode_attention=attention, decode_matmul=matmul, decode_norm=norm, sampler_branches=branches
        )
        eng = engine_for(cfg, run_opts, run_params, slots=1, max_seq_len=2048, chunk=1024, steps=steps)
        t = time.perf_counter()
        prefill(eng, [rng.integers(0, cfg.vocab_size, CTX).tolist()], max_tokens=1000)
        first = time.perf_counter() - t
        per_call = decode_seconds_per_call(eng)
        step_s = per_call / steps
        bytes_step = costs.decode_step_bytes(CTX + 80)
        tag = (
            f"steps{steps}"
            + ("" if attention == "auto" else f"_{attention}")
            + ("" if matmul == "xla" else f"_{matmul}")
        )
        tag += "" if fused is True else "_unfused" if fused is False else "_in_out"
        tag += "" if norm == "auto" else f"_norm_{norm}"
        tag += "" if branches == "auto" else f"_sampler_{branches}"
        results[f"a_decode_ms_b1_ctx1k_{tag}"] = step_s * 1e3
        results[f"a_mbu_{tag}"] = bytes_step / step_s / 4.3e12
        results[f"a_first_prefill_incl_compile_s_{tag}"] = first
        print(f"A {tag}: {step_s * 1e3:.2f} ms/token, MBU {bytes_step / step_s / 4.3e12:.0%} of 4.3 TB/s", flush=True)
        eng = None  # free the engine before the next case

    if "b" in cases:
        eng = engine_for(cfg, opts, params, slots=1, max_seq_len=2048 + 64, chunk=2048, steps=1)
        prompt = rng.integers(0, cfg.vocab_size, 2048).tolist()

        def one_prefill():
            seq = eng.add(prompt, SamplingParams(max_tokens=1, **GREEDY))
            eng.step()
            assert seq.generated
            eng.remove(seq)

        s = timed(one_prefill, repeats=5)
        flops = costs.prefill_flops(2048)
        results["b_prefill_2k_ms"] = s * 1e3
        results["b_mfu"] = flops / s / 790e12
        print(f"B prefill 2k: {s * 1e3:.1f} ms, MFU {flops / s / 790e12:.0%} of 790 TFLOP/s", flush=True)
        eng = None  # free the engine before the next case

    for slots in [int(n) for n in args.c_slots.split(",")] if "c" in cases else []:
        eng = engine_for(cfg, opts, params, slots=slots, max_seq_len=2048 + 64, chunk=1024, steps=args.steps)
        ctx = args.c_context
        sfx = "" if slots == 64 else f"_{slots}"
        prompts = [rng.integers(0, cfg.vocab_size, ctx).tolist() for _ in range(slots)]
        t = time.perf_counter()
        prefill(eng, prompts, max_tokens=2048 + 64 - ctx)
        results[f"c_prefill_{slots}x1k_s"] = prefill_s = time.perf_counter() - t
        per_call = decode_seconds_per_call(eng, calls=3)
        tok_s = slots * args.steps / per_call
        step_s = per_call / args.steps
        # Mean context over the timed calls: the prompt plus the ~(1 + 5 * 3) calls' steps so far.
        mbu = costs.decode_step_bytes(slots * (ctx + 8 * args.steps), rows=slots) / step_s / 4.3e12
        results.update(
            {f"c_decode_tok_s_{slots}x1k": tok_s, f"c_step_ms{sfx}": step_s * 1e3, f"c_mbu{sfx}": mbu, "c_context": ctx}
        )
        print(
            f"C {slots} concurrent at {ctx} ctx: {tok_s:.0f} output tok/s (decode only), {step_s * 1e3:.2f} ms/step, "
            f"MBU {mbu:.0%}; prefill of {slots} prompts took {prefill_s:.1f}s incl. compile",
            flush=True,
        )
        eng = None  # free the engine before the next case

    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
