"""Per-sample diversity measures of a comparison (likelihood and entropy come from the engine,
per drawn token: `jaxllm.research.compare`).

Pure functions of token ids, so they are tested against direct counts and do not depend on
how the samples were drawn.
"""

from __future__ import annotations

from collections.abc import Sequence


def ngrams(ids: Sequence[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]


def distinct_n(ids: Sequence[int], n: int) -> float:
    """Distinct n-grams / n-grams in one sample (Li et al., 2016); nan when there is none."""
    grams = ngrams(ids, n)
    return len(set(grams)) / len(grams) if grams else float("nan")


def repetition(ids: Sequence[int], n: int = 4) -> float:
    """Share of the sample's n-grams that repeat an earlier n-gram of the same sample."""
    grams = ngrams(ids, n)
    return 1 - len(set(grams)) / len(grams) if grams else 0.0
