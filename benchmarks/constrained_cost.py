"""Cost of constrained decoding: host mask time per token, and other requests' decode speed.

    JAX_PLATFORMS=cpu python benchmarks/constrained_cost.py [--model smollm2] [--free 3] [--tokens 64]

(1) Host cost: every `allowed_bitmask` + `advance` call of a constrained sequence is timed
    while it generates (greedy, real model) for a JSON schema, any JSON object and a forced
    tool call; the figure is ms per generated token.
(2) Neighbours: `--free` unconstrained sequences decode `--tokens` tokens each (ignore_eos)
    a) alone, b) next to one more unconstrained sequence, c) next to one constrained
    sequence that stays busy throughout (a grammar forcing a long JSON array); reported as
    the free sequences' decode tok/s each (rounds after every prompt is prefilled).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxllm.api import load
from jaxllm.constrained import (
    GrammarConstraint,
    constraint_for,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from jaxllm.engine_config import EngineConfig
from jaxllm.sampling import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "hobbies"],
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
LONG = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 400}


class Timed:
    """Wraps a constraint and accumulates the host seconds spent in it."""

    def __init__(self, inner: GrammarConstraint):
        self.inner = inner
        self.seconds = 0.0
        self.tokens = 0

    def allowed_bitmask(self) -> np.ndarray:
        t = time.perf_counter()
        mask = self.inner.allowed_bitmask()
        self.seconds += time.perf_counter() - t
        return mask

    def advance(self, token: int) -> None:
        t = time.perf_counter()
        self.inner.advance(token)
        self.seconds += time.perf_counter() - t
        self.tokens += 1


def host_cost(model, engine, prompt: list[int]) -> None:
    tools = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}}}
    for kind, grammar in [
        ("json_schema", json_schema_grammar(PERSON)),
        ("json_object", json_object_grammar()),
        ("tool_call", tool_call_grammar(tools, tools)),
    ]:
        t = time.perf_counter()
        c = Timed(constraint_for(model.tokenizer, model.cfg.vocab_size, grammar, kind))
        build = time.perf_counter() - t
        seq = engine.add(prompt, SamplingParams(temperature=0, max_tokens=96), constraint=c)
        while seq.finish_reason is None:
            engine.step()
        engine.remove(seq)
        print(
            f"host {kind:11s}: {c.tokens:3d} tokens, {1e3 * c.seconds / c.tokens:.3f} ms/token "
            f"(mask + advance), matcher build {1e3 * build:.1f} ms, finish {seq.finish_reason}"
        )


def neighbours(model, engine, prompt: list[int], n_free: int, tokens: int, extra: str) -> float:
    free = [
        engine.add(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)) for _ in range(n_free)
    ]
    other = None
    if extra == "free":
        other = engine.add(prompt, SamplingParams(temperature=0, max_tokens=4 * tokens, ignore_eos=True))
    elif extra == "constrained":
        c = constraint_for(model.tokenizer, model.cfg.vocab_size, json_schema_grammar(LONG), "json_schema")
        other = engine.add(prompt, SamplingParams(temperature=0, max_tokens=4 * tokens), constraint=c)
    while any(s.prefilled < len(s.prompt) for s in engine.seqs.values()):
        engine.step()
    start = [len(s.generated) for s in free]
    t = time.perf_counter()
    while any(s.finish_reason is None for s in free):
        engine.step()
    elapsed = time.perf_counter() - t
    if other is not None:
        assert other.finish_reason is None, "the neighbour finished early; raise its budget"
    rate = sum(len(s.generated) - g for s, g in zip(free, start)) / elapsed / n_free
    for s in list(engine.seqs.values()):
        engine.remove(s)
    return rate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--free", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    model = load(a.model)
    engine = model.engine(
        EngineConfig(
            max_slots=a.free + 1, max_seq_len=1024, kv_bytes=64 << 20, chunk_buckets=(64, 256), decode_steps_per_call=4
        )
    )
    engine.warmup()
    prompt = model.chat_ids([{"role": "user", "content": "Describe a person as JSON."}], add_generation_prompt=True)
    host_cost(model, engine, prompt)
    rates: dict[str, list[float]] = {"alone": [], "free": [], "constrained": []}
    neighbours(model, engine, prompt, a.free, 8, "constrained")  # first-use compiles out of the way
    for _ in range(a.repeats):  # interleaved, so load drift hits every case alike
        for extra in rates:
            rates[extra].append(neighbours(model, engine, prompt, a.free, a.tokens, extra))
    for extra, r in rates.items():
        print(
            f"{a.free} free seqs, neighbour {extra:11s}: {statistics.median(r):6.2f} tok/s each "
            f"(runs {', '.join(f'{x:.2f}' for x in r)})"
        )
    c, f = statistics.median(rates["constrained"]), statistics.median(rates["free"])
    print(f"constrained neighbour vs unconstrained neighbour: {100 * (c / f - 1):+.1f}%")


if __name__ == "__main__":
    main()
