"""A hybrid model (Qwen3.5 / Qwen3-Next shape) in the engine on one GPU.

    python -m benchmarks.hybrid_gpu [--config configs/qwen3.5-35b-a3b.json] [--cases a,aref,b,c] [--c-slots 16,64]

Dummy bfloat16 weights at the preset's real shapes, layers unrolled (`--scan` for the scanned
groups). Cases, one line each as they finish:

* a: batch-1 decode, `--steps` steps per call, after a `--context`-token prompt; "aref" the
  same with the jnp recurrence instead of the Pallas DeltaNet decode kernel.
* b: time to first token of one 2,048-token prompt (one 2,048-token chunk, warm).
* c: decode step of `--c-slots` concurrent sequences at `--c-context` positions (1,536: the
  mean context of 1k-in / 1k-out requests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import numpy as np

from benchmarks.gpu_engine import decode_seconds_per_call, engine_for, prefill, timed
from jaxllm.config import load_config_json
from jaxllm.loading import runtime_layout
from jaxllm.loading.dummy import dummy_params
from jaxllm.model.kernel_choice import debug_overrides

from jaxllm.runtime_options import RuntimeOptions
from jaxllm.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/qwen3.5-35b-a3b.json")
    ap.add_argument("--cases", default="a,aref,b,c")
    ap.add_argument("--scan", action="store_true", help="lax.scan over layer groups instead of unrolled")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--c-slots", default="16,64")
    ap.add_argument("--c-context", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=0, help="keep this many layers (0: the config's; a smaller card)")
    ap.add_argument("--out", default=None, help="write the results as JSON here too")
    args = ap.parse_args()
    cases = args.cases.split(",")
    cfg = load_config_json(args.config)
    if args.layers:
        cfg = dataclasses.replace(cfg, n_layers=args.layers, layer_types=cfg.layer_types[: args.layers])
    opts = RuntimeOptions(dtype="bfloat16", scan_layers=args.scan).replace(**debug_overrides())
    t = time.perf_counter()
    params = runtime_layout(dummy_params(cfg, dtype=opts.dtype, unrolled=not opts.scan_layers), opts)
    jax.block_until_ready(params)
    results: dict[str, object] = {
        "config": args.config,
        "device": str(jax.devices()[0]),
        "scan_layers": args.scan,
        "load_s": time.perf_counter() - t,
    }
    print(f"{args.config}: {cfg.param_count() / 1e9:.1f}B params ready in {results['load_s']:.1f}s", flush=True)
    rng = np.random.default_rng(0)

    for case, delta in (("a", "auto"), ("aref", "reference")):
        if case not in cases:
            continue
        eng = engine_for(
            cfg, opts.replace(decode_delta=delta), params, slots=1, max_seq_len=2048, chunk=1024, steps=args.steps
        )
        t = time.perf_counter()
        prefill(eng, [rng.integers(0, cfg.vocab_size, args.context).tolist()], max_tokens=1000)
        compile_s = time.perf_counter() - t
        step_ms = decode_seconds_per_call(eng) / args.steps * 1e3
        results[f"{case}_decode_ms_b1"] = step_ms
        print(
            f"A decode_delta={delta}: batch 1 at {args.context} ctx {step_ms:.2f} ms/token "
            f"(first prefill incl. compiles {compile_s:.1f}s)",
            flush=True,
        )
        eng = None

    if "b" in cases:
        eng = engine_for(cfg, opts, params, slots=1, max_seq_len=2048 + 64, chunk=2048, steps=1)
        prompt = rng.integers(0, cfg.vocab_size, 2048).tolist()

        def one_prefill():
            # As the server asks: a checkpoint at the last-but-one position (an exact repeat's).
            seq = eng.add(
                prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), stops=[len(prompt) - 1]
            )
            eng.step()
            assert seq.generated
            eng.remove(seq)

        ms = timed(one_prefill, repeats=5) * 1e3
        results["b_ttft_2k_ms"] = ms
        print(f"B 2k-token prompt: first token after {ms:.1f} ms (engine, warm)", flush=True)
        eng = None

    for slots in [int(n) for n in args.c_slots.split(",")] if "c" in cases else []:
        eng = engine_for(cfg, opts, params, slots=slots, max_seq_len=2048 + 64, chunk=1024, steps=args.steps)
        prompts = [rng.integers(0, cfg.vocab_size, args.c_context).tolist() for _ in range(slots)]
        t = time.perf_counter()
        prefill(eng, prompts, max_tokens=2048 + 64 - args.c_context)
        prefill_s = time.perf_counter() - t
        step_s = decode_seconds_per_call(eng, calls=3) / args.steps
        results[f"c_step_ms_{slots}"] = step_s * 1e3
        results[f"c_tok_s_{slots}"] = slots / step_s
        print(
            f"C {slots} concurrent at {args.c_context} ctx: {step_s * 1e3:.2f} ms/step, {slots / step_s:.0f} output "
            f"tok/s (decode only); prefill of {slots} prompts {prefill_s:.1f}s incl. compiles",
            flush=True,
        )
        eng = None

    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
