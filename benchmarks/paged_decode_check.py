"""Checks and times the Pallas paged decode kernel against the reference attention.

On the GPU: random inputs at the 8B model's shapes (H=32, K=8, Dh=128, page 16, bf16) for
1, 8 and 64 windows with ~1000 cached positions in a 64-page and a 136-page bucket (plus a
short sequence in the long bucket, which must be cheap), and the 135M model's shapes in
float32 and bf16. Prints one row per case: relative error of the output (norm of the
difference over norm of the reference), median times of kernel and reference, and the
kernel's effective bandwidth (bytes of K/V actually needed / time). Exits 1 on a mismatch.
Then a 32-layer scan over a stacked cache (as the forward runs it) compares passing the
kernel the stack plus a layer index with passing it a slice of the stack.

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

from jaxllm.attention.paged_decode import paged_decode_attention, paged_decode_attention_qkv  # noqa: E402
from jaxllm.model.layers import apply_rope  # noqa: E402
from jaxllm.attention.reference import Windows, paged_attention  # noqa: E402
from jaxllm.state import to_kv_dtype  # noqa: E402


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
    kv_dtype: str | None = None  # the pool's (and fresh k/v's) type when narrower: an 8-bit cache


def _cases(small: bool) -> list[Case]:
    if small:
        return [
            Case("tiny", 1, 4, 2, 32, 4, 50, "float32"),
            Case("tiny fp8", 3, 4, 2, 32, 8, 50, "bfloat16", kv_dtype="float8_e4m3fn"),
            Case("tiny", 3, 4, 2, 32, 8, 50, "float32"),
            Case("tiny-g3", 2, 6, 2, 32, 8, 100, "bfloat16"),
        ]
    cases = [Case("8B", W, 32, 8, 128, n, 1000) for W in (1, 8, 64) for n in (64, 136)]
    cases += [Case("8B short", 64, 32, 8, 128, 136, 100)]
    cases += [Case("135M", 64, 9, 3, 64, 64, 1000, dt) for dt in ("float32", "bfloat16")]
    cases += [Case("8B fp8", W, 32, 8, 128, 136, 1000, kv_dtype="float8_e4m3fn") for W in (1, 8, 64)]
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
    kv = normal if case.kv_dtype is None else lambda *shape: to_kv_dtype(normal(*shape), case.kv_dtype)  # noqa: E731
    return dict(
        q=normal(W, H, Dh),
        k_new=kv(W, K, Dh),
        v_new=kv(W, K, Dh),
        k_pages=kv(P, page, K, Dh),
        v_pages=kv(P, page, K, Dh),
        pages=jnp.asarray(pages),
        cached_len=jnp.asarray(cached),
    )


def _reference(q, k_new, v_new, k_pages, v_pages, pages, cached_len):
    W = q.shape[0]
    windows = Windows(slot=jnp.arange(W), start=jnp.arange(W), length=jnp.ones((W,), jnp.int32))
    return paged_attention(
        q, k_new, v_new, cached_len, k_pages, v_pages, pages, windows, window_len=1, n_ctx_pages=pages.shape[1]
    )


def _exact_reference(args: dict) -> jax.Array:
    """The reference with float32 dots in full precision (XLA would use TF32 on the GPU)."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(_reference)(**args)


