"""Does collecting round N wait for round N+1 launched behind it? (GPU diagnostic)

Times, on the engine at the 8B shape: a prompt round collected alone, and the same round
collected after a decode call was launched behind it. If collect waits for the round behind
it, the second time is the first plus a decode call; if a launch returns only once the device
has (nearly) run it, "launches returned" is about the rounds' time. On an H200 (2026-12-03,
docs/lab/2026-12.md) both held: 28.9 ms alone, 69.5 ms with a decode call behind; starting the
host copy at launch changed nothing, so the scheduler collects prompt-completing rounds first.

    python benchmarks/pipeline_check.py --config configs/llama3-8b.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxllm.config import load_config_json
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.loading import runtime_layout
from jaxllm.loading.dummy import dummy_params

from jaxllm.sampling import SamplingParams
from jaxllm.state import kv_bytes_per_page


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/llama3-8b.json")
    ap.add_argument("--prompt-len", type=int, default=1000)
    args = ap.parse_args()
    cfg = load_config_json(args.config)
    opts = RuntimeOptions(dtype="bfloat16", scan_layers=False)
    params = runtime_layout(dummy_params(cfg, dtype=opts.dtype, unrolled=True), opts.replace(scan_layers=False))
    config = EngineConfig(
        max_slots=1,
        kv_bytes=200 * kv_bytes_per_page(cfg, 16, opts),
        max_seq_len=2048,
        chunk_buckets=(1024,),
        min_ctx_pages=64,
        decode_steps_per_call=8,
    )
    eng = Engine(cfg, params, eos_ids=[], config=config, options=opts)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_len).tolist()

    def once(behind: bool) -> tuple[float, float, float]:
        seq = eng.add(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        t = time.perf_counter()
        first = eng.launch()
        second = eng.launch() if behind else None
        launched = time.perf_counter() - t  # long if a launch waits for the round before it
        eng.collect(first)
        got_first = time.perf_counter() - t
        if second is not None:
            eng.collect(second)
        total = time.perf_counter() - t
        eng.remove(seq)
        return launched, got_first, total

    for behind in (False, True):
        once(behind)  # compile / warm
        runs = [once(behind) for _ in range(5)]
        lau, f, tot = (statistics.median(r[i] for r in runs) * 1e3 for i in range(3))
        print(
            f"decode call launched behind={behind!s:5}: launches returned after "
            f"{lau:.1f} ms, first token collected after {f:.1f} ms (both rounds {tot:.1f} ms)",
            flush=True,
        )


if __name__ == "__main__":
    main()
