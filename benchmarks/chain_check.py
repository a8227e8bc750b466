"""Checks the one-token Pallas decode chain (`jaxllm.model.decode_chain`) against XLA's path
inside the real engine, at a model's real layer shapes with few layers.

Greedy decoding of one prompt, the same random weights, once with the default kernels
(XLA's dots; on the GPU the Pallas attention and norm kernels) and once with
`decode_matmul = "pallas"` (the chain): prints how many generated tokens agree and the
largest difference of the top-5 logprobs over the first tokens. Exits 1 when the first
tokens disagree or their logprobs differ by more than the tolerance (bf16 sums in another
order move logprobs by ~1e-2; a wrong kernel moves them by whole units).

    python benchmarks/chain_check.py --config configs/llama3-8b.json --layers 4     # on the GPU
    python benchmarks/chain_check.py --config configs/smollm2-135m.json --layers 2 --interpret --dtype float32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxllm.config import load_config_json  # noqa: E402
from jaxllm.engine import Engine, EngineConfig  # noqa: E402
from jaxllm.loading.dummy import dummy_params  # noqa: E402
from jaxllm.params import layout_params  # noqa: E402
from jaxllm.sampling import SamplingParams  # noqa: E402
from jaxllm.state import kv_bytes_per_page  # noqa: E402


def generate(cfg, params, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    config = EngineConfig(max_slots=1, kv_bytes=64 * kv_bytes_per_page(cfg, 16), max_seq_len=512,
                          chunk_buckets=(256,), min_ctx_pages=8, decode_steps_per_call=4)
    engine = Engine(cfg, params, eos_ids=[], config=config)
    seq = engine.add(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=True,
                                            top_logprobs=5))
    while seq.finish_reason is None:
        engine.step()
    return seq.generated, np.array([[p for _, p in top] for top in seq.top_logprobs])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/llama3-8b.json")
    ap.add_argument("--layers", type=int, default=4, help="layers kept (real widths, fewer of them)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--interpret", action="store_true", help="all kernels in the Pallas interpreter (CPU)")
    ap.add_argument("--tolerance", type=float, default=0.1, help="largest allowed top-5 logprob difference")
    args = ap.parse_args()

    cfg = load_config_json(args.config, dtype=args.dtype, scan_layers=False).replace(n_layers=args.layers)
    params = layout_params(dummy_params(cfg, seed=3), False)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 200).tolist()
    if args.interpret:
        base = cfg.replace(decode_attention="interpret", decode_norm="interpret", decode_matmul="xla")
        chain = base.replace(decode_matmul="interpret")
    else:
        base, chain = cfg.replace(decode_matmul="xla"), cfg.replace(decode_matmul="pallas")
    ref_tokens, ref_top = generate(base, params, prompt, args.tokens)
    tokens, top = generate(chain, params, prompt, args.tokens)
    agree = sum(a == b for a, b in zip(tokens, ref_tokens))
    # Compare logprobs only while the sequences agree: after a split they see other contexts.
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
    diff = float(np.abs(top[:same] - ref_top[:same]).max()) if same else float("inf")
    print(f"{args.config} x{args.layers} layers, {args.dtype}: {agree}/{len(tokens)} tokens agree, "
          f"first {same} identical; top-5 logprob max |diff| there {diff:.2e}")
    ok = same >= min(4, len(tokens)) and diff <= args.tolerance
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
