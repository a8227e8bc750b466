"""Sanity checks of a model file's shape metadata, before anything divides by it or sizes
memory from it: a zero head count, a hundred thousand layers or a NaN epsilon is a clear
ValueError naming the key, not a ZeroDivisionError or an allocation that takes the host.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

# Far above any real model (largest open models: ~130 layers, 128 heads, 16k width, 256k
# vocabulary, 10M context), far below what would exhaust a host before an error.
_INT_BOUNDS: dict[str, tuple[int, int]] = {
    "layers": (1, 1024),
    "heads": (1, 4096),
    "kv_heads": (1, 4096),
    "head_dim": (1, 4096),
    "width": (1, 1 << 17),
    "ffn": (0, 1 << 20),
    "vocab": (1, 1 << 23),
    "context": (1, 1 << 27),
    "experts": (0, 4096),
}


def check_dims(source: str, **dims: tuple[str, Any]) -> None:
    """Each `role=(key, value)`: an integer within the role's bounds.

    Args:
      source: names the file in messages ("GGUF metadata", "config.json").
      dims: role (a key of the bounds table) -> (the file's key, its value).

    Raises:
      ValueError: naming the key, its value and the accepted range.
    """
    for role, (key, value) in dims.items():
        low, high = _INT_BOUNDS[role]
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or value != int(value)
            or not low <= value <= high
        ):
            raise ValueError(f"{source}: {key} = {value!r} is not a valid value (an integer in [{low}, {high}])")


def check_positive_finite(source: str, key: str, value: Any) -> None:
    """A float the model divides by or raises to (epsilon, rope base) is finite and > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}: {key} = {value!r} is not a valid value (a finite number > 0)")


def check_heads(source: str, n_heads: int, n_kv_heads: int) -> None:
    if n_heads % n_kv_heads:
        raise ValueError(f"{source}: {n_heads} attention heads are not a multiple of {n_kv_heads} key/value heads")
