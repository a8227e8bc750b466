"""Does a sequence draw the same tokens alone and among neighbours on this device?

    python -m benchmarks.batch_invariance --config configs/smollm2-135m.json [--dtype bfloat16]

For each engine shape setting (fixed decode width, or the narrowest of several widths), runs
a few seeded targets alone, then beside 7 and 31 neighbours of other lengths, samplers and
budgets, and prints one JSON line per setting: targets whose tokens differ, and targets whose
chosen-token logprobs are not bitwise equal (the sensitive sign: a matmul that sums a row in
another order by batch width changes the last bits first, tokens only at near-ties).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import numpy as np

from jaxllm.api import Model
from jaxllm.config import load_config_json
from jaxllm.engine import EngineConfig
from jaxllm.engine_runs import kv_bytes, run_rows
from jaxllm.loading.dummy import dummy_params
from jaxllm.sampling import SamplingParams
from jaxllm.tokenizer import Tokenizer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/smollm2-135m.json")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=48)
    a = p.parse_args()
    cfg = dataclasses.replace(load_config_json(a.config), dtype=a.dtype)
    # Larger weights than the loader's default, so distributions are peaked as a trained model's.
    params = jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x, dummy_params(cfg, seed=0))
    model = Model(cfg=cfg, params=params, tokenizer=Tokenizer.synthetic(cfg.vocab_size))
    rng = np.random.default_rng(0)
    V = cfg.vocab_size
    targets = [
        (
            rng.integers(100, V, n).tolist(),
            SamplingParams(temperature=t, seed=s, max_tokens=a.max_tokens, ignore_eos=True),
        )
        for n, t, s in ((7, 1.0, 1), (40, 0.8, 2), (130, 1.0, 3), (300, 0.0, 4))
    ]
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=20),
        dict(temperature=1.2, min_p=0.05),
    ]

    def neighbours(n: int) -> list:
        return [
            (
                rng.integers(100, V, int(rng.integers(3, 400))).tolist(),
                SamplingParams(
                    seed=int(rng.integers(1 << 30)),
                    max_tokens=int(rng.integers(4, 64)),
                    ignore_eos=True,
                    **kinds[i % len(kinds)],
                ),
            )
            for i in range(n)
        ]

    for widths in ((), (1, 8, 32)):
        config = EngineConfig(
            max_slots=32,
            max_seq_len=512,
            kv_bytes=kv_bytes(cfg, 32, 512),
            chunk_buckets=(64, 256),
            decode_widths=widths,
        )
        engine = model.engine(config)
        alone = [run_rows(model, engine, [t])[0].completion for t in targets]
        for crowd in (7, 31):
            others = neighbours(crowd)
            half = len(others) // 2
            out = run_rows(model, engine, others[:half] + targets + others[half:])
            got = [out[half + i].completion for i in range(len(targets))]
            print(
                json.dumps(
                    {
                        "device": jax.devices()[0].device_kind,
                        "dtype": a.dtype,
                        "decode_widths": list(widths),
                        "neighbours": crowd,
                        "tokens_differ": [i for i, (x, y) in enumerate(zip(alone, got)) if x.token_ids != y.token_ids],
                        "logprobs_not_bitwise": [
                            i for i, (x, y) in enumerate(zip(alone, got)) if x.logprobs != y.logprobs
                        ],
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
