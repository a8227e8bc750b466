"""`jaxllm generate`; the `serving` package adds `serve`. Benchmarks live in `benchmarks/`."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxllm.api import Model

HELP_FORMAT = argparse.ArgumentDefaultsHelpFormatter  # --help shows every option's default


def _version() -> str:
    try:
        return importlib.metadata.version("jaxllm")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2, a .gguf file, an HF or orbax directory, or a configs/*.json preset with --load-format dummy",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "gguf", "safetensors", "orbax", "dummy"],
        help="weights' format (auto: from the path); dummy = random weights at the preset's shapes",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute and weight dtype")
    p.add_argument("--unroll-layers", action="store_true", help="unrolled layers (faster on GPU, slower compile)")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        type=_kv_dtype,
        metavar="{auto,fp8}",
        help="K/V cache element type: auto = the model's dtype; fp8 (float8_e4m3fn) halves a bfloat16 "
        "cache's bytes and decode reads; the rounding changes outputs (docs/benchmarks.md)",
    )


def load_from_args(args: argparse.Namespace) -> Model:
    """The model that `add_model_args`' options name."""
    from jaxllm.api import load

    return load(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        scan_layers=not args.unroll_layers,
        kv_dtype=args.kv_cache_dtype,
    )


def _kv_dtype(name: str) -> str:
    """--kv-cache-dtype: vLLM's spellings onto RuntimeOptions.kv_dtype."""
    known = {"auto": "auto", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}
    if name not in known:
        raise argparse.ArgumentTypeError(f"unknown K/V cache dtype {name!r}; known: {', '.join(known)}")
    return known[name]


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt", formatter_class=HELP_FORMAT)
    add_model_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="render the prompt as one user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from jaxllm.sampling import SamplingParams

    model = load_from_args(args)
    if args.chat:
        ids = model.chat_ids([{"role": "user", "content": args.prompt}])
    else:
        ids = model.tokenizer.encode(args.prompt)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed
    )
    started = time.perf_counter()
    (out,) = model.generate([ids], params)
    elapsed = time.perf_counter() - started
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_token_ids": out.prompt_token_ids,
                    "token_ids": out.token_ids,
                    "text": out.text,
                    "finish_reason": out.finish_reason,
                }
            )
        )
    else:
        print(out.text)
        print(
            f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, {elapsed:.2f}s incl. compile]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxllm", description="JAX LLM runtime", formatter_class=HELP_FORMAT)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"jaxllm: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from safetensors import SafetensorError

        # A damaged .safetensors file: the library's own error, one line (its message names the problem).
        if not isinstance(e, SafetensorError):
            raise
        print(f"jaxllm: error: invalid safetensors file: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
