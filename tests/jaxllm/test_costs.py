"""What a step reads (`jaxllm.costs`): the MBU numerator, and a MoE's experts by batch width."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm.config import ModelConfig
from jaxllm.costs import expected_distinct_experts, model_costs
from jaxllm.loading import runtime_layout
from jaxllm.loading.dummy import dummy_params
from jaxllm.runtime_options import RuntimeOptions
from tiny_configs import TINY_DENSE, TINY_HYBRID_MOE, TINY_MOE

TINY_HYBRID_MTP = TINY_HYBRID_MOE.replace(mtp_layers=1)


@pytest.mark.parametrize("n, k, tokens", [(256, 8, 1), (256, 8, 4), (128, 8, 16), (16, 2, 64)])
def test_expected_distinct_experts_match_random_routing(n: int, k: int, tokens: int) -> None:
    rng = np.random.default_rng(0)
    trials = [len({e for _ in range(tokens) for e in rng.choice(n, k, replace=False)}) for _ in range(2000)]
    assert expected_distinct_experts(n, k, tokens) == pytest.approx(np.mean(trials), rel=0.01)


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("cfg", [TINY_MOE, TINY_HYBRID_MTP], ids=["moe", "hybrid_mtp"])
@pytest.mark.parametrize("laid_out", [False, True], ids=["canonical", "runtime"])
def test_a_step_reads_the_experts_its_rows_route_to(cfg: ModelConfig, laid_out: bool) -> None:
    """Every weight but the embedding table (untied) and the MTP head, with the routed experts
    (counted here from the config) scaled by the share `rows` tokens touch."""
    opts = RuntimeOptions(dtype="bfloat16", scan_layers=not laid_out)
    params = dummy_params(cfg, dtype="bfloat16")
    if laid_out:  # fused projections, unrolled layers
        params = runtime_layout(params, opts)
    costs = model_costs(cfg, params, opts)

    experts = cfg.n_layers * cfg.n_experts * 3 * cfg.d_model * cfg.moe_ffn_dim * 2
    mtp = _nbytes(params.mtp) if params.mtp is not None else 0
    every = _nbytes(params) - (_nbytes(params.embed) if params.lm_head is not None else 0) - mtp
    assert costs.expert_weight_bytes == experts
    assert costs.step_weight_bytes == every
    if cfg.mtp_layers:
        assert mtp > 0
    share = cfg.n_experts_per_token / cfg.n_experts
    assert costs.decode_step_bytes(0) == pytest.approx(every - experts * (1 - share))
    assert costs.decode_step_bytes(0, rows=10_000) == pytest.approx(every)
    kv = costs.kv_bytes_per_position
    assert costs.decode_step_bytes(100, rows=3) - costs.decode_step_bytes(0, rows=3) == pytest.approx(100 * kv)


def test_a_dense_step_reads_every_weight_at_any_width() -> None:
    opts = RuntimeOptions(dtype="float32")
    params = jax.eval_shape(lambda: dummy_params(TINY_DENSE))
    costs = model_costs(TINY_DENSE, params, opts)
    assert costs.expert_weight_bytes == 0
    assert costs.decode_step_bytes(0, rows=1) == costs.decode_step_bytes(0, rows=64) == costs.step_weight_bytes
