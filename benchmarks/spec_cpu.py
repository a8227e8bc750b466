"""Prompt-lookup drafts on the default model (CPU): decode tok/s with and without drafts.

    JAX_PLATFORMS=cpu python -m benchmarks.spec_cpu [--drafts 4] [--max-tokens 128] [--slots 8]

Two workloads, one request at a time, greedy: an edit (repeat a given paragraph, the text
drafts come from) and an open-ended chat question. Each request runs once to compile, then
is timed; the tokens with and without drafts must be equal (drafts never change them). The
engine has the default server's 8 slots and one-row decode part (`--slots 1`: a lone slot).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from jaxllm.api import load
from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.sampling import SamplingParams

PARAGRAPH = (
    "The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed the "
    "ninety-seven steps, trimmed the wick, polished the great lens and watched the ships pass. When the storms "
    "came in winter, the light was the only thing the sailors could see."
)
WORKLOADS = {
    "edit": f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
    "chat": "What are three good habits for staying healthy? Explain each briefly.",
}


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], float]:
    seq = engine.add(prompt, params)
    while seq.prefilled < len(seq.prompt):
        engine.step()
    start, first = time.perf_counter(), len(seq.generated)
    while seq.finish_reason is None:
        engine.step()
    seconds = time.perf_counter() - start
    engine.remove(seq)
    return seq.generated, (len(seq.generated) - first) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--slots", type=int, default=8)
    args = ap.parse_args()
    model = load("smollm2")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    config = EngineConfig(max_slots=args.slots, max_seq_len=1024, decode_widths=(1,))
    engines = {k: model.engine(dataclasses.replace(config, max_drafts=k)) for k in (0, args.drafts)}
    for name, text in WORKLOADS.items():
        prompt = model.chat_ids([{"role": "user", "content": text}])
        rates, outputs = {}, {}
        for k, engine in engines.items():
            run(engine, prompt, params)  # compile
            outputs[k], rates[k] = run(engine, prompt, params)
        same = outputs[0] == outputs[args.drafts]
        stats = engines[args.drafts].draft_stats
        print(
            f"{name}: {len(outputs[0])} tokens, decode {rates[0]:.1f} tok/s without drafts, "
            f"{rates[args.drafts]:.1f} with {args.drafts} ({rates[args.drafts] / rates[0]:.2f}x); "
            f"same tokens: {same}; acceptance by position {[round(a, 2) if a is not None else None for a in stats.acceptance()]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
