"""Model loading: one entry point dispatching on the checkpoint format.

Formats: "gguf" (llama.cpp file), "safetensors" (Hugging Face directory), "orbax" (a
`save_model` directory), "dummy" (random weights at the shapes of a configs/*.json preset).
"""

from __future__ import annotations

import sys
from pathlib import Path

from jaxllm.config import ModelConfig, load_config_json
from jaxllm.params import Params, layout_params
from jaxllm.runtime_options import RuntimeOptions

FORMATS = ("auto", "gguf", "safetensors", "orbax", "dummy")

# Format modules are imported inside the functions below: orbax, gguf and safetensors are
# slow to import and a process only ever needs the one it loads from.


def detect_format(path: Path) -> str:
    """Guesses the checkpoint format of an existing path.

    Raises:
      FileNotFoundError: nothing at `path`.
      ValueError: a path that matches no known format.
    """
    if not path.exists():
        raise FileNotFoundError(f"model path not found: {path}")
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        # The suffix decides for named files, so a corrupt .gguf gets the GGUF loader's error.
        if path.suffix.lower() == ".gguf" or magic == b"GGUF":
            return "gguf"
    if path.is_dir() and (path / "config.json").is_file():
        return "safetensors"
    if path.is_dir():
        from jaxllm.loading.orbax_io import is_orbax_model

        if is_orbax_model(path):
            return "orbax"
    raise ValueError(
        f"cannot tell the model format of {path}: expected a .gguf file, a directory with "
        "config.json (safetensors) or a jaxllm orbax directory; for random weights pass "
        "fmt='dummy' with a configs/*.json path"
    )


def load_model(
    source: str | Path,
    *,
    fmt: str = "auto",
    options: RuntimeOptions = RuntimeOptions(),
    config_path: str | Path | None = None,
    progress: bool | None = None,
) -> tuple[ModelConfig, Params]:
    """Loads (config, params) from a checkpoint path, the default model name, or a preset.

    Args:
      source: a .gguf file, a Hugging Face directory, an orbax model directory, the
        default model's name ("smollm2"), or for fmt="dummy" a configs/*.json preset.
      fmt: one of FORMATS; "auto" detects from the path.
      options: how this machine runs the model; its `dtype` is the params' dtype and its
        `scan_layers` their layout (stacked for `lax.scan`, or a tuple of layers).
      config_path: for fmt="dummy", the preset JSON when `source` is not itself one.
      progress: show tqdm bars while reading files (None: when stderr is a terminal, so a
        log file gets no bar redrawn thousands of times).

    Returns:
      The ModelConfig and Params.

    Raises:
      FileNotFoundError: the source does not exist.
      ValueError: unknown format or a file that does not parse as its format.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown model format {fmt!r}; known: {', '.join(FORMATS)}")
    if progress is None:
        progress = sys.stderr.isatty()
    cfg, params = _load(source, fmt, options.dtype, config_path, progress, unrolled=not options.scan_layers)
    return cfg, runtime_layout(params, options)  # the loaded tree is ours alone


def runtime_layout(params: Params, options: RuntimeOptions) -> Params:
    """A canonical tree in the layout `options` run (`params.layout_params`), consumed."""
    # Imported here: the model package imports this one (the default model's cache directory).
    from jaxllm.model.kernel_choice import out_in_weights

    return layout_params(params, options.scan_layers, out_in=out_in_weights(options), consume=True)


def _load(
    source: str | Path, fmt: str, dtype: str, config_path: str | Path | None, progress: bool, *, unrolled: bool
) -> tuple[ModelConfig, Params]:
    if fmt == "dummy":
        from jaxllm.loading.dummy import dummy_params

        cfg = load_config_json(config_path or source)
        # Drawn in the runtime's layer layout: unstacking afterwards needs a stacked leaf
        # beside the model, more than an 80 GB card has for a 30B MoE.
        return cfg, dummy_params(cfg, dtype=dtype, unrolled=unrolled)

    from jaxllm.loading.default_model import resolve_model

    path = resolve_model(str(source))  # maps the default name to its cached GGUF
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "gguf":
        from jaxllm.loading.gguf import load_gguf_model

        return load_gguf_model(path, dtype=dtype, progress=progress)
    if fmt == "safetensors":
        from jaxllm.loading.safetensors import load_safetensors_model

        return load_safetensors_model(path, dtype=dtype, progress=progress)
    from jaxllm.loading.orbax_io import load_orbax_model

    return load_orbax_model(path, dtype=dtype)
