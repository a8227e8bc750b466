"""Tiny model configs several test files share (tests/ is on sys.path, see conftest)."""

from __future__ import annotations

from jaxllm.config import ModelConfig

# The linear-attention (DeltaNet) and partial-RoPE fields of the tiny hybrids.
TINY_DELTANET = dict(
    linear_n_k_heads=2, linear_n_v_heads=4, linear_k_dim=8, linear_v_dim=8, conv_kernel=4, rotary_dim=4
)

# A Qwen3-Next-shaped hybrid: DeltaNet and gated attention alternating, routed experts with a
# shared expert; small enough that an engine compiles in seconds on the CPU.
TINY_HYBRID_MOE = ModelConfig(
    family="qwen3_next",
    vocab_size=96,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=0,
    max_position=256,
    n_experts=4,
    n_experts_per_token=2,
    moe_ffn_dim=16,
    shared_expert_ffn_dim=24,
    layer_types=("linear_attention", "full_attention") * 2,
    **TINY_DELTANET,
)

# A llama-shaped dense model and a qwen3_moe one at the same widths.
TINY_DENSE = ModelConfig(
    family="llama",
    vocab_size=96,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=64,
    max_position=256,
)
TINY_MOE = TINY_DENSE.replace(
    family="qwen3_moe",
    ffn_dim=0,
    n_experts=6,  # not a power of two: the MoE kernels pad the experts
    n_experts_per_token=2,
    moe_ffn_dim=16,
)
