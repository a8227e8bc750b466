"""Counts the executables a block of code brings into being (tests that nothing compiles after warm-up)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# A program found in the persistent compilation cache is loaded, not compiled, so it records no
# backend compile; the suite writes every program to that cache (tests/conftest.py), so a shape
# that warm-up missed but an earlier test compiled would otherwise pass unnoticed.
_PERSISTENT_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """Yields a list that collects one entry per XLA compile or persistent-cache load inside the block."""
    seen: list[str] = []

    def on_duration(event: str, duration: float, **kw) -> None:
        if event == _BACKEND_COMPILE:
            seen.append(event)

    def on_event(event: str, **kw) -> None:
        if event == _PERSISTENT_CACHE_HIT:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)
