"""The step contract: determinism per seed, checkpoints, no recompiles, donation, errors."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny_configs import TINY_DENSE
from jaxllm.attention import paged_decode_cpu
from jaxllm.engine import Engine, EngineFull
from jaxllm.engine_config import EngineConfig
from jaxllm.engine_warmup import round_variants
from jaxllm.loading.dummy import dummy_params
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.model import matvec_cpu
from jaxllm.sampling import SamplingParams, process_logits
from jaxllm.state import empty_sampling
from compile_watch import compilations  # tests/ is on sys.path (conftest)

CFG = TINY_DENSE


@pytest.fixture(scope="module")
def params():
    # Larger weights than the loader's default so the distribution is not near uniform.
    return jax.tree.map(lambda x: x * 20 if x.ndim > 1 else x, dummy_params(CFG, seed=1))


def make_engine(
    params,
    *,
    slots=4,
    steps_per_call=1,
    chunk_buckets=(8, 32),
    decode_widths=(1, 2),
    chunk_segments=1,
    cfg=CFG,
    opts=RuntimeOptions(),
    chunk_decode_width=0,
    min_ctx_pages=2,
    warmup_runs=None,
    max_seq_len=128,
) -> Engine:
    config = EngineConfig(
        max_slots=slots,
        kv_bytes=1 << 20,
        max_seq_len=max_seq_len,
        chunk_buckets=chunk_buckets,
        min_ctx_pages=min_ctx_pages,
        decode_steps_per_call=steps_per_call,
        decode_widths=decode_widths,
        chunk_segments=chunk_segments,
        chunk_decode_width=chunk_decode_width,
        warmup_runs=warmup_runs,
    )
    return Engine(cfg, params, eos_ids=[0], config=config, options=opts)


def run_until_done(engine: Engine, seqs) -> None:
    while any(s.finish_reason is None for s in seqs):
        engine.step()


PROMPT = [5, 9, 33, 2, 71, 14, 14, 60, 3]
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=30, seed=1234, max_tokens=20, ignore_eos=True)


def test_seeded_sample_same_in_any_slot_beside_any_neighbours(params):
    alone = make_engine(params)
    (ref,) = [alone.add(PROMPT, SAMPLED)]
    run_until_done(alone, [ref])

    # Full width beside neighbours, 4 steps per call.
    crowded = make_engine(params, steps_per_call=4, decode_widths=())
    neighbours = [
        crowded.add([1, 2, 3], SamplingParams(temperature=0.7, seed=1, max_tokens=30, ignore_eos=True)),
        crowded.add(PROMPT[::-1], SamplingParams(temperature=0, max_tokens=5)),
        crowded.add([4] * 40, SamplingParams(temperature=1.3, min_p=0.1, max_tokens=25, ignore_eos=True)),
    ]
    target = crowded.add(PROMPT, SAMPLED)
    assert target.slot != ref.slot
    run_until_done(crowded, neighbours + [target])
    assert target.generated == ref.generated
    assert len(set(ref.generated)) > 3  # really sampled, not a constant stream


def test_top1_sampling_equals_greedy(params):
    engine = make_engine(params)
    greedy = engine.add(PROMPT, SamplingParams(temperature=0, max_tokens=15, ignore_eos=True))
    top1 = engine.add(PROMPT, SamplingParams(temperature=1.5, top_k=1, seed=7, max_tokens=15, ignore_eos=True))
    run_until_done(engine, [greedy, top1])
    assert greedy.generated == top1.generated


def test_biased_out_tokens_are_never_drawn(params):
    engine = make_engine(params)
    banned = set(range(0, 96, 2))
    seq = engine.add(
        PROMPT,
        SamplingParams(temperature=2.0, seed=3, max_tokens=40, ignore_eos=True, logit_bias={t: -100.0 for t in banned}),
    )
    run_until_done(engine, [seq])
    assert not banned & set(seq.generated)


def test_pause_and_resume_equals_never_paused(params):
    engine = make_engine(params)
    ref = engine.add(PROMPT, SAMPLED)
    run_until_done(engine, [ref])
    engine.remove(ref)

    engine = make_engine(params)
    seq = engine.add(PROMPT, SAMPLED)
    for _ in range(6):
        engine.step()
    paused = engine.pause(seq)
    other = engine.add([8, 8, 8], SamplingParams(temperature=0, max_tokens=3))  # takes the old slot
    resumed = engine.resume(paused)
    assert resumed.slot != seq.slot
    run_until_done(engine, [resumed, other])
    assert resumed.generated == ref.generated


def test_stop_tokens_and_min_tokens(params):
    engine = make_engine(params)
    free = engine.add(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    run_until_done(engine, [free])
    stop_at = free.generated[3]
    first = free.generated.index(stop_at)
    stopped = engine.add(
        PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,))
    )
    run_until_done(engine, [stopped])
    assert stopped.generated == free.generated[: first + 1] and stopped.finish_reason == "stop"
    assert free.finish_reason == "length"
    late = engine.add(
        PROMPT,
        SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2, ignore_eos=True, stop_token_ids=(stop_at,)),
    )
    run_until_done(engine, [late])
    assert stop_at not in late.generated[: first + 2]


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(0)
    B, V = 3, 11
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    seen = rng.random((B, V)) < 0.4
    counts = rng.integers(0, 3, size=(B, V)).astype(np.int32)
    s = empty_sampling(B, V).replace(
        repetition_penalty=jnp.asarray([1.0, 1.3, 0.8]),
        presence_penalty=jnp.asarray([0.0, 0.5, -0.2]),
        frequency_penalty=jnp.asarray([0.3, 0.0, 1.0]),
        logit_bias=jnp.asarray(rng.normal(size=(B, V)).astype(np.float32)),
    )
    ours = np.asarray(
        process_logits(jnp.asarray(logits), s, jnp.asarray(seen), jnp.asarray(counts), jnp.zeros((B,), jnp.int32))
    )
    ref = logits.copy()
    for b in range(B):
        rp = float(s.repetition_penalty[b])
        for v in range(V):
            if seen[b, v]:
                ref[b, v] = ref[b, v] / rp if ref[b, v] > 0 else ref[b, v] * rp
            ref[b, v] -= float(s.frequency_penalty[b]) * counts[b, v] + float(s.presence_penalty[b]) * (
                counts[b, v] > 0
            )
            ref[b, v] += float(s.logit_bias[b, v])
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)


# The engine shapes both warm-up tests below compile (once: the second finds them compiled):
# multi-step decode calls, packed prompts, chunk rounds at the widest decode width only.
WARM_SHAPES = dict(slots=3, steps_per_call=3, chunk_segments=2, chunk_decode_width=3)


def test_no_recompilation_after_warmup(params):
    for shapes in (dict(slots=3, steps_per_call=1, chunk_segments=1, chunk_decode_width=0), WARM_SHAPES):
        engine = make_engine(params, **shapes)
        engine.warmup()
        with compilations() as compiles:
            rng = np.random.default_rng(0)
            live = []
            variants = [
                SamplingParams(temperature=0, max_tokens=4),
                SamplingParams(
                    temperature=0.8, top_k=5, top_p=0.5, seed=2, max_tokens=6, logprobs=True, top_logprobs=20
                ),
                SamplingParams(
                    temperature=1.0,
                    min_p=0.2,
                    repetition_penalty=1.2,
                    presence_penalty=0.5,
                    frequency_penalty=0.4,
                    logit_bias={1: 5.0, 2: -3.0, 9: 1.0},
                    stop_token_ids=(3, 4, 5, 6),
                    min_tokens=2,
                    max_tokens=8,
                    top_logprobs=3,
                ),
                SamplingParams(temperature=0, ignore_eos=True, max_tokens=3, stop_token_ids=(7,), top_logprobs=0),
            ]
            for length in [1, 2, 7, 8, 9, 31, 33, 60, 100, 120]:
                prompt = rng.integers(1, CFG.vocab_size, size=length).tolist()
                p = variants[length % len(variants)]
                while True:
                    try:
                        live.append(engine.add(prompt, p))
                        break
                    except EngineFull:
                        engine.step(prefill_budget=int(rng.integers(1, 40)))
                        for s in [s for s in live if s.finish_reason is not None]:
                            engine.remove(s)
                            live.remove(s)
            # A prefix checkpoint inserted into a new slot, and n > 1 (the same prompt twice).
            run_until_done(engine, live)
            for s in live:
                engine.remove(s)
            donor = engine.add(list(range(1, 40)), SamplingParams(temperature=0, max_tokens=2))
            run_until_done(engine, [donor])
            ckpt = engine.extract(donor, 20)
            engine.remove(donor)
            twins = [
                engine.add(
                    list(range(1, 40)),
                    SamplingParams(temperature=1, seed=5, max_tokens=5),
                    checkpoint=ckpt,
                    cached_tokens=20,
                )
                for _ in range(2)
            ]
            run_until_done(engine, twins)
            assert twins[0].generated == twins[1].generated
        assert compiles == [], f"{len(compiles)} compilations after warm-up"
    # Widths (1, 2, 3) x 2 chunk buckets: 4 chunk-round variants per context bucket fewer than
    # with chunk rounds at every width (counted, not compiled).
    every_width = make_engine(params, **{**WARM_SHAPES, "chunk_decode_width": 0})
    n_ctx = len(engine.ctx_buckets())
    assert len(round_variants(engine)) == len(round_variants(every_width)) - 4 * n_ctx


def test_one_context_bucket_still_warms_every_checkpoint_size(params):
    """With a single context bucket (the GPU configs: the decode kernel reads only live
    pages) the checkpoints of short prefixes are smaller than any bucket; they compiled
    while serving until warm-up covered every power-of-two page count."""
    engine = make_engine(params, steps_per_call=2, min_ctx_pages=16, max_seq_len=256)
    assert engine.ctx_buckets() == [16]
    engine.warmup()
    with compilations() as compiles:
        donor = engine.add(list(range(1, 70)), SamplingParams(temperature=0, max_tokens=2))
        run_until_done(engine, [donor])
        sizes = {engine.extract(donor, n).n_pages for n in (10, 20, 40, 69)}
        paused = engine.pause(donor)
        engine.remove(engine.resume(paused))
    assert sizes == {1, 2, 4, 8}  # 8: neither a context bucket nor among warm-up's old 1, 2, 4
    assert compiles == [], f"{len(compiles)} compilations after warm-up"


def test_warmup_runs_leave_the_state_as_it_was(params):
    """Warm-up's idle runs of every round (on by default on a GPU) touch only the trash row
    and page: the state equals a warm-up without them, and requests draw the same."""
    engines = [make_engine(params, **WARM_SHAPES, warmup_runs=runs) for runs in (True, False)]
    for e in engines:
        e.warmup()
    ran, plain = engines
    trash_page_dropped = lambda st: st.replace(kv=jax.tree.map(lambda a: a[:, 1:], st.kv))  # noqa: E731
    jax.tree.map(np.testing.assert_array_equal, trash_page_dropped(ran.state), trash_page_dropped(plain.state))
    outs = []
    for e in engines:
        seqs = [e.add(PROMPT, SAMPLED), e.add(list(range(1, 40)), SamplingParams(temperature=0, max_tokens=6))]
        run_until_done(e, seqs)
        outs.append([s.generated for s in seqs])
    assert outs[0] == outs[1]


def test_packed_prompts_give_the_same_tokens(params):
    """Several fresh prompts in one chunk (packed prefill) sample exactly what they do alone."""
    prompts = [PROMPT, [4] * 3, list(range(10, 30)), [7]]
    sampling = [SamplingParams(temperature=1.0, seed=i, max_tokens=6, ignore_eos=True) for i in range(len(prompts))]

    def run(chunk_segments: int) -> tuple[list[list[int]], int]:
        engine = make_engine(params, chunk_segments=chunk_segments)
        seqs = [engine.add(p, s) for p, s in zip(prompts, sampling)]
        rounds = 0
        while any(s.finish_reason is None for s in seqs):
            engine.step()
            rounds += 1
        return [s.generated for s in seqs], rounds

    alone, alone_rounds = run(1)
    packed, packed_rounds = run(3)
    assert packed == alone
    assert packed_rounds < alone_rounds  # the prompts really shared rounds


@pytest.mark.parametrize("scan_layers", [True, False])
def test_decode_kernels_in_the_step_give_the_same_tokens(params, scan_layers):
    """The Pallas paged decode kernel and the add + RMSNorm kernel (interpreted on CPU), and the C++ CPU kernels, wired into the forward, in mixed rounds and multi-step decode calls, sample
    what the reference attention and XLA's dots sample."""
    from jaxllm.params import layout_params

    laid_out = layout_params(params, scan_layers)
    prompts = [PROMPT, list(range(3, 40))]  # the second prefills in chunks while the first decodes
    # Top logprobs too: sampled tokens alone missed a norm kernel dividing by D + 1.
    sampling = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True, top_logprobs=5) for i in range(2)
    ]

    def run(**kernels: str) -> tuple[list[list[int]], np.ndarray]:
        opts = RuntimeOptions(scan_layers=scan_layers, **kernels)
        engine = make_engine(laid_out, steps_per_call=3, opts=opts)
        first = engine.add(prompts[0], sampling[0])
        engine.step()
        second = engine.add(prompts[1], sampling[1])
        run_until_done(engine, [first, second])
        top = np.array([[p for _, p in t] for s in (first, second) for t in s.top_logprobs])
        return [first.generated, second.generated], top

    tokens, top = run(decode_attention="reference", decode_matmul="xla", decode_norm="xla")

    def check(**kernels: str) -> None:
        ours, our_top = run(**kernels)
        assert ours == tokens, kernels
        np.testing.assert_allclose(our_top, top, rtol=1e-4, atol=1e-4, err_msg=str(kernels))

    check(decode_attention="interpret", decode_matmul="xla", decode_norm="xla")
    # What a GPU decode round runs: the attention and norm kernels around XLA's dots.
    check(decode_attention="interpret", decode_matmul="xla", decode_norm="interpret")
    # The defaults: on the CPU in float32, the C++ attention and matmul kernels.
    if paged_decode_cpu.available("float32") and matvec_cpu.available("float32"):
        check()


