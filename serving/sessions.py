"""Sessions: a conversation kept by the server (history as published, sampler rng, usage).

Ids are random 128-bit hex strings chosen by the server. A session is bound to a hash of
the API key that created it; a request with another key sees 404. Sessions expire after
`ttl` idle seconds. A turn claims its session until its response ends: a second turn sent
meanwhile is refused (409) rather than interleaved into the history. Shared by handlers and
the worker, so every method takes the lock.

The rng: the sampler's draws are a function of (seed, position), so a sequence's whole rng
state is its seed. A session keeps the seed its next turn samples with; after each turn it
becomes `next_rng(seed that turn used)`, the request's own `seed` if it gave one. A seed
given on the first turn therefore fixes every later turn, and a replayed conversation
replays its tokens.

With a `directory` (the `[limits] session_dir` setting) the store is written there with
orbax on `persist` (the server's graceful stop) and read back by `SessionStore.open`: the
same conversation continues after a restart with the same history and rng. Only the hash
of the owner's key is written, never the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serving.errors import ApiError


def _key_hash(api_key: str | None) -> str:
    return hashlib.sha256((api_key or "").encode()).hexdigest()


def next_rng(rng: int) -> int:
    """SplitMix-style step: the seed of a session's next turn."""
    z = (rng + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0xFFFFFFFF


@dataclasses.dataclass
class Session:
    id: str
    owner: str
    rng: int
    created: float
    used_at: float
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    usage: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    )
    turns: int = 0

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "session",
            "created": int(self.created),
            "turns": self.turns,
            "messages": list(self.messages),
            "usage": dict(self.usage),
        }


class SessionBusy(Exception):
    """The session has a turn in progress (turns of one session run one at a time)."""


