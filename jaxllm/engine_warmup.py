"""Engine warm-up: every round shape an `Engine` can launch compiled before the first request.

`round_variants` enumerates each round variant `Engine.launch` can ask for (the
batch-invariant mode's few included) as a lowering thunk; `warmup` compiles them ahead of time
on a thread pool into the engine's table of executables, runs each once on idle inputs where
a first run pays once-only costs (a GPU), and warms the checkpoint moves at every
power-of-two page count. `Engine.warmup` calls `warmup`.

These are plain functions of the engine, not methods, so the engine's file keeps to serving
rounds; they are still the engine's own machinery, so they read its attributes directly,
private ones included (`_compiled`, which they fill, and the `_idle_chunk`,
`_invariant_chunk` and `_sampling_row` helpers the rounds use too).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxllm import steps
from jaxllm.model.kernel_choice import plain_sampler_pays
from jaxllm.sampling import SamplingParams
from jaxllm.state import page_row, pages_bucket

# `engine` arguments are `jaxllm.engine.Engine`, which imports this module: importing it back,
# even under TYPE_CHECKING, is a cycle tests/test_packaging.py rejects (`jaxllm.engine_runs`
# names `jaxllm.api.Model` the same way).
Engine = Any


def warmup(engine: Engine, progress: Callable[[int, int], None] | None = None) -> int:
    """Compiles every shape variant before the first request; returns how many.

    `progress(done, total)` is called as each variant is ready (from this thread).

    Round variants are lowered here and compiled ahead of time on a thread pool (an
    unrolled 8B step takes seconds of XLA time each, and compiles release the GIL); rounds
    then call the compiled executables directly. The small sequence moves (set / release /
    extract / insert) are warmed by running them on slot 0, which leaves the state as it
    was. Must be called before any sequence is added.
    """
    if engine.seqs:
        raise RuntimeError("warmup must run on an empty engine")
    variants = round_variants(engine)
    page_counts = sorted(
        {
            pages_bucket(1 << i, engine.layout.max_pages_per_seq)
            for i in range(engine.layout.max_pages_per_seq.bit_length() + 1)
        }
    )
    total, done = len(variants) + len(page_counts), 0
    report = progress or (lambda done, total: None)
    report(0, total)
    threads = engine.config.compile_threads or os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        # Lowering traces Python (GIL-bound) so it runs here, feeding compiles to the pool.
        futures = {pool.submit(lower().compile): key for key, lower in variants}
        for f in concurrent.futures.as_completed(futures):
            engine._compiled[futures[f]] = f.result()
            done += 1
            report(done, total)
    count = len(variants)
    runs = engine.config.warmup_runs
    if runs or (runs is None and jax.default_backend() != "cpu"):
        _run_idle_rounds(engine)
    # Checkpoints come in every power-of-two page count (`extract`): a prefix-cache entry
    # of any length, a paused request of any length, must not compile while serving.
    for n_pages in page_counts:
        ckpt = steps.extract(engine.state, np.int32(0), np.int32(0), n_pages=n_pages)
        engine.state = steps.insert(engine.state, np.int32(0), ckpt)
        count += 1
        done += 1
        report(done, total)
    row = engine._sampling_row(SamplingParams(), np.uint32(0), [])
    engine.state = steps.set_slot(engine.state, np.int32(0), np.asarray(page_row([], engine.layout)), row)
    engine.state = steps.release_slot(engine.state, np.int32(0))
    jax.block_until_ready(engine.state)
    return count


def round_variants(engine: Engine) -> list[tuple[tuple, Callable[[], Any]]]:
    """(key, lowering thunk) for every round shape `launch` can ask for."""
    B = engine.layout.max_slots
    idle = steps.round_inputs(B, engine.cfg.vocab_size)
    if engine.config.batch_invariant:
        return _invariant_variants(engine, idle)
    out: list[tuple[tuple, Callable[[], Any]]] = []
    n = engine.config.decode_steps_per_call
    for ctx, width in itertools.product(engine.ctx_buckets(), engine.config.widths()):
        chunk_sizes = list(engine.config.chunk_buckets) if width in engine.config.chunk_widths() else []
        for size in [0] + chunk_sizes:
            chunk_len = max(size, 1)
            out.append(
                (
                    ("step", chunk_len, ctx, width),
                    lambda size=size, chunk_len=chunk_len, ctx=ctx, width=width: _lower(
                        engine,
                        steps.step,
                        idle,
                        engine._idle_chunk(size),
                        chunk_len=chunk_len,
                        n_ctx_pages=ctx,
                        decode_width=width,
                    ),
                )
            )
        samplers = (True, False) if plain_sampler_pays(engine.options) else (True,)
        for full in samplers if engine.config.max_drafts and width in engine.config.verify_widths() else ():
            out.append(
                (
                    ("verify", engine.config.max_drafts, ctx, width, full),
                    lambda ctx=ctx, width=width, full=full: _lower(
                        engine,
                        steps.verify,
                        idle,
                        _no_drafts(engine),
                        n_ctx_pages=ctx,
                        decode_width=width,
                        full_sampler=full,
                    ),
                )
            )
        for full in samplers if n > 1 else ():
            out.append(
                (
                    ("decode", n, ctx, width, full),
                    lambda ctx=ctx, width=width, full=full: _lower(
                        engine,
                        steps.decode_steps,
                        idle,
                        n_steps=n,
                        n_ctx_pages=ctx,
                        decode_width=width,
                        full_sampler=full,
                    ),
                )
            )
    return out


def _invariant_variants(engine: Engine, idle: steps.RoundInputs) -> list[tuple[tuple, Callable[[], Any]]]:
    """The round shapes of the batch-invariant mode: the chunk program at each context
    bucket, and the one decode program."""
    size, width = engine._invariant_chunk(), engine.config.chunk_widths()[0]
    n, B = engine.config.decode_steps_per_call, engine.layout.max_slots
    out: list[tuple[tuple, Callable[[], Any]]] = [
        (
            ("step", size, ctx, width),
            lambda ctx=ctx: _lower(
                engine,
                steps.step,
                idle,
                engine._idle_chunk(size),
                chunk_len=size,
                n_ctx_pages=ctx,
                decode_width=width,
            ),
        )
        for ctx in engine.ctx_buckets()
    ]
    ctx = engine.layout.max_pages_per_seq
    out.append(
        (
            ("decode", n, ctx, B, True),
            lambda: _lower(
                engine, steps.decode_steps, idle, n_steps=n, n_ctx_pages=ctx, decode_width=B, full_sampler=True
            ),
        )
    )
    return out


def _lower(engine: Engine, step_fn: Any, *inputs: Any, **shape: Any) -> Any:
    """`step_fn` (a jitted round of `jaxllm.steps`) lowered on the engine's params and state
    for the static `shape` arguments, as `Engine._run_round` would call it."""
    return step_fn.lower(engine.params, engine.state, *inputs, cfg=engine.cfg, opts=engine.options, **shape)


def _run_idle_rounds(engine: Engine) -> None:
    """Runs every compiled round once with nothing decoding (see EngineConfig.warmup_runs).

    Idle rounds touch only the trash row and the trash page, so the state stays as it
    was. A chunk round runs twice: as a fresh prompt and as one continuing after cached
    context, the two branches of its chunk attention, both on the trash row.
    """
    B = engine.layout.max_slots
    idle = steps.round_inputs(B, engine.cfg.vocab_size)
    for key, compiled in engine._compiled.items():
        if key[0] == "decode":
            engine.state, _ = compiled(engine.params, engine.state, idle)
            continue
        if key[0] == "verify":
            engine.state, _ = compiled(engine.params, engine.state, idle, _no_drafts(engine))
            continue
        size = key[1] if key[1] in engine.config.chunk_buckets else 0
        engine.state, _ = compiled(engine.params, engine.state, idle, engine._idle_chunk(size))
        if size:
            chunk = engine._idle_chunk(size)
            chunk.positions[:] = np.minimum(np.arange(1, size + 1), engine.layout.max_seq_len - 1)
            chunk.seg_slot[0], chunk.seg_len[0] = B, size  # the trash row, after one cached position
            engine.state, _ = compiled(engine.params, engine.state, idle, chunk)
    jax.block_until_ready(engine.state)


def _no_drafts(engine: Engine) -> steps.Drafts:
    B = engine.layout.max_slots
    return steps.Drafts(tokens=np.zeros((B, engine.config.max_drafts), np.int32), count=np.zeros((B,), np.int32))
