"""A sequence's state in your hands: prefill once, then fork, rewind, save and continue.

    state = model.prefill(ids)                      # one prefill
    a, b = model.generate_from(state.fork(2), [p.replace(seed=1), p.replace(seed=2)])
    state.rewind(len(ids) - 3).save("/tmp/s")       # drop the last 3 tokens, keep on disk
    model.generate_from(SequenceState.load("/tmp/s"), p)

A `SequenceState` is the sequence's slice of the engine's decode state as plain arrays (a
`SeqCheckpoint`: its K/V pages, and the recurrent state of hybrid models) holding every token
but the last; continuing re-feeds that last token, as a prefix-cache hit does, and samples
from there. The sampler's randomness is a function of (seed, position), so a continuation
from a state draws exactly what a fresh prefill of the same tokens with the same seed does.

Attention layers keep every position, so a state can rewind to any shorter length. A
recurrent (linear-attention) layer keeps one state for the positions it has seen: rewinding
such a model needs a snapshot taken at that length (`Model.prefill(ids, snapshots=...)`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxllm.sampling import SamplingParams
from jaxllm.state import SeqCheckpoint

from jaxllm.engine_runs import Completion, Model, research_engine, run_rows

if TYPE_CHECKING:
    from jaxllm.engine import Engine

_META = "sequence_state.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceState:
    """One sequence's decode state in hand (immutable: every method returns a new one).

    Attributes:
      tokens: the whole sequence so far.
      checkpoint: the state after `tokens[:-1]` (None for a one-token sequence).
      snapshots: states after other prefixes, by their length (for rewinding hybrid models).
      seed: the seed continuations use when their `SamplingParams.seed` is None.
    """

    tokens: tuple[int, ...]
    checkpoint: SeqCheckpoint | None
    snapshots: Mapping[int, SeqCheckpoint] = dataclasses.field(default_factory=dict)
    seed: int | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def recurrent(self) -> bool:
        """Whether the model has recurrent layers (its state cannot rewind by itself)."""
        return self.checkpoint is not None and self.checkpoint.conv is not None

    def fork(self, n: int) -> list[SequenceState]:
        """`n` continuations of the same prefill: the arrays are shared, never recomputed
        (nothing mutates them: the engine copies a state into its slot)."""
        return [dataclasses.replace(self) for _ in range(n)]

    def rewind(self, length: int) -> SequenceState:
        """The state of `tokens[:length]`.

        Raises:
          ValueError: `length` outside [1, self.length], or a model with recurrent layers
            and no snapshot of `length - 1` positions.
        """
        if not 1 <= length <= self.length:
            raise ValueError(f"rewind length must be in [1, {self.length}], got {length}")
        tokens = self.tokens[:length]
        keep = {n: c for n, c in self.snapshots.items() if n < length}
        if length == 1:
            return dataclasses.replace(self, tokens=tokens, checkpoint=None, snapshots=keep)
        if length == self.length:
            return self
        if length - 1 in self.snapshots:
            return dataclasses.replace(self, tokens=tokens, checkpoint=self.snapshots[length - 1], snapshots=keep)
        if self.recurrent:
            raise ValueError(
                f"this model has recurrent (linear-attention) layers: their state holds {self.length - 1} positions "
                f"and cannot be cut to {length - 1}; take a snapshot there (Model.prefill(ids, snapshots=[{length}])) "
                f"or prefill tokens[:{length}] again"
            )
        return dataclasses.replace(
            self, tokens=tokens, checkpoint=_prefix(self.checkpoint, tokens[:-1]), snapshots=keep
        )

    def save(self, path: str | Path) -> None:
        """Writes the state to directory `path` (orbax for the arrays, JSON for the rest)."""
        from jaxllm.loading.orbax_io import save_pytree

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        arrays = {f"state_{n}": _fields(c) for n, c in self._checkpoints().items()}
        if arrays:
            save_pytree(path / "arrays", arrays)
        meta = {
            "tokens": list(self.tokens),
            "seed": self.seed,
            "checkpoint": self.checkpoint is not None,
            "snapshots": sorted(self.snapshots),
        }
        (path / _META).write_text(json.dumps(meta))

    @classmethod
    def load(cls, path: str | Path) -> SequenceState:
        """Reads a state written by `save`."""
        from jaxllm.loading.orbax_io import restore_pytree

        path = Path(path)
        meta = json.loads((path / _META).read_text())
        arrays = restore_pytree(path / "arrays") if (path / "arrays").exists() else {}
        ckpts = {
            int(k.split("_", 1)[1]): SeqCheckpoint(**{f: np.asarray(v) for f, v in d.items()})
            for k, d in arrays.items()
        }
        tokens = tuple(meta["tokens"])
        return cls(
            tokens=tokens,
            checkpoint=ckpts[len(tokens) - 1] if meta["checkpoint"] else None,
            snapshots={n: ckpts[n] for n in meta["snapshots"]},
            seed=meta["seed"],
        )

    def _checkpoints(self) -> dict[int, SeqCheckpoint]:
        out = dict(self.snapshots)
        if self.checkpoint is not None:
            out[self.length - 1] = self.checkpoint
        return out


def _fields(ckpt: SeqCheckpoint) -> dict[str, np.ndarray]:
    return {
        f.name: np.asarray(getattr(ckpt, f.name)) for f in dataclasses.fields(ckpt) if getattr(ckpt, f.name) is not None
    }


def _prefix(ckpt: SeqCheckpoint, prefix: Sequence[int]) -> SeqCheckpoint:
    """An attention-only checkpoint cut to `prefix` (positions past it are never read)."""
    seen = np.zeros(ckpt.seen.shape, bool)
    seen[list(prefix)] = True
    return ckpt.replace(
        length=np.int32(len(prefix)),
        seen=seen,
        last_token=np.int32(0),
        n_generated=np.int32(0),
        done=np.bool_(False),
        out_counts=np.zeros(ckpt.out_counts.shape, np.int32),
    )


# ---- what Model.prefill / Model.generate_from run ----------------------------------------
def state_engine(model: Model, n_slots: int, n_positions: int) -> Engine:
    """An engine for states: a research engine (`jaxllm.research.compare.research_engine`)
    of at least 8 slots, a power of two, so prefills, continuations and comparisons of
    similar sizes share compiled rounds."""

    slots = max(8, 1 << max(n_slots - 1, 0).bit_length())
    return research_engine(model, slots, n_positions, max_slots=slots)


def prefill(
    model: Model,
    ids: Sequence[int],
    *,
    snapshots: Sequence[int] = (),
    seed: int | None = None,
    engine: Engine | None = None,
) -> SequenceState:
    """Prefills `ids` once and returns its state (see the module docstring).

    Args:
      snapshots: prefix lengths to keep states of too (what hybrid models can rewind to).
      seed: the state's default seed for continuations.
    """
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("ids is empty")
    engine = engine or state_engine(model, 1, len(ids) + 1)
    points = sorted({n - 1 for n in snapshots if 1 < n <= len(ids)} | ({len(ids) - 1} if len(ids) > 1 else set()))
    seq = engine.add(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), stops=points)
    taken: dict[int, SeqCheckpoint] = {}
    try:
        while points:
            for n in [n for n in points if engine.can_extract(seq, n)]:
                taken[n] = engine.extract(seq, n)
                points.remove(n)
            if points:
                if seq.finish_reason is not None:
                    raise RuntimeError(f"no state of {points} positions could be taken")
                engine.step()
    finally:
        engine.remove(seq)
    main = taken.pop(len(ids) - 1, None)
    return SequenceState(tokens=tuple(ids), checkpoint=main, snapshots=taken, seed=seed)


def generate_from(
    model: Model,
    states: SequenceState | Sequence[SequenceState],
    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    *,
    engine: Engine | None = None,
) -> Completion | list[Completion]:
    """Continues states, batched in one engine; one state gives one `Completion`.

    Each continuation re-feeds its state's last token and samples as a fresh prefill of the
    same tokens with the same seed would. `params` is one for all or one per state.
    """

    single = isinstance(states, SequenceState)
    states = [states] if single else list(states)
    params = list(params) if isinstance(params, Sequence) else [params] * len(states)
    if len(params) != len(states):
        raise ValueError(f"{len(params)} params for {len(states)} states")
    params = [
        p if p.seed is not None or s.seed is None else dataclasses.replace(p, seed=s.seed)
        for s, p in zip(states, params)
    ]
    longest = max(s.length + p.max_tokens for s, p in zip(states, params))
    longest = max([longest] + [c.n_pages * 16 for s in states for c in [s.checkpoint] if c is not None])
    engine = engine or state_engine(model, len(states), longest)
    rows = [(list(s.tokens), p, s.checkpoint) for s, p in zip(states, params)]
    out = [r.completion for r in run_rows(model, engine, rows)]
    return out[0] if single else out
