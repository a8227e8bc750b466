"""SessionStore: the rng a turn leaves for the next, and the orbax round trip of a store."""

from __future__ import annotations

import time

from serving.sessions import SessionStore, next_rng

REPLY = {"role": "assistant", "content": "yo"}


def _turn(store: SessionStore, sid: str, seed: int | None) -> None:
    store.add_turn(sid, [{"role": "user", "content": "hi"}], REPLY, {"prompt_tokens": 3, "completion_tokens": 1}, seed)
    store.release(sid)


def test_the_next_rng_follows_the_seed_the_turn_used():
    store = SessionStore(60)
    s = store.create("key", rng=5, claimed=True)
    _turn(store, s.id, 123)  # the request's own seed replaced the session's for this turn
    assert store.claim(s.id, "key")[1] == next_rng(123)
    _turn(store, s.id, next_rng(123))
    assert store.get(s.id, "key").rng == next_rng(next_rng(123))


def test_a_store_round_trips_through_its_directory(tmp_path, monkeypatch):
    now = [1000.0]
    store = SessionStore(60, clock=lambda: now[0], directory=tmp_path / "s")
    key = "s3cret-key"
    kept = store.create(key, rng=7, claimed=True)
    _turn(store, kept.id, 7)
    stale = store.create(key, rng=8)
    assert store.persist() == 2
    on_disk = b"".join(p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file())
    assert key.encode() not in on_disk and kept.owner.encode() in on_disk  # a hash of the key, never the key
    back = SessionStore.open(60, tmp_path / "s")
    assert back.claim(kept.id, "other") is None  # still bound to its owner
    history, rng = back.claim(kept.id, key)
    assert history == [{"role": "user", "content": "hi"}, REPLY] and rng == next_rng(7)
    assert back.get(kept.id, key).usage == {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}
    assert back.get(stale.id, key) is not None
    # Idle time spans the downtime: a session last used over ttl ago (wall clock) is gone.
    now[0] += 30
    store.persist()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 45)  # 30 s idle at the save, then 45 s of downtime
    later = SessionStore.open(60, tmp_path / "s")
    assert later.get(kept.id, key) is None and later.stats()["active"] == 0
    assert SessionStore.open(60, None).persist() == 0  # no directory: memory only
