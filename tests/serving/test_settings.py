"""The [engine] shapes derived from slots, context, K/V budget and backend (serving.settings)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from jaxllm.config import load_config_json
from jaxllm.engine_config import EngineConfig
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.state import kv_bytes_per_page, layout_for_budget
from serving.settings import EngineShape, derive_engine, load_settings, parse_settings

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_shapes_from_the_four_settings():
    e = derive_engine(slots=8, context=2048, kv_mib=256, backend="cpu")
    assert (e.max_slots, e.max_seq_len, e.kv_bytes, e.page_size) == (8, 2048, 256 << 20, 16)
    assert e.chunk_buckets == (32, 128, 256, 512)  # each at most doubles the one below
    assert (e.decode_steps_per_call, e.decode_widths, e.chunk_segments, e.chunk_decode_width) == (4, (1,), 1, 0)
    # A short context caps the buckets: no chunk longer than a sequence.
    assert derive_engine(slots=2, context=200, kv_mib=8, backend="cpu").chunk_buckets == (32, 128, 200)


def test_gpu_shapes_scale_with_slots():
    small = derive_engine(slots=8, context=2048, kv_mib=256, backend="gpu")
    assert small.chunk_buckets == (32, 128, 512) and small.decode_steps_per_call == 16
    assert small.min_ctx_pages == 2048 // 16  # one context bucket
    big = derive_engine(slots=64, context=2176, kv_mib=24000, backend="gpu")
    assert big.chunk_buckets == (512, 1024, 2048, 4096) and big.chunk_segments == 4
    assert (big.decode_widths, big.chunk_decode_width, big.decode_steps_per_call) == ((1, 8), 64, 8)
    assert big.min_ctx_pages == 136


def test_models_with_recurrent_layers_take_one_prompt_a_chunk():
    """Packing prompts side by side multiplies a hybrid model's delta-rule work by the segment
    count (each segment spans the chunk's width), so its GPU shapes pack none; dense ones still do."""
    hybrid = derive_engine(slots=64, context=2176, kv_mib=24000, backend="gpu", recurrent=True)
    dense = derive_engine(slots=64, context=2176, kv_mib=24000, backend="gpu")
    assert (hybrid.chunk_segments, dense.chunk_segments) == (1, 4)
    assert hybrid.chunk_decode_width == 64
    # A small bucket for the prompt's lone last token (the exact-repeat checkpoint ends the chunk
    # before it), none past the context: one prompt a chunk is never longer than a sequence.
    assert dense.chunk_buckets == (512, 1024, 2048, 4096) and hybrid.chunk_buckets == (32, 512, 1024, 2048, 4096)
    short = derive_engine(slots=64, context=1024, kv_mib=24000, backend="gpu", recurrent=True)
    assert short.chunk_buckets == (32, 512, 1024)
    gpu = parse_settings({"engine": {"backend": "gpu", "max_slots": 64, "max_seq_len": 2176, "kv_mib": 24000}}).engine
    assert gpu.engine_config(recurrent=True).chunk_segments == 1 and gpu.engine_config().chunk_segments == 4


def test_budget_zero_holds_every_slot_at_full_context():
    cfg = load_config_json(ROOT / "configs" / "smollm2-135m.json")
    opts = RuntimeOptions()
    e = derive_engine(
        slots=4, context=1000, kv_mib=0, backend="cpu", kv_bytes_per_position=kv_bytes_per_page(cfg, 1, opts)
    )
    layout = layout_for_budget(cfg, opts, kv_bytes=e.kv_bytes, max_slots=e.max_slots, max_seq_len=e.max_seq_len)
    assert layout.max_pages_per_seq == 63  # ceil(1000 / 16)
    assert layout.n_pages - 1 >= 4 * layout.max_pages_per_seq  # every slot full, trash page aside
    # A fixed budget gives the pages it pays for.
    e = derive_engine(slots=4, context=1000, kv_mib=64, backend="cpu")
    layout = layout_for_budget(cfg, opts, kv_bytes=e.kv_bytes, max_slots=4, max_seq_len=1000)
    assert layout.n_pages == (64 << 20) // kv_bytes_per_page(cfg, 16, opts)


def test_advanced_overrides_and_older_spellings():
    s = parse_settings({"engine": {"slots": 4, "backend": "cpu", "decode_steps_per_call": 2, "chunk_buckets": [8, 16]}})
    e = s.engine.engine_config()
    assert (e.max_slots, e.decode_steps_per_call, e.chunk_buckets) == (4, 2, (8, 16))
    old = parse_settings({"engine": {"max_slots": 3, "max_seq_len": 512, "kv_mib": 16}}).engine.engine_config(
        backend="cpu"
    )
    assert (old.max_slots, old.max_seq_len) == (3, 512)
    with pytest.raises(ValueError, match="backend"):
        parse_settings({"engine": {"backend": "tpu"}})
    with pytest.raises(ValueError, match="slots"):
        parse_settings({"engine": {"slots": 0}})
    with pytest.raises(ValueError, match="older spelling"):
        EngineShape(slots=4, max_slots=5)


@pytest.mark.parametrize("name", ["server.toml", "gpu-smollm2.toml", "gpu-llama3-8b.toml"])
def test_shipped_settings_derive_a_valid_engine(name):
    settings = load_settings(ROOT / "configs" / name)
    assert isinstance(settings.engine.engine_config(backend="cpu"), EngineConfig)
    with open(ROOT / "configs" / name, "rb") as f:
        engine = tomllib.load(f)["engine"]
    # No hand-tuned shapes: the four user settings, plus the feature switches (research samplers,
    # batch invariance).
    assert set(engine) - {"extra_samplers", "batch_invariant"} == {"slots", "context", "kv_mib", "backend"}


def test_serve_refuses_a_missing_or_bad_config(tmp_path):
    from serving.cli import serve

    def never():
        raise AssertionError("the model must not load")

    kw = dict(model_name="x", host="127.0.0.1", port=0, api_key=None)
    with pytest.raises(SystemExit, match="no such file"):
        serve(never, config=str(tmp_path / "missing.toml"), **kw)
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nslots = 0\n")
    with pytest.raises(SystemExit, match="slots"):
        serve(never, config=str(bad), **kw)


def test_batch_invariant_from_the_file_or_the_command_line(tmp_path):
    """`[engine] batch_invariant` reaches the EngineConfig; `jaxllm serve --batch-invariant`
    sets it over the file, and a reload of a file without it keeps it (no restart asked)."""
    from serving.cli import build_parser
    from serving.settings import SettingsStore

    on = parse_settings(tomllib.loads("[engine]\nbatch_invariant = true\n"))
    assert on.engine.engine_config(backend="cpu").batch_invariant
    assert not parse_settings({}).engine.engine_config(backend="cpu").batch_invariant
    args = build_parser().parse_args(["serve", "--batch-invariant"])
    assert args.batch_invariant and not build_parser().parse_args(["serve"]).batch_invariant
    path = tmp_path / "s.toml"
    path.write_text("[engine]\nslots = 4\n")
    store = SettingsStore(load_settings(path), path, engine_overrides={"batch_invariant": True})
    assert store.current.engine.engine_config(backend="cpu").batch_invariant
    assert store.reload()["needs_restart"] == [] and store.current.engine.batch_invariant
