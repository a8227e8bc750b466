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
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API", formatter_class=runtime_cli.HELP_FORMAT)
    runtime_cli.add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--config",
        default=None,
        help="settings TOML (default: configs/server.toml of the working directory, else of the "
        "source tree jaxllm runs from; without either, the built-in settings, said in the log)",
    )
    # Read at run time, not as the default: --help would print the key.
    p.add_argument(
        "--api-key",
        default=None,
        help="API key(s) clients must send, comma-separated (default: $JAXLLM_API_KEY, else none)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="a file of further API keys, one a line ('#' starts a comment); sessions belong to the key that made them",
    )
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model's stem)")
    p.add_argument("--no-warmup", action="store_true", help="skip compiling every shape bucket before /health")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="same prompt + seed -> bitwise the same logits whatever else is in the batch (over the "
        "settings' [engine] batch_invariant); no drafts, prefill alternates with decoding: slower "
        "(docs/research.md)",
    )
    p.add_argument(
        "--compile-cache",
        default=None,
        help="XLA's persistent compilation cache, so a restart loads the warm-up's executables "
        "instead of compiling them (default: $JAX_COMPILATION_CACHE_DIR, else "
        "<jaxllm cache>/xla; 'off' disables)",
    )
    p.add_argument(
        "--profile-dir",
        default=None,
        help="enable POST /start_profile and /stop_profile, writing JAX profiler traces here",
    )
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


def serve(
    loader,
    *,
    model_name: str,
    host: str,
    port: int,
    config: str | None,
    api_key: str | None,
    warmup: bool = True,
    profile_dir: str | None = None,
    api_key_file: str | None = None,
    batch_invariant: bool = False,
) -> int:
    """Runs the server until stopped; returns the exit status (1 if the worker died)."""
    from serving.app import CappedHttpProtocol, create_app
    from serving.settings import SettingsStore, load_settings

    configure_logging()
    if config is not None and not Path(config).is_file():
        raise SystemExit(f"jaxllm serve: --config {config}: no such file")
    given = config is not None
    config = config or default_settings_path()
    if config is None:
        logging.getLogger("jaxllm").warning(
            "no --config and no configs/server.toml found: running on the built-in settings (serving/settings.py)"
        )
    else:
        logging.getLogger("jaxllm").info(
            "settings: %s%s", Path(config).resolve(), "" if given else " (no --config given)"
        )
    try:
        settings = load_settings(config)
    except (ValueError, OSError) as e:  # tomllib's errors are ValueErrors
        raise SystemExit(f"jaxllm serve: settings {config}: {e}") from None
    store = SettingsStore(settings, config, engine_overrides={"batch_invariant": True} if batch_invariant else None)
    status = {"code": 0}

    def on_death(e: BaseException) -> None:
        status["code"] = 1
        # /health already answers 503; give clients a moment to see it, then exit non-zero.
        threading.Timer(1.0, os._exit, (1,)).start()

    app = create_app(
        store,
        loader=loader,
        model_name=model_name,
        api_keys=api_keys_from(api_key, api_key_file),
        warmup=warmup,
        on_death=on_death,
        profile_dir=profile_dir,
    )
    print(f"jaxllm serving {model_name} at http://{host}:{port}/v1 (health: http://{host}:{port}/health)", flush=True)
    app.run(host=host, port=port, single_process=True, access_log=False, motd=False, protocol=CappedHttpProtocol)
    return status["code"]


def configure_logging() -> None:
    """INFO lines with a time stamp; JAX's backend probe held to warnings: it logs its failed
    probe for a TPU ("Unable to initialize backend 'tpu'") at INFO on every machine without
    one, and it reads like an error."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxllm").setLevel(logging.INFO)  # also where the root logger was set up before
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def default_settings_path() -> str | None:
    """configs/server.toml of the working directory, else of the source tree this package
    runs from (an editable install started elsewhere); None in neither."""
    for candidate in (Path("configs/server.toml"), Path(__file__).resolve().parents[1] / "configs" / "server.toml"):
        if candidate.exists():
            return str(candidate)
    return None


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
    return serve(
        loader,
        model_name=name,
        host=args.host,
        port=args.port,
        config=args.config,
        api_key=args.api_key or os.environ.get("JAXLLM_API_KEY"),
        warmup=not args.no_warmup,
        profile_dir=args.profile_dir,
        api_key_file=args.api_key_file,
        batch_invariant=args.batch_invariant,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = runtime_cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return runtime_cli.main(argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
