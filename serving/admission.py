"""Admission: what a request reserves, whether it can ever run, and which waiting jobs start.

Two halves with one owner each. The handler thread calls the pure functions `reserve` and
`never_fits` (they read only frozen values) before it hands a `Job` to the worker. The
worker thread alone owns an `Admission`: the bytes reserved by admitted requests and the
order in which pending jobs start (`select`). Data crosses, not methods: `select` takes the
pending queue and the free capacity and returns the jobs to start; it never calls back
into the scheduler, which starts them and reports each start with `admitted`.

The policy: a job starts when the active cap, the state budget and the engine's free slots
and pages all allow it. Smaller jobs may pass one that does not fit yet, but the oldest
waits at most `starvation_seconds`: after that nothing passes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from serving.output import Output
from serving.protocol import Prepared
from serving.settings import Settings

# Host bytes per choice beside its KV pages: the sampler's workspace per vocabulary entry
# (logits, probabilities and sort keys in float32 and int32 ...), and per context position
# the token id copies (prompt, generated, the detokenizer's and the tool decoder's).
SAMPLER_BYTES_PER_VOCAB = 24
TOKEN_BYTES_PER_POSITION = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pool:
    """The engine's fixed capacity and unit costs, read once when the worker is built."""

    max_slots: int
    usable_pages: int  # the pool's pages less page 0, the trash page never handed out
    bytes_per_page: int
    recurrent_bytes: int = 0  # per sequence: hybrid models' linear-attention state (else 0)
    vocab: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reservation:
    """What a request can need at most, by term; `total` is what admission counts."""

    choices: int
    kv_pages: int  # per choice: KV pages for prompt + max_tokens
    recurrent: int  # per choice: the fixed recurrent state
    sampler: int  # per choice
    tokens: int  # per choice
    messages: int  # the request body, held twice (raw and parsed)
    response: int  # the response budget (limits.response_bytes)

    @property
    def per_choice(self) -> int:
        return self.kv_pages + self.recurrent + self.sampler + self.tokens

    @property
    def total(self) -> int:
        return self.choices * self.per_choice + self.messages + self.response


def reserve(prepared: Prepared, pages: int, pool: Pool, settings: Settings, body_bytes: int) -> Reservation:
    """The reservation of a request whose choices each need `pages` KV pages."""
    context = len(prepared.prompt) + prepared.max_tokens
    return Reservation(
        choices=prepared.n,
        kv_pages=pages * pool.bytes_per_page,
        recurrent=pool.recurrent_bytes,
        sampler=pool.vocab * SAMPLER_BYTES_PER_VOCAB,
        tokens=context * TOKEN_BYTES_PER_POSITION,
        messages=2 * body_bytes,
        response=settings.limits.response_bytes,
    )


@dataclasses.dataclass(frozen=True)
class NeverFits:
    """Why a request could not start even on an idle server (503, not worth a retry)."""

    message: str
    param: str


def never_fits(n: int, pages: int, reservation: int, pool: Pool, settings: Settings) -> NeverFits | None:
    """None when the request fits an idle server; else why not, and which parameter to lower."""
    if n > pool.max_slots:
        return NeverFits(f"n={n} is more than the {pool.max_slots} sequence slots", "n")
    if pages * n > pool.usable_pages:
        return NeverFits("the request needs more KV pages than the pool holds", "max_tokens")
    if reservation > settings.budget_bytes:
        return NeverFits(
            "the request exceeds active_state_mib; reduce max_tokens or n, or raise the state budget", "max_tokens"
        )
    return None


@dataclasses.dataclass
class Job:
    """A prepared request on its way through the worker."""

    id: str
    prepared: Prepared
    settings: Settings
    output: Output
    reservation: int  # Reservation.total
    pages: int  # per choice
    arrived: float  # handed to the worker (scheduler clock)
    received: float | None = None  # the handler started: arrived - received is body, parse, tokenize
    session_id: str | None = None
    session_messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What is free now: the engine's slots and pages, and the active requests counted."""

    free_slots: int
    free_pages: int
    active: int


class Admission:
    """The worker's admission state: reserved bytes (see the module docstring)."""

    def __init__(self) -> None:
        self.reserved = 0

    def select(self, pending: list[Job], free: Capacity, now: float) -> list[Job]:
        """The pending jobs to start now, oldest first (`pending` is left as it is)."""
        reserved, slots, pages, active = self.reserved, free.free_slots, free.free_pages, free.active
        chosen: list[Job] = []
        for i, job in enumerate(pending):
            n, lim = job.prepared.n, job.settings.limits
            fits = (
                active < lim.active_requests
                and reserved + job.reservation <= job.settings.budget_bytes
                and slots >= n
                and pages >= job.pages * n
            )
            if not fits:
                # The oldest request may be passed by smaller ones only for a bounded time.
                if i == 0 and now - job.arrived > lim.starvation_seconds:
                    break
                continue
            chosen.append(job)
            reserved, slots, pages, active = reserved + job.reservation, slots - n, pages - job.pages * n, active + 1
        return chosen

    def admitted(self, job: Job) -> None:
        self.reserved += job.reservation

    def released(self, job: Job) -> None:
        self.reserved -= job.reservation
