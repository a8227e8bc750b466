"""Scheduler policy with a fake engine whose outputs can be worked out by hand.

The fake engine emits token `100 + position` for every decoding sequence each round and
prefills at most `prefill_budget` prompt tokens of the oldest prefilling sequence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from jaxllm.engine_records import PromptAdvance, RoundPlan
from jaxllm.prefix_cache import PrefixCache
from jaxllm.sampling import SamplingParams
from serving.metrics import Metrics
from serving.output import Delta, Done, Error, Finish, Output
from serving.pacer import ChunkPacer
from serving.protocol import Prepared
from serving.scheduler import Job, Scheduler
from serving.sessions import SessionStore
from serving.settings import Limits, Settings, SettingsStore


@dataclasses.dataclass
class FakeSeq:
    id: int
    slot: int
    prompt: list[int]
    params: SamplingParams
    pages: list[int]
    prefilled: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    extract_at: list[int] = dataclasses.field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)


class FakeEngine:
    def __init__(self, slots: int = 4, pages: int = 64, page_size: int = 4):
        self.layout = SimpleNamespace(max_slots=slots, n_pages=pages + 1, page_size=page_size)
        self.free_slots = list(range(slots))
        self.free_pages = list(range(pages, 0, -1))
        self.seqs: dict[int, FakeSeq] = {}
        self.next_id = 0
        self.added: list[list[int]] = []
        self.budgets: list[int | None] = []
        self.fail_next = False
        self.calls: list[str] = []
        self.token_offset: dict[int, int] = {}  # seq id -> shift of its tokens
        self.nan_logits: set[int] = set()  # seq ids whose rounds give nan logits (a device fault)

    max_context = 1000
    draft_stats = None
    expert_tokens = None
    last_distinct_experts = ()

    def pages_needed(self, n: int) -> int:
        return -(-n // self.layout.page_size)

    def can_admit(self, n: int) -> bool:
        return bool(self.free_slots) and self.pages_needed(n) <= len(self.free_pages)

    def add(self, prompt, params, *, checkpoint=None, cached_tokens=0, stops=()):
        slot = self.free_slots.pop(0)
        pages = [self.free_pages.pop() for _ in range(self.pages_needed(len(prompt) + params.max_tokens))]
        seq = FakeSeq(
            self.next_id,
            slot,
            list(prompt),
            params,
            pages,
            prefilled=cached_tokens if checkpoint else 0,
            extract_at=sorted({b for b in stops if 0 < b < len(prompt)}),
        )
        self.next_id += 1
        self.seqs[slot] = seq
        self.added.append(list(prompt))
        return seq

    def remove(self, seq):
        if self.seqs.get(seq.slot) is seq:
            del self.seqs[seq.slot]
            self.free_pages.extend(seq.pages)
            self.free_slots.append(seq.slot)

    def extract(self, seq, n):
        return SimpleNamespace(nbytes=lambda: 10, n=n)

    def reset(self):
        self.resets = getattr(self, "resets", 0) + 1
        for seq in list(self.seqs.values()):
            self.remove(seq)

    def can_extract(self, seq, n):
        return 0 < n <= min(seq.prefilled, len(seq.prompt))

    def next_prefill(self):
        prefilling = [s for s in self.seqs.values() if s.prefilled < len(s.prompt)]
        return min(prefilling, key=lambda s: s.id) if prefilling else None

    def launch(self, *, prefill_budget=None):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        self.budgets.append(prefill_budget)
        self.calls.append("launch")
        decoding = [s for s in self.seqs.values() if s.prefilled >= len(s.prompt) and s.finish_reason is None]
        prefilling = [s for s in self.seqs.values() if s.prefilled < len(s.prompt)]
        if not decoding and not prefilling:
            return None
        prompts = []
        drawing = list(decoding)
        if prefilling:
            s = min(prefilling, key=lambda s: s.id)
            start = s.prefilled
            s.prefilled += min(prefill_budget or 8, len(s.prompt) - start)
            ends = s.prefilled == len(s.prompt)
            prompts.append(
                PromptAdvance(
                    s.id, start, s.prefilled, tuple(b for b in s.extract_at if start < b <= s.prefilled), ends
                )
            )
            if ends:
                drawing.append(s)
        plan = RoundPlan(prompts=tuple(prompts), decoding=tuple(s.id for s in decoding))
        return SimpleNamespace(plan=plan, decoding=drawing)

    def collect(self, handle):
        events = []
        for s in handle.decoding:
            self.calls.append("collect")
            if s.finish_reason is not None:
                continue  # stopped on the device in an earlier round (a removed one still runs)
            t = 100 + s.length + self.token_offset.get(s.id, 0)
            s.generated.append(t)
            reason = "length" if len(s.generated) >= s.params.max_tokens else None
            s.finish_reason = reason
            events.append(
                SimpleNamespace(
                    seq_id=s.id,
                    tokens=[t],
                    logprobs=[float("nan") if s.id in self.nan_logits else 0.0],
                    top_logprobs=[[]],
                    finish_reason=reason,
                )
            )
        return events


class FakeDetok:
    def __init__(self):
        self.ids = []

    def feed(self, t):
        self.ids.append(t)
        return f"<{t}>"

    def flush(self):
        return ""


class FakeTok:
    eos_ids = frozenset({2})

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{t}>" for t in ids if t not in self.eos_ids)

    def detokenizer(self, skip_special_tokens=True):
        return FakeDetok()

    def token_text(self, t):
        return f"<{t}>"


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def make(limits: Limits, engine: FakeEngine | None = None):
    engine = engine or FakeEngine()
    clock = Clock()
    store = SettingsStore(Settings(limits=limits))
    sched = Scheduler(engine, FakeTok(), store, Metrics(), SessionStore(60), bytes_per_page=1, vocab=1000, clock=clock)
    return sched, engine, clock


def job(
    sched,
    loop,
    name: str,
    prompt_len: int = 4,
    max_tokens: int = 3,
    reservation: int = 10,
    stop=(),
    stream=False,
    parse_seconds: float | None = None,
):
    prepared = Prepared(
        kind="completion",
        model="m",
        prompt=list(range(10, 10 + prompt_len)),
        boundaries=[],
        params=[SamplingParams(max_tokens=max_tokens)],
        stop=stop,
        stream=stream,
    )
    j = Job(
        id=name,
        prepared=prepared,
        settings=sched.settings.current,
        output=Output(loop, clock=sched.clock),
        reservation=reservation,
        pages=-(-(prompt_len + max_tokens) // 4),
        arrived=sched.clock(),
        received=None if parse_seconds is None else sched.clock() - parse_seconds,
    )
    sched.submit(j)
    return j


def frames(loop, j) -> list:
    loop.run_until_complete(asyncio.sleep(0))
    out = []
    while not j.output._queue.empty():
        out.extend(j.output._queue.get_nowait())
    return out


def run_until_idle(sched, limit=100):
    for _ in range(limit):
        sched.run_once()
        if not sched.active and not sched.pending and sched.inbox.empty():
            return
    raise AssertionError("scheduler did not go idle")


def test_tokens_and_usage_worked_out_by_hand(loop):
    sched, engine, _ = make(Limits())
    j = job(sched, loop, "a", prompt_len=4, max_tokens=3)
    run_until_idle(sched)
    fs = frames(loop, j)
    text = "".join(f.text for f in fs if isinstance(f, Delta))
    assert text == "<104><105><106>"  # token 100 + position, positions 4, 5, 6
    (fin,) = [f for f in fs if isinstance(f, Finish)]
    assert fin.reason == "length" and fin.text == text
    assert fs[-1].usage["completion_tokens"] == 3 and fs[-1].usage["prompt_tokens"] == 4
    assert sched.reserved == 0 and not engine.seqs


def test_rounds_are_pipelined_and_tokens_past_a_stop_are_dropped(loop):
    sched, engine, _ = make(Limits())
    j = job(sched, loop, "a", prompt_len=4, max_tokens=6, stop=("<106>",))
    j.prepared.params.append(SamplingParams(max_tokens=6))  # n = 2; choice 1's tokens never hit the stop
    engine.token_offset[1] = 50
    unsent_at_launch = []
    launch = engine.launch
    engine.launch = lambda **kw: unsent_at_launch.append(len(j.output._buffer)) or launch(**kw)
    run_until_idle(sched)
    assert unsent_at_launch[1] == 0  # the first tokens were flushed before the next launch
    # The round that completes a prompt is collected before the next launch (its first token
    # goes out at once); decode rounds are pipelined: round N+1 launched before N is collected.
    # (The fake engine logs one "collect" per decoding sequence of the collected round.)
    assert engine.calls[:2] == ["launch", "collect"]
    assert any(engine.calls[i : i + 3] == ["launch", "launch", "collect"] for i in range(len(engine.calls)))
    fs = frames(loop, j)
    finishes = sorted((f for f in fs if isinstance(f, Finish)), key=lambda f: f.index)
    assert [(f.index, f.reason) for f in finishes] == [(0, "stop"), (1, "length")]
    assert finishes[0].text == "<104><105>"
    # Choice 0's stop string appeared while a round with its next token was in flight: that
    # token is dropped, not published or counted.
    assert fs[-1].usage["completion_tokens"] == 3 + 6


def test_a_streamed_first_token_is_written_before_the_next_launch(caplog):
    """The worker's next launch is host work holding the GIL, so the event loop could write a
    first token only after it: the worker waits (GIL released) until the handler wrote it.
    The handler here takes 2 ms to write, inside the worker's 5 ms bound; the report line puts
    its write on the request's timeline (the fake clock moved 7 ms meanwhile), after the 3 ms
    the request took to parse before it reached the worker."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        sched, engine, clock = make(Limits())
        j = job(sched, loop, "a", prompt_len=4, max_tokens=4, stream=True, parse_seconds=0.003)
        written: list[int] = []  # launches made when the handler wrote its first frames

        async def handler():
            await j.output.next_frames()
            await asyncio.sleep(0.002)
            written.append(engine.calls.count("launch"))
            clock.t += 0.007  # the worker waits meanwhile: nothing else reads the clock
            j.output.wrote_text()
            j.output.sent()

        writing = asyncio.run_coroutine_threadsafe(handler(), loop)
        with caplog.at_level("INFO", logger="jaxllm.serve"):
            run_until_idle(sched)
        writing.result(timeout=5)
        assert written == [1]  # only the prompt round had launched
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serve a: prefill")]
        assert line.endswith("| parsed in 3.0 ms | first token 0.0 ms (queued 0.0 ms, written 7.0 ms)"), line
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_round_time_counts_a_launch_that_blocks(loop):
    """On the GPU `engine.launch` returns only when the device has nearly run the round: the
    round's time (the request's prefill time, the pacer's rate) must include the call."""
    sched, engine, clock = make(Limits())
    launch = engine.launch

    def blocking_launch(**kw):
        handle = launch(**kw)
        clock.t += 0.25  # the device runs the round while the call blocks
        return handle

    engine.launch = blocking_launch
    job(sched, loop, "a", prompt_len=4, max_tokens=2)
    run_until_idle(sched)
    assert sched.totals["prefill_seconds"] == pytest.approx(0.25)
    assert sched.pacer.rate == pytest.approx(4 / 0.25)


