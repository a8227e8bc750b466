"""`mypy` (the settings are [tool.mypy] in pyproject.toml) passes on the runtime package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_on_the_runtime():
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent)) or shutil.which("mypy")
    assert mypy, "mypy is missing: pip install -e '.[test]'"
    done = subprocess.run([mypy, "jaxllm"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
