"""A checkpoint's own sampling defaults (temperature, top_p, ...), as vLLM reads them.

Hugging Face directories (and our orbax directories, which keep one beside the weights) carry
`generation_config.json`; GGUF files may carry `general.sampling.*` metadata. A server uses
these where neither its settings nor the request name a value; OpenAI's defaults fill the rest.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# generation_config.json key -> our name (SamplingParams' and the server's).
_HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
# GGUF metadata (llama.cpp's `general.sampling.*`) -> our name.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def _clean(raw: dict[str, Any]) -> dict[str, float]:
    """Finite numbers only (a config with `"top_k": null` or junk names nothing)."""
    out = {}
    for name, value in raw.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = int(value) if name == "top_k" else float(value)
    return out


def generation_defaults(path: str | Path, reader: Any = None) -> dict[str, float]:
    """The sampling defaults a checkpoint names, by our field names; {} when it names none.

    Args:
      path: a Hugging Face or orbax model directory, or a .gguf file.
      reader: an open `gguf.GGUFReader` of `path`, to skip parsing it again.
    """
    path = Path(path)
    if path.is_dir():
        f = path / "generation_config.json"
        try:
            gen = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}
        except ValueError:
            return {}
        if not isinstance(gen, dict):
            return {}
        return _clean({ours: gen[key] for key, ours in _HF_KEYS.items() if key in gen})
    if path.suffix == ".gguf" and path.is_file():
        if reader is None:
            import gguf

            reader = gguf.GGUFReader(str(path))
        raw = {}
        for key, ours in _GGUF_KEYS.items():
            field = reader.fields.get(key)
            if field is not None:
                raw[ours] = field.contents()
        return _clean(raw)
    return {}