def _rope_err(case: Case, *, interpret: bool) -> float:
    """The fused-projection entry (q, k, v as rows of one array, RoPE in the kernel) against
    the exact reference on inputs rotated by `apply_rope`."""
    args = _inputs(case, seed=1)
    dt = args["q"].dtype  # an 8-bit k/v widens exactly into the model's dtype
    qkv = jnp.concatenate([args["q"], args["k_new"].astype(dt), args["v_new"].astype(dt)], axis=1)
    inv_freq = 1.0 / (500000.0 ** (jnp.arange(case.Dh // 2, dtype=jnp.float32) * 2 / case.Dh))
    positions = args["cached_len"]
    ours = paged_decode_attention_qkv(
        qkv,
        positions,
        inv_freq,
        args["k_pages"],
        args["v_pages"],
        args["pages"],
        args["cached_len"],
        n_heads=case.H,
        interpret=interpret,
    )
    k_rotated = apply_rope(args["k_new"].astype(dt), positions, inv_freq)
    if case.kv_dtype is not None:  # the kernel attends to the fresh key as the cache will hold it
        k_rotated = to_kv_dtype(k_rotated, case.kv_dtype)
    rotated = dict(args, q=apply_rope(args["q"], positions, inv_freq), k_new=k_rotated)
    return _rel_err(ours, _exact_reference(rotated))


def _chained(fn, n: int):
    """n calls in one jit, each query the previous output: like the forward's layer loop, so
    the time per call has no Python dispatch in it."""

    @jax.jit
    def run(args):
        rest = {k: v for k, v in args.items() if k != "q"}
        return jax.lax.fori_loop(0, n, lambda i, q: fn(q=q, **rest).astype(q.dtype), args["q"])

    return run


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
    per_position = 2 * case.K * case.Dh * jnp.dtype(case.kv_dtype or case.dtype).itemsize
    return int(np.asarray(cached_len, np.int64).sum()) * per_position


def _rel_err(ours: jax.Array, ref: jax.Array) -> float:
    a, b = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _tolerance(dtype: str) -> float:
    return 1e-5 if dtype == "float32" else 2e-2


CHAIN = 10  # calls per jit in the in-jit timing


def _in_jit_seconds(fn, args: dict, reps: int) -> float:
    run = _chained(fn, CHAIN)
    return _median_seconds(lambda: run(args), reps) / CHAIN


def run_case(case: Case, *, interpret: bool, reps: int) -> dict:
    """Error against the exact reference; per-call (dispatch included) and in-jit times."""
    args = _inputs(case)
    kernel = jax.jit(functools.partial(paged_decode_attention, interpret=interpret))
    reference = jax.jit(_reference)
    err = _rel_err(kernel(**args), _exact_reference(args))
    t_kernel = _in_jit_seconds(kernel, args, reps)
    return dict(
        err=err,
        call_kernel=_median_seconds(lambda: kernel(**args), reps),
        call_ref=_median_seconds(lambda: reference(**args), reps),
        kernel=t_kernel,
        ref=_in_jit_seconds(reference, args, reps),
        gbps=_needed_bytes(case, args["cached_len"]) / t_kernel / 1e9,
    )


def _layer_loop_table(*, interpret: bool, reps: int, small: bool) -> None:
    """Per-layer time inside a scan over a stacked [L, ...] cache, as the forward runs it:
    the kernel on the stack with a layer index, on a slice of the stack, and the reference."""
    L, W, H, K, Dh, n, page, ctx = (4, 3, 4, 2, 32, 8, 16, 100) if small else (32, 64, 32, 8, 128, 64, 16, 1000)
    dt = jnp.float32 if small else jnp.bfloat16
    keys = jax.random.split(jax.random.key(1), 5)
    P = 1 + W * n
    k_stack = jax.random.normal(keys[0], (L, P, page, K, Dh), dt)
    v_stack = jax.random.normal(keys[1], (L, P, page, K, Dh), dt)
    q = jax.random.normal(keys[2], (W, H, Dh), dt)
    k_new = jax.random.normal(keys[3], (W, K, Dh), dt)
    v_new = jax.random.normal(keys[4], (W, K, Dh), dt)
    pages = jnp.asarray((1 + np.random.default_rng(0).permutation(W * n)).reshape(W, n), jnp.int32)
    cached = jnp.full((W,), ctx, jnp.int32)
    # Everything goes in as jit arguments: closed-over arrays would be baked in as constants.
    variants = {
        "kernel, stack + layer": lambda q, i, ks, vs, small: paged_decode_attention(
            q, *small[:2], ks, vs, *small[2:], layer=i, interpret=interpret
        ),
        "kernel, kv[i] slice": lambda q, i, ks, vs, small: paged_decode_attention(
            q, *small[:2], ks[i], vs[i], *small[2:], interpret=interpret
        ),
        "reference, kv[i]": lambda q, i, ks, vs, small: _reference(q, *small[:2], ks[i], vs[i], *small[2:]),
    }
    print(
        f"\nlayer loop: scan over {L} layers, W={W}, bucket {n} pages, ctx {ctx} ({jnp.dtype(dt).name}); ms per layer"
    )
    small_args = (k_new, v_new, pages, cached)
    for name, attend in variants.items():

        @jax.jit
        def run(q, ks, vs, small, attend=attend):
            step = lambda x, i: (attend(x, i, ks, vs, small).astype(x.dtype), None)  # noqa: E731
            return jax.lax.scan(step, q, jnp.arange(L))[0]

        seconds = _median_seconds(lambda: run(q, k_stack, v_stack, small_args), reps)
        print(f"  {name:24s} {seconds / L * 1e3:8.4f}")


def _sweep(cases: list[Case], *, interpret: bool, reps: int, budget_s: float, wide: bool = False) -> None:
    """Times the kernel's knobs on the bf16 cases (best five per case), each case within an
    equal share of the time budget. `wide`: the grid for many windows (more splits, bigger
    blocks, deeper pipelines), in the "hsw" order only."""
    print("\nsweep: fastest settings per case (kernel ms)")
    settings = [
        dict(_pages_per_block=ppb, _n_splits=s, _num_warps=nw, _num_stages=st, _grid_order=order)
        for order in ("hsw", "whs")
        for ppb in (4, 8, 2)
        for s in (None, 1, 4)
        for st in (2, 3)
        for nw in (4, 8)
    ]
    if wide:  # the defaults first: the line to beat
        settings = [dict()] + [
            dict(_pages_per_block=ppb, _n_splits=s, _num_warps=nw, _num_stages=st, _grid_order="hsw")
            for s in (1, 2, 4, 8)
            for ppb in (4, 8, 16)
            for st in (2, 3, 4)
            for nw in (4, 8)
        ]
    swept = [c for c in cases if c.dtype == "bfloat16"]
    for i, case in enumerate(swept):
        deadline = time.perf_counter() + budget_s / len(swept)
        args = _inputs(case)
        ref = _exact_reference(args)
        results = []
        for knobs in settings:
            if time.perf_counter() > deadline:
                print("  (sweep budget spent)")
                break
            kernel = jax.jit(functools.partial(paged_decode_attention, interpret=interpret, **knobs))
            try:
                err = _rel_err(kernel(**args), ref)
                t = _in_jit_seconds(kernel, args, reps)
            except Exception as e:  # a setting that does not compile is a finding, not a crash
                print(f"  {case.name} W={case.W} n={case.n_ctx_pages} {knobs}: failed {type(e).__name__}: {e}"[:300])
                continue
            results.append((t, knobs, _needed_bytes(case, args["cached_len"]) / t / 1e9, err))
        if results and not results[0][1]:
            t, _, gbps, err = results[0]
            print(
                f"  {case.name:9s} W={case.W:3d} n={case.n_ctx_pages:4d} {t * 1e3:8.4f} ms {gbps:7.0f} GB/s err={err:.1e} (defaults)"
            )
        results.sort(key=lambda r: r[0])
        for t, knobs, gbps, err in results[:5]:
            print(
                f"  {case.name:9s} W={case.W:3d} n={case.n_ctx_pages:4d} {t * 1e3:8.4f} ms {gbps:7.0f} GB/s err={err:.1e} {knobs}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true", help="run the kernel in the Pallas interpreter")
    parser.add_argument("--small", action="store_true", help="tiny shapes (for --interpret on CPU)")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--no-layer-loop", action="store_true", help="skip the 32-layer scan table (8.6 GB of cache)")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's tuning knobs")
    parser.add_argument("--sweep-budget", type=float, default=300.0, help="seconds the sweep may take")
    parser.add_argument(
        "--sweep-wide",
        default=None,
        metavar="W:CTX[,W:CTX]",
        help="sweep only these 8B shapes (bf16 and 8-bit pools), over the wide knob grid",
    )
    args = parser.parse_args()
    reps = 3 if args.interpret else args.reps
    if args.sweep_wide:
        shapes = [tuple(int(x) for x in item.split(":")) for item in args.sweep_wide.split(",")]
        wide = [
            Case(name, W, 32, 8, 128, 136, ctx, kv_dtype=kv)
            for W, ctx in shapes
            for name, kv in (("8B", None), ("8B fp8", "float8_e4m3fn"))
        ]
        if args.small:
            wide = [dataclasses.replace(c, H=4, K=2, Dh=32, n_ctx_pages=8, ctx=100) for c in wide]
        _sweep(wide, interpret=args.interpret, reps=reps, budget_s=args.sweep_budget, wide=True)
        return 0

    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}), interpret={args.interpret}"
    )
    print(
        f"ms per call: 'in jit' = {CHAIN} chained calls in one jit / {CHAIN} (as in the forward); "
        "'call' = one jitted call from Python (dispatch included). GB/s = live K/V bytes / kernel in-jit time."
    )
    header = (
        f"{'case':9s} {'dtype':8s} {'W':>3s} {'bucket':>6s} {'ctx':>5s} {'rel err':>8s} {'kernel':>8s} {'ref':>8s} "
        f"{'speedup':>7s} {'GB/s':>6s} {'call k':>8s} {'call ref':>8s}"
    )
    print(header)
    failed = False
    cases = _cases(args.small)
    for case in cases:
        try:
            r = run_case(case, interpret=args.interpret, reps=reps)
        except Exception as e:  # report and keep checking the other shapes
            print(f"{case.name:9s} {case.dtype:8s} {case.W:3d} {case.n_ctx_pages:6d}: FAILED {type(e).__name__}: {e}")
            failed = True
            continue
        bad = not r["err"] <= _tolerance(case.dtype)
        failed |= bad
        print(
            f"{case.name:9s} {case.dtype:8s} {case.W:3d} {case.n_ctx_pages:6d} {case.ctx:5d} {r['err']:8.1e} "
            f"{r['kernel'] * 1e3:8.4f} {r['ref'] * 1e3:8.4f} {r['ref'] / r['kernel']:7.1f} {r['gbps']:6.0f} "
            f"{r['call_kernel'] * 1e3:8.4f} {r['call_ref'] * 1e3:8.4f}" + ("  MISMATCH" if bad else "")
        )
    for case in cases:
        err = _rope_err(case, interpret=args.interpret)
        bad = not err <= _tolerance(case.dtype)
        failed |= bad
        print(
            f"{case.name:9s} {case.dtype:8s} {case.W:3d} {case.n_ctx_pages:6d}: fused q/k/v input with RoPE, "
            f"rel err {err:.1e}" + ("  MISMATCH" if bad else "")
        )
    if not args.no_layer_loop:
        try:
            _layer_loop_table(interpret=args.interpret, reps=reps, small=args.small)
        except Exception as e:  # timing only: report it without hiding the check's verdict
            print(f"layer loop failed: {type(e).__name__}: {e}"[:500])
    if args.sweep:
        sweep_cases = cases if args.small else [c for c in cases if c.name == "8B" and c.n_ctx_pages == 136]
        _sweep(sweep_cases, interpret=args.interpret, reps=reps, budget_s=args.sweep_budget)
    print("FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