def test_steps_donate_the_state_without_copies(params):
    engine = make_engine(params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seq = engine.add(PROMPT, SamplingParams(temperature=0, max_tokens=6))
        run_until_done(engine, [seq])
    assert not [w for w in caught if "donated" in str(w.message)]


def test_bad_inputs_have_clear_errors(params):
    engine = make_engine(params)
    with pytest.raises(ValueError, match="exceeds the context"):
        engine.add([1] * 120, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="empty"):
        engine.add([], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add([1, 500], SamplingParams())
    for bad, message in [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_logprobs=21), "top_logprobs"),
        (dict(logit_bias={1000: 1.0}), "logit_bias"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add([1, 2], SamplingParams(**bad))
    assert engine.seqs == {} and len(engine.free_slots) == 4
    for bad, message in [
        (dict(chunk_segments=0), "chunk_segments"),
        (dict(decode_steps_per_call=0), "decode_steps"),
        (dict(chunk_buckets=(128, 32)), "chunk_buckets"),
        (dict(chunk_buckets=()), "chunk_buckets"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(**bad)


class AllowList:
    """A toy constraint: only tokens of one set may be drawn (a grammar stands here in serving)."""

    def __init__(self, allowed: set[int], vocab_size: int):
        bits = np.zeros((-(-vocab_size // 32),), np.uint32)
        for t in allowed:
            bits[t // 32] |= np.uint32(1 << (t % 32))
        self.bits, self.drawn = bits, []

    def allowed_bitmask(self) -> np.ndarray:
        return self.bits

    def advance(self, token: int) -> None:
        self.drawn.append(token)


@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_token_masks_constrain_only_their_slot(params, steps_per_call):
    engine = make_engine(params, steps_per_call=steps_per_call)
    allowed = {11, 12, 13, 40}
    constraint = AllowList(allowed, CFG.vocab_size)
    free = engine.add(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    seq = engine.add(
        PROMPT, SamplingParams(temperature=1.5, seed=9, max_tokens=10, ignore_eos=True), constraint=constraint
    )
    run_until_done(engine, [free, seq])
    assert set(seq.generated) <= allowed and constraint.drawn == seq.generated
    assert not set(free.generated) <= allowed

    alone = make_engine(params)
    ref = alone.add(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    run_until_done(alone, [ref])
    assert free.generated == ref.generated


def run_pipelined(engine: Engine, seqs) -> None:
    """Launches round N+1 before collecting round N, as the server's worker does."""
    in_flight = None
    while any(s.finish_reason is None for s in seqs):
        handle = engine.launch()
        if in_flight is not None:
            engine.collect(in_flight)
        in_flight = handle
    if in_flight is not None:
        engine.collect(in_flight)


class Alternating(AllowList):
    """A stateful toy grammar: tokens from `first` and `second` must alternate."""

    def __init__(self, first: set[int], second: set[int], vocab_size: int):
        super().__init__(first, vocab_size)
        self.masks = [self.bits, AllowList(second, vocab_size).bits]

    def allowed_bitmask(self) -> np.ndarray:
        return self.masks[len(self.drawn) % 2]


@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_pipelined_rounds_give_the_same_tokens(params, steps_per_call):
    """Rounds planned before the previous one is read: sequences that stopped on the device
    are skipped, and a constrained sequence waits for its tokens before its next mask."""
    engine = make_engine(params, steps_per_call=steps_per_call)
    constraint = Alternating({11, 12, 13}, {40, 41}, CFG.vocab_size)
    greedy = engine.add(PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    sampled = engine.add(PROMPT[:4], SAMPLED)
    forced = engine.add(
        PROMPT, SamplingParams(temperature=1.5, seed=9, max_tokens=10, ignore_eos=True), constraint=constraint
    )
    run_pipelined(engine, [greedy, sampled, forced])

    assert len(greedy.generated) == 7 and len(sampled.generated) == 20 and len(forced.generated) == 10
    assert set(forced.generated[0::2]) <= {11, 12, 13} and set(forced.generated[1::2]) <= {40, 41}
    assert constraint.drawn == forced.generated
    reference = make_engine(params)
    expected = [reference.add(PROMPT, greedy.params), reference.add(PROMPT[:4], SAMPLED)]
    run_until_done(reference, expected)
    assert [greedy.generated, sampled.generated] == [s.generated for s in expected]


def test_no_round_is_launched_past_max_tokens(params):
    """Rounds in flight that already draw a sequence's last token are not followed by more."""
    engine = make_engine(params, steps_per_call=4)
    one = engine.add(PROMPT, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    first = engine.launch()  # the prompt chunk draws the only token
    assert engine.launch() is None
    engine.collect(first)
    assert one.finish_reason == "length" and len(one.generated) == 1
    engine.remove(one)

    five = engine.add(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    handles = [engine.launch(), engine.launch()]  # prompt (token 1), then 4 decode steps (tokens 2-5)
    assert engine.launch() is None
    for h in handles:
        engine.collect(h)
    assert five.finish_reason == "length" and len(five.generated) == 5


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_a_prompt_round_copies_no_layer_of_the_cache(params, monkeypatch, scan_layers, fused):
    """The fused chunk path's `lax.cond` gets the whole cache: a layer's slice passed in as a
    conditional operand was materialised, a copy of that layer's pool per layer per prompt
    round (memcpy, 25% of an 8B's 1k-token round on an H100). XLA's attention stands in for
    cuDNN on the CPU; the compiled round must hold no layer-sized array at all."""
    import re

    import jaxllm.attention.fused as fused_module
    import jaxllm.model.forward as forward
    from jaxllm import steps
    from jaxllm.params import layout_params

    monkeypatch.setattr(forward, "fused_attention_available", lambda dtype: fused)
    real_fresh = fused_module.fresh_causal_attention
    monkeypatch.setattr(
        fused_module,
        "fresh_causal_attention",
        lambda *a, implementation=None, **k: real_fresh(*a, implementation="xla", **k),
    )
    jax.clear_caches()  # traces an earlier test made with the real choices must not be reused
    opts = RuntimeOptions(scan_layers=scan_layers)
    eng = make_engine(layout_params(params, scan_layers), opts=opts, chunk_segments=2)
    eng.add(list(range(1, 11)), SamplingParams(max_tokens=1, temperature=0.0))
    seen = {}
    real_step = steps.step
    monkeypatch.setattr(steps, "step", lambda *a, **k: seen.update(a=a, k=k) or real_step(*a, **k))
    eng.collect(eng.launch())
    assert seen, "the round did not go through steps.step"
    text = real_step.lower(*seen["a"], **seen["k"]).compile().as_text()
    layer = ",".join(str(d) for d in eng.state.kv.k.shape[1:])
    copies = [line.strip()[:160] for line in text.splitlines() if re.search(rf"= f32\[{layer}\]", line)]
    assert not copies, copies[:2]
