"""Checks and times the Pallas paged decode kernel against the reference attention.

On the GPU: random inputs at the 8B model's shapes (H=32, K=8, Dh=128, page 16, bf16) for
1, 8 and 64 windows with ~1000 cached positions in a 64-page and a 136-page bucket (plus a
short sequence in the long bucket, which must be cheap), and the 135M model's shapes in
float32 and bf16. Prints one row per case: relative error of the output (norm of the
difference over norm of the reference), median times of kernel and reference, and the
kernel's effective bandwidth (bytes of K/V actually needed / time). Exits 1 on a mismatch.

    python benchmarks/paged_decode_check.py               # on the GPU
    python benchmarks/paged_decode_check.py --sweep       # also try the tuning knobs
    python benchmarks/paged_decode_check.py --interpret --small   # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# Run from a checkout without installing jaxllm: the repo root is this file's parent's parent.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxllm.attention.paged_decode import paged_decode_attention  # noqa: E402
from jaxllm.attention.reference import Windows, paged_attention  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    W: int
    H: int
    K: int
    Dh: int
    n_ctx_pages: int
    ctx: int  # cached positions per window (about: each window gets ctx - rng(0..ctx/20))
    dtype: str = "bfloat16"
    page: int = 16


def _cases(small: bool) -> list[Case]:
    if small:
        return [
            Case("tiny", 1, 4, 2, 32, 4, 50, "float32"),
            Case("tiny", 3, 4, 2, 32, 8, 50, "float32"),
            Case("tiny-g3", 2, 6, 2, 32, 8, 100, "bfloat16"),
        ]
    cases = [Case("8B", W, 32, 8, 128, n, 1000) for W in (1, 8, 64) for n in (64, 136)]
    cases += [Case("8B short", 64, 32, 8, 128, 136, 100)]
    cases += [Case("135M", 64, 9, 3, 64, 64, 1000, dt) for dt in ("float32", "bfloat16")]
    return cases


def _inputs(case: Case, seed: int = 0):
    """Random q/k/v and a shuffled pool holding every window's pages (page 0 = trash)."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(case.dtype)
    W, H, K, Dh, n, page = case.W, case.H, case.K, case.Dh, case.n_ctx_pages, case.page
    P = 1 + W * n
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dt)  # noqa: E731
    pages = (1 + rng.permutation(W * n)).reshape(W, n).astype(np.int32)
    cached = np.minimum(case.ctx - rng.integers(0, case.ctx // 20 + 1, W), n * page).astype(np.int32)
    return dict(
        q=normal(W, H, Dh), k_new=normal(W, K, Dh), v_new=normal(W, K, Dh),
        k_pages=normal(P, page, K, Dh), v_pages=normal(P, page, K, Dh),
        pages=jnp.asarray(pages), cached_len=jnp.asarray(cached),
    )


@functools.partial(jax.jit, static_argnames=("n_ctx_pages",))
def _reference(q, k_new, v_new, k_pages, v_pages, pages, cached_len, *, n_ctx_pages):
    W = q.shape[0]
    windows = Windows(slot=jnp.arange(W), start=jnp.arange(W), length=jnp.ones((W,), jnp.int32))
    return paged_attention(
        q, k_new, v_new, cached_len, k_pages, v_pages, pages, windows, window_len=1, n_ctx_pages=n_ctx_pages
    )


def _median_seconds(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _needed_bytes(case: Case, cached_len: jax.Array) -> int:
    """K and V bytes of the live cache positions: what any kernel must read."""
    per_position = 2 * case.K * case.Dh * jnp.dtype(case.dtype).itemsize
    return int(np.asarray(cached_len, np.int64).sum()) * per_position


def _rel_err(ours: jax.Array, ref: jax.Array) -> float:
    a, b = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _tolerance(dtype: str) -> float:
    return 1e-5 if dtype == "float32" else 2e-2


def run_case(case: Case, *, interpret: bool, reps: int, knobs: dict | None = None) -> tuple[float, float, float, float]:
    args = _inputs(case)
    kernel = functools.partial(paged_decode_attention, interpret=interpret, **(knobs or {}))
    ours = kernel(**args)
    ref = _reference(**args, n_ctx_pages=case.n_ctx_pages)
    err = _rel_err(ours, ref)
    t_kernel = _median_seconds(lambda: kernel(**args), reps)
    t_ref = _median_seconds(lambda: _reference(**args, n_ctx_pages=case.n_ctx_pages), reps)
    gbps = _needed_bytes(case, args["cached_len"]) / t_kernel / 1e9
    return err, t_kernel, t_ref, gbps


def _sweep(cases: list[Case], *, interpret: bool, reps: int, budget_s: float) -> None:
    """Times the kernel's knobs on the bf16 cases (best five per case), within a time budget."""
    print("\nsweep: fastest settings per case (kernel ms)")
    settings = [
        dict(pages_per_block=ppb, n_splits=s, num_warps=nw, num_stages=st)
        for ppb in (2, 4, 8)
        for s in (None, 1, 4, 16)
        for nw in (4, 8)
        for st in (2, 3)
    ]
    deadline = time.perf_counter() + budget_s
    for case in (c for c in cases if c.dtype == "bfloat16"):
        args = _inputs(case)
        ref = _reference(**args, n_ctx_pages=case.n_ctx_pages)
        results = []
        for knobs in settings:
            if time.perf_counter() > deadline:
                print("  (sweep budget spent)")
                break
            kernel = functools.partial(paged_decode_attention, interpret=interpret, **knobs)
            try:
                err = _rel_err(kernel(**args), ref)
                t = _median_seconds(lambda: kernel(**args), reps)
            except Exception as e:  # a setting that does not compile is a finding, not a crash
                print(f"  {case.name} W={case.W} n={case.n_ctx_pages} {knobs}: failed {type(e).__name__}: {e}"[:300])
                continue
            results.append((t, knobs, _needed_bytes(case, args["cached_len"]) / t / 1e9, err))
        results.sort(key=lambda r: r[0])
        for t, knobs, gbps, err in results[:5]:
            print(f"  {case.name:9s} W={case.W:3d} n={case.n_ctx_pages:4d} {t * 1e3:8.4f} ms {gbps:7.0f} GB/s err={err:.1e} {knobs}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true", help="run the kernel in the Pallas interpreter")
    parser.add_argument("--small", action="store_true", help="tiny shapes (for --interpret on CPU)")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's tuning knobs")
    parser.add_argument("--sweep-budget", type=float, default=300.0, help="seconds the sweep may take")
    args = parser.parse_args()
    reps = 3 if args.interpret else args.reps

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}), interpret={args.interpret}")
    header = f"{'case':9s} {'dtype':8s} {'W':>3s} {'bucket':>6s} {'ctx':>5s} {'rel err':>8s} {'kernel ms':>9s} {'ref ms':>8s} {'speedup':>7s} {'GB/s':>6s}"
    print(header)
    failed = False
    cases = _cases(args.small)
    for case in cases:
        try:
            err, t_kernel, t_ref, gbps = run_case(case, interpret=args.interpret, reps=reps)
        except Exception as e:  # report and keep checking the other shapes
            print(f"{case.name:9s} {case.dtype:8s} {case.W:3d} {case.n_ctx_pages:6d}: FAILED {type(e).__name__}: {e}")
            failed = True
            continue
        bad = not err <= _tolerance(case.dtype)
        failed |= bad
        print(
            f"{case.name:9s} {case.dtype:8s} {case.W:3d} {case.n_ctx_pages:6d} {case.ctx:5d} {err:8.1e} "
            f"{t_kernel * 1e3:9.4f} {t_ref * 1e3:8.4f} {t_ref / t_kernel:7.1f} {gbps:6.1f}" + ("  MISMATCH" if bad else "")
        )
    if args.sweep:
        sweep_cases = cases if args.small else [c for c in cases if c.name == "8B" and c.n_ctx_pages == 136]
        _sweep(sweep_cases, interpret=args.interpret, reps=reps, budget_s=args.sweep_budget)
    print("FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
