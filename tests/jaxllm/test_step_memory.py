"""What the compiled decode step does with memory: no whole-cache copies, one layer's context
live at a time (see `jaxllm.model.forward._after`)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import steps
from jaxllm.config import ModelConfig
from jaxllm.loading.dummy import dummy_params
from jaxllm.model.forward import _after
from jaxllm.params import layout_params
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.state import StateLayout

# SmolLM2-135M's shapes with 4 layers (tiny shapes do not show the copies).
CFG = ModelConfig(
    family="llama",
    vocab_size=49152,
    d_model=576,
    n_layers=4,
    n_heads=9,
    n_kv_heads=3,
    head_dim=64,
    ffn_dim=1536,
    max_position=512,
)
OPTS = RuntimeOptions()
# One slot: its one-token K/V write is a dynamic-update-slice, the case XLA copied the cache for.
LAYOUT = StateLayout(max_slots=1, page_size=16, n_pages=31, max_pages_per_seq=28)


def _abstract_params_and_state(scan_layers: bool) -> tuple:
    """Shapes only: compiling needs no values, and drawing and laying out 135M-sized weights
    eagerly cost the tests ~70 s where XLA's CPU code is unoptimised (conftest)."""
    params = jax.eval_shape(lambda: layout_params(dummy_params(CFG), scan_layers))
    return params, jax.eval_shape(lambda: steps.new_state(CFG, LAYOUT, OPTS))


def _compiled_decode(scan_layers: bool) -> str:
    params, state = _abstract_params_and_state(scan_layers)
    inputs = steps.round_inputs(LAYOUT.max_slots, CFG.vocab_size)
    lowered = steps.decode_steps.lower(
        params, state, inputs, cfg=CFG, opts=OPTS, n_steps=2, n_ctx_pages=28, decode_width=LAYOUT.max_slots
    )
    return lowered.compile().as_text()


@pytest.mark.parametrize("scan_layers", [True, False])
def test_decode_step_never_copies_the_cache(scan_layers):
    hlo = _compiled_decode(scan_layers)
    L, P, page, K, Dh = CFG.n_layers, LAYOUT.n_pages, LAYOUT.page_size, CFG.n_kv_heads, CFG.head_dim
    cache = re.escape(f"f32[{L},{P},{page},{K},{Dh}]")
    assert not re.search(cache + r"\{[0-9,]*\} copy\(", hlo)


def test_unrolled_layers_keep_one_layers_context_live():
    # The temp buffer must not grow with the layer count: each layer's gathered context K/V
    # ([slots, context, K, Dh], twice) is read right before that layer, not all up front.
    params, state = _abstract_params_and_state(False)
    inputs = steps.round_inputs(LAYOUT.max_slots, CFG.vocab_size)
    compiled = steps.decode_steps.lower(
        params, state, inputs, cfg=CFG, opts=OPTS, n_steps=1, n_ctx_pages=28, decode_width=LAYOUT.max_slots
    ).compile()
    context_bytes = 2 * LAYOUT.max_slots * 28 * LAYOUT.page_size * CFG.n_kv_heads * CFG.head_dim * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < CFG.n_layers * context_bytes


@pytest.mark.parametrize("anchor", [1.5, -2.0, 0.0, -0.0, float("inf"), float("-inf"), float("nan")])
def test_after_returns_the_values_unchanged(anchor):
    values = jnp.asarray([0, 7, 2**30, np.iinfo(np.int32).max - 1], jnp.int32)
    out = jax.jit(_after)(values, jnp.full((2, 3), anchor, jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(values))
