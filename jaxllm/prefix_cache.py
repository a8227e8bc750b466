"""Token prefix -> saved sequence state (a `SeqCheckpoint`), longest match first.

Entries are written at chat-message boundaries and prompt ends; a lookup returns the longest
stored prefix of a prompt, at most `len(prompt) - 1` tokens long so the last position is still
computed (it yields the first token's logits). Keys hash the token ids with xxhash together
with an `options` byte string naming everything else that changes the state (model, dtype).
Entries expire after `ttl` seconds unused and are evicted least-recently-used within
`max_bytes`. Not thread-safe: one thread (the server's worker) owns it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np
import xxhash


class _Sized(Protocol):
    def nbytes(self) -> int: ...


V = TypeVar("V", bound=_Sized)


def prefix_key(tokens: Sequence[int], options: bytes = b"") -> bytes:
    h = xxhash.xxh3_128()
    h.update(options)
    h.update(b"\0")
    h.update(np.asarray(tokens, np.int32).tobytes())
    return h.digest()


@dataclasses.dataclass
class _Entry(Generic[V]):
    value: V
    length: int
    nbytes: int
    used_at: float


@dataclasses.dataclass
class PrefixCacheStats:
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    inserts: int = 0
    evictions: int = 0
    expirations: int = 0


class PrefixCache(Generic[V]):
    def __init__(self, max_bytes: int, ttl: float, *, clock: Callable[[], float] = time.monotonic):
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self._entries: OrderedDict[bytes, _Entry[V]] = OrderedDict()
        self._lengths: dict[int, int] = {}  # stored prefix length -> number of entries
        self._bytes = 0
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def contains(self, tokens: Sequence[int], options: bytes = b"") -> bool:
        return prefix_key(tokens, options) in self._entries

    def lookup(self, prompt: Sequence[int], options: bytes = b"") -> tuple[int, V | None]:
        """The longest stored prefix of `prompt` (at most len - 1 tokens): (length, value)."""
        now = self.clock()
        for length in sorted(self._lengths, reverse=True):
            if length > len(prompt) - 1:
                continue
            key = prefix_key(prompt[:length], options)
            entry = self._entries.get(key)
            if entry is None:
                continue
            if now - entry.used_at > self.ttl:
                self._drop(key, expired=True)
                continue
            entry.used_at = now
            self._entries.move_to_end(key)
            self.stats.hits += 1
            self.stats.hit_tokens += length
            return length, entry.value
        self.stats.misses += 1
        return 0, None

    def put(self, tokens: Sequence[int], value: V, options: bytes = b"") -> bool:
        """Stores `value` for this exact prefix; False when it cannot fit the budget at all."""
        nbytes = value.nbytes()
        if nbytes > self.max_bytes or not tokens:
            return False
        key = prefix_key(tokens, options)
        if key in self._entries:
            self._drop(key)
        while self._bytes + nbytes > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)), evicted=True)
        self._entries[key] = _Entry(value=value, length=len(tokens), nbytes=nbytes, used_at=self.clock())
        self._lengths[len(tokens)] = self._lengths.get(len(tokens), 0) + 1
        self._bytes += nbytes
        self.stats.inserts += 1
        self._sync()
        return True

    def expire(self) -> int:
        """Drops entries unused for `ttl` seconds; returns how many."""
        now = self.clock()
        old = [k for k, e in self._entries.items() if now - e.used_at > self.ttl]
        for k in old:
            self._drop(k, expired=True)
        while self._bytes > self.max_bytes and self._entries:  # budget lowered by a reload
            self._drop(next(iter(self._entries)), evicted=True)
        return len(old)

    def clear(self) -> None:
        for k in list(self._entries):
            self._drop(k)

    def _drop(self, key: bytes, *, evicted: bool = False, expired: bool = False) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        n = self._lengths[entry.length] - 1
        if n:
            self._lengths[entry.length] = n
        else:
            del self._lengths[entry.length]
        self.stats.evictions += evicted
        self.stats.expirations += expired
        self._sync()

    def _sync(self) -> None:
        self.stats.entries = len(self._entries)
        self.stats.bytes = self._bytes
