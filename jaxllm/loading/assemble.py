"""Assemble a Params tree from per-layer host tensors, shared by the file-format loaders.

Loaders translate checkpoint tensors into our layout (see `jaxllm/params.py`) and hand them
over one at a time; the assembler writes each into a preallocated, stacked host buffer in
the target dtype, so peak host memory is one copy of the model rather than per-layer lists
plus a stacked copy. Keys are the dotted field paths of `Params`: "embed", "final_norm",
"lm_head", "layers.attn.wq", "layers.mlp.router", ...

Also holds the reshapes from Hugging Face `[out, in]` linear weights to our einsum layouts,
since GGUF tensors, once read into numpy order, have the same orientation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.params import Params, check_params, param_shapes

# Routed experts' leaves (their first axes are (layers, E)); shared experts are dense.
_EXPERT_SUFFIXES = (".mlp.w_gate", ".mlp.w_up", ".mlp.w_down")


def _dotted(path: tuple) -> str:
    return ".".join(k.name for k in path)


def _stacked_axes(key: str, cfg: ModelConfig) -> int:
    """How many leading axes of a leaf are indexed by (layer[, expert]) rather than stored whole.

    "layers.*" leaves and the MTP block's are stacked over their layers; a hybrid model
    stacks each layer kind apart, so a loader's layer index is the index within its kind.
    """
    if not (key.startswith("layers.") or key.startswith("mtp.block.")):
        return 0
    return 2 if cfg.is_moe and key.endswith(_EXPERT_SUFFIXES) else 1


class ParamAssembler:
    """Collects tensors into stacked host buffers and builds a checked `Params` tree."""

    def __init__(self, cfg: ModelConfig, dtype: str = "float32") -> None:
        """Preallocates one host buffer per leaf of `param_shapes(cfg, dtype)`.

        Args:
          cfg: the model config.
          dtype: the dtype of the built params.
        """
        self.cfg = cfg
        leaves, self._treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, dtype))
        self._order = [_dotted(path) for path, _ in leaves]
        self._buffers: dict[str, np.ndarray] = {}
        self._filled: dict[str, np.ndarray] = {}
        for key, (_, sds) in zip(self._order, leaves):
            # np.empty is lazy (untouched pages cost nothing until written).
            self._buffers[key] = np.empty(sds.shape, dtype=sds.dtype)
            self._filled[key] = np.zeros(sds.shape[: _stacked_axes(key, cfg)], dtype=bool)

    def wants(self, key: str) -> bool:
        """Whether the config has a leaf `key` (e.g. False for "lm_head" when tied)."""
        return key in self._buffers

    def put(self, key: str, value: np.ndarray, layer: int | None = None, expert: int | None = None) -> None:
        """Stores one tensor, already in our layout, casting to the target dtype.

        Args:
          key: dotted leaf name, e.g. "layers.attn.wq".
          value: the tensor without the stacked axes it is indexed by.
          layer: the layer index for "layers.*" keys.
          expert: the expert index for one expert of a stacked MoE weight; None stores
            all experts of the layer at once.

        Raises:
          ValueError: unknown key, or a shape that does not match the config.
        """
        if key not in self._buffers:
            raise ValueError(f"tensor {key!r} is not part of a {self.cfg.family} model with this config")
        index: tuple[int, ...] = ()
        buf = self._buffers[key]
        if _stacked_axes(key, self.cfg):
            n_layers = buf.shape[0]
            if layer is None or not 0 <= layer < n_layers:
                raise ValueError(f"tensor {key!r}: layer {layer} out of range 0..{n_layers - 1}")
            index = (layer,)
            if expert is not None:
                if not 0 <= expert < self.cfg.n_experts:
                    raise ValueError(f"tensor {key!r}: expert {expert} out of range 0..{self.cfg.n_experts - 1}")
                index = (layer, expert)
        want = buf.shape[len(index) :]
        if tuple(value.shape) != tuple(want):
            where = f" (layer {layer}" + (f", expert {expert})" if expert is not None else ")") if index else ""
            raise ValueError(f"tensor {key!r}{where} has shape {tuple(value.shape)}, expected {tuple(want)}")
        buf[index] = value  # numpy (and ml_dtypes for bfloat16) casts on assignment.
        self._filled[key][index] = True

    def missing(self) -> list[str]:
        """Names of the leaves (with layer / expert) that were never stored."""
        out = []
        for key in self._order:
            for idx in np.argwhere(~self._filled[key]):  # a 0-d mask yields one empty index
                out.append(key + "".join(f"[{int(i)}]" for i in idx))
        return out

    def finish(self) -> Params:
        """Moves the buffers to the default device and returns the checked Params.

        Raises:
          ValueError: some tensor was never stored, or shapes disagree with the config.
        """
        missing = self.missing()
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint lacks tensors: {', '.join(missing[:5])}{more}")
        leaves = []
        for key in self._order:
            leaves.append(jnp.asarray(self._buffers[key]))
            del self._buffers[key]  # release host memory as soon as it is on the device
        params = jax.tree_util.tree_unflatten(self._treedef, leaves)
        check_params(params, self.cfg)
        return params


def heads_in(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF q/k/v_proj weight [n*Dh, D] -> our [D, n, Dh]."""
    return w.T.reshape(w.shape[1], n_heads, w.shape[0] // n_heads)


def heads_out(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF o_proj weight [D, H*Dh] -> our [H, Dh, D]."""
    return w.T.reshape(n_heads, w.shape[1] // n_heads, w.shape[0])


def heads_bias(b: np.ndarray, n_heads: int) -> np.ndarray:
    """HF q/k/v_proj bias [n*Dh] -> our [n, Dh]."""
    return b.reshape(n_heads, b.shape[0] // n_heads)


def linear(w: np.ndarray) -> np.ndarray:
    """HF linear weight [out, in] -> our [in, out]; also works stacked: [E, out, in] -> [E, in, out]."""
    return np.swapaxes(w, -1, -2)