def test_queue_time_and_first_token_time_are_worked_out_from_arrival(loop, caplog):
    """A request that arrives, waits 0.1 s for the worker, then rides a prompt round that
    blocks 0.25 s: queued 100 ms, first token 350 ms, in the histograms and its report line."""
    sched, engine, clock = make(Limits())
    launch = engine.launch

    def blocking_launch(**kw):
        handle = launch(**kw)
        clock.t += 0.25
        return handle

    engine.launch = blocking_launch
    job(sched, loop, "timed", prompt_len=4, max_tokens=2)
    clock.t += 0.1
    with caplog.at_level("INFO", logger="jaxllm.serve"):
        run_until_idle(sched)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serve timed: prefill")]
    assert line.endswith("| first token 350.0 ms (queued 100.0 ms)"), line
    for name, value in (("jaxllm_request_queue_seconds", 0.1), ("jaxllm_time_to_first_token_seconds", 0.35)):
        assert sched.metrics.registry.get_sample_value(f"{name}_count") == 1
        assert sched.metrics.registry.get_sample_value(f"{name}_sum") == pytest.approx(value)


def test_budget_and_active_cap_admission_order(loop):
    sched, engine, _ = make(Limits(active_requests=2, active_state_mib=1))
    budget = 1 << 20
    jobs = [job(sched, loop, f"r{i}", reservation=budget // 2, max_tokens=50) for i in range(3)]
    sched.run_once()
    assert [a.job.id for a in sched.active] == ["r0", "r1"]
    assert [p.id for p in sched.pending] == ["r2"]
    assert sched.reserved == budget
    run_until_idle(sched, 500)
    assert all(isinstance(frames(loop, j)[-1], Done) for j in jobs)
    assert sched.reserved == 0


def test_smaller_passes_larger_but_not_forever(loop):
    sched, engine, clock = make(Limits(active_requests=8, active_state_mib=1, starvation_seconds=5))
    mib = 1 << 20
    job(sched, loop, "running", reservation=mib // 2, max_tokens=100)
    sched.run_once()
    big = job(sched, loop, "big", reservation=mib // 2 + 1)
    small1 = job(sched, loop, "small1", reservation=10, max_tokens=100)
    sched.run_once()
    assert {a.job.id for a in sched.active} == {"running", "small1"}  # small passes big
    clock.t = 10.0  # big has now waited past the starvation bound
    small2 = job(sched, loop, "small2", reservation=10)
    sched.run_once()
    assert [p.id for p in sched.pending] == ["big", "small2"]  # nobody passes big any more
    del big, small1, small2


def test_cancel_while_queued_never_touches_engine(loop):
    sched, engine, _ = make(Limits(active_requests=1))
    first = job(sched, loop, "first", max_tokens=20)
    sched.run_once()
    queued = job(sched, loop, "queued")
    sched.run_once()
    queued.output.cancel()
    sched.run_once()
    (err,) = frames(loop, queued)
    assert isinstance(err, Error) and err.status == 499
    assert len(engine.added) == 1 and sched.totals["cancelled_queued"] == 1
    del first


@pytest.mark.parametrize("phase_rounds", [0, 1, 5])
def test_cancel_in_prefill_or_decode_frees_everything(loop, phase_rounds):
    sched, engine, _ = make(Limits(prefill_quantum=4))
    j = job(sched, loop, "c", prompt_len=12, max_tokens=50)
    for _ in range(1 + phase_rounds):
        sched.run_once()
    j.output.cancel()
    sched.run_once()
    assert not sched.active and sched.reserved == 0 and not engine.seqs
    assert len(engine.free_pages) == 64 and sched.totals["cancelled"] == 1


def test_failing_round_fails_only_its_requests(loop):
    sched, engine, _ = make(Limits())
    a = job(sched, loop, "a")
    engine.fail_next = True
    sched.run_once()
    assert any(isinstance(f, Error) and f.status == 500 for f in frames(loop, a))
    assert engine.resets == 1  # the donated device state may be gone: the engine starts a fresh one
    b = job(sched, loop, "b")
    run_until_idle(sched)
    assert isinstance(frames(loop, b)[-1], Done)
    assert sched.reserved == 0 and not engine.seqs


def test_a_round_launched_before_a_failure_is_not_read(loop):
    # Round N+1 is launched before round N is collected; when N fails, N+1 ran on the state N
    # lost, so it is dropped unread, and a request admitted after the failure runs normally.
    sched, engine, _ = make(Limits())
    a = job(sched, loop, "a", max_tokens=5)
    sched.run_once()
    sched.run_once()
    collect = engine.collect

    def failing(handle):
        engine.collect = collect
        raise RuntimeError("device error surfacing at the read")

    engine.collect = failing
    sched.run_once()
    assert any(isinstance(f, Error) and f.status == 500 for f in frames(loop, a))
    assert sched._in_flight is not None and sched._in_flight.epoch != sched.totals["failed_rounds"]
    b = job(sched, loop, "b")
    run_until_idle(sched)
    assert isinstance(frames(loop, b)[-1], Done) and not any(isinstance(f, Error) for f in frames(loop, b))
    assert sched.reserved == 0 and not engine.seqs and sched.totals["failed_rounds"] == 1


def test_stop_string_is_never_leaked(loop):
    sched, engine, _ = make(Limits())
    j = job(sched, loop, "s", prompt_len=4, max_tokens=10, stop=("><106",))
    run_until_idle(sched)
    fs = frames(loop, j)
    streamed = "".join(f.text for f in fs if isinstance(f, Delta))
    (fin,) = [f for f in fs if isinstance(f, Finish)]
    assert streamed == fin.text == "<104><105"
    assert fin.reason == "stop" and not engine.seqs


def test_pacing_alone_uses_quantum_and_contended_uses_learned_rate(loop):
    sched, engine, clock = make(Limits(prefill_quantum=64, prefill_chunk_seconds=0.5))
    sched.pacer.observe(40, 1.0)  # 40 tok/s -> 20 tokens per 0.5 s chunk
    job(sched, loop, "alone", prompt_len=100, max_tokens=1)
    sched.run_once()
    assert engine.budgets[-1] == 64
    job(sched, loop, "other", prompt_len=4, max_tokens=1)
    sched.run_once()
    assert engine.budgets[-1] == 20


def test_pacer_bounds():
    p = ChunkPacer(512, 0.1, min_chunk=16)
    assert p.tokens(contended=True) == 512  # nothing learned yet
    p.observe(1000, 1.0)
    assert p.tokens(contended=True) == 100
    assert p.tokens(contended=False) == 512
    p.observe(1_000_000, 1.0)
    assert p.tokens(contended=True) == 512
    p2 = ChunkPacer(512, 0.1, min_chunk=16)
    p2.observe(10, 1.0)
    assert p2.tokens(contended=True) == 16


class Blob:
    def __init__(self, n):
        self.n = n

    def nbytes(self):
        return self.n


def test_prefix_cache_longest_match_lru_ttl():
    clock = Clock()
    cache = PrefixCache(100, ttl=10, clock=clock)
    prompt = list(range(50))
    cache.put(prompt[:10], Blob(30))
    cache.put(prompt[:20], Blob(30))
    cache.put(prompt, Blob(30))  # whole prompt: never returned for the same prompt (len - 1 cap)
    n, v = cache.lookup(prompt)
    assert n == 20
    assert cache.lookup(prompt + [7])[0] == 50
    assert cache.lookup(prompt, options=b"other")[0] == 0
    cache.put([9, 9, 9], Blob(30))  # evicts the least recently used (length 10)
    assert not cache.contains(prompt[:10]) and cache.stats.evictions == 1
    clock.t = 11
    assert cache.expire() == 3 and len(cache) == 0 and cache.nbytes == 0


def test_expert_activity_summary():
    from serving.reporting import expert_activity

    assert expert_activity(None) is None
    assert expert_activity(np.zeros((2, 0), np.int64)) is None
    summary = expert_activity(np.array([[3, 1, 0, 0], [1, 1, 1, 1]]))
    assert summary["tokens_routed"] == 8 and summary["per_expert"] == [4, 2, 1, 1]
    assert summary["idle_experts"] == 0
    assert summary["max_over_mean_per_layer"] == [3.0, 1.0]


def test_pacer_discounts_the_decode_step_riding_in_mixed_rounds():
    """A mixed round = one decode step + the chunk; only the chunk's share sets the rate."""
    p = ChunkPacer(512, 0.05, min_chunk=16)
    for _ in range(20):
        p.observe_decode(0.100)  # decode steps of the other requests: 100 ms each
        p.observe(64, 0.100 + 64 / 1000)  # the chunk itself runs at 1000 tok/s
    assert abs(p.rate - 1000) < 1
    assert p.tokens(contended=True) == 50  # 0.05 s of prompt work, not the floor


def test_worker_death_is_never_silent(loop):
    """A fatal error outside a round kills the thread loudly: requests get an error, health sees
    `dead`, and the on_death hook (which makes the process exit non-zero) runs."""
    engine = FakeEngine()
    died = []
    store = SettingsStore(Settings(limits=Limits()))
    sched = Scheduler(
        engine,
        FakeTok(),
        store,
        Metrics(),
        SessionStore(60),
        bytes_per_page=1,
        vocab=1000,
        clock=Clock(),
        on_death=died.append,
    )

    def broken_next_prefill():  # planning happens outside the round's error handling
        raise MemoryError("host out of memory")

    engine.next_prefill = broken_next_prefill
    j = job(sched, loop, "a")
    sched.start()
    sched._thread.join(10)
    assert not sched._thread.is_alive()
    assert isinstance(sched.dead, MemoryError) and died and died[0] is sched.dead
    assert sched.ready is False
    errors = [f for f in frames(loop, j) if isinstance(f, Error)]
    assert errors and errors[0].status == 503 and "worker died" in errors[0].message


def test_host_code_error_fails_only_its_request(loop):
    """An exception in one request's text pipeline (here the detokenizer) fails that request with
    a 500 and frees its slot; the worker goes on and the other request finishes."""
    sched, engine, _ = make(Limits())

    class Exploding(FakeDetok):
        def feed(self, t):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    good = FakeTok()
    sched.tok = SimpleNamespace(
        eos_ids=good.eos_ids,
        decode=good.decode,
        token_text=good.token_text,
        detokenizer=lambda skip_special_tokens=True: Exploding(),
    )
    bad = job(sched, loop, "bad")
    sched.run_once()  # admitted with the exploding detokenizer
    sched.tok = good
    ok = job(sched, loop, "ok")
    run_until_idle(sched)
    errors = [f for f in frames(loop, bad) if isinstance(f, Error)]
    assert errors and errors[0].status == 500 and "UnicodeDecodeError" in errors[0].message
    assert isinstance(frames(loop, ok)[-1], Done)
    assert sched.totals["host_errors"] == 1 and sched.reserved == 0 and not engine.seqs and len(engine.free_slots) == 4


def test_slots_held_by_no_request_turn_health_stuck(loop):
    """An engine that keeps a slot after a failed add: the worker reports it cannot admit
    everything (the server's /health then answers 503 with the reason)."""
    sched, engine, _ = make(Limits())
    real_add = engine.add

    def leaky_add(prompt, params, **kw):
        engine.free_slots.pop(0)
        raise OverflowError("top_k out of range")

    engine.add = leaky_add
    j = job(sched, loop, "a")
    run_until_idle(sched)
    assert any(isinstance(f, Error) for f in frames(loop, j))
    assert sched.stuck and "1 of 4 sequence slots" in sched.stuck and sched.metrics.state["stuck"] == sched.stuck
    engine.add = real_add
    engine.free_slots = list(range(4))
    sched.run_once()
    assert sched.stuck is None


def test_n_choices_share_one_prefill(loop):
    """n = 3: the prompt is prefilled once; choices 1 and 2 fork from choice 0's state of
    prompt[:-1], each recomputing the last position only, and meanwhile their slots stay held."""
    sched, engine, _ = make(Limits(prefill_quantum=4))
    j = job(sched, loop, "n3", prompt_len=12, max_tokens=3)
    j.prepared.params.extend([SamplingParams(max_tokens=3)] * 2)
    sched.run_once()
    assert len(engine.seqs) == 1 and sched.active[0].phase == "prefill"
    two = job(sched, loop, "two", prompt_len=4, max_tokens=3)
    two.prepared.params.append(SamplingParams(max_tokens=3))
    sched.run_once()
    assert [p.id for p in sched.pending] == ["two"]  # 3 slots free in the engine, 2 of them held
    run_until_idle(sched)
    assert sched.totals["prefilled_tokens"] == (12 + 2) + (4 + 1)
    finishes = [f for f in frames(loop, j) if isinstance(f, Finish)]
    assert sorted((f.index, f.text, f.reason) for f in finishes) == [(i, "<112><113><114>", "length") for i in range(3)]
    assert sched.reserved == 0 and not engine.seqs and len(engine.free_slots) == 4


def test_report_line_counts_the_request_own_pages(loop, caplog):
    """A request alone on the server: its report line's KV fullness is its own 2 pages (read
    before they go back), its context the prompt plus its tokens."""
    sched, engine, _ = make(Limits())
    job(sched, loop, "alone", prompt_len=4, max_tokens=3)  # 7 positions: 2 pages of 4
    with caplog.at_level("INFO", logger="jaxllm.serve"):
        run_until_idle(sched)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serve alone: prefill")]
    assert "| ctx 7/1000 (1% full) | kv cache 2/64 pages (3% full)" in line, line
    assert "prefill 4 tok (0 cached)" in line and "decode 3 tok" in line
    assert len(engine.free_pages) == 64  # and back afterwards


def test_tokens_from_nan_logits_are_logged_counted_and_flagged(loop, caplog):
    """A round whose logits are nan (a numerical fault on the device; its tokens are not the
    model's) is said once per request in the log, counted in /metrics and flagged on the
    request's report line; a healthy request beside it is not."""
    sched, engine, _ = make(Limits())
    engine.nan_logits.add(0)  # the first sequence added
    job(sched, loop, "sick", max_tokens=3)
    job(sched, loop, "well", max_tokens=3)
    with caplog.at_level("INFO", logger="jaxllm.serve"):
        run_until_idle(sched)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("drawn from nan logits" in m for m in messages) == 1
    assert any(m.startswith("serve sick: a token was drawn from nan logits") for m in messages)
    (sick,) = [m for m in messages if m.startswith("serve sick: prefill")]
    (well,) = [m for m in messages if m.startswith("serve well: prefill")]
    assert sick.endswith("| NAN LOGITS: 3 tok") and "NAN" not in well
    assert sched.metrics.nan_tokens._value.get() == 3


def test_admission_counts_are_written_by_the_worker_thread_alone(loop):
    """Handlers only submit: every change to the reserved bytes happens on the worker thread."""
    sched, engine, _ = make(Limits())
    writers = []
    for name in ("admitted", "released"):
        real = getattr(sched.admission, name)

        def record(job, real=real):
            writers.append(threading.current_thread().name)
            real(job)

        setattr(sched.admission, name, record)
    sched.start()
    try:
        jobs = [job(sched, loop, f"t{i}") for i in range(3)]  # submitted from this (handler) thread
        deadline = time.monotonic() + 20
        while (sched.active or sched.pending or not sched.inbox.empty() or len(writers) < 6) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.01)
    finally:
        sched.stop()
    assert all(isinstance(frames(loop, j)[-1], Done) for j in jobs)
    assert writers and set(writers) == {"jaxllm-worker"} and len(writers) == 6
    assert sched.reserved == 0
