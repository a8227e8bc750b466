"""Save and restore pytrees and whole models with orbax-checkpoint.

A model checkpoint is a directory holding `params/` (an orbax StandardCheckpointer
checkpoint) and `model_config.json` (our ModelConfig fields; deliberately not named
config.json, which marks a Hugging Face directory for `load_model`'s auto detection), and,
when saved with one, the tokenizer in Hugging Face's files (`tokenizer.json`,
`tokenizer_config.json` with the chat template, `generation_config.json` with the eos ids and
the sampling defaults), so that `jaxllm.load` gets the same tokenizer and template back.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxllm.config import ModelConfig, RopeScaling
from jaxllm.params import Params, canonical_params, check_params, param_shapes
from jaxllm.tokenizer import Tokenizer

CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"


def save_pytree(path: str | Path, tree: Any, *, force: bool = True) -> None:
    """Writes a pytree of arrays to `path`, blocking until the (async) save has finished.

    Args:
      path: checkpoint directory; made absolute because orbax requires it.
      tree: any pytree of jax arrays (dtypes and shardings are recorded).
      force: overwrite an existing checkpoint at `path`.
    """
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), tree, force=force)
        # The save commits in a background thread; return only once it is on disk.
        ckptr.wait_until_finished()


def restore_pytree(path: str | Path, like: Any = None) -> Any:
    """Reads a pytree written by `save_pytree`.

    Args:
      path: checkpoint directory.
      like: optional target tree of arrays or `jax.ShapeDtypeStruct`s (with `.sharding`
        to place shards); gives the result its structure (e.g. dataclasses), dtypes and
        shardings. Without it, orbax's nested containers come back with the saved dtypes.

    Returns:
      The restored pytree.

    Raises:
      FileNotFoundError: no checkpoint at `path`.
    """
    path = Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(f"orbax checkpoint not found: {path}")
    if like is not None:
        like = jax.tree.map(_abstract, like)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, like)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """A restore target for one leaf, keeping its sharding when it has one."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        # Unplaced targets restore onto the default device.
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> JSON-able dict (rope_scaling nested)."""
    return dataclasses.asdict(cfg)


# Runtime options that checkpoints written before `RuntimeOptions` stored in their config.
_OLD_RUNTIME_KEYS = (
    "dtype",
    "scan_layers",
    "kv_dtype",
    "decode_attention",
    "decode_matmul",
    "decode_norm",
    "sampler_branches",
)


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """Inverse of `config_to_dict`; unknown keys are rejected by the dataclass."""
    d = {k: v for k, v in d.items() if k not in _OLD_RUNTIME_KEYS}
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    if "layer_types" in d:  # JSON gives a list; the config must stay hashable (static under jit)
        d["layer_types"] = tuple(d["layer_types"])
    return ModelConfig(**d)


def save_model(
    path: str | Path,
    cfg: ModelConfig,
    params: Params,
    *,
    tokenizer: Tokenizer | None = None,
    generation_defaults: dict[str, float] | None = None,
) -> None:
    """Writes params (orbax, the canonical tree) and the config (JSON) into directory `path`.

    Args:
      path: the directory (created).
      cfg, params: the model.
      tokenizer: saved beside the weights (with its chat template); without one, loading
        the directory gives a synthetic tokenizer.
      generation_defaults: sampling defaults (`jaxllm.loading.generation`) to store in
        generation_config.json.
    """
    check_params(params, cfg)
    params = canonical_params(params)  # a runtime tree (unrolled, fused) is stored like any other
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_pytree(path / PARAMS_DIR, params)
    (path / CONFIG_FILE).write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    if generation_defaults:
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        gen_file.write_text(json.dumps({**gen, **generation_defaults}, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_hf_dir(path)


def is_orbax_model(path: str | Path) -> bool:
    """Whether `path` looks like a `save_model` directory."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / PARAMS_DIR).is_dir()


def load_orbax_model(path: str | Path, *, dtype: str = "float32") -> tuple[ModelConfig, Params]:
    """Reads a `save_model` directory.

    Args:
      path: the directory.
      dtype: restore into this dtype, whatever the saved one (orbax casts on read).

    Returns:
      The ModelConfig and Params (on the default device).

    Raises:
      FileNotFoundError: the directory or its config/params are missing.
    """
    path = Path(path)
    if not is_orbax_model(path):
        raise FileNotFoundError(f"no jaxllm orbax model at {path} (expected {CONFIG_FILE} and {PARAMS_DIR}/)")
    cfg = config_from_dict(json.loads((path / CONFIG_FILE).read_text()))
    params = restore_pytree(path / PARAMS_DIR, like=param_shapes(cfg, dtype))
    check_params(params, cfg)
    return cfg, params
