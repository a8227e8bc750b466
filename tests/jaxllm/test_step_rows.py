"""How many rows a compiled round's lm_head and sampler work on."""

from __future__ import annotations

import re

import numpy as np

from jaxllm import steps
from jaxllm.config import ModelConfig
from jaxllm.loading.dummy import dummy_params
from jaxllm.params import layout_params
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.state import StateLayout

CFG = ModelConfig(
    family="llama",
    vocab_size=1000,
    d_model=32,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    ffn_dim=64,
    max_position=128,
)
OPTS = RuntimeOptions(decode_matmul="xla")
LAYOUT = StateLayout(max_slots=8, page_size=16, n_pages=17, max_pages_per_seq=4)


def _logits_rows(decode_width: int, drafts: int = 0) -> set[int]:
    """Row counts of the [rows, vocab] products in a lowered decode call (with `drafts`, a
    verification round of 1 + drafts tokens a slot)."""
    params = layout_params(dummy_params(CFG), False)
    state = steps.new_state(CFG, LAYOUT, OPTS)
    inputs = steps.round_inputs(LAYOUT.max_slots, CFG.vocab_size)
    common = dict(cfg=CFG, opts=OPTS, n_ctx_pages=4, decode_width=decode_width)
    if drafts:
        B = LAYOUT.max_slots
        none = steps.Drafts(tokens=np.zeros((B, drafts), np.int32), count=np.zeros((B,), np.int32))
        text = steps.verify.lower(params, state, inputs, none, **common).as_text()
    else:
        text = steps.decode_steps.lower(params, state, inputs, n_steps=1, **common).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    return {int(m) for line in dots for m in re.findall(rf"-> tensor<(\d+)x{CFG.vocab_size}xf32>", line)}


def test_a_decode_part_draws_for_its_own_rows_only():
    # A one-row decode part of an 8-slot state: the lm_head product and the sampler after it
    # run on one row, not on every slot (the others draw nothing in such a round).
    assert _logits_rows(1) == {1}
    assert _logits_rows(8) == {8}


def test_a_verification_round_runs_on_its_width_only():
    # 1 + 3 tokens of one verifying slot in an 8-slot state: four rows, not 32.
    assert _logits_rows(1, drafts=3) == {4}
    assert _logits_rows(8, drafts=3) == {32}
