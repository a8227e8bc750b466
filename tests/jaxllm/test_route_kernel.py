"""The MoE routing kernel (in the Pallas interpreter) against XLA's routing (`layers.route`)
and expert counts (`layers.expert_counts`), and wired into the model's rounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny_configs import TINY_HYBRID_MOE, TINY_MOE
from jaxllm.api import prompt_logits
from jaxllm.config import ModelConfig
from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.loading.dummy import dummy_params
from jaxllm.model.kernel_choice import ROUTE_KERNEL_MAX_ROWS, route_kernel_choice
from jaxllm.model.layers import expert_counts, route
from jaxllm.model.route_kernel import route_and_count
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.sampling import SamplingParams


def _routing_cfg(E: int, k: int, norm_topk_prob: bool) -> ModelConfig:
    return TINY_MOE.replace(n_experts=E, n_experts_per_token=k, norm_topk_prob=norm_topk_prob)


def _check(logits: jax.Array, valid: jax.Array, k: int, norm_topk_prob: bool, **knobs: int) -> None:
    top_w, top_e, counts = route_and_count(logits, valid, k=k, norm_topk_prob=norm_topk_prob, interpret=True, **knobs)
    ref_w, ref_e = route(logits, _routing_cfg(logits.shape[1], k, norm_topk_prob))
    assert top_e.dtype == jnp.int32 and top_w.dtype == jnp.float32
    np.testing.assert_array_equal(top_e, ref_e)
    np.testing.assert_allclose(top_w, ref_w, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(counts, expert_counts(ref_e, valid, logits.shape[1]))


@pytest.mark.parametrize(
    "T,E,k,norm_topk_prob,knobs",
    [
        (1, 8, 2, True, {}),
        (5, 60, 4, False, {}),  # 60 experts: padded to 64
        (3, 6, 6, True, {}),  # every expert chosen
        (7, 20, 10, False, {"_block_rows": 2}),  # k padded to 16; four row blocks, the last partial
        (37, 128, 8, True, {}),  # Qwen3-30B-A3B's routing over three blocks of 16 rows
    ],
)
def test_kernel_matches_xla_routing_and_counts(T, E, k, norm_topk_prob, knobs):
    rng = np.random.default_rng(T * E + k)
    logits = jnp.asarray(rng.normal(size=(T, E)) * 3, jnp.float32)
    valid = jnp.asarray(rng.random(T) < 0.7).at[0].set(True)  # padding rows are routed, not counted
    _check(logits, valid, k, norm_topk_prob, **knobs)


def test_ties_go_to_the_lower_expert_like_top_k():
    """Equal probabilities, from equal logits or from logits so far below the max that their
    probabilities underflow to 0, go to the lower expert first, as in `lax.top_k`."""
    logits = jnp.asarray(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 2.0],  # a three-way tie at the top, a tie at the k-th
            [0.0] * 7,  # all equal: the first k, equal weights
            [-1.0, 5.0, -1.0, -1.0, 5.0, -1.0, -1.0],
            [-200.0, 100.0, -300.0, -250.0, 60.0, -400.0, -350.0],  # zeros: 0 and 2, not 0 and 3
        ],
        jnp.float32,
    )
    valid = jnp.array([True, True, False, True])
    _check(logits, valid, 4, True)
    _check(logits, valid, 4, False)
    _, top_e, _ = route_and_count(logits, valid, k=4, norm_topk_prob=True, interpret=True)
    np.testing.assert_array_equal(top_e[0], [1, 2, 4, 5])
    np.testing.assert_array_equal(top_e[3], [1, 4, 0, 2])


def test_a_nan_row_still_names_real_experts():
    """The expert kernels index weights by these ids, so a diverged row must not name an
    expert past E; the other rows route as usual."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 12)), jnp.float32).at[1, 4].set(jnp.nan)
    top_w, top_e, _ = route_and_count(logits, jnp.ones((3,), bool), k=3, norm_topk_prob=True, interpret=True)
    assert ((top_e >= 0) & (top_e < 12)).all()
    ref_w, ref_e = route(logits[::2], _routing_cfg(12, 3, True))
    np.testing.assert_array_equal(top_e[::2], ref_e)
    np.testing.assert_allclose(top_w[::2], ref_w, rtol=1e-6, atol=1e-7)


