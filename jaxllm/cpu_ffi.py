"""C++ kernels for the CPU backend as XLA FFI custom calls: built on first use, cached.

A kernel's source (`*.cc` beside the module that calls it) is compiled with the machine's C++
compiler (`$CXX`, else `c++`) against the XLA FFI headers jaxlib ships, for this CPU
(`-march=native`), and cached under the jaxllm cache directory keyed by the source, jaxlib's
version, the flags and the CPU's features, so every machine builds its own once. Without a
compiler, or if a build fails, `load` returns None (with one warning) and callers keep their
jnp path: slower, never wrong.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

from jaxllm.loading.default_model import default_cache_dir

log = logging.getLogger(__name__)

_HEADERS = Path(__file__).parent  # headers the kernels share (cpu_parallel.h)
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")


def _cpu_features() -> str:
    """The CPU's feature flags: a library built with -march=native only runs where they match."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str, source: Path, out: Path) -> None:
    """Compiles `source` into `out` (atomically: concurrent builders never see half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        tmp_lib = Path(tmp) / out.name
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{_HEADERS}", str(source), "-o", str(tmp_lib)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        os.replace(tmp_lib, out)


@functools.cache
def load(source: Path, targets: tuple[tuple[str, str], ...]) -> ctypes.CDLL | None:
    """Builds `source` (once per machine) and registers its handlers for the CPU.

    Args:
      source: the kernel's C++ file.
      targets: (FFI target name, exported handler symbol) pairs to register.

    Returns:
      The loaded library, or None where no compiler or a failed build makes that impossible.
    """
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        log.warning("no C++ compiler (CXX / c++): %s is not built, its jnp path is used", source.name)
        return None
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                *(h.read_bytes() for h in sorted(_HEADERS.glob("*.h"))),
                jaxlib.__version__.encode(),
                _cpu_features().encode(),
                " ".join(FLAGS).encode(),
                compiler.encode(),
            ]
        )
    ).hexdigest()[:16]
    lib_path = default_cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    try:
        if not lib_path.exists():
            log.info("compiling %s into %s", source.name, lib_path)
            _build(compiler, source, lib_path)
        lib = ctypes.CDLL(str(lib_path))
        for target, symbol in targets:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        log.warning("%s unavailable (%s): its jnp path is used", source.name, e)
        return None
    return lib


def on_cpu() -> bool:
    return jax.default_backend() == "cpu"
