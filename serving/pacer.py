"""Prefill chunk sizing: under contention a chunk should take about `chunk_seconds`.

The rate (prompt tokens per second) is learned from observed rounds that carried a prompt
chunk and no compilation; alone, a request prefills in the largest chunks (`quantum`).
"""

from __future__ import annotations


class ChunkPacer:
    def __init__(self, quantum: int, chunk_seconds: float, *, min_chunk: int = 16, smoothing: float = 0.3):
        self.quantum = max(1, quantum)
        self.chunk_seconds = chunk_seconds
        self.min_chunk = min(min_chunk, self.quantum)
        self.smoothing = smoothing
        self.rate: float | None = None  # tokens per second, exponentially smoothed
        self.last: int = self.quantum

    def configure(self, quantum: int, chunk_seconds: float) -> None:
        """Applies reloaded settings (the learned rate is kept)."""
        self.quantum = max(1, quantum)
        self.chunk_seconds = chunk_seconds
        self.min_chunk = min(self.min_chunk, self.quantum)

    def observe(self, tokens: int, seconds: float) -> None:
        """Records one round's prompt tokens and wall time (rounds without compiles only)."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.rate = rate if self.rate is None else (1 - self.smoothing) * self.rate + self.smoothing * rate

    def tokens(self, contended: bool) -> int:
        """The prompt tokens the next round may carry."""
        if not contended or self.rate is None:
            self.last = self.quantum
        else:
            self.last = int(min(self.quantum, max(self.min_chunk, self.rate * self.chunk_seconds)))
        return self.last
