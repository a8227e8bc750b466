"""Starts a real server process on 127.0.0.1 for a test module and waits on /health."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(
    module_args: list[str], tmp: Path, config_text: str, *, health_timeout: float = 300, warmup: bool = False
) -> Iterator[dict]:
    """Runs `python -m <module_args> --port P --config C` until the block ends.

    Without `warmup` the server starts with `--no-warmup`: its rounds compile as the tests
    first run them, not every shape bucket up front (most modules use a few; warming all of
    them was most of each module's time on CI). Tests of compilations while serving warm up.

    Yields a dict with base (URL), port, config, log, tmp and proc; fails with the server's
    log if it exits or never turns healthy.
    """
    config = tmp / "server.toml"
    config.write_text(config_text)
    port = free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": os.environ.get(
            "JAX_COMPILATION_CACHE_DIR", str(Path.home() / ".cache/jaxllm/xla")
        ),
    }
    log_path = tmp / "server.log"
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", *module_args, "--port", str(port), "--config", str(config)]
            + ([] if warmup else ["--no-warmup"]),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + health_timeout
        try:
            while True:
                assert proc.poll() is None, log_path.read_text()
                try:
                    if requests.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                assert time.monotonic() < deadline, "server never became healthy:\n" + log_path.read_text()[-3000:]
                time.sleep(0.2)
            yield dict(base=base, port=port, config=config, log=log_path, tmp=tmp, proc=proc)
        finally:
            proc.terminate()
            proc.wait(30)
