"""GGUF files of the hybrid family (llama.cpp architectures `qwen3next`, `qwen35`, `qwen35moe`)
-> a `qwen3_next` ModelConfig and our layout (`jaxllm.params.HybridLayers`).

What llama.cpp's converter (convert_hf_to_gguf.py: Qwen3NextModel, _LinearAttentionVReorderBase,
Qwen3_5TextModel, Qwen3_5MoeTextModel) does to the Hugging Face tensors, undone here:
- Zero-centred RMSNorms (every `*norm.weight` but the DeltaNet's gated `linear_attn.norm`) are
  written as `1 + w`: exactly what we store, so they load as they are.
- `A_log` is written as `ssm_a = -exp(A_log)`; we recover `a_log = log(-ssm_a)`.
- `dt_bias` becomes `ssm_dt.bias`; conv1d [C, 1, K] is squeezed to `ssm_conv1d` [C, K].
- Qwen3-Next's grouped `in_proj_qkvz` is split into `attn_qkv` (all q heads, all k heads,
  all v heads) and `attn_gate` (z); older files keep it whole as `ssm_in` (llama.cpp still
  reads both). `in_proj_ba` stays grouped per key head as `ssm_ba`. Both grouped tensors
  are split by hf_hybrid's own helpers (the layout is HF's).
- Qwen3.5 (`qwen35`, `qwen35moe`) keeps q/k/v, z, b, a apart (`attn_qkv`, `attn_gate`,
  `ssm_beta`, `ssm_alpha`) but reorders the value heads from grouped (value head h served by
  key head h // r, HF's order and ours) to tiled (value head h served by key head h % Hk, so
  ggml can broadcast with a plain repeat), wherever a value-head axis appears: the v rows of
  attn_qkv and of ssm_conv1d, the rows of attn_gate / ssm_beta / ssm_alpha, ssm_a, ssm_dt
  and the columns of ssm_out. `untile_value_heads` inverts it. Qwen3-Next files are not
  reordered (its graph repeats key heads interleaved).
- Gated attention's `attn_q` is HF's q_proj as is: per head the query, then its gate.
- Layer i is a full-attention layer where `blk.i.attn_q.weight` exists; the file's
  `full_attention_interval` must agree (llama.cpp derives the layer kinds from it).
- Qwen3.5's multimodal RoPE (`rope.dimension_sections`) rotates every section by the token
  position for text, which is plain (partial) RoPE over `rope.dimension_count` dims.

Newer converters append the multi-token-prediction head as extra blocks
(`nextn_predict_layers`, `blk.{n}.nextn.*`); gguf-py 0.19 has no tensor names for them in
these architectures, and they are not loaded: the model loads without its MTP head.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np

from jaxllm.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from jaxllm.loading.assemble import ParamAssembler, heads_in, heads_out, linear
from jaxllm.loading.hf_hybrid import _split_ba, _split_qkvz, kind_index


def _f32(v: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (as `gguf._f32`; kept
    here so the hybrid mapping does not import its caller back)."""
    return float(np.format_float_positional(np.float32(v), unique=True, trim="-"))


