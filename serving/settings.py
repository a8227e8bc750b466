"""Server settings from `configs/server.toml`: limits, sampling defaults, engine shapes.

`SettingsStore.reload()` re-reads the file and bumps a generation; a request keeps the
`Settings` object it arrived with, so a reload never changes a request midway. The
`[engine]` table is baked into compiled shapes: a reload that changes it is refused for
those fields (they keep their value) and the reload result says they need a restart.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import tomllib
from pathlib import Path
from typing import Any

from jaxllm.engine import EngineConfig
from serving.tool_calls import FORMATS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    active_requests: int = 8
    active_state_mib: int = 1024
    request_bytes: int = 1 << 20
    response_bytes: int = 1 << 20
    max_output_tokens: int = 4096
    prefill_quantum: int = 512
    prefill_chunk_seconds: float = 0.05
    starvation_seconds: float = 2.0
    prefix_cache_mib: int = 256
    prefix_cache_ttl_seconds: float = 600.0
    prefix_cache_min_tokens: int = 16
    session_ttl_seconds: float = 1800.0
    session_dir: str = ""  # sessions are saved here on a graceful stop and read back at start ("": kept in memory only)
    max_messages: int = 1024  # messages of one conversation (history included)
    max_tools: int = 128  # tools of one request
    max_schema_bytes: int = 65536  # tools plus response_format, as JSON: each compiles into a grammar
    body_seconds: float = 30.0  # a request body must arrive within this (408 after); headers: idle bound
    max_connections: int = 256  # open client connections; more are answered 503 and closed
    drain_seconds: float = 30.0  # on SIGTERM: in-flight requests finish within this; new ones get 503
    profile_max_seconds: float = 60.0  # a profiler trace stops by itself after this
    profile_max_mib: int = 1024  # no new trace while --profile-dir holds this much


@dataclasses.dataclass(frozen=True, kw_only=True)
class Defaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    tool_call_format: str = ""


_ENGINE = EngineConfig()  # the runtime's defaults are the server's


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineShape:
    """Settings baked into compiled shapes (restart to change)."""

    max_slots: int = _ENGINE.max_slots
    kv_mib: int = _ENGINE.kv_bytes >> 20
    max_seq_len: int = _ENGINE.max_seq_len
    page_size: int = _ENGINE.page_size
    chunk_buckets: tuple[int, ...] = _ENGINE.chunk_buckets
    min_ctx_pages: int = _ENGINE.min_ctx_pages
    decode_steps_per_call: int = _ENGINE.decode_steps_per_call
    decode_widths: tuple[int, ...] = _ENGINE.decode_widths
    chunk_segments: int = _ENGINE.chunk_segments
    chunk_decode_width: int = _ENGINE.chunk_decode_width
    # Speculative decoding: prompt-lookup drafts verified per sequence and round (0 = off);
    # a request's `drafts` may ask for fewer.
    max_drafts: int = _ENGINE.max_drafts
    # The research samplers (typical-p, epsilon, eta, top-nσ, DRY, XTC, mirostat) as request
    # fields: per-slot state rows and a costlier sampler in every round.
    extra_samplers: bool = _ENGINE.extra_samplers

    def __post_init__(self) -> None:
        self.engine_config()  # a bad shape fails when the settings are read, with the runtime's message

    def engine_config(self) -> EngineConfig:
        """The runtime's EngineConfig for these shapes."""
        return EngineConfig(
            max_slots=self.max_slots, kv_bytes=self.kv_mib << 20, max_seq_len=self.max_seq_len,
            page_size=self.page_size, chunk_buckets=tuple(self.chunk_buckets), min_ctx_pages=self.min_ctx_pages,
            decode_steps_per_call=self.decode_steps_per_call, decode_widths=tuple(self.decode_widths),
            chunk_segments=self.chunk_segments, chunk_decode_width=self.chunk_decode_width,
            max_drafts=self.max_drafts, extra_samplers=self.extra_samplers,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    limits: Limits = Limits()
    defaults: Defaults = Defaults()
    engine: EngineShape = EngineShape()
    generation: int = 0

    @property
    def budget_bytes(self) -> int:
        return self.limits.active_state_mib << 20


# Smallest value of each numeric setting (default 0); a value the server divides by or
# needs at least one of is refused when read, at start-up and on reload alike.
_MINIMUM: dict[str, float] = {
    "active_requests": 1, "active_state_mib": 1, "request_bytes": 1, "response_bytes": 1, "max_output_tokens": 1,
    "prefill_quantum": 1, "max_messages": 1, "max_tokens": 1, "top_k": -1, "max_connections": 1,
}
_EXCLUSIVE_ZERO = {"prefill_chunk_seconds", "top_p", "body_seconds", "profile_max_seconds"}  # must be > 0


def _check_value(name: str, value: Any, kind: Any, where: str) -> None:
    """The TOML value has the field's type (ints count as floats) and a sane range."""
    label = f"[{where}] {name} = {value!r}"
    if kind in ("int", int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind in ("float", float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    elif kind in ("bool", bool):
        ok = isinstance(value, bool)
    elif kind in ("str", str):
        ok = isinstance(value, str)
    else:  # tuple[int, ...]
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if not ok:
        raise ValueError(f"{label}: must be {str(kind).replace('tuple[int, ...]', 'a list of integers').replace('bool', 'true or false')}")
    if name == "tool_call_format" and value not in ("", *FORMATS):
        raise ValueError(f"{label}: must be one of \"\", {', '.join(FORMATS)}")
    if isinstance(value, (int, float)):
        low = _MINIMUM.get(name, 0)
        if value < low or name in _EXCLUSIVE_ZERO and value <= 0:
            raise ValueError(f"{label}: must be {'> 0' if name in _EXCLUSIVE_ZERO else f'>= {low}'}")


def _build(cls: type, table: dict[str, Any], where: str) -> Any:
    if not isinstance(table, dict):
        raise ValueError(f"[{where}] must be a table")  # noqa: TRY004 - settings errors are ValueErrors (reload's 400)
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    unknown = set(table) - set(fields)
    if unknown:
        raise ValueError(f"unknown setting(s) in [{where}]: {', '.join(sorted(unknown))}")
    for name, value in table.items():
        _check_value(name, value, fields[name], where)
    kw = {k: tuple(v) if isinstance(v, list) else float(v) if fields[k] in ("float", float) else v
          for k, v in table.items()}
    return cls(**kw)


def parse_settings(data: dict[str, Any], generation: int = 0) -> Settings:
    """Builds Settings from a parsed TOML document; raises ValueError on unknown keys."""
    unknown = set(data) - {"limits", "defaults", "engine"}
    if unknown:
        raise ValueError(f"unknown settings table(s): {', '.join(sorted(unknown))}")
    return Settings(
        limits=_build(Limits, data.get("limits", {}), "limits"),
        defaults=_build(Defaults, data.get("defaults", {}), "defaults"),
        engine=_build(EngineShape, data.get("engine", {}), "engine"),
        generation=generation,
    )


def load_settings(path: str | Path | None) -> Settings:
    if path is None:
        return Settings()
    with open(path, "rb") as f:
        return parse_settings(tomllib.load(f))


class SettingsStore:
    """The current settings and their generation; `reload` is safe from any thread."""

    def __init__(self, settings: Settings, path: str | Path | None = None):
        self._path = path
        self._lock = threading.Lock()
        self.current = settings

    def reload(self) -> dict[str, Any]:
        """Re-reads the file; returns {generation, changed, needs_restart}."""
        with self._lock:
            old = self.current
            if self._path is None:
                new = dataclasses.replace(old, generation=old.generation + 1)
            else:
                with open(self._path, "rb") as f:
                    new = parse_settings(tomllib.load(f), old.generation + 1)
            needs_restart = [
                f"engine.{f.name}"
                for f in dataclasses.fields(EngineShape)
                if getattr(new.engine, f.name) != getattr(old.engine, f.name)
            ]
            changed = [
                f"{table}.{f.name}"
                for table in ("limits", "defaults")
                for f in dataclasses.fields(getattr(old, table))
                if getattr(getattr(new, table), f.name) != getattr(getattr(old, table), f.name)
            ]
            self.current = dataclasses.replace(new, engine=old.engine)
            return {"generation": self.current.generation, "changed": changed, "needs_restart": needs_restart}
