"""Where a marker or a stop string starts, or may yet start, in text that is still arriving.

Streamed text must hold back a suffix that could be the start of a stop string (the stop
cuts it) or of a tool-call marker (the decoder takes it): both ask the same question.
"""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def holdback(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    return max((partial_suffix(text, m) for m in markers), default=0)


def find_first(text: str, markers: tuple[str, ...], start: int = 0) -> int | None:
    """Where the earliest of `markers` begins in `text[start:]` (an index into `text`), if any."""
    found = [i for i in (text.find(m, start) for m in markers) if i >= 0]
    return min(found) if found else None