class SessionStore:
    def __init__(self, ttl: float, *, clock: Callable[[], float] = time.monotonic, directory: str | Path | None = None):
        self.ttl = ttl
        self.clock = clock
        self.directory = None if directory is None else Path(directory).absolute()
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._busy: set[str] = set()  # sessions with a turn in progress
        self.expired = 0
        self.created = 0

    def create(self, api_key: str | None, *, rng: int | None = None, claimed: bool = False) -> Session:
        """A new session owned by `api_key`; `claimed`: its first turn is in progress."""
        now = self.clock()
        s = Session(
            id=secrets.token_hex(16),
            owner=_key_hash(api_key),
            rng=secrets.randbits(32) if rng is None else rng,
            created=time.time(),
            used_at=now,
        )
        with self._lock:
            self._sessions[s.id] = s
            self.created += 1
            if claimed:
                self._busy.add(s.id)
        return s

    def claim(self, session_id: str, api_key: str | None) -> tuple[list[dict[str, Any]], int] | None:
        """(history copy, rng) for a new turn, which holds the session until `release`;
        None when there is no such session for this key.

        Raises:
          SessionBusy: another turn holds it (two at once would interleave their histories).
        """
        with self._lock:
            s = self._live(session_id, api_key)
            if s is None:
                return None
            if session_id in self._busy:
                raise SessionBusy(session_id)
            self._busy.add(session_id)
            return [dict(m) for m in s.messages], s.rng

    def release(self, session_id: str) -> None:
        with self._lock:
            self._busy.discard(session_id)

    def owned(self, session_id: str, api_key: str | None) -> bool:
        with self._lock:
            s = self._sessions.get(session_id)
            return s is not None and s.owner == _key_hash(api_key)

    def _live(self, session_id: str, api_key: str | None) -> Session | None:
        """The session if it exists, belongs to `api_key` and has not expired (lock held)."""
        s = self._sessions.get(session_id)
        if s is None or s.owner != _key_hash(api_key) or self.clock() - s.used_at > self.ttl:
            return None
        s.used_at = self.clock()
        return s

    def get(self, session_id: str, api_key: str | None) -> Session | None:
        with self._lock:
            return self._live(session_id, api_key)

    def delete(self, session_id: str, api_key: str | None) -> bool:
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None or s.owner != _key_hash(api_key):
                return False
            del self._sessions[session_id]
            self._busy.discard(session_id)
            return True

    def add_turn(
        self,
        session_id: str,
        new_messages: list[dict[str, Any]],
        reply: dict[str, Any],
        usage: dict[str, int],
        seed: int | None,
    ) -> None:
        """Appends a finished turn; `seed` is the seed it sampled with (the session's rng or
        the request's own), from which the next turn's rng follows."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                return
            s.messages.extend(dict(m) for m in new_messages)
            s.messages.append(reply)
            for k in s.usage:
                s.usage[k] += usage.get(k, 0)
            s.rng = next_rng(s.rng if seed is None else seed)
            s.turns += 1
            s.used_at = self.clock()

    def expire(self) -> int:
        now = self.clock()
        with self._lock:
            old = [k for k, s in self._sessions.items() if now - s.used_at > self.ttl and k not in self._busy]
            for k in old:
                del self._sessions[k]
            self.expired += len(old)
            return len(old)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"active": len(self._sessions), "created": self.created, "expired": self.expired}

    # ---- persistence ---------------------------------------------------------------------
    _FILE_VERSION = 1

    @classmethod
    def open(cls, ttl: float, directory: str | Path | None = None) -> SessionStore:
        """A store over `directory` (None: in memory only), with the sessions saved there."""
        store = cls(ttl, directory=directory or None)
        if store.directory is not None and store.directory.exists():
            store._load()
        return store

    def persist(self) -> int:
        """Writes every live session to `directory` (orbax, atomically replacing the last
        save); returns how many. A no-op without a directory."""
        if self.directory is None:
            return 0
        self.expire()
        now, wall = self.clock(), time.time()
        with self._lock:
            rows = [
                {
                    "id": s.id,
                    "owner": s.owner,
                    "rng": s.rng,
                    "created": s.created,
                    "used_wall": wall - (now - s.used_at),
                    "messages": s.messages,
                    "usage": s.usage,
                    "turns": s.turns,
                }
                for s in self._sessions.values()
            ]
        import orbax.checkpoint as ocp  # only servers that persist pay for the import

        self.directory.parent.mkdir(parents=True, exist_ok=True)
        with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
            ckptr.save(
                self.directory, args=ocp.args.JsonSave({"version": self._FILE_VERSION, "sessions": rows}), force=True
            )
        return len(rows)

    def _load(self) -> None:
        import orbax.checkpoint as ocp

        with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
            data = ckptr.restore(self.directory, args=ocp.args.JsonRestore())
        if data.get("version") != self._FILE_VERSION:
            raise ValueError(
                f"{self.directory}: sessions saved in format {data.get('version')!r}, "
                f"this server reads {self._FILE_VERSION}"
            )
        now, wall = self.clock(), time.time()
        with self._lock:
            for r in data["sessions"]:
                # Idle time spans the downtime: a session expires `ttl` after its last use.
                s = Session(
                    id=r["id"],
                    owner=r["owner"],
                    rng=int(r["rng"]),
                    created=float(r["created"]),
                    used_at=now - max(0.0, wall - float(r["used_wall"])),
                    messages=list(r["messages"]),
                    usage={k: int(v) for k, v in r["usage"].items()},
                    turns=int(r["turns"]),
                )
                self._sessions[s.id] = s
        self.expire()


class SessionTurn:
    """One request's hold on a session: an existing session is claimed (one turn at a time,
    409 otherwise) and released when the response ends; a new one is created only once the
    request is accepted, and deleted again if it fails before its first turn."""

    def __init__(
        self,
        store: SessionStore,
        key: str | None,
        session_id: str | None,
        history: list | None,
        seed: int | None,
        new: bool,
    ):
        self.store, self.key, self.id, self.history, self.seed, self.new = store, key, session_id, history, seed, new
        self.completed = False

    @classmethod
    def open(cls, store: SessionStore, key: str | None, sess: Any) -> SessionTurn:
        if sess in (None, False):
            return cls(store, key, None, None, None, False)
        if sess is True or sess == "new":
            return cls(store, key, None, [], secrets.randbits(32), True)
        if not isinstance(sess, str):
            raise ApiError(400, "'session' must be true, \"new\" or a session id", param="session")
        try:
            snap = store.claim(sess, key)
        except SessionBusy:
            raise ApiError(
                409,
                f"session '{sess}' has a turn in progress; send the next turn after it ends",
                type="invalid_request_error",
                param="session",
                code="session_busy",
            ) from None
        if snap is None:
            raise ApiError(
                404, f"session '{sess}' does not exist (or expired)", param="session", code="session_not_found"
            )
        history, seed = snap
        return cls(store, key, sess, history, seed, False)

    def accepted(self) -> None:
        """The request passed validation and admission checks: a new session exists from now."""
        if self.new:
            self.id = self.store.create(self.key, rng=self.seed, claimed=True).id

    def close(self) -> None:
        if self.id is None:
            return
        if self.new and not self.completed:
            self.store.delete(self.id, self.key)
        else:
            self.store.release(self.id)
