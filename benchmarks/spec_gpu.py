"""Speculative decoding's acceptance-independent costs on one GPU (dummy weights).

    python -m benchmarks.spec_gpu --config configs/llama3-8b.json [--drafts 3] [--cases verify,wide]

* verify: batch 1, one sequence at `--context` positions. A plain decode step (one step per
  call, and `--steps` per call) against one verification round of 1 + `--drafts` tokens
  (drafting forced on: dummy weights accept nothing, and the per-sequence control would stop
  drafting). Prints the verify/plain cost ratio and the speed-up that ratio gives at 60% and
  80% acceptance per draft position (expected tokens a round: 1 + a + ... + a^k).
  MTP models (`mtp_layers`) draft with their head; others get a constant proposal.
* wide: `--wide` concurrent sequences decoding with `max_drafts` 0 and `--drafts` under the
  engine's own draft control (prompt lookup, or the MTP head): output tok/s of each, so the
  cost of drafting that does not pay shows (the issue's bound: at most 3% slower).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np

from benchmarks.gpu_engine import decode_seconds_per_call, engine_config, engine_for, prefill
from jaxllm.config import load_config_json
from jaxllm.costs import model_costs
from jaxllm.engine import Engine
from jaxllm.loading import runtime_layout
from jaxllm.loading.dummy import dummy_params

from jaxllm.runtime_options import RuntimeOptions
from jaxllm.speculative import DraftControl


@dataclasses.dataclass
class ForcedDraft(DraftControl):
    """Always drafts `most` tokens, whatever was accepted (cost measurement only)."""

    def wanted(self) -> int:
        return self.most

    def verified(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted


def spec_engine(
    cfg, opts: RuntimeOptions, params, *, slots: int, drafts: int, steps: int, forced: bool, always_verify: bool = False
) -> Engine:
    """`gpu_engine.engine_for`'s engine with `max_drafts` = drafts; `forced`: a constant
    proposal of every wanted draft for models without an MTP head; `always_verify`: every
    round with drafts verifies (a verify cost near zero), to time verification at width."""
    config = engine_config(cfg, opts, slots=slots, max_seq_len=2048 + 64, chunk=1024, steps=steps, max_drafts=drafts)
    if always_verify:
        config = dataclasses.replace(config, verify_cost=1e-3)
    kw = {"draft_source": lambda tokens, k: [tokens[-1]] * k} if forced else {}
    return Engine(cfg, params, eos_ids=[], config=config, options=opts, **kw)


def rounds_per_second(eng: Engine, rounds: int, log: list | None = None) -> tuple[float, float]:
    """(seconds per `eng.step()`, tokens emitted a round) over `rounds` synchronous rounds,
    leaving out rounds over 4x the median (a compile of a variant first met here). `log`
    gets each kept round's (seconds, tokens, decoding sequences)."""
    times, tokens, widths = [], [], []
    for _ in range(rounds):
        before = sum(len(q.generated) for q in eng.seqs.values())
        widths.append(sum(q.prefilled >= len(q.prompt) for q in eng.seqs.values()))
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
        tokens.append(sum(len(q.generated) for q in eng.seqs.values()) - before)
    cut = 4 * statistics.median(times)
    kept = [(t, n, b) for t, n, b in zip(times, tokens, widths) if t <= cut]
    if log is not None:
        log.extend(kept)
    return sum(t for t, _, _ in kept) / len(kept), sum(n for _, n, _ in kept) / len(kept)


