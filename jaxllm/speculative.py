"""Draft sources for speculative decoding, and the per-sequence control of how many to draft.

Verification is `jaxllm.steps.verify`: it accepts exactly the drafts that decoding without
drafts would have produced, so a draft source only changes the speed, never the tokens.

Prompt lookup (n-gram) drafting needs no weights: when the last few tokens appeared earlier in
the prompt or the output, the tokens that followed them then are proposed now. Edits, code
and quotes repeat a lot of their input; open-ended chat rarely does, so drafting turns itself
down per sequence when its drafts stop being accepted (`DraftControl`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


def prompt_lookup(tokens: Sequence[int], k: int, *, max_ngram: int = 4, min_ngram: int = 2) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
    n-gram of `tokens` (n from `max_ngram` down to `min_ngram`); [] without one."""
    if k <= 0 or len(tokens) <= min_ngram:
        return []
    arr = np.asarray(tokens, np.int64)
    for n in range(min(max_ngram, len(arr) - 1), min_ngram - 1, -1):
        suffix = arr[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every n-gram that has a successor
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence: the most local context
            return arr[start : start + k].tolist()
    return []


@dataclasses.dataclass
class NgramIndex:
    """`prompt_lookup` for one growing sequence, kept up to date token by token.

    `prompt_lookup` scans the whole text on every call: at 64 sequences of 2k tokens that
    is ~15 ms of host time a round, paid even when nothing matches (an H100's 64-wide 8B
    rounds were 33 ms slower with drafting on and no verification; docs/lab/spec-load.md).
    Here every n-gram that has a successor maps to where its latest successor starts, so a
    new token costs `max_ngram - min_ngram + 1` dict writes and a proposal a few lookups;
    the answers are `prompt_lookup`'s (tests/jaxllm/test_speculative.py).
    """

    max_ngram: int = 4
    min_ngram: int = 2
    tokens: list[int] = dataclasses.field(default_factory=list)
    _successor: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)

    def extend(self, new: Sequence[int]) -> None:
        for token in new:
            end = len(self.tokens)  # the n-grams ending just before `token` now have a successor
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._successor[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(token))

    def propose(self, k: int) -> list[int]:
        """What `prompt_lookup(self.tokens, k)` returns."""
        toks, size = self.tokens, len(self.tokens)
        if k <= 0 or size <= self.min_ngram:
            return []
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            start = self._successor.get(tuple(toks[size - n :]))
            if start is not None:
                return toks[start : start + k]
        return []


# A sequence's acceptance before it has any of its own: optimistic (a new sequence must draft
# to learn its rate), and worth this many checked drafts against what it then learns.
PRIOR_ACCEPTANCE = 0.8
PRIOR_CHECKS = 4


@dataclasses.dataclass
class DraftControl:
    """How many tokens one sequence drafts next.

    Starts at the most allowed; all accepted -> one more, none accepted -> one fewer. At zero
    the sequence rests for `rest` plain tokens, then tries one draft again, so a chat that
    never repeats pays for one wasted verification in `rest` tokens.
    """

    most: int
    k: int = -1
    resting: int = 0
    rest: int = 16
    proposed: int = 0  # drafts verified so far
    accepted: int = 0
    checked: int = 0  # drafts compared with the model's token: the accepted ones and each first miss

    def __post_init__(self) -> None:
        if self.k < 0:
            self.k = self.most

    def wanted(self) -> int:
        return 0 if self.resting > 0 else self.k

    def plain_tokens(self, n: int) -> None:
        """`n` tokens came without drafting."""
        if self.resting > 0:
            self.resting = max(0, self.resting - n)
            if self.resting == 0:
                self.k = 1

    def acceptance(self) -> float:
        """The chance that this sequence's next draft is accepted once the ones before it
        were: accepted over checked drafts (a round's drafts after its first miss are never
        compared), pulled toward `PRIOR_ACCEPTANCE` while the sequence has few checks."""
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_CHECKS) / (self.checked + PRIOR_CHECKS)

    def expected_tokens(self, drafts: int) -> float:
        """Tokens a verification round with `drafts` drafts is expected to emit for this
        sequence: 1 + a + a^2 + ... + a^drafts at its `acceptance` a."""
        a = self.acceptance()
        return sum(a**i for i in range(drafts + 1))

    def verified(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.checked += accepted + (accepted < proposed)
        if proposed == 0:
            return
        if accepted == proposed:
            self.k = min(self.most, self.k + 1)
        elif accepted == 0:
            self.k -= 1
            if self.k <= 0:
                self.k, self.resting = 0, self.rest