# Architectures whose converter tiles the value heads (see the module docstring).
_TILED_ARCHS = ("qwen35", "qwen35moe")
_MOE_ARCHS = ("qwen3next", "qwen35moe")
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def untile_value_heads(w: np.ndarray, axis: int, n_k_heads: int, n_v_heads: int) -> np.ndarray:
    """Value heads along `axis` from llama.cpp's tiled order back to grouped (HF) order.

    The converter views the axis as [Hk, r, d] (grouped: r = Hv / Hk value heads per key
    head, d the per-head size) and writes it as [r, Hk, d]; here the axis is viewed as
    [r, Hk, d] and swapped back. d is inferred (1 for per-head scalars such as ssm_a).
    """
    axis = axis % w.ndim
    r = n_v_heads // n_k_heads
    if r == 1:
        return w
    n = w.shape[axis]
    shape = w.shape[:axis] + (r, n_k_heads, n // n_v_heads) + w.shape[axis + 1 :]
    return np.swapaxes(w.reshape(shape), axis, axis + 1).reshape(w.shape)


def hybrid_gguf_config(reader: gguf.GGUFReader, arch: str, meta: Callable[..., Any]) -> ModelConfig:
    """The ModelConfig of a hybrid GGUF (metadata plus which blocks hold attention tensors).

    Args:
      reader: the open file.
      arch: qwen3next, qwen35 or qwen35moe.
      meta: `meta(key, default=...)` reads `{arch}.{key}`, raising ValueError when a
        required key is missing.

    Raises:
      ValueError: missing metadata, a block that is neither kind, or layer kinds that
        disagree with the file's full_attention_interval.
    """
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    n_blocks = int(meta("block_count"))
    n_mtp = int(meta("nextn_predict_layers", 0))
    n_layers = n_blocks - n_mtp
    types = []
    for i in range(n_layers):
        if f"blk.{i}.attn_q.weight" in names:
            types.append(FULL_ATTENTION)
        elif f"blk.{i}.ssm_a" in names or f"blk.{i}.ssm_conv1d.weight" in names:
            types.append(LINEAR_ATTENTION)
        else:
            raise ValueError(f"GGUF block {i} has neither attention (attn_q) nor linear-attention (ssm_*) tensors")
    interval = meta("full_attention_interval", None)
    if interval is not None:
        want = [FULL_ATTENTION if (i + 1) % int(interval) == 0 else LINEAR_ATTENTION for i in range(n_layers)]
        if want != types:
            raise ValueError(
                f"GGUF {arch}.full_attention_interval {interval} disagrees with the blocks' tensors "
                f"({''.join('F' if t == FULL_ATTENTION else 'L' for t in types)})"
            )
    d_model = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", d_model // n_heads))
    n_v_heads = int(meta("ssm.time_step_rank"))
    moe = arch in _MOE_ARCHS
    return ModelConfig(
        family="qwen3_next",
        vocab_size=int(names["token_embd.weight"].shape[1]),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(meta("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(meta("feed_forward_length", 0)),
        max_position=int(meta("context_length", 4096)),
        rms_eps=_f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(meta("rope.freq_base", 10000.0)),
        tie_embeddings="output.weight" not in names,
        qk_norm=True,
        n_experts=int(meta("expert_count")) if moe else 0,
        n_experts_per_token=int(meta("expert_used_count")) if moe else 0,
        moe_ffn_dim=int(meta("expert_feed_forward_length")) if moe else 0,
        norm_topk_prob=bool(meta("expert_weights_norm", True)),
        layer_types=tuple(types),
        linear_n_k_heads=int(meta("ssm.group_count")),
        linear_n_v_heads=n_v_heads,
        linear_k_dim=int(meta("ssm.state_size")),
        linear_v_dim=int(meta("ssm.inner_size")) // n_v_heads,
        conv_kernel=int(meta("ssm.conv_kernel")),
        rotary_dim=int(meta("rope.dimension_count", head_dim)),
        shared_expert_ffn_dim=int(meta("expert_shared_feed_forward_length", 0)) if moe else 0,
    )


def _untile_qkv_rows(cfg: ModelConfig, w: np.ndarray) -> np.ndarray:
    """attn_qkv rows / ssm_conv1d channels: q and k untouched, the v part untiled."""
    qk = 2 * cfg.linear_n_k_heads * cfg.linear_k_dim
    v = untile_value_heads(w[qk:], 0, cfg.linear_n_k_heads, cfg.linear_n_v_heads)
    return np.concatenate([w[:qk], v])


def _delta_tensor(cfg: ModelConfig, tiled: bool, name: str, w: np.ndarray) -> dict[str, np.ndarray] | None:
    """One linear-attention tensor -> {DeltaNetParams field: value}; None when unknown."""
    Hk, Hv = cfg.linear_n_k_heads, cfg.linear_n_v_heads
    untile = (lambda x, axis: untile_value_heads(x, axis, Hk, Hv)) if tiled else (lambda x, axis: x)
    if name == "ssm_in.weight":  # legacy Qwen3-Next: grouped [q, k, v, z] per key head
        return _split_qkvz(cfg, w)
    if name == "ssm_ba.weight":  # Qwen3-Next: grouped [b, a] per key head
        return _split_ba(cfg, w)
    if name == "ssm_a":
        if not np.all(w < 0):
            raise ValueError("GGUF ssm_a must be -exp(A_log) < 0 everywhere")
        return {"a_log": np.log(-untile(w, 0))}
    table: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
        "attn_qkv.weight": ("w_qkv", lambda x: linear(_untile_qkv_rows(cfg, x) if tiled else x)),
        "attn_gate.weight": ("w_z", lambda x: heads_in(untile(x, 0), Hv)),
        "ssm_beta.weight": ("w_b", lambda x: linear(untile(x, 0))),
        "ssm_alpha.weight": ("w_a", lambda x: linear(untile(x, 0))),
        "ssm_conv1d.weight": ("conv", lambda x: _untile_qkv_rows(cfg, x) if tiled else x),
        "ssm_dt.bias": ("dt_bias", lambda x: untile(x, 0)),
        "ssm_norm.weight": ("norm", lambda x: x),  # per value-head dim, shared by the heads
        "ssm_out.weight": ("w_out", lambda x: heads_out(untile(x, 1), Hv)),
    }
    if name not in table:
        return None
    key, fn = table[name]
    return {key: fn(w)}


def _attention_tensor(cfg: ModelConfig, name: str, w: np.ndarray) -> dict[str, np.ndarray] | None:
    """One gated-attention tensor -> {GatedAttentionParams field: value}; None when unknown."""
    H, K = cfg.n_heads, cfg.n_kv_heads
    if name == "attn_q.weight":
        q, gate = np.split(heads_in(w, H), 2, axis=-1)  # per head: the query, then its gate
        return {"wq": q, "w_gate": gate}
    table: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
        "attn_k.weight": ("wk", lambda x: heads_in(x, K)),
        "attn_v.weight": ("wv", lambda x: heads_in(x, K)),
        "attn_output.weight": ("wo", lambda x: heads_out(x, H)),
        "attn_q_norm.weight": ("q_norm", lambda x: x),  # already 1 + w
        "attn_k_norm.weight": ("k_norm", lambda x: x),
    }
    if name not in table:
        return None
    key, fn = table[name]
    return {key: fn(w)}


def _mlp_tensor(cfg: ModelConfig, name: str, w: np.ndarray) -> dict[str, np.ndarray] | None:
    """One feed-forward tensor -> {dotted field under `mlp`: value}; None when unknown."""
    if name == "ffn_gate_up_exps.weight":  # fused experts [E, 2F, D], gate rows first
        F = cfg.moe_ffn_dim
        return {"w_gate": linear(w[:, :F]), "w_up": linear(w[:, F:])}
    table: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
        "ffn_gate.weight": ("w_gate", linear),
        "ffn_up.weight": ("w_up", linear),
        "ffn_down.weight": ("w_down", linear),
        "ffn_gate_inp.weight": ("router", linear),
        "ffn_gate_exps.weight": ("w_gate", linear),  # [E, F, D] -> [E, D, F]
        "ffn_up_exps.weight": ("w_up", linear),
        "ffn_down_exps.weight": ("w_down", linear),  # [E, D, F] -> [E, F, D]
        "ffn_gate_shexp.weight": ("shared.w_gate", linear),
        "ffn_up_shexp.weight": ("shared.w_up", linear),
        "ffn_down_shexp.weight": ("shared.w_down", linear),
        "ffn_gate_inp_shexp.weight": ("shared_gate", lambda x: x.reshape(-1)),  # [1, D] or [D]
    }
    if name not in table:
        return None
    key, fn = table[name]
    return {key: fn(w)}


