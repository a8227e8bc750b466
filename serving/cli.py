"""The `jaxllm` command: the runtime's subcommands plus `serve` (which needs this package)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path

from jaxllm import cli as runtime_cli


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    runtime_cli.add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--config", default=None, help="settings TOML (default: configs/server.toml if present)")
    p.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"),
                   help="API key(s) clients must send, comma-separated (default: $JAXLLM_API_KEY)")
    p.add_argument("--api-key-file", default=None,
                   help="a file of further API keys, one a line ('#' starts a comment); sessions belong to "
                        "the key that made them")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--no-warmup", action="store_true", help="skip compiling every shape bucket before /health")
    p.add_argument("--compile-cache", default=None,
                   help="XLA's persistent compilation cache, so a restart loads the warm-up's executables "
                        "instead of compiling them (default: $JAX_COMPILATION_CACHE_DIR, else "
                        "<jaxllm cache>/xla; 'off' disables)")
    p.add_argument("--profile-dir", default=None,
                   help="enable POST /start_profile and /stop_profile, writing JAX profiler traces here")
    p.set_defaults(func=run_serve)


def api_keys_from(api_key: str | None, key_file: str | None) -> list[str]:
    """The keys of --api-key (comma-separated) and of --api-key-file (one a line)."""
    keys = [k.strip() for k in (api_key or "").split(",") if k.strip()]
    if key_file:
        for line in Path(key_file).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    return keys


def serve(loader, *, model_name: str, host: str, port: int, config: str | None, api_key: str | None,
          warmup: bool = True, profile_dir: str | None = None, api_key_file: str | None = None) -> int:
    """Runs the server until stopped; returns the exit status (1 if the worker died)."""
    from serving.app import CappedHttpProtocol, create_app
    from serving.settings import SettingsStore, load_settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config is None and Path("configs/server.toml").exists():
        config = "configs/server.toml"
    store = SettingsStore(load_settings(config), config)
    status = {"code": 0}

    def on_death(e: BaseException) -> None:
        status["code"] = 1
        # /health already answers 503; give clients a moment to see it, then exit non-zero.
        threading.Timer(1.0, os._exit, (1,)).start()

    app = create_app(store, loader=loader, model_name=model_name, api_keys=api_keys_from(api_key, api_key_file),
                     warmup=warmup, on_death=on_death, profile_dir=profile_dir)
    print(f"jaxllm serving {model_name} at http://{host}:{port}/v1 (health: http://{host}:{port}/health)", flush=True)
    app.run(host=host, port=port, single_process=True, access_log=False, motd=False, protocol=CappedHttpProtocol)
    return status["code"]


def use_compile_cache(setting: str | None) -> str | None:
    """Points JAX's persistent compilation cache at `setting` (see --compile-cache); returns it."""
    import jax

    from jaxllm.loading.default_model import default_cache_dir

    path = setting or os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(default_cache_dir() / "xla")
    if path == "off":
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def run_serve(args: argparse.Namespace) -> int:
    use_compile_cache(args.compile_cache)

    def loader():
        return runtime_cli.load_from_args(args)

    name = args.served_model_name or Path(args.model).stem
    return serve(loader, model_name=name, host=args.host, port=args.port, config=args.config, api_key=args.api_key,
                 warmup=not args.no_warmup, profile_dir=args.profile_dir, api_key_file=args.api_key_file)


def build_parser() -> argparse.ArgumentParser:
    parser = runtime_cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    add_serve_parser(sub)
    from serving.bench_serve import add_bench_serve_parser

    add_bench_serve_parser(sub)
    return parser


def _alias_bench_serve(argv: list[str]) -> list[str]:
    """`jaxllm bench serve ...` is `jaxllm bench-serve ...` (vLLM's spelling).

    A rewrite rather than a nested subparser: the runtime's `bench` parser (jaxllm/) takes
    only options, and nesting would change how it parses; "serve" is never a valid value there.
    """
    if argv[:2] == ["bench", "serve"]:
        return ["bench-serve", *argv[2:]]
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = _alias_bench_serve(list(sys.argv[1:] if argv is None else argv))
    return runtime_cli.main(argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
