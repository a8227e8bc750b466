"""The worker thread: pending -> admit -> rounds -> frames -> finish.

Concurrency story: one thread (this one) owns the engine and the prefix cache and is the
only code that touches device arrays. Handlers hand in `Job`s through a queue and read what
the worker publishes: frames through each job's `Output`, and `metrics.state`, a dict
swapped in every round. A round is one engine call (every decoding sequence's next token
plus one paced prompt chunk); a failing round fails only its requests. If the thread dies,
`on_death` is called (the server turns /health 503 and exits non-zero).

Rounds are pipelined: the worker launches round N+1 before it collects round N, so the
host's work on round N's tokens (detokenizing, stop strings, tool calls, frames) overlaps
the device running round N+1; except after a round that completes prompts, whose first
tokens are collected before the next launch (see `run_once`). The engine plans round N+1
without round N's tokens: decode tokens stay on the device, and a sequence that stopped in
round N is skipped there by its on-device flag.

Policy (admission order with a bounded starvation wait, reservations within the budget,
prefill pacing, cancellation at each phase) is plain Python over the `EngineLike` protocol,
so tests drive it with a fake engine.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from jaxllm.engine_records import DraftStats, RoundPlan
from jaxllm.prefix_cache import PrefixCache
from jaxllm.sampling import SamplingParams
from serving import faults
from serving.admission import Admission, Capacity, Job, Pool
from serving.choice_text import ChoiceEnd, ChoiceText, ChoiceTextError, TokenizerLike, usage
from serving.metrics import Metrics
from serving.output import Done, Error
from serving.pacer import ChunkPacer
from serving.reporting import (
    PoolUse,
    RequestView,
    WorkerView,
    draft_totals,
    publish,
    report,
    stuck_reason,
    tool_call_diagnostics,
)
from serving.sessions import SessionStore
from serving.settings import SettingsStore

log = logging.getLogger("jaxllm.serve")

# How long the worker waits for first tokens to reach the socket before its next launch: the
# interpreter's switch interval, after which the event loop would have had the GIL anyway.
_FIRST_TOKEN_SEND_SECONDS = 0.005
_FIRST_TOKEN_SEND_SECONDS_UNDER_LOAD = 0.001  # when other sequences' tokens wait on the device too


def _since(moment: float | None, arrived: float) -> float | None:
    return None if moment is None else moment - arrived


class LaunchedLike(Protocol):
    """A launched round as the scheduler reads it: what the engine planned."""

    plan: RoundPlan


class EngineLike(Protocol):
    """Everything the scheduler uses of `jaxllm.engine.Engine` (tests/serving/test_engine_contract.py
    checks that Engine has each with a compatible signature, and that the scheduler uses no more)."""

    layout: Any  # jaxllm.state.StateLayout: max_slots, n_pages
    free_pages: list[int]
    free_slots: list[int]
    seqs: dict[int, Any]  # slot -> sequence (id, prompt, prefilled, pages, length, drafting)
    draft_stats: DraftStats | None
    expert_tokens: np.ndarray | None
    last_distinct_experts: tuple[float, ...]

    @property
    def max_context(self) -> int: ...
    def add(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        checkpoint: Any = None,
        cached_tokens: int = 0,
        constraint: Any = None,
        stops: Sequence[int] = (),
    ) -> Any: ...
    def can_extract(self, seq: Any, n_positions: int) -> bool: ...
    def remove(self, seq: Any) -> None: ...
    def next_prefill(self) -> Any | None: ...
    def launch(self, *, prefill_budget: int | None = None) -> LaunchedLike | None: ...
    def collect(self, handle: Any) -> list[Any]: ...
    def extract(self, seq: Any, n_positions: int | None = None) -> Any: ...
    def reset(self) -> None: ...


class CompileCounter:
    """Counts XLA compilations (jax.monitoring), so paced timings skip rounds that compiled."""

    def __init__(self) -> None:
        self.count = 0
        try:
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(self._on_event)
        except Exception:  # noqa: BLE001 - fake engines in tests run without jax monitoring
            pass

    def _on_event(self, event: str, duration: float, **_: Any) -> None:
        if "backend_compile" in event:
            self.count += 1


@dataclasses.dataclass
class Choice:
    index: int
    params: SamplingParams
    text: ChoiceText
    seq: Any = None  # None while the choice waits to fork from choice 0's prefill
    end: ChoiceEnd | None = None  # set once the choice finished

    @property
    def finished(self) -> bool:
        return self.end is not None


@dataclasses.dataclass
class InFlight:
    """A launched round not yet collected, with what the host needs to account for it."""

    handle: Any
    members: list[tuple["Active", Choice]]  # requests with a sequence in the engine at launch
    prefillers: list["Active"]  # the requests whose prompt chunks ride in the round
    launched: float
    compiled: bool  # the launch compiled a new variant (its time says nothing about speed)
    completes_prompts: bool = False  # some prompt's last chunk rides in it: it has first tokens
    epoch: int = 0  # failed rounds before its launch: one failing since means its state is gone


@dataclasses.dataclass
class Active:
    job: Job
    choices: list[Choice]
    admitted: float
    cached_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    first_launch: float | None = None  # clock of the first round carrying its prompt
    first_token: float | None = None  # clock at which its first token was handed on
    nan_tokens: int = 0  # tokens drawn from nan logits (a numerical fault; see `_on_tokens`)
    failed: bool = False
    fork_at: int | None = None  # n > 1: the other choices fork from choice 0 once it prefilled this many tokens

    @property
    def phase(self) -> str:
        ready = all(c.seq is not None and c.seq.prefilled >= len(c.seq.prompt) for c in self.choices)
        return "decode" if ready else "prefill"

    @property
    def waiting_forks(self) -> list[Choice]:
        return [c for c in self.choices if c.seq is None and not c.finished]

    @property
    def generated_tokens(self) -> int:
        return sum(len(c.text.generated) for c in self.choices)

    def view(self) -> RequestView:
        """What /v1/state and the report line show of it."""
        p = self.job.prepared
        return RequestView(
            id=self.job.id,
            phase=self.phase,
            session=self.job.session_id,
            n=p.n,
            generation=self.job.settings.generation,
            reserved_state_bytes=self.job.reservation,
            prompt_tokens=len(p.prompt),
            cached_tokens=self.cached_tokens,
            generated_tokens=self.generated_tokens,
            prefill_seconds=self.prefill_seconds,
            decode_seconds=self.decode_seconds,
            parse_seconds=None if self.job.received is None else self.job.arrived - self.job.received,
            queued_seconds=_since(self.first_launch, self.job.arrived),
            first_token_seconds=_since(self.first_token, self.job.arrived),
            first_written_seconds=_since(self.job.output.first_written, self.job.arrived),
            nan_tokens=self.nan_tokens,
            context=max((c.seq.length if c.seq is not None else 0) for c in self.choices),
        )


class Scheduler:
    """Owns the engine on one thread; see the module docstring."""

    def __init__(
        self,
        engine: EngineLike,
        tokenizer: TokenizerLike,
        settings: SettingsStore,
        metrics: Metrics,
        sessions: SessionStore,
        *,
        bytes_per_page: int,
        vocab: int,
        cache_options: bytes = b"",
        recurrent_bytes: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        on_death: Callable[[BaseException], None] | None = None,
        warmup: Callable[[], None] | None = None,
    ):
        self.engine = engine
        self.tok = tokenizer
        self.settings = settings
        self.metrics = metrics
        self.sessions = sessions
        layout = engine.layout
        self.pool = Pool(
            max_slots=layout.max_slots,
            usable_pages=layout.n_pages - 1,
            bytes_per_page=bytes_per_page,
            recurrent_bytes=recurrent_bytes,
            vocab=vocab,
        )
        self.cache_options = cache_options
        self.clock = clock
        self.on_death = on_death
        self.warmup = warmup
        lim = settings.current.limits
        self.cache: PrefixCache = PrefixCache(lim.prefix_cache_mib << 20, lim.prefix_cache_ttl_seconds, clock=clock)
        self.pacer = ChunkPacer(lim.prefill_quantum, lim.prefill_chunk_seconds)
        self.compiles = CompileCounter()
        self.inbox: queue.Queue[Job | None] = queue.Queue()
        self.pending: list[Job] = []
        self.active: list[Active] = []
        self.by_seq: dict[int, tuple[Active, Choice]] = {}
        self.admission = Admission()
        self.ready = False
        self.dead: BaseException | None = None
        self.stuck: str | None = None  # why nothing can be admitted any more (/health turns 503)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_housekeeping = 0.0
        self._generation = settings.current.generation
        self._in_flight: InFlight | None = None
        self._last_collect = 0.0
        self._failed_rounds = 0  # rounds that raised (also a Prometheus counter): InFlight.epoch

    @property
    def totals(self) -> dict[str, float]:
        """Counts since start (kept once, in the Prometheus counters)."""
        return self.metrics.totals()

    @property
    def reserved(self) -> int:
        """Bytes reserved by admitted requests (the admission's count)."""
        return self.admission.reserved

    # ---- thread ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="jaxllm-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        self.metrics.queued_requests.inc()
        self.inbox.put(job)

    def _main(self) -> None:
        try:
            if self.warmup is not None:
                self.warmup()
            self.ready = True
            self.publish()
            while not self._stop.is_set():
                self.run_once(block=True)
            self._shutdown()
        except BaseException as e:  # noqa: BLE001 - the worker never dies silently
            self.dead = e
            self.ready = False
            log.critical("worker thread died: %s\n%s", e, traceback.format_exc())
            self.publish()
            self._shutdown(f"worker died: {e}")
            if self.on_death is not None:
                self.on_death(e)

    def _shutdown(self, reason: str = "server is stopping") -> None:
        for job in self.pending:
            job.output.add(Error(503, reason))
            job.output.flush()
        self.pending.clear()
        for a in list(self.active):
            a.job.output.add(Error(503, reason))
            a.job.output.flush()
        self.active.clear()

    # ---- one iteration ---------------------------------------------------------------
    def run_once(self, *, block: bool = False) -> None:
        """Intake, cancellations, admission, one round, frames, housekeeping."""
        idle = not self.pending and not self.active and self._in_flight is None
        self._intake(block=block and idle)
        self._reap_cancelled()
        self._admit()
        if self._in_flight is not None and self._in_flight.completes_prompts:
            # First tokens are collected before the next launch. On the GPU a launch returns
            # only when the device has nearly run it (a call's thousands of kernels fill the
            # CUDA launch queue; benchmarks/pipeline_check.py), so launching first would hold
            # every first token back by a whole decode call.
            prompt_round, self._in_flight = self._in_flight, None
            self._finish(prompt_round)
            self._send_first_tokens(prompt_round)
            self._flush_outputs()  # out now, not after the next launch returns
        launched = self._launch() if self.active else None
        if self._in_flight is not None:
            self._finish(self._in_flight)
        self._in_flight = launched
        self._flush_outputs()
        now = self.clock()
        if now - self._last_housekeeping >= 1.0:
            self._housekeeping()
            self._last_housekeeping = now
        self.publish()

    def _flush_outputs(self) -> None:
        for a in self.active:
            a.job.output.flush()

    def _send_first_tokens(self, r: InFlight) -> None:
        """Flushes the streams whose first token a prompt round produced and waits (a few ms at
        most, the GIL released) until their handlers have written them. The worker's next
        launch is host work holding the GIL, so the event loop would otherwise wait out
        Python's 5 ms switch interval before writing. The device idles meanwhile (the prompt
        round was collected, nothing is launched), so where other sequences decode beside the
        new ones the wait is shorter."""
        firsts = [a.job.output for a in r.prefillers if a.first_token is not None and a.job.prepared.stream]
        for output in firsts:
            output.flush()
        alone = all(any(a is p for p in r.prefillers) for a, _ in r.members)
        deadline = time.monotonic() + (_FIRST_TOKEN_SEND_SECONDS if alone else _FIRST_TOKEN_SEND_SECONDS_UNDER_LOAD)
        for output in firsts:
            if not output.wait_sent(max(0.0, deadline - time.monotonic())):
                return

    def _intake(self, *, block: bool) -> None:
        try:
            if block:
                job = self.inbox.get(timeout=1.0)
                if job is not None:
                    self.pending.append(job)
            while True:
                job = self.inbox.get_nowait()
                if job is not None:
                    self.pending.append(job)
        except queue.Empty:
            pass

    def _reap_cancelled(self) -> None:
        keep = []
        for job in self.pending:
            if job.output.cancelled:
                # The client left before admission: it never touches the device (499).
                self.metrics.count_outcome("cancelled_before_admission")
                self.metrics.count_http_error(499)
                log.info("serve %s: 499 client went away before admission", job.id)
                job.output.add(Error(499, "request cancelled before admission"))
                job.output.flush()
            else:
                keep.append(job)
        self.pending = keep
        for a in list(self.active):
            if a.job.output.cancelled:
                self._release(a)
                self.metrics.count_outcome("cancelled")

    # ---- admission ---------------------------------------------------------------------
    def _admit(self) -> None:
        # Choices waiting to fork hold the slots and pages admission counted for them.
        forks = [(a, c) for a in self.active for c in a.waiting_forks]
        free = Capacity(
            free_slots=len(self.engine.free_slots) - len(forks),
            free_pages=len(self.engine.free_pages) - sum(a.job.pages for a, _ in forks),
            active=len(self.active),
        )
        chosen = self.admission.select(self.pending, free, self.clock())
        self.pending = [job for job in self.pending if job not in chosen]
        for job in chosen:
            self._start(job)

    def _start(self, job: Job) -> None:
        p = job.prepared
        cached, ckpt = self.cache.lookup(p.prompt, self.cache_options)
        active = Active(job=job, choices=[], admitted=self.clock(), cached_tokens=cached)
        # n > 1 prefills the prompt once: the other choices fork from choice 0's state of
        # prompt[:-1] and each recomputes the last position to draw its own first token.
        if p.n > 1 and cached < len(p.prompt) - 1:
            active.fork_at = len(p.prompt) - 1
        try:
            for i, params in enumerate(p.params):
                c = Choice(
                    index=i,
                    params=params,
                    text=ChoiceText(
                        i,
                        self.tok,
                        stop=p.stop,
                        tools=p.tools,
                        skip_special_tokens=p.skip_special_tokens,
                        logprobs=p.logprobs,
                        response_bytes=job.settings.limits.response_bytes,
                    ),
                )
                active.choices.append(c)
                if i == 0 or active.fork_at is None:
                    self._add_sequence(active, c, ckpt, cached)
        except Exception as e:  # noqa: BLE001 - engine validation: fail this request only
            for c in active.choices:
                if c.seq is not None:
                    self.engine.remove(c.seq)
                    self.by_seq.pop(c.seq.id, None)
            self.metrics.count_outcome("failed")
            job.output.add(Error(400 if isinstance(e, ValueError) else 500, str(e)))
            job.output.flush()
            return
        self.admission.admitted(job)
        self.active.append(active)
        self.metrics.admitted_requests.inc()
        self.metrics.prompt_tokens.inc(len(p.prompt))
        self.metrics.cached_tokens.inc(cached)

    def _add_sequence(self, a: Active, c: Choice, checkpoint: Any, cached: int) -> None:
        """Puts choice `c` into the engine, its first `cached` prompt tokens restored from `checkpoint`."""
        p = a.job.prepared
        # Structured output: the grammar constraint was built with the request.
        extra = {"constraint": p.constraints[c.index]} if p.constraints else {}
        stops = self._cache_points(a.job) + ([a.fork_at] if a.fork_at is not None else [])
        c.seq = self.engine.add(
            p.prompt,
            c.params,
            checkpoint=checkpoint,
            cached_tokens=cached if checkpoint is not None else 0,
            stops=stops,
            **extra,
        )
        self.by_seq[c.seq.id] = (a, c)

    def _fork(self, a: Active, seq: Any) -> None:
        """Adds the waiting choices from `seq`'s state of prompt[:fork_at] (a full prefill each
        where the engine cannot extract it)."""
        n = a.fork_at
        a.fork_at = None
        ckpt = self.engine.extract(seq, n) if self.engine.can_extract(seq, n) else None
        for c in a.waiting_forks:
            self._add_sequence(a, c, ckpt, n)

    def _release(self, a: Active) -> None:
        for c in a.choices:
            if c.seq is not None:
                self.engine.remove(c.seq)
                self.by_seq.pop(c.seq.id, None)
        self.admission.released(a.job)
        self.active.remove(a)
        a.job.output.flush()

    # ---- rounds ----------------------------------------------------------------------
    def _launch(self) -> InFlight | None:
        """Plans and dispatches the next round; returns without waiting for the device."""
        budget = None
        if self.engine.next_prefill() is not None:
            contended = len(self.active) > 1 or bool(self.pending)
            budget = self.pacer.tokens(contended)
        members = [self.by_seq[s.id] for s in self.engine.seqs.values() if s.id in self.by_seq]
        compiles = self.compiles.count
        # Timed from before the call: on the GPU a launch returns only when the device has
        # nearly run the round (see run_once), so a clock read after it would miss the round.
        started = self.clock()
        try:
            faults.inject(members, self.engine)  # test-only: a no-op unless the debug hook turns faults on
            handle = self.engine.launch(prefill_budget=budget)
            if handle is None:
                return None
            # A chunk may carry several prompts and pass several boundaries; each passed
            # boundary is checkpointed right after launch (the engine extracts exactly prompt[:b]).
            advanced = [p for p in handle.plan.prompts if p.seq_id in self.by_seq]
            for p in advanced:
                owner, choice = self.by_seq[p.seq_id]
                points = set(self._cache_points(owner.job))  # the fork point may be none
                self._checkpoint_crossed(choice.seq, tuple(b for b in p.crossed if b in points))
                if owner.fork_at is not None and owner.fork_at in p.crossed:
                    self._fork(owner, choice.seq)
        except Exception as e:  # noqa: BLE001 - a failing round fails only its requests
            self._round_failed(members, e)
            return None
        prefillers = {id(a): a for a in (self.by_seq[p.seq_id][0] for p in advanced)}  # n > 1 share a request
        for a in prefillers.values():
            if a.first_launch is None:
                a.first_launch = started
                self.metrics.queue_time.observe(started - a.job.arrived)
        return InFlight(
            handle=handle,
            members=members,
            prefillers=list(prefillers.values()),
            launched=started,
            compiled=self.compiles.count != compiles,
            completes_prompts=handle.plan.completes_prompts,
            epoch=self._failed_rounds,
        )

    @staticmethod
    def _cache_points(job: Job) -> list[int]:
        """Prompt prefixes worth a prefix-cache checkpoint: message boundaries, and all but the
        last token (an exact repeat of the prompt then recomputes one position only)."""
        p = job.prepared
        points = sorted(set(p.boundaries) | {len(p.prompt) - 1})
        return [b for b in points if b > 0 and b >= job.settings.limits.prefix_cache_min_tokens]

    def _checkpoint_crossed(self, seq: Any, crossed: tuple[int, ...]) -> None:
        """Checkpoints the prefix-cache points a round's chunk crossed (models with recurrent
        layers end their chunks there; others can extract any passed prefix)."""
        for b in crossed:
            if self.engine.can_extract(seq, b):
                self._checkpoint(seq, b)

    def _round_failed(self, members: list[tuple[Active, Choice]], e: Exception) -> None:
        """A round raised: the device state it was given (donated) may be gone, and with it the
        cache of every live sequence (the round's and any admitted since), so they all fail,
        the engine starts an empty state and the prefix cache forgets what it may have copied
        from the lost one. Queued requests and the server go on."""
        self._failed_rounds += 1  # the epoch of rounds launched from now on
        self.metrics.round_failures.inc()
        log.error(
            "round failed (%d requests in it): %s\n%s", len({id(a) for a, _ in members}), e, traceback.format_exc()
        )
        status, message = faults.round_failure(e)  # device out of memory: 503, else 500
        self.engine.reset()
        self.cache.clear()
        for a in list(self.active):
            self._fail(a, message, status)

    def _finish(self, r: InFlight) -> None:
        """Collects a launched round and turns its tokens into text and frames."""
        if r.epoch != self._failed_rounds:
            return  # launched on a device state that a failed round has since lost: nothing to read
        try:
            events = self.engine.collect(r.handle)
        except Exception as e:  # noqa: BLE001 - a failing round fails only its requests
            self._round_failed(r.members, e)
            return
        now = self.clock()
        # The device starts a round when it was launched or when the previous one ended,
        # whichever is later, so this is the round's own time once the pipeline is full.
        elapsed = now - max(r.launched, self._last_collect)
        self._last_collect = now
        self.metrics.rounds.inc()
        for distinct in self.engine.last_distinct_experts:
            if distinct:  # steps past every sequence's end route nothing
                self.metrics.distinct_experts.observe(distinct)
        plan = r.handle.plan
        prefill_tokens = plan.prefill_tokens
        self.metrics.prefilled_tokens.inc(prefill_tokens)
        if prefill_tokens:
            if not r.compiled:
                self.pacer.observe(prefill_tokens, elapsed)
            self.metrics.prefill_seconds.inc(elapsed)
            for a in r.prefillers:
                a.prefill_seconds += elapsed
        else:
            if not r.compiled:
                self.pacer.observe_decode(elapsed / plan.steps)
            self.metrics.decode_seconds.inc(elapsed)
        decoding = {id(a): a for a, c in r.members if c.seq is not None and c.seq.prefilled >= len(c.seq.prompt)}
        for a in decoding.values():
            if all(a is not p for p in r.prefillers):
                a.decode_seconds += elapsed
        for ev in events:
            entry = self.by_seq.get(ev.seq_id)
            if entry is None:  # removed (cancelled or finished) after launch
                continue
            a, c = entry
            if a.failed or a not in self.active or c.finished:  # c.finished: tokens past a stop string
                continue
            try:
                self._on_tokens(a, c, ev)
            except Exception as e:  # noqa: BLE001 - host code of one request fails that request alone
                self._host_failed(a, e)
        for a in list(self.active):
            if not a.failed and all(c.finished for c in a.choices):
                try:
                    self._complete(a)
                except Exception as e:  # noqa: BLE001 - e.g. sessions or usage: this request alone
                    self._host_failed(a, e)

    def _checkpoint(self, seq: Any, length: int) -> None:
        if self.cache.contains(seq.prompt[:length], self.cache_options):
            return
        # The engine gives a prefix exactly prompt[:length], unsampled, whatever ran since.
        ckpt = self.engine.extract(seq, length)
        self.cache.put(seq.prompt[:length], ckpt, self.cache_options)

    # ---- tokens -> text -> frames ------------------------------------------------------
    def _on_tokens(self, a: Active, c: Choice, ev: Any) -> None:
        self.metrics.generated_tokens.inc(len(ev.tokens))
        # A nan log-probability means the round's logits were nan: the token is whatever the
        # sampler's argmax made of them, not the model's. Said once per request, and counted.
        nan = sum(math.isnan(lp) for lp in ev.logprobs)
        if nan:
            if not a.nan_tokens:
                log.error("serve %s: a token was drawn from nan logits (a numerical fault in the round)", a.job.id)
            a.nan_tokens += nan
            self.metrics.nan_tokens.inc(nan)
        if a.first_token is None and len(ev.tokens):
            a.first_token = self.clock()
            self.metrics.first_token_time.observe(a.first_token - a.job.arrived)
        try:
            for frame in c.text.feed(ev.tokens, ev.logprobs, ev.top_logprobs, ev.finish_reason):
                a.job.output.add(frame)
            if not c.text.ended:
                return
            if c.seq is not None:
                self.engine.remove(c.seq)
            c.end = c.text.finish()
        except ChoiceTextError as e:
            if e.reconcile is not None:
                self.metrics.reconcile_errors.inc()
                log.error("serve %s: streamed text differs from the final decode (%s)", a.job.id, e.reconcile)
            self._fail(a, str(e), e.status)
            return
        for frame in c.end.frames:
            a.job.output.add(frame)
        tool_call_diagnostics(self.metrics, a.job.id, c.end)

    def _complete(self, a: Active) -> None:
        p = a.job.prepared
        completion = a.generated_tokens
        drafts = draft_totals(
            a.job.id, (c.seq.drafting for c in a.choices if c.seq is not None and getattr(c.seq, "drafting", None))
        )
        if a.job.session_id is not None:
            end = a.choices[0].end
            reply: dict[str, Any] = {"role": "assistant", "content": end.content or (None if end.tool_calls else "")}
            if end.tool_calls:
                reply["tool_calls"] = list(end.tool_calls)
            self.sessions.add_turn(
                a.job.session_id,
                a.job.session_messages,
                reply,
                {"prompt_tokens": len(p.prompt), "completion_tokens": completion, "cached_tokens": a.cached_tokens},
                seed=p.params[0].seed,
            )
        a.job.output.add(Done(usage(len(p.prompt), completion, a.cached_tokens, drafts), a.job.session_id))
        report(a.view(), self._pool_use(including=a))
        self._release(a)
        self.metrics.count_outcome("finished")

    def _host_failed(self, a: Active, e: Exception) -> None:
        """A request's host code (text, tool calls, finish, usage, sessions) raised: the
        request gets a 500 and its resources back; the worker and every other request go on."""
        self.metrics.host_errors.inc()
        log.error("serve %s: request failed in host code: %s\n%s", a.job.id, e, traceback.format_exc())
        if not a.failed:
            self._fail(a, f"internal error while processing the request ({type(e).__name__}: {e})"[:1000], 500)
        elif a in self.active:
            self._release(a)

    def _fail(self, a: Active, message: str, status: int = 500) -> None:
        a.failed = True
        a.job.output.add(Error(status, message))
        a.job.output.flush()
        if a in self.active:
            self._release(a)
        self.metrics.count_outcome("failed")

    # ---- housekeeping and the published snapshot ---------------------------------------
    def _housekeeping(self) -> None:
        s = self.settings.current
        if s.generation != self._generation:
            self._generation = s.generation
            self.pacer.configure(s.limits.prefill_quantum, s.limits.prefill_chunk_seconds)
            self.cache.max_bytes = s.limits.prefix_cache_mib << 20
            self.cache.ttl = s.limits.prefix_cache_ttl_seconds
            self.sessions.ttl = s.limits.session_ttl_seconds
        self.cache.expire()
        self.sessions.expire()

    def _pool_use(self, including: Active | None = None) -> PoolUse:
        """The engine's slots and pages in use; with `including`, as if that request's finished
        choices (their sequences already given back to the engine) still held theirs."""
        layout = self.engine.layout
        live = {id(s) for s in self.engine.seqs.values()}
        gone = [c.seq for c in (including.choices if including else ()) if c.seq is not None and id(c.seq) not in live]
        return PoolUse(
            max_slots=layout.max_slots,
            free_slots=max(0, len(self.engine.free_slots) - len(gone)),
            usable_pages=layout.n_pages - 1,
            free_pages=max(0, len(self.engine.free_pages) - sum(len(seq.pages) for seq in gone)),
            live_sequences=min(layout.max_slots, len(self.engine.seqs) + len(gone)),
            recurrent_bytes=self.pool.recurrent_bytes,
            max_context=self.engine.max_context,
        )

    def publish(self) -> None:
        """Swaps in a fresh host snapshot for /v1/state and the gauges (`reporting.publish`)."""
        pool = self._pool_use()
        stuck = stuck_reason(pool, busy=bool(self.active) or self._in_flight is not None)
        if stuck != self.stuck:
            if stuck:
                log.critical("the worker can no longer admit everything: %s", stuck)
            self.stuck = stuck
        live = {id(s) for s in self.engine.seqs.values()}
        publish(
            self.metrics,
            WorkerView(
                ready=self.ready,
                dead=None if self.dead is None else str(self.dead),
                stuck=self.stuck,
                settings_generation=self.settings.current.generation,
                queued=len(self.pending) + self.inbox.qsize(),
                waiting=len(self.pending),
                active=tuple(a.view() for a in self.active),
                reserved_bytes=self.reserved,
                budget_bytes=self.settings.current.budget_bytes,
                reserved_pages=sum(len(c.seq.pages) for a in self.active for c in a.choices if id(c.seq) in live),
                pool=pool,
                prefill_chunk=self.pacer.last,
                prefill_rate=self.pacer.rate,
                prefix_cache=dataclasses.asdict(self.cache.stats),
                sessions=self.sessions.stats(),
                compilations=self.compiles.count,
                draft_stats=self.engine.draft_stats,
                expert_tokens=self.engine.expert_tokens,
            ),
        )


def warmup_engine(engine: Any, *, vocab: int, progress: Callable[[int, int], None] | None = None) -> int:
    """Compiles every shape bucket before the server reports healthy; returns variants run.
    `progress(done, total)` follows the compiles."""
    return engine.warmup(progress)
