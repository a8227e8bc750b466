"""The engine: params, decode state and compiled steps for one device, behind a small API.

Concurrency story: an Engine is not thread-safe; exactly one thread (the server's worker, or
a notebook) calls it. `launch` dispatches a round and returns at once (JAX runs it
asynchronously); `collect` does the round's single `device_get`. A caller may launch round
N+1 before collecting round N: decode tokens live in the state on the device, and slots that
stopped on the device simply skip later rounds, so nothing waits on the host.

Host bookkeeping (which slot holds which sequence, which pages it owns, how far its prompt
has been prefilled) lives in plain Python objects here and in `jaxllm.engine_records`; the
device state never needs to be read to plan a round.

The engine's configuration is `jaxllm.engine_config.EngineConfig`; its warm-up (compiling
every round shape before the first request) is `jaxllm.engine_warmup`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import jax
import numpy as np

from jaxllm import engine_warmup, samplers_extra, steps
from jaxllm.config import ModelConfig
from jaxllm.engine_config import VERIFY_COST_STEPS, EngineConfig
from jaxllm.engine_records import (
    DraftStats,
    PausedSequence,
    PromptAdvance,
    Round,
    RoundPlan,
    Sequence,
    TokenConstraint,
    TokenEvent,
)
from jaxllm.runtime_options import RuntimeOptions
from jaxllm.model.kernel_choice import plain_sampler_pays
from jaxllm.params import Params
from jaxllm.sampling import SamplingParams, needs_full_sampler, sampling_row, seed_to_u32
from jaxllm.speculative import DraftControl, NgramIndex, prompt_lookup
from jaxllm.state import SeqCheckpoint, StateLayout, layout_for_budget, page_row, pages_bucket


class EngineFull(RuntimeError):
    """No free slot or not enough free pages right now (the caller should wait)."""


class Engine:
    """Owns params + decode state + compiled steps; `add` / `launch` / `collect` / `remove`."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        *,
        eos_ids: Seq[int] = (),
        config: EngineConfig = EngineConfig(),
        options: RuntimeOptions = RuntimeOptions(),
        draft_source: Callable[[list[int], int], list[int]] = prompt_lookup,
    ):
        """`options` says how this machine runs the model (dtypes, kernels; the params must be
        in `options.dtype`). `draft_source(tokens, k)` proposes up to k tokens to follow
        `tokens` (a sequence's prompt and output so far) when `config.max_drafts` > 0."""
        self.cfg = cfg
        # Batch-invariant rounds never take the C++ matvec: XLA's dot at one row count each.
        self.options = options.replace(decode_matmul="xla") if config.batch_invariant else options
        self.draft_source = draft_source
        self.params = params
        self.config = config
        self.eos_ids = frozenset(eos_ids)
        self.layout: StateLayout = layout_for_budget(
            cfg,
            options,
            kv_bytes=config.kv_bytes,
            max_slots=config.max_slots,
            max_seq_len=config.max_seq_len,
            page_size=config.page_size,
        )
        self.reset()
        self._ids = itertools.count()
        # Tokens routed to each expert since start, [L, E] ([L, 0] for dense models).
        self.expert_tokens = np.zeros((cfg.n_layers, cfg.n_experts if cfg.is_moe else 0), np.int64)
        # Distinct experts each step of the last collected round touched, the mean over the
        # layers (the seed's expert statistics: why a wider round costs more); () when dense.
        self.last_distinct_experts: tuple[float, ...] = ()
        self._seed_counter = itertools.count(1)
        self.draft_stats = DraftStats(config.max_drafts)
        # With an MTP head every verification round also drafts the next one (on device).
        self.mtp_drafts = bool(
            config.max_drafts and not config.batch_invariant and cfg.mtp_layers and params.mtp is not None
        )
        backend = "gpu" if jax.default_backend() == "gpu" else "cpu"
        # (alone, at several sequences); a configured cost holds for both.
        self.verify_cost: tuple[float, float] = (
            (config.verify_cost, config.verify_cost) if config.verify_cost else VERIFY_COST_STEPS[backend, cfg.is_moe]
        )
        self._last_round = ""  # batch-invariant rounds alternate "chunk" and "decode"
        # Ahead-of-time compiled round variants keyed by their static shape arguments
        # (filled by `warmup`); a round whose key is missing goes through `jax.jit`.
        self._compiled: dict[tuple, Callable[..., Any]] = {}

    def reset(self) -> None:
        """An empty device state and no sequences. After a round raised, the state it was
        given (donated) may be gone, and with it every live sequence's cache: the caller
        resets and fails those sequences' requests."""
        self.state = steps.new_state(self.cfg, self.layout, self.options)
        if self.config.extra_samplers:
            self.state = self.state.replace(
                sampling=self.state.sampling.replace(
                    extra=samplers_extra.empty_extra(
                        self.config.max_slots,
                        self.cfg.vocab_size,
                        self.layout.max_seq_len,
                        self.config.logits_processors,
                    )
                )
            )
        # (sequence id, positions) of the state in the side row, written by the last chunk
        # built (`_build_chunk`); `extract` reads a prefix there.
        self._side: tuple[int, int] | None = None
        self.free_slots = list(range(self.config.max_slots))
        self.free_pages = list(range(self.layout.n_pages - 1, 0, -1))  # page 0 is the trash page
        self.seqs: dict[int, Sequence] = {}  # slot -> sequence

    # ---- capacity ---------------------------------------------------------------------
    @property
    def max_context(self) -> int:
        return self.layout.max_seq_len

    def pages_needed(self, n_positions: int) -> int:
        return self.layout.pages_for(n_positions)

    def can_admit(self, n_positions: int) -> bool:
        return bool(self.free_slots) and self.pages_needed(n_positions) <= len(self.free_pages)

    # ---- sequences in and out ---------------------------------------------------------
    def add(
        self,
        prompt: Seq[int],
        params: SamplingParams,
        *,
        checkpoint: SeqCheckpoint | None = None,
        cached_tokens: int = 0,
        constraint: TokenConstraint | None = None,
        stops: Seq[int] = (),
    ) -> Sequence:
        """Puts a new sequence into a free slot; `checkpoint` restores its first `cached_tokens`.

        `stops` are prompt positions the caller wants to `extract` a prefix at; models with
        recurrent layers end prompt chunks there (others can extract any prefilled prefix).

        Raises:
          ValueError: empty prompt, bad sampling values, or prompt + max_tokens over the context.
          EngineFull: no free slot or pages now.
        """
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt has a token id outside the vocabulary (size {self.cfg.vocab_size})")
        params.validate(self.cfg.vocab_size)
        total = len(prompt) + params.max_tokens
        if total > self.max_context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{self.max_context} tokens"
            )
        if not self.can_admit(total):
            raise EngineFull(f"no room for {total} positions now")
        if checkpoint is not None and not 0 < cached_tokens < len(prompt):
            raise ValueError("cached_tokens must be in (0, len(prompt))")
        if checkpoint is not None and self.cfg.n_linear_layers and int(checkpoint.length) != cached_tokens:
            raise ValueError(f"a recurrent state holds exactly {int(checkpoint.length)} positions, not {cached_tokens}")
        if checkpoint is not None and self.config.batch_invariant:
            checkpoint, cached_tokens = self._aligned_checkpoint(checkpoint, cached_tokens)
        # Everything that can fail on the host runs before the slot and pages are taken:
        # a sequence that fails here must not hold them for good.
        seed = seed_to_u32(params.seed, next(self._seed_counter) * 0x9E3779B1)
        row = self._sampling_row(params, seed, prompt)
        slot = self.free_slots.pop(0)
        pages = [self.free_pages.pop() for _ in range(self.pages_needed(total))]
        state = self.state
        try:
            state = steps.set_slot(state, np.int32(slot), np.asarray(page_row(pages, self.layout)), row)
            if checkpoint is not None:
                state = steps.insert(state, np.int32(slot), checkpoint)
        except BaseException:
            self.free_pages.extend(reversed(pages))
            self.free_slots.append(slot)
            self.free_slots.sort()
            raise
        self.state = state
        points = sorted({int(b) for b in stops if 0 < b < len(prompt)})
        chunk_stops = points if self.cfg.n_linear_layers and not self.config.batch_invariant else []
        side_point = len(prompt) - 1 if len(prompt) - 1 in chunk_stops else None
        seq = Sequence(
            id=next(self._ids),
            slot=slot,
            prompt=prompt,
            params=params,
            pages=pages,
            seed=int(seed),
            constraint=constraint,
            extract_at=points,
            stops=[b for b in chunk_stops if b != side_point],
            side_point=side_point,
            drafting=self._draft_control(params, constraint),
        )
        if checkpoint is not None:
            seq.prefilled = cached_tokens
        self.seqs[slot] = seq
        return seq

    def _aligned_checkpoint(self, ckpt: SeqCheckpoint, cached: int) -> tuple[SeqCheckpoint | None, int]:
        """Batch-invariant mode: a prefix checkpoint counts only up to the last chunk boundary
        (a multiple of the chunk size), so the rest of the prompt runs in the chunks a full
        prefill runs it in; None where that leaves nothing (a recurrent state cannot be cut)."""
        aligned = cached // self._invariant_chunk() * self._invariant_chunk()
        if aligned == 0 or (self.cfg.n_linear_layers and aligned != cached):
            return None, 0
        return ckpt.replace(length=np.int32(aligned)), aligned

    def _sampling_row(self, params: SamplingParams, seed: np.uint32, tokens: list[int]):
        """A slot's `SlotSampling` row; with extra samplers, its `ExtraSampling` row too
        (whose history starts as `tokens`). Called before a slot is taken, so it may raise."""
        row = sampling_row(params, self.cfg.vocab_size, self.eos_ids, seed)
        if not self.config.extra_samplers:
            if samplers_extra.uses_extra(params):
                raise ValueError("this sampler needs an engine built with EngineConfig(extra_samplers=True)")
            return row
        return row.replace(
            extra=samplers_extra.extra_row(
                params, self.cfg.vocab_size, self.layout.max_seq_len, tokens, self.config.logits_processors
            )
        )

    def _draft_control(self, params: SamplingParams, constraint: TokenConstraint | None) -> DraftControl | None:
        """Drafting for a new sequence: up to the request's `drafts` (None: the engine's
        `max_drafts`), never for constrained ones (their masks need the host per token)."""
        most = self.config.max_drafts if params.drafts is None else min(params.drafts, self.config.max_drafts)
        return DraftControl(most=most) if most > 0 and constraint is None and not self.config.batch_invariant else None

    def can_extract(self, seq: Sequence, n_positions: int) -> bool:
        """Whether `extract(seq, n_positions)` can give exactly `prompt[:n_positions]` now.

        Attention layers keep every prefilled position in the pages; a recurrent state exists
        only at the position the sequence reached, before any decode step was dispatched.
        """
        prefilled = min(seq.prefilled, len(seq.prompt))
        if not 0 < n_positions <= prefilled:
            return False
        if self._side == (seq.id, n_positions):
            return True
        return not self.cfg.n_linear_layers or (n_positions == prefilled and seq.dispatched == 0)

    def remove(self, seq: Sequence) -> None:
        """Frees a sequence's slot and pages (finished, cancelled or failed)."""
        if self.seqs.get(seq.slot) is not seq:
            return
        del self.seqs[seq.slot]
        self.state = steps.release_slot(self.state, np.int32(seq.slot))
        self.free_pages.extend(seq.pages)
        self.free_slots.append(seq.slot)
        self.free_slots.sort()

    def extract(self, seq: Sequence, n_positions: int | None = None) -> SeqCheckpoint:
        """Copies a sequence's state out of its slot.

        Args:
          seq: a sequence in this engine.
          n_positions: None for the whole sequence (to pause and resume it); otherwise a
            prompt prefix length (a prefix-cache entry): the checkpoint then holds exactly
            `prompt[:n_positions]`, whatever the slot has prefilled since.
        """
        written = min(seq.prefilled, len(seq.prompt)) + len(seq.generated)
        n = written if n_positions is None else n_positions
        n_pages = pages_bucket(max(self.layout.pages_for(n), 1), self.layout.max_pages_per_seq)
        side = n_positions is not None and self._side == (seq.id, n_positions)
        row = self.layout.max_slots + 1 if side else seq.slot  # the side row: see RecurrentState
        ckpt = steps.extract(self.state, np.int32(seq.slot), np.int32(row), n_pages=n_pages)
        if n_positions is None:
            return ckpt
        if not self.can_extract(seq, n_positions):
            raise ValueError(
                f"no state of exactly {n_positions} prompt positions now (prefilled "
                f"{min(seq.prefilled, len(seq.prompt))}, decode steps dispatched {seq.dispatched})"
            )
        seen = np.zeros((self.cfg.vocab_size,), bool)
        seen[seq.prompt[:n_positions]] = True
        return ckpt.replace(
            length=np.int32(n_positions),
            last_token=np.int32(0),
            n_generated=np.int32(0),
            done=np.bool_(False),
            seen=seen,
            out_counts=np.zeros((self.cfg.vocab_size,), np.int32),
        )

    def pause(self, seq: Sequence) -> PausedSequence:
        """Takes a decoding sequence out of its slot, keeping everything needed to resume it."""
        ckpt = self.extract(seq)
        self.remove(seq)
        return PausedSequence(
            checkpoint=ckpt, sequence=dataclasses.replace(seq, pages=[], generated=list(seq.generated), lookup=None)
        )

    def resume(self, paused: PausedSequence) -> Sequence:
        """Puts a paused sequence into any free slot; it continues exactly where it stopped."""
        old = paused.sequence
        total = len(old.prompt) + old.params.max_tokens
        if not self.can_admit(total):
            raise EngineFull(f"no room for {total} positions now")
        row = self._sampling_row(old.params, np.uint32(old.seed), old.prompt + list(old.generated))
        slot = self.free_slots.pop(0)
        pages = [self.free_pages.pop() for _ in range(self.pages_needed(total))]
        state = steps.set_slot(self.state, np.int32(slot), np.asarray(page_row(pages, self.layout)), row)
        self.state = steps.insert(state, np.int32(slot), paused.checkpoint)
        seq = dataclasses.replace(old, slot=slot, pages=pages)
        self.seqs[slot] = seq
        return seq

    def ctx_buckets(self) -> list[int]:
        """Every context bucket (pages read per slot) a round can use."""
        out, pages = [], self._ctx_pages(1)
        while True:
            out.append(pages)
            if pages >= self.layout.max_pages_per_seq:
                return out
            pages = pages_bucket(pages + 1, self.layout.max_pages_per_seq)

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Compiles every shape variant before the first request; returns how many
        (`jaxllm.engine_warmup.warmup`, which says how). Must run on an empty engine."""
        return engine_warmup.warmup(self, progress)

    def _idle_chunk(self, size: int) -> steps.ChunkBatch:
        B = self.layout.max_slots
        if size == 0:
            return steps.empty_chunk(B)
        nc = self.config.chunk_segments
        return steps.ChunkBatch(
            tokens=np.zeros((size,), np.int32),
            slots=np.full((size,), B, np.int32),
            positions=np.zeros((size,), np.int32),
            seg_slot=np.zeros((nc,), np.int32),
            seg_start=np.zeros((nc,), np.int32),
            seg_len=np.zeros((nc,), np.int32),
            seg_samples=np.zeros((nc,), bool),
            seg_side=np.zeros((nc,), bool),
        )

    # ---- rounds -----------------------------------------------------------------------
    def _prefilling(self) -> list[Sequence]:
        """Sequences with prompt tokens still to prefill, oldest admitted first."""
        return sorted((s for s in self.seqs.values() if s.prefilled < len(s.prompt)), key=lambda s: s.id)

    def next_prefill(self) -> Sequence | None:
        """The oldest prefilling sequence: the next round's chunk starts with it (and may pack
        other fresh prompts beside it, see `_chunk_members`)."""
        return next(iter(self._prefilling()), None)

    def launch(self, *, prefill_budget: int | None = None) -> Round | None:
        """Dispatches one round (or several decode steps) and returns without waiting.

        Args:
          prefill_budget: about this many prompt tokens ride in this round (pacing), rounded
            up to the chunk bucket they would be padded to; None means the largest bucket.

        Returns:
          A handle for `collect`, or None when no sequence has work.
        """
        decoding = [s for s in self.seqs.values() if s.decoding and not s.awaiting_host and not s.fully_dispatched]
        prefilling = self._prefilling()
        if not decoding and not prefilling:
            return None
        B = self.layout.max_slots
        inputs = steps.round_inputs(B, self.cfg.vocab_size)
        inputs.decode_mask[[s.slot for s in decoding]] = True
        inputs = inputs.replace(want_top=np.bool_(any(s.params.top_logprobs > 0 for s in self.seqs.values())))
        snapshot = dict(self.seqs)
        if self.config.batch_invariant:
            return self._launch_invariant(inputs, decoding, prefilling, snapshot)

        if not prefilling and self.config.max_drafts:
            wanted = {s.slot: k for s in decoding if (k := self._wanted_drafts(s)) > 0}
            # Drafting (prompt lookup over every sequence's text) only when it could pay.
            drafts = self._propose(decoding, wanted) if wanted and self._verify_pays(decoding, wanted) else {}
            planned = {slot: wanted[slot] if self.mtp_drafts else len(p) for slot, p in drafts.items()}
            if drafts and self._verify_pays(decoding, planned):  # an MTP head proposes in the round
                return self._launch_verify(inputs, decoding, drafts, snapshot)

        # Several steps per call only help unconstrained slots (a constrained one takes the
        # first step alone); when every decoding slot is constrained one step is all the work.
        free = any(s.constraint is None for s in decoding)
        if not prefilling and free and self.config.decode_steps_per_call > 1:
            n = self.config.decode_steps_per_call
            self._constrain(inputs, decoding)
            ctx = self._ctx_pages(max(s.position_bound for s in decoding) + n)
            for s in decoding:
                s.dispatched += 1 if s.constraint is not None else n
            width = self._decode_width(decoding, self.config.widths())
            # Slots that are not decoding draw nothing, so only the decoding ones decide.
            full = not plain_sampler_pays(self.options) or any(needs_full_sampler(s.params) for s in decoding)
            return self._decode_call(inputs, decoding, snapshot, n, ctx, width, full)

        max_chunk = self.config.chunk_buckets[-1]
        budget = max_chunk if prefill_budget is None else max(1, min(prefill_budget, max_chunk))
        # The chunk is padded to its bucket anyway: padded rows cost what prompt tokens do.
        budget = next(b for b in self.config.chunk_buckets if b >= budget)
        chunk, ctx_needed, prompts, finishing = self._build_chunk(budget)
        n_prompt = sum(p.end - p.start for p in prompts)
        self._constrain(inputs, decoding + finishing)
        ctx_needed = max([ctx_needed] + [s.position_bound + 1 for s in decoding])
        for s in decoding:
            s.dispatched += 1
        chunk_len = int(chunk.tokens.shape[0]) if n_prompt else 1
        ctx, width = (
            self._ctx_pages(ctx_needed),
            self._decode_width(decoding, self.config.chunk_widths() if n_prompt else self.config.widths()),
        )
        out = self._run_round(
            ("step", chunk_len, ctx, width),
            steps.step,
            inputs,
            chunk,
            chunk_len=chunk_len,
            n_ctx_pages=ctx,
            decode_width=width,
        )
        return Round(output=out, seqs=snapshot, plan=RoundPlan(prompts=prompts, decoding=_ids(decoding)))

    @staticmethod
    def _wanted_drafts(s: Sequence) -> int:
        """How many drafts a decoding sequence would verify next round: none unless it drafts
        and every token of it is collected (drafts continue the text the host has)."""
        if s.drafting is None or s.constraint is not None or len(s.generated) != s.dispatched + 1:
            return 0
        # Never past max_tokens (nor so past the reserved pages).
        return max(0, min(s.drafting.wanted(), s.params.max_tokens - len(s.generated) - 1))

    @staticmethod
    def _lookup(s: Sequence) -> NgramIndex:
        """The sequence's prompt-lookup index, brought up to its prompt and output so far
        (built afresh if the text no longer extends what it indexed)."""
        have = len(s.lookup.tokens) if s.lookup is not None else 0
        if s.lookup is None or have > len(s.prompt) + len(s.generated):
            s.lookup, have = NgramIndex(), 0
        if have < len(s.prompt):
            s.lookup.extend(s.prompt[have:])
            have = len(s.prompt)
        s.lookup.extend(s.generated[have - len(s.prompt) :])
        return s.lookup

    def _propose(self, decoding: list[Sequence], wanted: dict[int, int]) -> dict[int, list[int]]:
        """Drafts for the sequences of `wanted` (slot -> most drafts); {} when none has any."""
        out: dict[int, list[int]] = {}
        for s in decoding:
            k = wanted.get(s.slot, 0)
            if k <= 0:
                continue
            if self.mtp_drafts:
                source = s.mtp_drafts
            elif self.draft_source is prompt_lookup:
                source = self._lookup(s).propose(k)
            else:
                source = self.draft_source(s.prompt + s.generated, k)
            proposal = list(source)[:k]
            if proposal or self.mtp_drafts:  # an MTP model verifies with no drafts to get the head's first ones
                out[s.slot] = proposal
        return out

    def _verify_pays(self, decoding: list[Sequence], planned: dict[int, int]) -> bool:
        """Whether a verification round with `planned` drafts (slot -> count) is expected to
        emit more tokens per second than the plain decode call it replaces: drafting turned
        down by load.

        A verification round is one step for every decoding slot, drafts or not, and it costs
        `verify_cost` steps of a plain call of `decode_steps_per_call` steps
        (`VERIFY_COST_STEPS`). A plain call emits one token per decoding sequence each step; the
        round emits 1 + a + ... + a^k for a sequence planning k drafts at its own acceptance
        a so far (`DraftControl.expected_tokens`), 1 for one without. So with B decoding
        sequences it verifies only when those tokens reach `verify_cost` x B. Without this,
        64 concurrent sequences lost a third of their throughput on a GPU (docs/lab/
        hybrid-h200.md): prompt lookup rarely hits random prompts, but some sequence was
        always retrying a lone draft, and its retry took everyone's multi-step call.

        One-step calls always verify, and so does a single decoding sequence while a round
        of `max_drafts` all accepted would pay: single-stream drafting keeps its gains
        (`DraftControl` turns it down when its drafts miss), but where a round costs more
        steps than it can ever emit (the 35B-A3B shape's MTP rounds on a GPU) drafting is off. The tokens never depend
        on the choice: a verification round accepts exactly what decoding would have drawn,
        stateful samplers included.
        """
        if self.config.decode_steps_per_call <= 1:
            return True
        alone, several = self.verify_cost
        if len(decoding) <= 1:
            return 1 + self.config.max_drafts > alone
        expected = float(len(decoding) - len(planned))  # a sequence without drafts emits one token
        for slot, k in planned.items():
            control = self.seqs[slot].drafting
            assert control is not None  # only sequences that draft plan drafts
            expected += control.expected_tokens(k)
        return expected >= several * len(decoding)

    def _launch_verify(
        self,
        inputs: steps.RoundInputs,
        decoding: list[Sequence],
        drafts: dict[int, list[int]],
        snapshot: dict[int, Sequence],
    ) -> Round:
        """One verification round for every decoding sequence (those without drafts decode one
        token in it); they all sit out later launches until `collect` has settled it."""
        B, K = self.layout.max_slots, self.config.max_drafts
        tokens = np.zeros((B, K), np.int32)
        count = np.zeros((B,), np.int32)
        for slot, proposal in drafts.items():
            tokens[slot, : len(proposal)] = proposal
            count[slot] = len(proposal)
        # Constrained sequences wait for the next plain round (their masks need the host).
        decoding = [s for s in decoding if s.constraint is None]
        inputs.decode_mask[:] = False
        inputs.decode_mask[[s.slot for s in decoding]] = True
        for s in decoding:
            s.verifying = 1 + int(count[s.slot])
            s.dispatched += s.verifying
        ctx = self._ctx_pages(max(s.position_bound for s in decoding) + 1)
        full = not plain_sampler_pays(self.options) or any(needs_full_sampler(s.params) for s in decoding)
        d = steps.Drafts(tokens=tokens, count=count)
        width = self._decode_width(decoding, self.config.verify_widths())
        out = self._run_round(
            ("verify", K, ctx, width, full),
            steps.verify,
            inputs,
            d,
            n_ctx_pages=ctx,
            decode_width=width,
            full_sampler=full,
        )
        return Round(
            output=out,
            seqs=snapshot,
            plan=RoundPlan(decoding=_ids(decoding), multi=True),
            drafts={s.slot: int(count[s.slot]) for s in decoding},
        )

    @staticmethod
    def _constrain(inputs: steps.RoundInputs, sampling: list[Sequence]) -> None:
        """Fills the allowed-token bits of constrained sequences that draw a token this round."""
        for s in sampling:
            if s.constraint is not None:
                inputs.token_mask[s.slot] = s.constraint.allowed_bitmask()
                inputs.constrained[s.slot] = True

    @staticmethod
    def _decode_width(decoding: list[Sequence], widths: tuple[int, ...]) -> int:
        """The smallest of `widths` (the config's decode, chunk-round or verify widths) covering
        every decoding slot."""
        top = max((s.slot for s in decoding), default=-1) + 1
        return next(w for w in widths if w >= top)

    def _ctx_pages(self, n_positions: int) -> int:
        pages = max(self.layout.pages_for(n_positions), self.config.min_ctx_pages)
        return pages_bucket(pages, self.layout.max_pages_per_seq)

    # ---- batch-invariant rounds (EngineConfig.batch_invariant) --------------------------
    def _launch_invariant(
        self,
        inputs: steps.RoundInputs,
        decoding: list[Sequence],
        prefilling: list[Sequence],
        snapshot: dict[int, Sequence],
    ) -> Round:
        """One round of the batch-invariant mode: a decode call of the one decode program, or
        one prompt's next aligned chunk alone (no decode rows); they alternate while both
        have work. Neither program's shape depends on which or how many sequences ride."""
        if prefilling and (not decoding or self._last_round != "chunk"):
            self._last_round = "chunk"
            size = self._invariant_chunk()
            start = prefilling[0].prefilled
            inputs.decode_mask[:] = False
            chunk, _, prompts, finishing = self._build_chunk(size - start % size, bucket=size)
            self._constrain(inputs, finishing)
            # The context bucket of the chunk's aligned end: the same for this chunk of this
            # prompt whatever prompt (longer, or a cache hit) computes it.
            ctx, width = self._ctx_pages(start - start % size + size), self.config.chunk_widths()[0]
            out = self._run_round(
                ("step", size, ctx, width),
                steps.step,
                inputs,
                chunk,
                chunk_len=size,
                n_ctx_pages=ctx,
                decode_width=width,
            )
            return Round(output=out, seqs=snapshot, plan=RoundPlan(prompts=prompts))
        self._last_round = "decode"
        n, ctx, B = self.config.decode_steps_per_call, self.layout.max_pages_per_seq, self.layout.max_slots
        self._constrain(inputs, decoding)
        for s in decoding:
            s.dispatched += 1 if s.constraint is not None else n
        return self._decode_call(inputs, decoding, snapshot, n, ctx, B, True)

    def _decode_call(
        self,
        inputs: steps.RoundInputs,
        decoding: list[Sequence],
        snapshot: dict[int, Sequence],
        n: int,
        ctx: int,
        width: int,
        full: bool,
    ) -> Round:
        """A decode call of `n` steps at one static shape: the warmed-up executable, or `jit`."""
        out = self._run_round(
            ("decode", n, ctx, width, full),
            steps.decode_steps,
            inputs,
            n_steps=n,
            n_ctx_pages=ctx,
            decode_width=width,
            full_sampler=full,
        )
        return Round(output=out, seqs=snapshot, plan=RoundPlan(decoding=_ids(decoding), steps=n, multi=True))

    def _run_round(self, key: tuple, step_fn: Callable[..., Any], *inputs: Any, **shape: Any) -> steps.StepOutput:
        """Runs one round on the state: the executable warm-up compiled for `key`, else
        `step_fn` under jit with the static `shape` arguments that `key` stands for (the same
        ones `engine_warmup.round_variants` lowers it with)."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            self.state, out = compiled(self.params, self.state, *inputs)
        else:
            self.state, out = step_fn(self.params, self.state, *inputs, cfg=self.cfg, opts=self.options, **shape)
        return out

    def _invariant_chunk(self) -> int:
        """The batch-invariant mode's one chunk size: the largest bucket within the context."""
        buckets = self.config.chunk_buckets
        return next((b for b in reversed(buckets) if b <= self.layout.max_seq_len), buckets[0])

    def _chunk_members(self, budget: int) -> list[tuple[Sequence, int]]:
        """Which prompts the next chunk carries, oldest first, and how many tokens of each.

        The oldest prefilling sequence always goes first. Others join it (up to
        `chunk_segments`, within `budget`) only when every member starts its prompt in this
        chunk, so the round keeps the fused no-context attention path.
        """
        prefilling = self._prefilling()
        if not prefilling:
            return []
        first = prefilling[0]
        if first.prefilled > 0 or self.config.chunk_segments == 1 or self.config.batch_invariant:
            group = [first]
        else:
            group = [s for s in prefilling if s.prefilled == 0][: self.config.chunk_segments]
        members, left = [], budget
        for seq in group:
            if left <= 0:
                break
            n = min(left, len(seq.prompt) - seq.prefilled)
            stop = next((b for b in seq.stops if b > seq.prefilled), None)
            if stop is not None:
                n = min(n, stop - seq.prefilled)
            members.append((seq, n))
            left -= n
        return members

    def _build_chunk(
        self, budget: int, bucket: int | None = None
    ) -> tuple[steps.ChunkBatch, int, tuple[PromptAdvance, ...], list[Sequence]]:
        """The next round's prompt chunk (see `_chunk_members`) padded to `bucket` (None: the
        smallest chunk bucket that holds it); advances `prefilled`.

        Returns:
          (chunk, furthest position it reaches, what it prefills of each prompt, the
          sequences whose prompt it ends: they draw their first token this round).
        """
        B = self.layout.max_slots
        members = self._chunk_members(budget)
        if not members:
            return steps.empty_chunk(B), 0, (), []
        total = sum(n for _, n in members)
        bucket = bucket or next(b for b in self.config.chunk_buckets if b >= total)
        chunk = self._idle_chunk(bucket)
        reach, at, finishing, advances = 0, 0, [], []
        self._side = None  # the side row holds one state: this round's, if it keeps one
        for i, (seq, n) in enumerate(members):
            start = seq.prefilled
            chunk.tokens[at : at + n] = seq.prompt[start : start + n]
            chunk.slots[at : at + n] = seq.slot
            chunk.positions[at : at + n] = np.arange(start, start + n)
            seq.prefilled = start + n
            ends = seq.prefilled == len(seq.prompt)
            chunk.seg_slot[i], chunk.seg_start[i], chunk.seg_len[i], chunk.seg_samples[i] = seq.slot, at, n, ends
            if ends and self._side is None and seq.side_point is not None and start <= seq.side_point:
                chunk.seg_side[i] = True
                self._side = (seq.id, seq.side_point)
            finishing += [seq] if ends else []
            advances.append(
                PromptAdvance(
                    seq.id, start, seq.prefilled, tuple(b for b in seq.extract_at if start < b <= seq.prefilled), ends
                )
            )
            reach = max(reach, seq.prefilled)
            at += n
        return chunk, reach, tuple(advances), finishing

    def collect(self, handle: Round) -> list[TokenEvent]:
        """Reads a launched round (one device_get) and appends its tokens to the sequences."""
        out = jax.device_get(handle.output)
        next_drafts, out = out.next_drafts, out.replace(next_drafts=None)
        experts = out.expert_tokens
        self.expert_tokens += experts.sum(axis=0) if handle.plan.multi else experts
        if experts.shape[-1]:
            per_step = experts if handle.plan.multi else experts[None]  # [steps, L, E]
            self.last_distinct_experts = tuple((per_step > 0).sum(axis=-1).mean(axis=-1).tolist())
        steps_out = (
            [jax.tree.map(lambda x: x[i], out) for i in range(out.tokens.shape[0])] if handle.plan.multi else [out]
        )
        events: list[TokenEvent] = []
        for slot, seq in handle.seqs.items():
            if seq.finish_reason is not None:
                continue
            new, lps, tops = [], [], []
            for o in steps_out:
                if not o.sampled[slot] or seq.finish_reason is not None:
                    continue
                token = int(o.tokens[slot])
                new.append(token)
                lps.append(float(o.logprob[slot]))
                k = seq.params.top_logprobs
                tops.append([(int(i), float(p)) for i, p in zip(o.top_ids[slot][:k], o.top_logprobs[slot][:k])])
                seq.generated.append(token)
                if o.entropy is not None:
                    seq.entropies.append(float(o.entropy[slot]))
                if seq.constraint is not None:
                    seq.constraint.advance(token)
                if o.done[slot]:
                    seq.finish_reason = "stop" if self._is_stop(seq, token) else "length"
            if new:
                seq.logprobs.extend(lps)
                seq.top_logprobs.extend(tops)
                events.append(TokenEvent(seq.id, new, lps, tops, seq.finish_reason))
            self._settle_drafts(seq, handle, len(new))
            if next_drafts is not None and seq.slot in handle.drafts:
                seq.mtp_drafts = [int(t) for t in next_drafts[slot]]
        return events

    def _settle_drafts(self, seq: Sequence, handle: Round, n_new: int) -> None:
        """After a collect: a verification round's real token count replaces the bound it was
        dispatched with, and the sequence's drafting adapts to what was accepted."""
        proposed = handle.drafts.get(seq.slot)
        if proposed is None:  # not part of a verification round
            if seq.drafting is not None:
                seq.drafting.plain_tokens(n_new)
            return
        if seq.verifying:
            seq.dispatched -= seq.verifying - n_new
            seq.verifying = 0
        if seq.drafting is not None and proposed:
            accepted = min(max(n_new - 1, 0), proposed)
            seq.drafting.verified(proposed, accepted)
            self.draft_stats.record(proposed, accepted)

    def _is_stop(self, seq: Sequence, token: int) -> bool:
        stops = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else set(self.eos_ids))
        return token in stops

    def step(self, *, prefill_budget: int | None = None) -> list[TokenEvent]:
        """Launches and collects one round (the synchronous form notebooks use)."""
        handle = self.launch(prefill_budget=prefill_budget)
        return [] if handle is None else self.collect(handle)


def _ids(seqs: list[Sequence]) -> tuple[int, ...]:
    return tuple(s.id for s in seqs)