def hybrid_block_tensor(asm: ParamAssembler, cfg: ModelConfig, arch: str, name: str, w: np.ndarray) -> bool:
    """Stores one tensor of a hybrid GGUF (numpy order, dequantized); False when unknown.

    `blk.{i}.*` of the main stack goes to the stack of its kind at its index within the
    kind; blocks past the main stack (the MTP head, see the module docstring) are refused.
    """
    m = _BLOCK.match(name)
    if not m or int(m[1]) >= cfg.n_layers:
        return False
    kind, i = kind_index(cfg, int(m[1]))
    prefix, rest = f"layers.{kind}", m[2]
    if rest in ("attn_norm.weight", "post_attention_norm.weight"):
        asm.put(f"{prefix}.{'attn_norm' if rest.startswith('attn') else 'mlp_norm'}", w, layer=i)  # already 1 + w
        return True
    if (parts := _mlp_tensor(cfg, rest, w)) is not None:
        prefix = f"{prefix}.mlp"
    elif kind == "full":
        parts = _attention_tensor(cfg, rest, w)
        prefix = f"{prefix}.mixer"
    else:
        parts = _delta_tensor(cfg, arch in _TILED_ARCHS, rest, w)
        prefix = f"{prefix}.mixer"
    if parts is None:
        return False
    for key, value in parts.items():
        asm.put(f"{prefix}.{key}", value, layer=i)
    return True


def warn_unloaded_mtp(cfg: ModelConfig, arch: str, n_blocks: int) -> None:
    """Says that the file's MTP blocks (past the main stack) were not loaded."""
    if n_blocks > cfg.n_layers:
        warnings.warn(
            f"GGUF {arch} file has {n_blocks - cfg.n_layers} multi-token-prediction block(s) "
            f"(blk.{cfg.n_layers}.*); they are not loaded (the model runs without its MTP head)",
            stacklevel=3,
        )
