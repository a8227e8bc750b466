"""Does a sequence get the same tokens and logprobs alone and among neighbours, and what does
`EngineConfig.batch_invariant` cost?

    python -m benchmarks.batch_invariance --config configs/smollm2-135m.json [--dtype bfloat16]

Engine settings (`--settings`): "derived" is the shape `jaxllm serve` derives for this
backend (serving.settings.derive_engine); "widths" adds several decode widths; "drafts"
adds prompt-lookup speculative decoding (4 drafts); "invariant" is "derived" with
`batch_invariant=True`. For each setting it prints one JSON line per crowd: a few seeded
targets run alone, then beside 7 and 31 neighbours of other lengths, samplers and budgets;
`tokens_differ` and `logprobs_not_bitwise` list the targets whose tokens / chosen-token
logprobs differ (the sensitive sign: a matmul that sums a row in another order by batch
width changes the last bits first, tokens only at near-ties). Then one "throughput" line per
setting: the same workload of `--rows` mixed requests through the warmed-up engine, with
generated tokens per second (`tok_s`) and prompt + generated tokens per second. The mode's
cost is "invariant" against "derived" on the same device.

`--layers` / `--vocab` shrink the config (CPU runs); widths stay the checkpoint's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import numpy as np

from jaxllm.api import Model
from jaxllm.config import load_config_json
from jaxllm.engine_config import EngineConfig
from jaxllm.engine_runs import run_rows
from jaxllm.loading.dummy import dummy_params
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.sampling import SamplingParams
from jaxllm.state import kv_bytes_per_page
from jaxllm.tokenizer import Tokenizer
from serving.settings import derive_engine

KINDS = [
    dict(temperature=0.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_k=20),
    dict(temperature=1.2, min_p=0.05),
]


def engine_config(setting: str, cfg, opts: RuntimeOptions, slots: int, context: int, backend: str) -> EngineConfig:
    base = derive_engine(
        slots=slots,
        context=context,
        kv_mib=0,
        backend=backend,
        kv_bytes_per_position=kv_bytes_per_page(cfg, 1, opts),
    )
    if setting == "derived":
        return base
    if setting == "widths":
        return dataclasses.replace(base, decode_widths=(1, 8, slots))
    if setting == "drafts":
        return dataclasses.replace(base, decode_widths=(1, 8, slots), max_drafts=4)
    if setting == "invariant":
        return dataclasses.replace(base, batch_invariant=True)
    raise ValueError(f"unknown setting {setting!r}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/smollm2-135m.json")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=0, help="keep this many layers (0: the config's)")
    p.add_argument("--vocab", type=int, default=0, help="shrink the vocabulary to this (0: the config's)")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=48, help="the targets' budget")
    p.add_argument("--rows", type=int, default=96, help="requests of the throughput workload (0: no timing)")
    p.add_argument("--settings", default="derived,widths,drafts,invariant")
    p.add_argument("--no-check", action="store_true", help="throughput only")
    a = p.parse_args()
    cfg = load_config_json(a.config)
    cfg = dataclasses.replace(cfg, n_layers=a.layers or cfg.n_layers, vocab_size=a.vocab or cfg.vocab_size)
    opts = RuntimeOptions(dtype=a.dtype)
    backend = "gpu" if jax.default_backend() == "gpu" else "cpu"
    # Larger weights than the loader's default, so distributions are peaked as a trained model's.
    params = jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x, dummy_params(cfg, seed=0, dtype=a.dtype))
    model = Model(cfg=cfg, params=params, tokenizer=Tokenizer.synthetic(cfg.vocab_size), options=opts)
    rng = np.random.default_rng(0)
    V = cfg.vocab_size
    longest = a.context - 64  # prompt + budget of every row fits the context
    targets = [
        (
            rng.integers(100, V, n).tolist(),
            SamplingParams(temperature=t, seed=s, max_tokens=a.max_tokens, ignore_eos=True),
        )
        for n, t, s in ((7, 1.0, 1), (40, 0.8, 2), (130, 1.0, 3), (min(300, longest - a.max_tokens), 0.0, 4))
    ]

    def neighbours(n: int, seed: int) -> list:
        r = np.random.default_rng(seed)
        return [
            (
                r.integers(100, V, int(r.integers(3, longest - 64))).tolist(),
                SamplingParams(
                    seed=int(r.integers(1 << 30)),
                    max_tokens=int(r.integers(4, 64)),
                    ignore_eos=True,
                    **KINDS[i % len(KINDS)],
                ),
            )
            for i in range(n)
        ]

    device = jax.devices()[0].device_kind
    for setting in a.settings.split(","):
        config = engine_config(setting, cfg, opts, a.slots, a.context, backend)
        engine = model.engine(config)
        started = time.perf_counter()
        variants = engine.warmup()
        common = {"device": device, "dtype": a.dtype, "setting": setting}
        print(json.dumps({**common, "warmup_s": round(time.perf_counter() - started, 1), "variants": variants}))
        if not a.no_check:
            alone = [run_rows(model, engine, [t])[0].completion for t in targets]
            for crowd in (7, 31):
                others = neighbours(crowd, crowd)
                half = len(others) // 2
                out = run_rows(model, engine, others[:half] + targets + others[half:])
                got = [out[half + i].completion for i in range(len(targets))]
                print(
                    json.dumps(
                        {
                            **common,
                            "neighbours": crowd,
                            "tokens_differ": [
                                i for i, (x, y) in enumerate(zip(alone, got)) if x.token_ids != y.token_ids
                            ],
                            "logprobs_not_bitwise": [
                                i for i, (x, y) in enumerate(zip(alone, got)) if x.logprobs != y.logprobs
                            ],
                        }
                    ),
                    flush=True,
                )
        if a.rows:
            rows = neighbours(a.rows, 12345)
            jax.block_until_ready(engine.state)
            started = time.perf_counter()
            out = run_rows(model, engine, rows)
            wall = time.perf_counter() - started
            generated = sum(len(s.completion.token_ids) for s in out)
            prompt = sum(len(r[0]) for r in rows)
            print(
                json.dumps(
                    {
                        **common,
                        "throughput": True,
                        "rows": a.rows,
                        "slots": a.slots,
                        "wall_s": round(wall, 2),
                        "generated_tokens": generated,
                        "tok_s": round(generated / wall, 1),
                        "prompt_plus_generated_tok_s": round((generated + prompt) / wall, 1),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
