"""What a token costs the hardware: bytes a decode step reads and FLOPs a token takes.

These are the numerators of MBU (model bandwidth utilisation: bytes a step must read / step
time / peak bandwidth) and MFU (FLOPs / time / peak FLOP/s), shared by the engine benchmark
and the server (which publishes them in /v1/state for `benchmarks/bench_serve.py`).
"""

from __future__ import annotations

import dataclasses

import jax

from jaxllm.config import ModelConfig
from jaxllm.params import Params
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.state import kv_bytes_per_page


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    # Bytes of weights one decode step reads: every weight except the input embedding table,
    # of which a step reads one row per token (a tied table is read whole by the LM head).
    # For MoE models this counts every expert: an upper bound at batch 1.
    step_weight_bytes: int
    kv_bytes_per_position: int  # K and V of one position, all layers
    layer_flops_per_token: int  # 2 x layer weights a token multiplies (MoE: only routed experts)
    head_flops_per_token: int  # the LM head, paid only by tokens that sample (not prompt tokens)
    attention_flops_per_pair: int  # QK^T and PV of one (query, key) pair, all layers

    def decode_step_bytes(self, context_positions: float) -> float:
        """Bytes a decode step reads with `context_positions` cached positions in all."""
        return self.step_weight_bytes + self.kv_bytes_per_position * context_positions

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
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    embed = params.embed.size * params.embed.dtype.itemsize
    step_bytes = total - embed if params.lm_head is not None else total
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
    )
