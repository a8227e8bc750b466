"""Starts `jaxllm serve` on a tiny random-weight llama with the SmolLM2 tokenizer (tests).

python -m tests.serving.tiny_server --port P --config C [--api-key K] [--api-key-file F] [--profile-dir D] [--no-warmup]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def tiny_model():
    from jaxllm.api import Model
    from jaxllm.config import load_config_json
    from jaxllm.loading.default_model import default_model_path
    from jaxllm.loading.dummy import dummy_params
    from jaxllm.tokenizer import Tokenizer

    cfg = load_config_json("configs/smollm2-135m.json")
    cfg = dataclasses.replace(cfg, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128)
    return Model(cfg=cfg, params=dummy_params(cfg, seed=1), tokenizer=Tokenizer.from_gguf(default_model_path()))


def main() -> int:
    from serving.cli import serve

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--api-key-file", default=None)
    p.add_argument("--profile-dir", default=None)
    p.add_argument("--no-warmup", action="store_true")
    a = p.parse_args()
    return serve(
        tiny_model,
        model_name="tiny",
        host="127.0.0.1",
        port=a.port,
        config=a.config,
        api_key=a.api_key,
        profile_dir=a.profile_dir,
        api_key_file=a.api_key_file,
        warmup=not a.no_warmup,
    )


if __name__ == "__main__":
    sys.exit(main())