def round_kinds(log: list, steps: int) -> str:
    """The wide case's rounds by kind: a plain call emits `steps` tokens for each decoding
    sequence, a verification round between 1 and 1 + drafts; the verify round's cost in steps
    of a plain call at this width is what `EngineConfig.verify_cost` must say."""
    plain = [t for t, n, b in log if n == steps * b]
    verify = [(t, n / max(b, 1)) for t, n, b in log if n != steps * b]
    if not plain or not verify:
        return f"{len(plain)} plain calls, {len(verify)} verification rounds"
    step = statistics.median(plain) / steps
    v = statistics.median(t for t, _ in verify)
    return (
        f"{len(plain)} plain calls ({step * 1e3:.2f} ms a step), {len(verify)} verification rounds "
        f"({v * 1e3:.2f} ms = {v / step:.2f} steps, {statistics.mean(n for _, n in verify):.2f} tokens a sequence)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/llama3-8b.json")
    ap.add_argument("--cases", default="verify,wide")
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--wide", type=int, default=64)
    ap.add_argument("--wide-context", type=int, default=1536)
    args = ap.parse_args()
    cfg = load_config_json(args.config)
    opts = RuntimeOptions(dtype="bfloat16", scan_layers=False)
    params = runtime_layout(dummy_params(cfg, dtype=opts.dtype, unrolled=True), opts.replace(scan_layers=False))
    jax.block_until_ready(params)
    rng = np.random.default_rng(0)
    k = args.drafts
    name = args.config.rsplit("/", 1)[-1]

    if "verify" in args.cases.split(","):
        prompt = rng.integers(0, cfg.vocab_size, args.context).tolist()
        plain = engine_for(cfg, opts, params, slots=1, max_seq_len=2048 + 64, chunk=1024, steps=1)
        prefill(plain, [prompt], max_tokens=1000)
        for _ in range(3):
            plain.step()
        plain_s, _ = rounds_per_second(plain, 20)
        plain = engine_for(cfg, opts, params, slots=1, max_seq_len=2048 + 64, chunk=1024, steps=args.steps)
        prefill(plain, [prompt], max_tokens=1000)
        multi_s = decode_seconds_per_call(plain) / args.steps
        plain = None
        eng = spec_engine(cfg, opts, params, slots=1, drafts=k, steps=1, forced=True)
        (seq,) = prefill(eng, [prompt], max_tokens=1000)
        seq.drafting = ForcedDraft(most=k)
        for _ in range(4):  # compiles the verify round
            eng.step()
        verify_s, emitted = rounds_per_second(eng, 20)  # emitted: tokens a round
        ratio = verify_s / plain_s
        # What the verification's forward must read against a plain step (a MoE's 1 + k rows
        # route to more experts; the drafts' MTP passes are on top of this).
        costs = model_costs(cfg, params, opts)
        floor = costs.decode_step_bytes(args.context, rows=k + 1) / costs.decode_step_bytes(args.context)
        gains = {a: (1 - a ** (k + 1)) / (1 - a) / ratio for a in (0.6, 0.8)}
        print(
            f"VERIFY {name} batch 1: plain step {plain_s * 1e3:.2f} ms (1 step a call; {multi_s * 1e3:.2f} ms at "
            f"{args.steps} a call), verify 1+{k} {verify_s * 1e3:.2f} ms ({emitted:.2f} tokens a round): "
            f"{ratio:.2f}x a plain step; speed-up at 60% / 80% acceptance {gains[0.6]:.2f}x / {gains[0.8]:.2f}x "
            f"(against {args.steps}-step calls: {gains[0.6] * multi_s / plain_s:.2f}x / {gains[0.8] * multi_s / plain_s:.2f}x); "
            f"weights read: {floor:.2f}x a plain step's",
            flush=True,
        )
        eng = None

    if "wide" in args.cases.split(","):
        prompts = [rng.integers(0, cfg.vocab_size, args.wide_context).tolist() for _ in range(args.wide)]
        rates = {}
        for drafts in (0, k):
            eng = spec_engine(cfg, opts, params, slots=args.wide, drafts=drafts, steps=args.steps, forced=False)
            prefill(eng, prompts, max_tokens=400)
            for _ in range(10):  # compiles, and lets the draft control settle
                eng.step()
            log: list = []
            s, emitted = rounds_per_second(eng, 24, log)
            if drafts == 0:
                plain_round = s
            rates[drafts] = emitted / s
            print(
                f"WIDE {name} {args.wide} concurrent, max_drafts={drafts}: {rates[drafts]:.0f} output tok/s "
                f"({s * 1e3:.2f} ms a round; {round_kinds(log, args.steps)})",
                flush=True,
            )
            eng = None
        if "wide_cost" in args.cases.split(","):  # every round a verification of 1 + k forced drafts
            eng = spec_engine(
                cfg, opts, params, slots=args.wide, drafts=k, steps=args.steps, forced=True, always_verify=True
            )
            for q in prefill(eng, prompts, max_tokens=400):
                q.drafting = ForcedDraft(most=k)
            for _ in range(6):
                eng.step()
            log = []
            rounds_per_second(eng, 12, log)
            v = statistics.median(t for t, _, _ in log)
            print(
                f"WIDE {name} {args.wide} concurrent: a verification round of 1+{k} {v * 1e3:.2f} ms = "
                f"{v / (plain_round / args.steps):.2f} steps of a {args.steps}-step call",
                flush=True,
            )
            eng = None
        print(f"WIDE {name}: drafting costs {(1 - rates[k] / rates[0]) * 100:.1f}% of throughput", flush=True)


if __name__ == "__main__":
    main()
