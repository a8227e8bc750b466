"""A hybrid model in the engine on one GPU: decode ms per step at a few widths.

    python -m benchmarks.hybrid_gpu [--config configs/qwen3.5-35b-a3b.json] [--slots 1,16]

Dummy bfloat16 weights at the preset's real shapes; each width prefills its slots with
`--context` random tokens, then times decode calls of `--steps` steps (after one warm call).
Prints one line per width as it goes.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jaxllm.config import load_config_json
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.engine import Engine, EngineConfig
from jaxllm.loading.dummy import dummy_params
from jaxllm.sampling import SamplingParams
from jaxllm.state import kv_bytes_per_page


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/qwen3.5-35b-a3b.json")
    ap.add_argument("--slots", default="1,16")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    cfg = load_config_json(args.config)
    opts = RuntimeOptions(dtype="bfloat16")
    t = time.perf_counter()
    params = dummy_params(cfg, dtype=opts.dtype)
    jax.block_until_ready(params)
    print(f"{args.config}: {cfg.param_count() / 1e9:.1f}B params ready in {time.perf_counter() - t:.1f}s", flush=True)
    rng = np.random.default_rng(0)
    for slots in (int(s) for s in args.slots.split(",")):
        pages = slots * (-(-2048 // 16) + 1) + 4
        config = EngineConfig(max_slots=slots, kv_bytes=pages * kv_bytes_per_page(cfg, 16, opts), max_seq_len=2048,
                              chunk_buckets=(1024,), min_ctx_pages=64, decode_steps_per_call=args.steps)
        engine = Engine(cfg, params, config=config, options=opts)
        t = time.perf_counter()
        seqs = [engine.add(rng.integers(0, cfg.vocab_size, args.context).tolist(),
                           SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)) for _ in range(slots)]
        while any(s.prefilled < len(s.prompt) for s in seqs):
            engine.step()
        engine.step()  # compiles the decode call
        print(f"width {slots}: prefill + compiles {time.perf_counter() - t:.1f}s", flush=True)
        calls = 5
        t = time.perf_counter()
        for _ in range(calls):
            engine.step()
        per_step = (time.perf_counter() - t) / (calls * args.steps)
        print(f"width {slots}: decode {per_step * 1e3:.2f} ms/step, {slots / per_step:.0f} tok/s", flush=True)
        del engine, seqs


if __name__ == "__main__":
    main()
