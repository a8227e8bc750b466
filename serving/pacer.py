"""Prefill chunk sizing: under contention a prompt chunk should take about `chunk_seconds`.

A mixed round costs one decode step of the decoding slots plus the prompt chunk, so the
pacer learns both: the decode step time from rounds without prompt tokens, and the prompt
rate from the rest of each mixed round's time (rounds that compiled are never observed).
Alone, a request prefills in the largest chunks (`quantum`).
"""

from __future__ import annotations


class ChunkPacer:
    def __init__(self, quantum: int, chunk_seconds: float, *, min_chunk: int = 16, smoothing: float = 0.3):
        self.quantum = max(1, quantum)
        self.chunk_seconds = chunk_seconds
        self.min_chunk = min(min_chunk, self.quantum)
        self.smoothing = smoothing
        self.rate: float | None = None  # prompt tokens per second, exponentially smoothed
        self.decode_step: float = 0.0  # seconds of one decode step, exponentially smoothed
        self.last: int = self.quantum

    def configure(self, quantum: int, chunk_seconds: float) -> None:
        """Applies reloaded settings (the learned rates are kept)."""
        self.quantum = max(1, quantum)
        self.chunk_seconds = chunk_seconds
        self.min_chunk = min(self.min_chunk, self.quantum)

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_decode(self, seconds_per_step: float) -> None:
        """Records the time of one decode step (a round that carried no prompt tokens)."""
        if seconds_per_step > 0:
            self.decode_step = self._smooth(self.decode_step or None, seconds_per_step)

    def observe(self, tokens: int, seconds: float) -> None:
        """Records a mixed round: its prompt tokens and wall time (rounds without compiles only)."""
        if tokens <= 0 or seconds <= 0:
            return
        # The decode step riding in the same round is not prompt work; keep at least a tenth
        # of the round so a noisy decode estimate cannot make the rate explode.
        prompt_seconds = max(seconds - self.decode_step, 0.1 * seconds)
        self.rate = self._smooth(self.rate, tokens / prompt_seconds)

    def tokens(self, contended: bool) -> int:
        """The prompt tokens the next round may carry."""
        if not contended or self.rate is None:
            self.last = self.quantum
        else:
            self.last = int(min(self.quantum, max(self.min_chunk, self.rate * self.chunk_seconds)))
        return self.last
