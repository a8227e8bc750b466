"""Whatever a round's padding and idle rows hold, real sequences never see it.

A round pads its prompt chunk to a bucket and its decode part to a width; those rows run
token 0 through the model and write their keys and values to the trash page and their
recurrent state to the trash row. Masked positions of attention (pages past a context, the
unwritten tail of a page, rows outside a window) and padding positions of the delta rule may
therefore hold anything, non-finite values included, and a zero weight times nan is still nan.
On an H100 the 35B shape's exact repeats from the prefix cache (a one-token chunk continuing
a restored context, attended by the reference path over the pages) decoded nothing but nan
logits (docs/lab/server-rows-and-first-tokens.md, section 10).

Here token 0's embedding is nan, so every padding and idle row carries nan through every
layer (and into the trash page and row); prompts and outputs never contain token 0. A fresh
prompt beside another, an exact repeat and a partial hit from a prefix checkpoint must give
the tokens the clean model gives.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiny_configs import TINY_DENSE, TINY_HYBRID_MOE, TINY_MOE
from jaxllm.config import ModelConfig
from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.loading.dummy import dummy_params
from jaxllm.params import layout_params
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.sampling import SamplingParams

_MODELS = {"hybrid": TINY_HYBRID_MOE, "dense": TINY_DENSE, "moe": TINY_MOE}
_GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _run(cfg: ModelConfig, params, kernels: str) -> dict[str, list[int]]:
    """Two prompts side by side (a checkpoint of all but the first one's last token taken as
    it prefills), then an exact repeat and a partial hit from that checkpoint, side by side."""
    forced = (
        {}
        if kernels == "auto"
        else dict.fromkeys(("decode_delta", "decode_attention", "decode_norm", "decode_route"), kernels)
    )
    engine = Engine(
        cfg,
        params,
        eos_ids=[0],
        options=RuntimeOptions(dtype="float32", scan_layers=False, **forced),
        config=EngineConfig(
            max_slots=4,
            kv_bytes=1 << 20,
            max_seq_len=64,
            chunk_buckets=(4, 32),
            min_ctx_pages=4,
            decode_widths=(1, 4),
            decode_steps_per_call=2,
            chunk_segments=1,
            chunk_decode_width=4,
        ),
    )
    rng = np.random.default_rng(0)
    first, second, tail = (rng.integers(1, cfg.vocab_size, n).tolist() for n in (20, 13, 7))
    cut = len(first) - 1
    donor = engine.add(first, _GREEDY, stops=[cut])
    other = engine.add(second, _GREEDY)
    ckpt = None
    while donor.finish_reason is None or other.finish_reason is None:
        engine.step()
        if ckpt is None and engine.can_extract(donor, cut):
            ckpt = engine.extract(donor, cut)
    assert ckpt is not None
    engine.remove(donor)
    engine.remove(other)
    repeat = engine.add(first, _GREEDY, checkpoint=ckpt, cached_tokens=cut)
    partial = engine.add(first[:cut] + tail, _GREEDY, checkpoint=ckpt, cached_tokens=cut)
    while repeat.finish_reason is None or partial.finish_reason is None:
        engine.step()
    return {
        s: seq.generated for s, seq in (("donor", donor), ("other", other), ("repeat", repeat), ("partial", partial))
    }


@pytest.mark.parametrize(
    "model, kernels", [("hybrid", "auto"), ("hybrid", "interpret"), ("dense", "auto"), ("moe", "auto")]
)
def test_nan_in_padding_rows_never_reaches_a_sequence(model: str, kernels: str) -> None:
    cfg = _MODELS[model]
    clean = layout_params(dummy_params(cfg, seed=1), False)
    poisoned = clean.replace(embed=clean.embed.at[0].set(np.nan))
    want = _run(cfg, clean, kernels)
    assert all(0 not in tokens for tokens in want.values())  # else token 0 would be a real nan input
    assert want["repeat"] == want["donor"]
    assert _run(cfg, poisoned, kernels) == want
