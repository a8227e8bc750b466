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

from jaxllm.engine_config import EngineConfig
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


# OpenAI's sampling defaults: what a request gets when neither the settings nor the model's
# generation config (`jaxllm.loading.generation.generation_defaults`) name a value.
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Defaults:
    # Sampling defaults: unset (None) takes the model's generation config, else OpenAI's.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int = 256
    tool_call_format: str = ""


BACKENDS = ("auto", "cpu", "gpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineShape:
    """Settings baked into compiled shapes (restart to change).

    Four user settings (`slots`, `context`, `kv_mib`, `backend`) derive every shape of the
    runtime's EngineConfig (`derive_engine`); each derived field may still be set by name
    (an advanced override; None = derived). `max_slots` and `max_seq_len` are the older
    spellings of `slots` and `context`.
    """

    slots: int = 8  # sequences decoding at once
    context: int = 2048  # longest sequence, prompt plus output (positions)
    kv_mib: int = 256  # K/V cache budget; 0 = enough for every slot at full context
    backend: str = "auto"  # auto | cpu | gpu: which backend's shapes to derive (auto: the default device's)
    # Advanced overrides (None = derived; see `derive_engine`).
    max_slots: int | None = None
    max_seq_len: int | None = None
    page_size: int | None = None
    chunk_buckets: tuple[int, ...] | None = None
    min_ctx_pages: int | None = None
    decode_steps_per_call: int | None = None
    decode_widths: tuple[int, ...] | None = None
    chunk_segments: int | None = None
    chunk_decode_width: int | None = None
    # Speculative decoding: prompt-lookup drafts verified per sequence and round (0 = off);
    # a request's `drafts` may ask for fewer.
    max_drafts: int | None = None
    # A verification round's cost in steps of a plain decode call, which drafts must pay
    # (None: the figure measured on the backend for the model's kind; EngineConfig.verify_cost).
    verify_cost: float | None = None
    # The research samplers (typical-p, epsilon, eta, top-nσ, DRY, XTC, mirostat) as request
    # fields: per-slot state rows and a costlier sampler in every round.
    extra_samplers: bool = False
    # Batch-invariant rounds (`EngineConfig.batch_invariant`, `jaxllm serve --batch-invariant`):
    # same prompt + seed -> bitwise the same logits whatever else is in the batch; drafts off,
    # prefill no longer overlaps decoding (cost: docs/research.md).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"[engine] backend = {self.backend!r}: must be one of {', '.join(BACKENDS)}")
        for old, new in (("max_slots", "slots"), ("max_seq_len", "context")):
            if (
                getattr(self, old) is not None
                and getattr(self, new) != EngineShape.__dataclass_fields__[new].default
                and getattr(self, old) != getattr(self, new)
            ):
                raise ValueError(f"[engine] sets both {new} and its older spelling {old}, differently")
        # A bad shape fails when the settings are read, with the runtime's message ("auto" is
        # checked as the CPU's shapes: asking JAX for its backend here would start it).
        self.engine_config(backend="cpu")

    @property
    def n_slots(self) -> int:
        return self.max_slots if self.max_slots is not None else self.slots

    @property
    def n_context(self) -> int:
        return self.max_seq_len if self.max_seq_len is not None else self.context

    @property
    def drafts(self) -> int:
        """The most drafts a request may ask for (0 = speculative decoding off)."""
        return self.max_drafts or 0

    def overrides(self) -> dict[str, Any]:
        """The advanced fields this file sets, by EngineConfig name."""
        names = (
            "page_size",
            "chunk_buckets",
            "min_ctx_pages",
            "decode_steps_per_call",
            "decode_widths",
            "chunk_segments",
            "chunk_decode_width",
            "max_drafts",
            "verify_cost",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def engine_config(
        self, kv_bytes_per_position: int | None = None, backend: str | None = None, *, recurrent: bool = False
    ) -> EngineConfig:
        """The runtime's EngineConfig for these settings.

        Args:
          kv_bytes_per_position: the model's K/V bytes per position (`kv_bytes_per_page(cfg,
            1, opts)`); sizes the cache when `kv_mib` is 0 (None: one byte, for checks only).
          backend: the backend to derive for when `backend` is "auto" (None: JAX's default).
          recurrent: the model has linear-attention layers (see `derive_engine`).
        """
        resolved = self.backend if self.backend != "auto" else backend or _default_backend()
        return derive_engine(
            slots=self.n_slots,
            context=self.n_context,
            kv_mib=self.kv_mib,
            backend=resolved,
            kv_bytes_per_position=kv_bytes_per_position or 1,
            recurrent=recurrent,
            extra_samplers=self.extra_samplers,
            batch_invariant=self.batch_invariant,
            **self.overrides(),
        )


def _default_backend() -> str:
    import jax

    return "gpu" if jax.default_backend() == "gpu" else "cpu"


def _recurrent_buckets(buckets: tuple[int, ...], context: int) -> tuple[int, ...]:
    """The chunk buckets of a hybrid model on a many-slot GPU server: a 32-row one first and
    none past the first that holds a whole sequence.

    A hybrid's prompt chunk ends at every prefix-cache point (message boundaries), so a chat
    prompt's last chunk is often a few tokens (the assistant header after the last message);
    padded to a 512-row bucket such a round cost as much as a 512-token prompt (a lone token's
    round: 16.1 ms at 32 rows on an H100, docs/lab/hybrid-h200.md). One prompt a chunk also
    means no chunk is longer than the context.
    """
    fits = [b for b in buckets if b < context]
    whole = [b for b in buckets if b >= context][:1]
    return tuple(sorted({32, *fits, *whole}))


def derive_engine(
    *,
    slots: int,
    context: int,
    kv_mib: int,
    backend: str,
    kv_bytes_per_position: int = 1,
    recurrent: bool = False,
    **overrides: Any,
) -> EngineConfig:
    """Every EngineConfig shape from slots, context, the K/V budget and the backend.

    CPU: prefill is compute-bound, so chunk buckets at most double one another (little padding
    thrown away); few decode steps per call; one prompt per chunk (packing multiplies the
    reference attention's cost); past 4 slots a one-row decode part for a lone request. GPU: a
    small model is launch-bound, so more decode steps per call; the paged decode kernel reads
    only live pages, so one context bucket (fewer compiled variants, nothing lost); with many
    slots, doubling chunk buckets with prompts packed four to a chunk (dense models), chunk
    rounds compiled at the full decode width only, and a narrower decode part for low occupancy.

    Args:
      slots, context, kv_mib, backend ("cpu" or "gpu"): the user settings; kv_mib 0 sizes the
        cache for every slot at full context (plus a page each and the trash page).
      kv_bytes_per_position: the model's, for kv_mib 0.
      recurrent: the model has linear-attention layers (hybrid family): one prompt a chunk on
        every backend, since each packed segment runs the delta rule over the chunk's whole
        width (docs/lab/hybrid-h200.md).
      overrides: EngineConfig fields set by hand (win over the derived ones).
    """
    page = overrides.get("page_size", 16)
    if backend == "gpu":
        many = slots >= 32
        top = min(4096, max(512, 64 * slots))
        # Doubling buckets: a lone 1k prompt pads to 1024 rows, not 2048 (its first token
        # waited on a 2k prompt's FLOPs: docs/lab/2026-12.md, 8B TTFT).
        buckets = tuple(top >> k for k in (3, 2, 1, 0)) if many else (32, 128, min(top, max(context, 128)))
        if many and recurrent:
            buckets = _recurrent_buckets(buckets, context)
        shapes: dict[str, Any] = dict(
            chunk_segments=4 if many and not recurrent else 1,
            chunk_buckets=buckets,
            decode_steps_per_call=16 if slots <= 16 else 8,
            decode_widths=(1, slots // 8) if slots > 8 else (1,),
            chunk_decode_width=slots if many else 0,
            min_ctx_pages=-(-context // page),
        )
    else:
        base = (32, 128, 256, 512)
        limit = min(base[-1], context)
        shapes = dict(
            chunk_segments=1,
            chunk_buckets=tuple(b for b in base if b < limit) + (limit,),
            decode_steps_per_call=4,
            decode_widths=(1,) if slots > 4 else (),  # a one-row decode part for low occupancy
            chunk_decode_width=0,
            min_ctx_pages=8,
        )
    if kv_mib:
        kv_bytes = kv_mib << 20
    else:
        kv_bytes = (slots * (-(-context // page) + 1) + 1) * page * kv_bytes_per_position
    shapes.update(overrides)
    return EngineConfig(
        max_slots=slots,
        max_seq_len=context,
        kv_bytes=kv_bytes,
        page_size=page,
        **{k: tuple(v) if isinstance(v, list) else v for k, v in shapes.items() if k != "page_size"},
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    limits: Limits = Limits()
    defaults: Defaults = Defaults()
    engine: EngineShape = EngineShape()
    generation: int = 0
    # The loaded model's generation defaults ((name, value) pairs; see `sampling_defaults`).
    model_defaults: tuple[tuple[str, float], ...] = ()

    @property
    def budget_bytes(self) -> int:
        return self.limits.active_state_mib << 20

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """Each sampling default a request falls back to: the settings file's value, else the
        model's generation config (as vLLM does), else OpenAI's."""
        model = dict(self.model_defaults)
        out = {}
        for name, fallback in OPENAI_SAMPLING.items():
            mine = getattr(self.defaults, name)
            out[name] = mine if mine is not None else model.get(name, fallback)
        out["top_k"] = int(out["top_k"])
        return out


# Smallest value of each numeric setting (default 0); a value the server divides by or
# needs at least one of is refused when read, at start-up and on reload alike.
_MINIMUM: dict[str, float] = {
    "active_requests": 1,
    "active_state_mib": 1,
    "request_bytes": 1,
    "response_bytes": 1,
    "max_output_tokens": 1,
    "prefill_quantum": 1,
    "max_messages": 1,
    "max_tokens": 1,
    "top_k": -1,
    "max_connections": 1,
    "slots": 1,
    "context": 1,
}
_EXCLUSIVE_ZERO = {
    "prefill_chunk_seconds",
    "top_p",
    "body_seconds",
    "profile_max_seconds",
    "verify_cost",
}  # must be > 0


def _check_value(name: str, value: Any, kind: Any, where: str) -> None:
    """The TOML value has the field's type (ints count as floats) and a sane range."""
    label = f"[{where}] {name} = {value!r}"
    if isinstance(kind, str):
        kind = kind.removesuffix(" | None")  # an optional (advanced) setting: None is its absence
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
        raise ValueError(
            f"{label}: must be {str(kind).replace('tuple[int, ...]', 'a list of integers').replace('bool', 'true or false')}"
        )
    if name == "backend" and value not in BACKENDS:
        raise ValueError(f"{label}: must be one of {', '.join(BACKENDS)}")
    if name == "tool_call_format" and value not in ("", *FORMATS):
        raise ValueError(f'{label}: must be one of "", {", ".join(FORMATS)}')
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
    floats = ("float", float, "float | None")
    kw = {k: tuple(v) if isinstance(v, list) else float(v) if fields[k] in floats else v for k, v in table.items()}
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

    def __init__(
        self, settings: Settings, path: str | Path | None = None, engine_overrides: dict[str, Any] | None = None
    ):
        """`engine_overrides`: [engine] fields the command line sets (`--batch-invariant`),
        over the file's, at start and on every reload."""
        self._path = path
        self._lock = threading.Lock()
        self._engine_overrides = dict(engine_overrides or {})
        self.current = self._overridden(settings)

    def _overridden(self, settings: Settings) -> Settings:
        if not self._engine_overrides:
            return settings
        return dataclasses.replace(settings, engine=dataclasses.replace(settings.engine, **self._engine_overrides))

    def use_model_defaults(self, defaults: dict[str, float]) -> None:
        """Records the loaded model's generation defaults (kept across reloads)."""
        with self._lock:
            pairs = tuple(sorted((k, float(v)) for k, v in defaults.items() if k in OPENAI_SAMPLING))
            self.current = dataclasses.replace(self.current, model_defaults=pairs)

    def reload(self) -> dict[str, Any]:
        """Re-reads the file; returns {generation, changed, needs_restart}."""
        with self._lock:
            old = self.current
            if self._path is None:
                new = dataclasses.replace(old, generation=old.generation + 1)
            else:
                with open(self._path, "rb") as f:
                    new = self._overridden(parse_settings(tomllib.load(f), old.generation + 1))
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
            self.current = dataclasses.replace(new, engine=old.engine, model_defaults=old.model_defaults)
            return {"generation": self.current.generation, "changed": changed, "needs_restart": needs_restart}
