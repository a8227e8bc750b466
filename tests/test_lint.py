"""`ruff check` (the rules are in pyproject.toml) and `ruff format --check` pass on every package and the tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


PACKAGES = ["jaxllm", "serving", "tests", "benchmarks"]


def _ruff() -> str:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is missing: pip install -e '.[test]'"
    return ruff


def test_ruff_check():
    done = subprocess.run(
        [_ruff(), "check", "--no-cache", *PACKAGES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format():
    """One layout everywhere, so a diff shows behaviour, not whitespace: run `ruff format` to fix."""
    done = subprocess.run(
        [_ruff(), "format", "--check", "--no-cache", *PACKAGES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
