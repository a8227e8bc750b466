"""Per-sample measures of a comparison: likelihood and entropy under the model, diversity.

All are pure functions of token ids and logits (numpy), so they are tested against direct
counts and do not depend on how the samples were drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def generation_scores(logits: np.ndarray, prompt_len: int, generated: Sequence[int]) -> tuple[float, float]:
    """(mean negative log-likelihood of the generated tokens, mean entropy of the model's
    next-token distribution at each generated position), both at temperature 1, in nats.

    Args:
      logits: [T, V] logits of the whole sequence (prompt then generated), position t
        predicting token t + 1.
      prompt_len: tokens of prompt.
      generated: the generated ids (len n; the logits cover at least prompt_len + n - 1 rows).
    """
    n = len(generated)
    if n == 0:
        return float("nan"), float("nan")
    logp = log_softmax(logits[prompt_len - 1 : prompt_len - 1 + n])
    nll = -logp[np.arange(n), np.asarray(generated)].mean()
    entropy = -(np.exp(logp) * logp).sum(axis=-1).mean()
    return float(nll), float(entropy)