def test_choice_per_round():
    """Rounds of few tokens take the kernel where asked (the interpreter here, a CPU); longer
    rounds, "xla", and "auto" without a GPU keep XLA's ops."""
    assert route_kernel_choice(RuntimeOptions(decode_route="interpret"), ROUTE_KERNEL_MAX_ROWS) == "interpret"
    assert route_kernel_choice(RuntimeOptions(decode_route="interpret"), ROUTE_KERNEL_MAX_ROWS + 1) is None
    assert route_kernel_choice(RuntimeOptions(decode_route="xla"), 1) is None
    if jax.default_backend() == "cpu":
        assert route_kernel_choice(RuntimeOptions(), 1) is None


def _large_weights(cfg: ModelConfig):
    # Larger weights than the loader's default so that routing is far from uniform.
    return jax.tree.map(lambda x: x * 20 if x.ndim > 1 else x, dummy_params(cfg, seed=3))


IDS = jnp.asarray([5, 9, 33, 2, 71, 14, 14, 60, 3, 7, 8, 9], jnp.int32)


def _runs_the_kernel(params, cfg: ModelConfig, decode_route: str) -> bool:
    """Whether a round of `IDS` traces the routing kernel (by its pallas_call's name)."""
    opts = RuntimeOptions(decode_route=decode_route)
    return "moe_route" in str(jax.make_jaxpr(prompt_logits, static_argnums=(1, 3))(params, cfg, IDS, opts))


def test_forward_with_the_kernel_matches_xla_routing():
    """Wired into `forward` (a round of 12 tokens, at most ROUTE_KERNEL_MAX_ROWS): the same logits."""
    params = _large_weights(TINY_MOE)
    assert _runs_the_kernel(params, TINY_MOE, "interpret") and not _runs_the_kernel(params, TINY_MOE, "xla")
    logits = jax.jit(prompt_logits, static_argnums=(1, 3))
    ref = logits(params, TINY_MOE, IDS, RuntimeOptions(decode_route="xla"))
    ours = logits(params, TINY_MOE, IDS, RuntimeOptions(decode_route="interpret"))
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def test_hybrid_rounds_with_the_kernel_match_xla_routing():
    """Wired into `hybrid_forward`'s blocks, in prompt and decode rounds with padding rows (a
    chunk bucket of 16, decode width 2 for one sequence once the other is done): the same
    tokens, log-probabilities and tokens per expert as XLA's routing."""
    cfg = TINY_HYBRID_MOE.replace(norm_topk_prob=False)
    params = _large_weights(cfg)
    assert _runs_the_kernel(params, cfg, "interpret") and not _runs_the_kernel(params, cfg, "xla")
    config = EngineConfig(
        max_slots=2, kv_bytes=1 << 20, max_seq_len=64, chunk_buckets=(16,), min_ctx_pages=2, decode_widths=(2,)
    )
    requests = [
        ([5, 9, 33, 2, 71, 14, 14, 60, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
        ([7, 8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
    ]

    def run(decode_route: str) -> tuple[list[list[int]], list[list[float]], np.ndarray]:
        engine = Engine(cfg, params, eos_ids=[0], config=config, options=RuntimeOptions(decode_route=decode_route))
        seqs = [engine.add(prompt, sampling) for prompt, sampling in requests]
        while any(s.finish_reason is None for s in seqs):
            engine.step()
        return [s.generated for s in seqs], [s.logprobs for s in seqs], engine.expert_tokens.copy()

    tokens, logprobs, experts = run("xla")
    ours, our_logprobs, our_experts = run("interpret")
    assert ours == tokens
    for a, b in zip(our_logprobs, logprobs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(our_experts, experts)
    assert (experts > 0).sum() > cfg.n_experts_per_token  # routing spread over experts
