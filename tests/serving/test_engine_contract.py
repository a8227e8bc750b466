"""The scheduler's view of the engine (`EngineLike`) is the real engine's: every member exists on
`jaxllm.engine.Engine` with a compatible signature, the scheduler uses nothing else, and
`launch` says what it planned."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jax
import pytest

import serving.scheduler
from tiny_configs import TINY_DENSE
from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.engine_records import PromptAdvance
from jaxllm.loading.dummy import dummy_params
from jaxllm.sampling import SamplingParams
from serving.scheduler import EngineLike

CFG = TINY_DENSE


def protocol_members(proto: type) -> set[str]:
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n, v in vars(proto).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


@pytest.fixture(scope="module")
def engine() -> Engine:
    config = EngineConfig(
        max_slots=2, kv_bytes=1 << 20, max_seq_len=64, chunk_buckets=(8,), decode_widths=(2,), min_ctx_pages=2
    )
    return Engine(CFG, dummy_params(CFG, seed=1), eos_ids=[0], config=config)


def test_scheduler_uses_only_what_engine_like_lists():
    source = Path(inspect.getfile(serving.scheduler)).read_text()
    used = set(re.findall(r"self\.engine\.(\w+)", source)) | set(
        re.findall(r"getattr\(self\.engine, \"(\w+)\"", source)
    )
    assert used, "the pattern no longer finds the scheduler's engine calls"
    assert used <= protocol_members(EngineLike), f"not in EngineLike: {sorted(used - protocol_members(EngineLike))}"


def test_engine_has_every_member_with_a_compatible_signature(engine):
    for name in sorted(protocol_members(EngineLike)):
        assert hasattr(engine, name), f"Engine has no {name}"
        wanted = vars(EngineLike).get(name)
        if not callable(wanted) or isinstance(wanted, property):
            continue
        have = inspect.signature(getattr(Engine, name)).parameters
        for p in inspect.signature(wanted).parameters.values():
            assert p.name in have, f"Engine.{name} has no parameter {p.name}"
            assert have[p.name].kind == p.kind, f"Engine.{name}({p.name}) is {have[p.name].kind}, not {p.kind}"
            if p.default is not inspect.Parameter.empty:
                assert have[p.name].default is not inspect.Parameter.empty, f"Engine.{name}({p.name}) needs a default"
        extra = [q for q in have.values() if q.name not in inspect.signature(wanted).parameters]
        assert all(q.default is not inspect.Parameter.empty for q in extra), f"Engine.{name} needs more arguments"


def test_launch_returns_its_plan(engine):
    """A 12-token prompt with extract points 4 and 10, prefilled 8 tokens a round: the first
    round crosses 4, the second crosses 10 and ends the prompt; then a decode round."""
    seq = engine.add(list(range(3, 15)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), stops=[4, 10])
    try:
        plans = []
        for _ in range(3):
            handle = engine.launch(prefill_budget=8)
            plans.append(handle.plan)
            engine.collect(handle)
        assert [p.prompts for p in plans] == [
            (PromptAdvance(seq.id, 0, 8, (4,), False),),
            (PromptAdvance(seq.id, 8, 12, (10,), True),),
            (),
        ]
        assert [p.prefill_tokens for p in plans] == [8, 4, 0]
        assert [p.completes_prompts for p in plans] == [False, True, False]
        assert [p.decoding for p in plans] == [(), (), (seq.id,)]
        assert [(p.steps, p.multi) for p in plans] == [(1, False), (1, False), (4, True)]  # 4 steps per call
    finally:
        engine.remove(seq)
        jax.clear_caches()
