"""The small API a notebook or script uses: load a model, generate, inspect logits.

model = jaxllm.load("smollm2")
out = model.generate(["Hello"], jaxllm.SamplingParams(temperature=0, max_tokens=20))
model.next_token_distribution(model.chat_ids([{"role": "user", "content": "Hi"}]))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.chat_template import tokenize_chat
from jaxllm.config import ModelConfig
from jaxllm.engine import Engine
from jaxllm.engine_config import EngineConfig
from jaxllm.engine_records import Sequence as EngineSequence
from jaxllm.engine_runs import Completion, kv_bytes, round_up
from jaxllm.loading import load_model
from jaxllm.model.forward import lm_head
from jaxllm.model.kernel_choice import debug_overrides
from jaxllm.params import Params
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.sampling import SamplingParams
from jaxllm.state import StateLayout, page_row
from jaxllm.tokenizer import Tokenizer


@dataclasses.dataclass
class Model:
    """A loaded model: architecture, params, tokenizer and how this machine runs it (`options`,
    whose dtype the params are in); engines are made on demand."""

    cfg: ModelConfig
    params: Params
    tokenizer: Tokenizer
    options: RuntimeOptions = RuntimeOptions()
    # The checkpoint's sampling defaults (`jaxllm.loading.generation`); a server's fallbacks.
    generation_defaults: dict[str, float] = dataclasses.field(default_factory=dict)

    def engine(self, config: EngineConfig | None = None) -> Engine:
        return Engine(
            self.cfg, self.params, eos_ids=self.tokenizer.eos_ids, config=config or EngineConfig(), options=self.options
        )

    def save(self, path: str) -> None:
        """Writes an orbax model directory with the tokenizer, chat template and generation
        defaults beside the weights; `jaxllm.load(path)` reads it all back."""
        from jaxllm.loading.orbax_io import save_model

        save_model(path, self.cfg, self.params, tokenizer=self.tokenizer, generation_defaults=self.generation_defaults)

    def chat_ids(self, messages: list[dict], **template_kwargs) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template."""
        return tokenize_chat(self.tokenizer, messages, **template_kwargs).ids

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams = SamplingParams(),
        *,
        engine: Engine | None = None,
    ) -> list[Completion]:
        """Generates for every prompt (text or token ids), batched in one engine."""
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        longest = max(len(i) for i in ids) + params.max_tokens
        engine = engine or self.engine(
            EngineConfig(
                max_slots=max(1, len(ids)),
                max_seq_len=round_up(longest, 64),
                kv_bytes=kv_bytes(self.cfg, len(ids), longest, opts=self.options),
            )
        )
        pending = list(enumerate(ids))
        running: dict[int, EngineSequence] = {}
        results: dict[int, Completion] = {}
        while pending or running:
            while pending and engine.free_slots and engine.can_admit(len(pending[0][1]) + params.max_tokens):
                index, prompt = pending.pop(0)
                running[index] = engine.add(prompt, params)
            engine.step()
            for index, seq in list(running.items()):
                if seq.finish_reason is not None:
                    results[index] = Completion(
                        prompt_token_ids=seq.prompt,
                        token_ids=list(seq.generated),
                        text=self.tokenizer.decode(seq.generated),
                        finish_reason=seq.finish_reason,
                        logprobs=list(seq.logprobs),
                    )
                    engine.remove(seq)
                    del running[index]
        return [results[i] for i in range(len(ids))]

    def prefill(self, ids: Sequence[int], **kwargs):
        """Prefills `ids` once and returns its `SequenceState` (fork, rewind, save, continue);
        see `jaxllm.sequence_state.prefill`."""
        from jaxllm.sequence_state import prefill

        return prefill(self, ids, **kwargs)

    def generate_from(self, states, params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), **kwargs):
        """Continues one `SequenceState` (-> Completion) or several (-> list, batched); see
        `jaxllm.sequence_state.generate_from`."""
        from jaxllm.sequence_state import generate_from

        return generate_from(self, states, params, **kwargs)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Float32 logits [T, V] of every position of a prompt (one prefill, paged path)."""
        return np.asarray(prompt_logits(self.params, self.cfg, jnp.asarray(list(ids), jnp.int32), self.options))

    def next_token_distribution(self, ids: Sequence[int], top: int = 10) -> list[tuple[str, float]]:
        """The `top` most likely next tokens after `ids`, as (piece, probability)."""
        probs = jax.nn.softmax(self.logits(ids)[-1])
        order = np.argsort(-np.asarray(probs))[:top]
        return [(self.tokenizer.decode([int(i)], skip_special_tokens=False), float(probs[i])) for i in order]


@functools.partial(jax.jit, static_argnames=("cfg", "opts"))
def prompt_logits(
    params: Params, cfg: ModelConfig, ids: jax.Array, opts: RuntimeOptions = RuntimeOptions()
) -> jax.Array:
    """Logits of every position of one prompt, computed through a one-slot paged state."""
    from jaxllm.attention.reference import Windows
    from jaxllm.model.forward import TokenBatch, forward
    from jaxllm.state import init_state

    T = ids.shape[0]
    page_size = 16
    n_pages = -(-T // page_size)
    layout = StateLayout(max_slots=1, page_size=page_size, n_pages=n_pages + 1, max_pages_per_seq=n_pages)
    state = init_state(cfg, layout, opts)
    page_table = state.page_table.at[0].set(jnp.asarray(page_row(list(range(1, n_pages + 1)), layout)))
    zero = jnp.zeros((1,), jnp.int32)
    batch = TokenBatch(
        tokens=ids,
        slots=jnp.zeros((T,), jnp.int32),
        positions=jnp.arange(T, dtype=jnp.int32),
        decode=Windows(slot=zero, start=zero, length=zero),
        chunks=Windows(slot=zero, start=zero, length=jnp.full((1,), T, jnp.int32)),
    )
    if cfg.is_hybrid:
        from jaxllm.model.hybrid import hybrid_forward

        hidden, *_ = hybrid_forward(
            params, cfg, batch, state.kv, state.recurrent, page_table, opts=opts, chunk_len=T, n_ctx_pages=n_pages
        )
    else:
        hidden, _, _ = forward(params, cfg, batch, state.kv, page_table, opts=opts, chunk_len=T, n_ctx_pages=n_pages)
    return lm_head(params, hidden)


def load(
    model: str = "smollm2",
    *,
    load_format: str = "auto",
    dtype: str = "float32",
    scan_layers: bool = True,
    config_path: str | None = None,
    kv_dtype: str = "auto",
) -> Model:
    """Loads a model by name ("smollm2"), path (.gguf, HF directory, orbax directory) or preset.

    `dtype`, `scan_layers` and `kv_dtype` are this machine's choices (`RuntimeOptions`), kept
    apart from the architecture (`ModelConfig`); so are the kernel choices, which only the
    debug hook `$JAXLLM_DEBUG_KERNELS` overrides (`kernel_choice.debug_overrides`).
    """
    options = RuntimeOptions(dtype=dtype, scan_layers=scan_layers, kv_dtype=kv_dtype, **debug_overrides())
    cfg, params = load_model(model, fmt=load_format, options=options, config_path=config_path)
    return Model(
        cfg=cfg,
        params=params,
        tokenizer=load_tokenizer(model, load_format, cfg),
        options=options,
        generation_defaults=load_generation_defaults(model, load_format),
    )


def load_generation_defaults(model: str, load_format: str) -> dict[str, float]:
    """The checkpoint's sampling defaults (none for random weights)."""
    if load_format == "dummy":
        return {}
    from jaxllm.loading.default_model import resolve_model
    from jaxllm.loading.generation import generation_defaults

    return generation_defaults(resolve_model(model))


def load_tokenizer(model: str, load_format: str, cfg: ModelConfig) -> Tokenizer:
    if load_format == "dummy":
        return Tokenizer.synthetic(cfg.vocab_size)
    from pathlib import Path

    from jaxllm.loading import detect_format
    from jaxllm.loading.default_model import resolve_model

    path = resolve_model(model)
    fmt = detect_format(path) if load_format == "auto" else load_format
    if fmt == "gguf":
        return Tokenizer.from_gguf(path)
    if fmt == "orbax" and not (Path(path) / "tokenizer.json").exists():
        return Tokenizer.synthetic(cfg.vocab_size)
    return Tokenizer.from_hf_dir(path)
