"""The engine's host-side records: what it keeps per sequence (`Sequence`, `PausedSequence`),
what a caller may attach to one (`TokenConstraint`), and what it hands back from a round
(`Round` with its `RoundPlan` of `PromptAdvance`s, `TokenEvent`) or keeps across rounds
(`DraftStats`). Plain Python objects: planning a round never reads the device state.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from jaxllm import steps
from jaxllm.sampling import SamplingParams
from jaxllm.speculative import DraftControl, NgramIndex
from jaxllm.state import SeqCheckpoint


@dataclasses.dataclass
class Sequence:
    """Host view of one sequence in a slot."""

    id: int
    slot: int
    prompt: list[int]
    params: SamplingParams
    pages: list[int]
    seed: int = 0  # the u32 the sampler's keys derive from; kept so a resumed sequence matches
    prefilled: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    entropies: list[float] = dataclasses.field(default_factory=list)  # research engines only
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    constraint: TokenConstraint | None = None
    dispatched: int = 0  # decode steps dispatched (may run ahead of `generated`)
    # Prompt positions the caller wants to extract a prefix at (`add(stops=...)`); a launch's
    # plan names those its chunk crossed.
    extract_at: list[int] = dataclasses.field(default_factory=list)
    # Prompt positions where a prompt chunk must end: a recurrent state exists only where a
    # round stopped, so prefix-cache checkpoints of hybrid models are taken there.
    stops: list[int] = dataclasses.field(default_factory=list)
    # Hybrid models, when the caller wants prompt[:-1] (an exact repeat's checkpoint): instead
    # of a stop there (and a one-token round after it) the chunk that ends the prompt keeps
    # the state at len(prompt) - 1 in the side row (`ChunkBatch.seg_side`).
    side_point: int | None = None
    drafting: DraftControl | None = None  # None: this sequence does not draft
    lookup: NgramIndex | None = None  # its prompt-lookup index (`Engine._lookup`)
    verifying: int = 0  # tokens an in-flight verification round may emit (collect settles it)
    mtp_drafts: list[int] = dataclasses.field(default_factory=list)  # the head's drafts for the next round

    @property
    def position_bound(self) -> int:
        """Upper bound of the positions written on the device, in-flight rounds included."""
        return min(self.prefilled, len(self.prompt)) + self.dispatched

    @property
    def decoding(self) -> bool:
        return self.prefilled >= len(self.prompt) and self.finish_reason is None

    @property
    def awaiting_host(self) -> bool:
        """A constrained sequence whose drawn tokens are not all collected: its next mask
        needs them, so it sits out rounds launched before that collect."""
        drawn = self.dispatched + 1  # the first token comes with the last prompt chunk
        return (self.constraint is not None and len(self.generated) < drawn) or self.verifying > 0

    @property
    def fully_dispatched(self) -> bool:
        """Rounds already launched draw all of its `max_tokens`: another round would only
        burn a decode call on a finished slot (and delay whatever is queued behind it)."""
        return self.dispatched + 1 >= self.params.max_tokens

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)


class TokenConstraint(Protocol):
    """Host-side grammar state of a constrained sequence (structured output, forced tools)."""

    def allowed_bitmask(self) -> np.ndarray:
        """[ceil(V/32)] u32: bit v%32 of word v//32 set where token v may come next."""
        ...

    def advance(self, token: int) -> None:
        """Consumes a drawn token."""
        ...


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """New tokens of one sequence from one collected round."""

    seq_id: int
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None


@dataclasses.dataclass
class PausedSequence:
    """A sequence taken out of the engine: its state slice plus host bookkeeping."""

    checkpoint: SeqCheckpoint
    sequence: Sequence


@dataclasses.dataclass(frozen=True)
class PromptAdvance:
    """One prompt's part of a round's chunk: positions [start, end) are prefilled by it."""

    seq_id: int
    start: int
    end: int
    crossed: tuple[int, ...]  # the sequence's `extract_at` points in (start, end]
    ends_prompt: bool  # the chunk ends the prompt: the sequence draws its first token


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """What `launch` planned, so a caller never diffs the sequences to learn it."""

    prompts: tuple[PromptAdvance, ...] = ()  # the prompt chunk's members, oldest first
    decoding: tuple[int, ...] = ()  # ids of the sequences that draw tokens without a chunk
    steps: int = 1  # decode steps run one after another in the call
    multi: bool = False  # the output has a leading step axis (several steps or a verification)

    @property
    def prefill_tokens(self) -> int:
        return sum(p.end - p.start for p in self.prompts)

    @property
    def completes_prompts(self) -> bool:
        return any(p.ends_prompt for p in self.prompts)


@dataclasses.dataclass
class Round:
    """A launched round: outputs still on the device, plus what the host planned."""

    output: steps.StepOutput
    seqs: dict[int, Sequence]  # slot -> sequence as of dispatch
    plan: RoundPlan
    drafts: dict[int, int] = dataclasses.field(default_factory=dict)  # slot -> drafts verified


@dataclasses.dataclass
class DraftStats:
    """Speculative decoding since start: drafts verified and accepted at each draft position."""

    max_drafts: int
    proposed: np.ndarray = dataclasses.field(init=False)  # [K] drafts verified at position j
    accepted: np.ndarray = dataclasses.field(init=False)  # [K] of them accepted

    def __post_init__(self) -> None:
        self.proposed = np.zeros((self.max_drafts,), np.int64)
        self.accepted = np.zeros((self.max_drafts,), np.int64)

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed[:proposed] += 1
        self.accepted[:accepted] += 1

    def acceptance(self) -> list[float | None]:
        """Acceptance rate per draft position (None where nothing was drafted there yet)."""
        return [None if p == 0 else float(a / p) for p, a in zip(self.proposed, self.accepted)]
