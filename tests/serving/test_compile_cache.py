"""`jaxllm serve --compile-cache`: XLA's persistent compilation cache for warm restarts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_PROGRAM = """
import sys, jax
from serving.cli import use_compile_cache
print(use_compile_cache(sys.argv[1] if sys.argv[1] != "-" else None))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
print(jax.jit(lambda x: x * 3 + 1)(2.0))
"""


def _run(arg: str, env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, arg],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize("how", ["flag", "env", "default"])
def test_compiled_executables_land_in_the_cache(tmp_path, how):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAXLLM_CACHE"] = str(tmp_path / "jaxllm")
    target = {"flag": tmp_path / "flag", "env": tmp_path / "env", "default": tmp_path / "jaxllm" / "xla"}[how]
    if how == "env":
        env["JAX_COMPILATION_CACHE_DIR"] = str(target)
    printed_path, result = _run(str(target) if how == "flag" else "-", env)
    assert printed_path == str(target) and result == "7.0"
    assert any(target.iterdir())


def test_off_disables_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAXLLM_CACHE"] = str(tmp_path / "jaxllm")
    assert _run("off", env) == ["None", "7.0"]
    assert not (tmp_path / "jaxllm" / "xla").exists()
