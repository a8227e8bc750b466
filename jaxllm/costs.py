"""What a token costs the hardware: bytes a decode step reads and FLOPs a token takes.

These are the numerators of MBU (model bandwidth utilisation: bytes a step must read / step
time / peak bandwidth) and MFU (FLOPs / time / peak FLOP/s), shared by the engine benchmark
and the server (which publishes them in /v1/state for `benchmarks/bench_serve.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxllm.config import ModelConfig
from jaxllm.params import MoeParams, Params
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.state import kv_bytes_per_page


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    # Bytes of weights a decode step of the whole batch reads if every routed expert is
    # touched: every weight except the input embedding table, of which a step reads one row per
    # token (a tied table is read whole by the LM head), and except an MTP head (only drafting
    # reads it). `decode_step_bytes` takes off the experts a step's rows do not route to.
    step_weight_bytes: int
    kv_bytes_per_position: int  # K and V of one position, all layers
    layer_flops_per_token: int  # 2 x layer weights a token multiplies (MoE: only routed experts)
    head_flops_per_token: int  # the LM head, paid only by tokens that sample (not prompt tokens)
    attention_flops_per_pair: int  # QK^T and PV of one (query, key) pair, all layers
    # MoE: the routed experts' share of step_weight_bytes (every layer, every expert), and the
    # routing (0 for dense models, and from servers that predate these fields).
    expert_weight_bytes: int = 0
    n_experts: int = 0
    experts_per_token: int = 0

    def decode_step_bytes(self, context_positions: float, rows: int = 1) -> float:
        """Bytes a step of `rows` token rows (decoding sequences, or a verification's positions)
        reads with `context_positions` cached positions in all: the weights, with only the
        experts `rows` uniformly routed tokens are expected to touch, plus the K/V."""
        weights = float(self.step_weight_bytes)
        if self.n_experts:
            touched = expected_distinct_experts(self.n_experts, self.experts_per_token, rows) / self.n_experts
            weights -= self.expert_weight_bytes * (1 - touched)
        return weights + self.kv_bytes_per_position * context_positions

    def prefill_flops(self, prompt_len: int) -> float:
        """FLOPs of prefilling one causal prompt of `prompt_len` tokens."""
        return (
            self.layer_flops_per_token * prompt_len
            + self.head_flops_per_token
            + self.attention_flops_per_pair * prompt_len * prompt_len / 2
        )

    def decode_flops(self, context_positions: float) -> float:
        """FLOPs of one decode token attending to `context_positions` positions."""
        return (
            self.layer_flops_per_token + self.head_flops_per_token + self.attention_flops_per_pair * context_positions
        )


def model_costs(cfg: ModelConfig, params: Params, opts: RuntimeOptions) -> ModelCosts:
    """Costs from the params' real sizes and dtypes (host metadata only, no device reads)."""
    total = _bytes(params)
    embed = _bytes(params.embed) if params.lm_head is not None else 0
    step_bytes = total - embed - (_bytes(params.mtp) if params.mtp is not None else 0)
    if cfg.is_moe:
        dense_ffn = cfg.n_experts_per_token * 3 * cfg.d_model * cfg.moe_ffn_dim + cfg.d_model * cfg.n_experts
    else:
        dense_ffn = 3 * cfg.d_model * cfg.ffn_dim
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    return ModelCosts(
        step_weight_bytes=int(step_bytes),
        kv_bytes_per_position=kv_bytes_per_page(cfg, 1, opts),
        layer_flops_per_token=2 * cfg.n_layers * (attn + dense_ffn),
        head_flops_per_token=2 * cfg.vocab_size * cfg.d_model,
        attention_flops_per_pair=4 * cfg.n_layers * cfg.n_heads * cfg.head_dim,
        expert_weight_bytes=_routed_expert_bytes(params.layers) if cfg.is_moe else 0,
        n_experts=cfg.n_experts,
        experts_per_token=cfg.n_experts_per_token,
    )


def _bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _routed_expert_bytes(layers: Any) -> int:
    """Bytes of the routed experts' matrices (`MoeParams.w_gate/w_up/w_down`) in every layer;
    a shared expert (`MoeParams.shared`) is read by every token, so it is not among them."""
    moe = [m for m in jax.tree.leaves(layers, is_leaf=lambda x: isinstance(x, MoeParams)) if isinstance(m, MoeParams)]
    return sum(_bytes((m.w_gate, m.w_up, m.w_down)) for m in moe)


def expected_distinct_experts(n_experts: int, per_token: int, tokens: int) -> float:
    """Experts of one layer that a round of `tokens` tokens touches when each token routes to
    `per_token` of `n_experts` uniformly at random (random weights route about so; a trained
    model's consecutive tokens share more): n (1 - (1 - k / n)^t)."""
    return n_experts * (1 - (1 - per_token / n_experts) ** tokens)
