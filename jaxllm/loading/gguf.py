"""Load a llama.cpp GGUF file (llama / qwen2 / qwen3 / qwen3moe, and the hybrid qwen3next /
qwen35 / qwen35moe through `jaxllm.loading.gguf_hybrid`), dequantizing to float.

GGUF stores dims fastest-first (ggml `ne`), i.e. reversed relative to numpy; the reader's
`tensor.data` is already in numpy order, so a linear weight reads as HF's [out, in] (for
quantized types the last axis is bytes until `gguf.quants.dequantize` expands it).

llama.cpp's converter permutes the rows of q/k projections for the "llama" architecture
(GGML's original interleaved RoPE); we use HF's rotate-half RoPE, so those rows are
un-permuted here. Qwen2/Qwen3 GGUFs are written unpermuted (NEOX RoPE).

Llama-3 RoPE scaling is not stored as metadata by the converter but as a `rope_freqs`
tensor of per-frequency divisors; `_llama3_scaling` recovers an equivalent RopeScaling.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm.auto import tqdm

from jaxllm.config import ModelConfig, RopeScaling
from jaxllm.loading.assemble import ParamAssembler, heads_bias, heads_in, heads_out, linear
from jaxllm.loading.checks import check_dims, check_heads, check_positive_finite
from jaxllm.params import Params

_ARCH_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
# Hybrid architectures (Gated DeltaNet + gated attention), mapped in gguf_hybrid.py (which
# imports this module, hence the imports inside the functions below).
_HYBRID_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Opens a GGUF file (memory-mapped) with clear errors.

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: "not a GGUF file: ..." for anything the reader rejects.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors...
        raise ValueError(f"not a GGUF file: {path} ({type(e).__name__}: {e})") from e


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.get_field(key)
    return default if f is None else f.contents()


def _f32(v: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-6, not 9.99e-07)."""
    return float(np.format_float_positional(np.float32(v), unique=True, trim="-"))


