"""Sampling comparisons: every (prompt, sampler, seed) as a row of one batched engine run.

    table = compare(model, make_tasks(2), {"greedy": SamplingParams(temperature=0),
                                           "min-p": SamplingParams(temperature=1, min_p=0.1)},
                    seeds=range(4), max_tokens=64)

Rows of different samplers share the engine's compiled rounds: every sampler parameter is a
per-slot array (`jaxllm.samplers_extra`), so a configuration never recompiles. Randomness is a
function of (seed, position), so a row's tokens do not depend on which rows run beside it.
Likelihood and entropy are the model's own distribution at temperature 1, before any
penalty or filter, as the engine drew from it (`sequence_logits` recomputes them by one
forward pass over a sample, for checking).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

import jaxllm.research.metrics as metrics
from jaxllm.api import Model
from jaxllm.engine_runs import research_engine, round_up, run_rows
from jaxllm.research.tasks import Task
from jaxllm.sampling import SamplingParams

Prompt = str | Sequence[dict] | Sequence[int] | Task


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreparedPrompt:
    label: str
    ids: list[int]
    task: Task | None = None


def prepare_prompt(model: Model, prompt: Prompt) -> PreparedPrompt:
    """A string is one user message through the chat template; a list of dicts a conversation;
    a list of ints token ids as they are; a `Task` its message, with its checker."""
    if isinstance(prompt, Task):
        return PreparedPrompt(label=prompt.prompt, ids=model.chat_ids(prompt.messages), task=prompt)
    if isinstance(prompt, str):
        return PreparedPrompt(label=prompt, ids=model.chat_ids([{"role": "user", "content": prompt}]))
    items = list(prompt)
    if items and all(isinstance(m, dict) for m in items):
        return PreparedPrompt(label=str(items[-1].get("content", "")), ids=model.chat_ids(items))
    ids = [int(t) for t in items]
    return PreparedPrompt(label=model.tokenizer.decode(ids), ids=ids)


def sequence_logits(model: Model, ids: Sequence[int], bucket: int = 64) -> np.ndarray:
    """[len(ids), V] logits, the prompt padded to a multiple of `bucket` (causal attention:
    padding after the sequence changes none of its rows) so lengths share compilations."""
    padded = list(ids) + [0] * (round_up(len(ids), bucket) - len(ids))
    return model.logits(padded)[: len(ids)]


def compare(
    model: Model,
    prompts: Iterable[Prompt],
    samplers: Mapping[str, SamplingParams],
    seeds: Iterable[int] = (0,),
    max_tokens: int = 64,
    *,
    max_slots: int = 32,
    logits_processors: tuple = (),
    batch_invariant: bool = False,
):
    """Runs every (prompt, sampler, seed) in one batched engine and measures each sample.

    Args:
      model: a loaded `jaxllm.api.Model`.
      prompts: strings, message lists, token-id lists or `Task`s (which add a `score`).
      samplers: name -> `SamplingParams`; their `seed` and `max_tokens` are overridden per row.
      seeds: one row per seed for each (prompt, sampler).
      max_tokens: the generation budget of every row.
      max_slots: most rows decoding at once.
      logits_processors: user processors to compile in besides the samplers' own (comparisons
        whose engines carry the same ones reuse each other's compilations).
      batch_invariant: run on a batch-invariant engine (`EngineConfig.batch_invariant`): each
        row's logprobs are then bitwise what it gets alone or in any other comparison with
        the same `max_slots`, processors and context bucket (`research_engine`); slower.

    Returns:
      A pandas DataFrame, one row per sample: prompt, sampler, seed, text, token_ids,
      n_tokens, finish_reason, nll and mean_entropy (nats, the model at temperature 1),
      distinct_1, distinct_2, repetition (share of repeated 4-grams), score (tasks; else nan).
    """
    import pandas as pd

    prepared = [prepare_prompt(model, p) for p in prompts]
    seeds = list(seeds)
    rows, keys = [], []
    for pi, prompt in enumerate(prepared):
        for name, params in samplers.items():
            for seed in seeds:
                rows.append((prompt.ids, dataclasses.replace(params, seed=seed, max_tokens=max_tokens)))
                keys.append((pi, name, seed))
    processors = tuple(
        dict.fromkeys(list(logits_processors) + [p.logits_processor for _, p in rows if p.logits_processor is not None])
    )
    longest = max(len(p.ids) for p in prepared) + max_tokens
    engine = research_engine(
        model, len(rows), longest, max_slots=max_slots, logits_processors=processors, batch_invariant=batch_invariant
    )
    samples = run_rows(model, engine, rows)

    records = []
    for (pi, name, seed), sample in zip(keys, samples):
        completion = sample.completion
        prompt, ids = prepared[pi], completion.token_ids
        nll = -float(np.mean(completion.logprobs)) if ids else float("nan")
        entropy = float(np.mean(sample.entropies)) if ids else float("nan")
        records.append(
            dict(
                prompt=prompt.label,
                task=prompt.task.kind if prompt.task else None,
                sampler=name,
                seed=seed,
                text=completion.text,
                token_ids=ids,
                n_tokens=len(ids),
                finish_reason=completion.finish_reason,
                nll=nll,
                mean_entropy=entropy,
                distinct_1=metrics.distinct_n(ids, 1),
                distinct_2=metrics.distinct_n(ids, 2),
                repetition=metrics.repetition(ids, 4),
                score=prompt.task.check(completion.text) if prompt.task else float("nan"),
            )
        )
    return pd.DataFrame.from_records(records)


def summary(table, by: str = "sampler"):
    """Mean of every numeric measure per sampler (the frontier's points)."""
    columns = ["n_tokens", "nll", "mean_entropy", "distinct_1", "distinct_2", "repetition", "score"]
    return table.groupby(by, sort=False)[columns].mean()