def unpermute_llama_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverts llama.cpp's `permute` of q/k rows (axis 0), back to HF order.

    The converter does `w.reshape(n, 2, rows//n//2, *rest).swapaxes(1, 2)`; the inverse
    reshapes to (n, rows//n//2, 2) and swaps back.
    """
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _llama3_scaling(factors: np.ndarray, theta: float, head_dim: int, orig_ctx: int) -> RopeScaling:
    """Recovers Llama-3 RoPE scaling parameters from llama.cpp's `rope_freqs` divisors.

    For frequency f the converter stores 1 (high freq), `factor` (low freq), or
    1 / ((1 - s) / factor + s) with s = (orig_ctx * f / 2pi - low) / (high - low). s is
    linear in f, so two smooth-band points give the slope and intercept; any
    (orig_ctx, low, high) with that slope and intercept yields identical frequencies, so
    fixing orig_ctx (metadata, else Llama 3's 8192) loses nothing.
    """
    factors = np.asarray(factors, dtype=np.float64)
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(factors.max())
    if factor <= 1.0:
        raise ValueError("rope_freqs tensor has no scaled frequencies")
    smooth = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    if smooth.sum() >= 2:
        s = (1.0 / factors[smooth] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(freqs[smooth], s, 1)
        # s = orig * f / (2pi (high - low)) - low / (high - low)
        width = orig_ctx / (2 * math.pi * slope)
        low = -intercept * width
        high = low + width
    else:
        low, high = 1.0, 4.0  # Llama 3's published values; check below that they fit.
    scaling = RopeScaling(
        factor=factor, low_freq_factor=float(low), high_freq_factor=float(high), original_max_position=orig_ctx
    )
    if not np.allclose(llama3_rope_factors(scaling, theta, head_dim), factors, rtol=1e-4):
        warnings.warn("rope_freqs tensor is not reproduced exactly by the recovered llama3 rope scaling", stacklevel=3)
    return scaling


def llama3_rope_factors(s: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as `rope_freqs`."""
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    out = 1.0 / ((1 - smooth) / s.factor + smooth)
    out = np.where(wavelen < s.original_max_position / s.high_freq_factor, 1.0, out)
    out = np.where(wavelen > s.original_max_position / s.low_freq_factor, s.factor, out)
    return out.astype(np.float32)


def gguf_config(reader: gguf.GGUFReader) -> ModelConfig:
    """Maps GGUF metadata (and tensor presence) onto a ModelConfig.

    Raises:
      ValueError: unknown architecture or missing required metadata.
    """
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH_FAMILY and arch not in _HYBRID_ARCHS:
        raise ValueError(f"unknown GGUF architecture {arch!r}; known: {', '.join([*_ARCH_FAMILY, *_HYBRID_ARCHS])}")
    names = {t.name: t for t in reader.tensors}

    def meta(key: str, default: Any = ...) -> Any:
        v = _field(reader, f"{arch}.{key}", None)
        if v is None:
            if default is ...:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}")
            return default
        return v

    src = "GGUF metadata"
    check_dims(
        src,
        width=(f"{arch}.embedding_length", meta("embedding_length")),
        heads=(f"{arch}.attention.head_count", meta("attention.head_count")),
    )
    if arch in _HYBRID_ARCHS:
        from jaxllm.loading.gguf_hybrid import hybrid_gguf_config

        return hybrid_gguf_config(reader, arch, meta)
    family = _ARCH_FAMILY[arch]
    d_model = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", d_model // n_heads))
    n_layers = meta("block_count")
    check_dims(
        src,
        head_dim=(f"{arch}.attention.key_length", head_dim),
        layers=(f"{arch}.block_count", n_layers),
        kv_heads=(f"{arch}.attention.head_count_kv", meta("attention.head_count_kv", n_heads)),
        ffn=(f"{arch}.feed_forward_length", meta("feed_forward_length", 0)),
        context=(f"{arch}.context_length", meta("context_length", 4096)),
    )
    check_heads(src, n_heads, int(meta("attention.head_count_kv", n_heads)))
    blocks = {int(m[1]) for t in names if (m := re.match(r"blk\.(\d+)\.", t))}
    if blocks and len(blocks) != int(n_layers):
        raise ValueError(f"{src}: {arch}.block_count = {n_layers} but the file has tensors for {len(blocks)} blocks")
    for key, default in (("attention.layer_norm_rms_epsilon", 1e-6), ("rope.freq_base", 10000.0)):
        check_positive_finite(src, f"{arch}.{key}", _f32(meta(key, default)))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if "token_embd.weight" not in names:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    # ne[1] of the embedding is authoritative; the token list can be padded differently.
    vocab = int(names["token_embd.weight"].shape[1])
    check_dims(src, vocab=("token_embd.weight rows", vocab))
    if tokens is not None and len(tokens.data) != vocab:
        warnings.warn(f"GGUF token list has {len(tokens.data)} entries, embedding has {vocab} rows", stacklevel=3)
    theta = _f32(meta("rope.freq_base", 10000.0))
    max_pos = int(meta("context_length", 4096))
    scaling = None
    if meta("rope.scaling.type", None) not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling type {meta('rope.scaling.type')!r}")
    if "rope_freqs.weight" in names:
        freqs = gguf.quants.dequantize(names["rope_freqs.weight"].data, names["rope_freqs.weight"].tensor_type)
        orig = int(meta("rope.scaling.original_context_length", 8192))
        scaling = _llama3_scaling(np.asarray(freqs).reshape(-1), theta, head_dim, orig)
    is_moe = family == "qwen3_moe"
    return ModelConfig(
        family=family,  # type: ignore[arg-type]
        vocab_size=vocab,
        d_model=d_model,
        n_layers=int(meta("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(meta("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(meta("feed_forward_length", 0)),
        max_position=max_pos,
        rms_eps=_f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        n_experts=int(meta("expert_count", 0)) if is_moe else 0,
        n_experts_per_token=int(meta("expert_used_count", 0)) if is_moe else 0,
        moe_ffn_dim=int(meta("expert_feed_forward_length", 0)) if is_moe else 0,
        norm_topk_prob=bool(meta("expert_weights_norm", True)),
    )


def _block_tensor(asm: ParamAssembler, cfg: ModelConfig, permuted: bool, i: int, name: str, w: np.ndarray) -> bool:
    """Stores one `blk.{i}.*` tensor (numpy order, dequantized); False if unknown."""
    H, K = cfg.n_heads, cfg.n_kv_heads
    if permuted and name in ("attn_q.weight", "attn_q.bias"):
        w = unpermute_llama_rows(w, H)
    elif permuted and name in ("attn_k.weight", "attn_k.bias"):
        w = unpermute_llama_rows(w, K)
    table = {
        "attn_norm.weight": ("layers.attn_norm", lambda x: x),
        "ffn_norm.weight": ("layers.mlp_norm", lambda x: x),
        "attn_q.weight": ("layers.attn.wq", lambda x: heads_in(x, H)),
        "attn_k.weight": ("layers.attn.wk", lambda x: heads_in(x, K)),
        "attn_v.weight": ("layers.attn.wv", lambda x: heads_in(x, K)),
        "attn_output.weight": ("layers.attn.wo", lambda x: heads_out(x, H)),
        "attn_q.bias": ("layers.attn.bq", lambda x: heads_bias(x, H)),
        "attn_k.bias": ("layers.attn.bk", lambda x: heads_bias(x, K)),
        "attn_v.bias": ("layers.attn.bv", lambda x: heads_bias(x, K)),
        "attn_q_norm.weight": ("layers.attn.q_norm", lambda x: x),
        "attn_k_norm.weight": ("layers.attn.k_norm", lambda x: x),
        "ffn_gate.weight": ("layers.mlp.w_gate", linear),
        "ffn_up.weight": ("layers.mlp.w_up", linear),
        "ffn_down.weight": ("layers.mlp.w_down", linear),
        "ffn_gate_inp.weight": ("layers.mlp.router", linear),  # [E, D] -> [D, E]
        "ffn_gate_exps.weight": ("layers.mlp.w_gate", linear),  # [E, F, D] -> [E, D, F]
        "ffn_up_exps.weight": ("layers.mlp.w_up", linear),
        "ffn_down_exps.weight": ("layers.mlp.w_down", linear),  # [E, D, F] -> [E, F, D]
    }
    if name not in table:
        return False
    key, fn = table[name]
    asm.put(key, fn(w), layer=i)
    return True


def load_gguf_model(path: str | Path, *, dtype: str = "float32", progress: bool = True) -> tuple[ModelConfig, Params]:
    """Loads a GGUF file into (config, params), dequantizing every tensor.

    Args:
      path: the .gguf file.
      dtype: dtype of the returned params.
      progress: show a tqdm bar over tensors.

    Returns:
      The ModelConfig and the Params on the default device.

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: not a GGUF file, unknown architecture, unsupported tensor type,
        missing tensors or shape mismatches.
    """
    reader = open_gguf(path)
    cfg = gguf_config(reader)
    arch = _field(reader, "general.architecture")
    permuted = arch == "llama"
    asm = ParamAssembler(cfg, dtype)
    if cfg.is_hybrid:
        from jaxllm.loading.gguf_hybrid import hybrid_block_tensor, warn_unloaded_mtp

        warn_unloaded_mtp(cfg, arch, int(_field(reader, f"{arch}.block_count")))
        block_tensor: Any = lambda i, name, w: hybrid_block_tensor(asm, cfg, arch, f"blk.{i}.{name}", w)
    else:
        block_tensor = lambda i, name, w: _block_tensor(asm, cfg, permuted, i, name, w)
    unknown: list[str] = []
    for t in tqdm(reader.tensors, desc="loading gguf", unit="tensor", disable=not progress):
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as e:
            raise ValueError(f"tensor {t.name}: GGUF type {t.tensor_type.name} cannot be dequantized ({e})") from e
        if t.name == "token_embd.weight":
            asm.put("embed", w)
        elif t.name == "output_norm.weight":
            asm.put("final_norm", w)
        elif t.name == "output.weight":
            asm.put("lm_head", linear(w))
        elif t.name == "rope_freqs.weight":
            pass  # folded into cfg.rope_scaling by gguf_config
        elif (m := _BLOCK.match(t.name)) and block_tensor(int(m[1]), m[2], w):
            pass
        elif cfg.is_hybrid and m and int(m[1]) >= cfg.n_layers:
            pass  # an MTP block (warned about above)
        else:
            unknown.append(t.name)
    if unknown:
        warnings.warn(f"ignored {len(unknown)} unknown GGUF tensors, e.g. {unknown[:3]}", stacklevel=2)
    return cfg, asm.finish()
