"""Checks and times the Pallas decode matvec against XLA's dot at Llama-3-8B decode shapes.

On the GPU, bf16, for each projection (qkv [4096, 6144], wo [4096, 4096], gate_up [4096, 28672],
down [14336, 4096], lm_head [4096, 128256]) and M rows of x:
  1. error of the kernel against jnp.dot(x, w, preferred_element_type=f32): ||diff|| / ||ref||
     and max |diff| / max |ref|;
  2. time per call of a chain of L distinct weight matrices (32, or 4 for lm_head: several GB,
     far past the 60 MB L2, so weights come from HBM) in one jit, each call's output feeding
     the next call's x, for XLA's dot and for the kernel at its defaults; GB/s = weight bytes /
     time. Chained jitted calls are dispatched back to back and timed together, so the host's
     dispatch overlaps device work;
  3. a sweep of the kernel's knobs (one- or two-knob moves from the defaults, or the product
     given with --grid) for M = 1 per shape (or --sweep-ms), within a time budget, best first;
  4. the whole decode step's GEMV time: 32 x (qkv + wo + gate_up + down) + lm_head.

    python benchmarks/matvec_check.py                      # on the GPU (~4 min)
    python benchmarks/matvec_check.py --ms 1 8 64          # also M = 64
    python benchmarks/matvec_check.py --no-check --sweep-ms 8 --sweep-budget 170 \
        --grid "use_dot=1 block_k=32,64,128 block_n=32,64,128 num_warps=4,8 num_stages=3,4"
    python benchmarks/matvec_check.py --interpret --small  # CPU smoke test
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import time

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# Run from a checkout without installing jaxllm: the repo root is this file's parent's parent.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxllm.model.matvec import default_config, matvec  # noqa: E402

LLAMA3_8B = {  # name: (K, N, layers in the chain, calls per decode step)
    "qkv": (4096, 6144, 32, 32),
    "wo": (4096, 4096, 32, 32),
    "gate_up": (4096, 28672, 32, 32),
    "down": (14336, 4096, 32, 32),
    "lm_head": (4096, 128256, 4, 1),
}
SMALL = {
    "qkv": (64, 96, 2, 32),
    "down": (200, 48, 2, 32),
    "lm_head": (64, 300, 2, 1),
}
TARGET_MS = 4.4


def _next_x(y: jax.Array, K: int) -> jax.Array:
    """The next call's [M, K] input from this call's [M, N] output (a data dependency)."""
    N = y.shape[1]
    if N < K:
        y = jnp.tile(y, (1, -(-K // N)))
    return y[:, :K]


def _xla(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _chain(fn):
    """One jit: x through every weight of the list in turn."""

    @jax.jit
    def run(x, ws):
        for w in ws:
            x = _next_x(fn(x, w), x.shape[1])
        return x

    return run


def _seconds_per_run(run, x, ws, *, reps: int, inner: int) -> float:
    """Median over `reps` groups of `inner` back-to-back runs, after warm-up."""
    x = jax.block_until_ready(run(x, ws))  # compile
    x = jax.block_until_ready(run(x, ws))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            x = run(x, ws)
        jax.block_until_ready(x)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _weights(K: int, N: int, L: int, dtype, seed: int) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(seed), L)
    # Scaled so that chained outputs stay O(1) in any dtype.
    return [(jax.random.normal(k, (K, N), jnp.float32) * K**-0.5).astype(dtype) for k in keys]


def _errors(ours: jax.Array, ref: jax.Array) -> tuple[float, float]:
    a, b = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    if not np.all(np.isfinite(a)):
        return float("inf"), float("inf")
    norm = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    peak = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
    return norm, peak


def _sweep_configs(M: int, K: int, N: int, itemsize: int) -> list[dict]:
    """The defaults and one- or two-knob moves away from them (~16)."""
    d = default_config(M, K, N, itemsize)
    s = d["split_k"]
    moves = [
        {},
        dict(num_warps=8), dict(num_stages=2), dict(num_stages=4), dict(num_warps=2),
        dict(block_k=2 * d["block_k"]), dict(block_k=max(16, d["block_k"] // 2)),
        dict(block_n=max(16, d["block_n"] // 2)), dict(block_n=2 * d["block_n"]),
        dict(block_n=2 * d["block_n"], block_k=2 * d["block_k"], num_warps=8),
        dict(split_k=max(1, s // 2)), dict(split_k=2 * s),
        dict(use_dot=not d["use_dot"]), dict(use_dot=not d["use_dot"], num_warps=8),
        dict(use_dot=not d["use_dot"], block_k=2 * d["block_k"], num_stages=4),
        dict(block_k=4 * d["block_k"], block_n=max(16, d["block_n"] // 2), num_warps=8),
    ]
    return moves


def _parse_grid(spec: str) -> list[dict]:
    """'block_k=16,32 use_dot=0,1 split_k=auto,8' -> every combination (auto: the default)."""
    axes = []
    for item in spec.split():
        key, values = item.split("=")
        parse = (lambda v: bool(int(v))) if key == "use_dot" else int
        axes.append([(key, None if v == "auto" else parse(v)) for v in values.split(",")])
    return [{k: v for k, v in combo if v is not None} for combo in itertools.product(*axes)]


def _knobs(knobs: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in knobs.items()) or "defaults"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true", help="run the kernel in the Pallas interpreter")
    parser.add_argument("--small", action="store_true", help="tiny shapes (for --interpret on CPU)")
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 8], help="rows of x to check and time")
    parser.add_argument("--shapes", nargs="+", default=None, help="subset of the shape names")
    parser.add_argument("--reps", type=int, default=7, help="timed groups per measurement")
    parser.add_argument("--inner", type=int, default=5, help="back-to-back runs per timed group")
    parser.add_argument("--sweep-budget", type=float, default=120.0, help="seconds for the M=1 sweep (0: none)")
    parser.add_argument("--grid", default=None,
                        help="sweep this product of knobs instead, e.g. 'block_k=16,32 num_warps=4,8 split_k=auto,8'")
    parser.add_argument("--sweep-ms", type=int, nargs="+", default=[1], help="rows of x in the sweep")
    parser.add_argument("--no-check", action="store_true", help="skip the check-and-time table (sweep only)")
    parser.add_argument("--top", type=int, default=4, help="fastest configs printed per shape")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    reps, inner = (1, 1) if args.interpret else (args.reps, args.inner)
    dtype = jnp.dtype(args.dtype)
    shapes = SMALL if args.small else LLAMA3_8B
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes}
    kernel = functools.partial(matvec, interpret=args.interpret)

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"interpret={args.interpret}, {dtype.name}")
    print("us = time per call in a chain of L distinct weights in one jit; GB/s = weight bytes / time")
    print(f"{'shape':8s} {'K':>6s} {'N':>7s} {'M':>3s} {'L':>3s} {'err':>8s} {'max err':>8s} "
          f"{'xla us':>8s} {'xla GB/s':>8s} {'ker us':>8s} {'ker GB/s':>8s} {'speedup':>7s}  defaults")
    failed = False
    per_call: dict[tuple[str, int], dict[str, float]] = {}
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for name, (K, N, L, _) in ({} if args.no_check else shapes).items():
        try:
            ws = _weights(K, N, L, dtype, seed=len(name))
        except Exception as e:  # out of memory, say: the other shapes still run
            print(f"{name:8s} weights failed: {type(e).__name__}: {e}"[:300])
            failed = True
            continue
        nbytes = L * K * N * dtype.itemsize
        for M in args.ms:
            x = jax.random.normal(jax.random.key(M), (M, K), jnp.float32).astype(dtype)
            d = default_config(M, K, N, dtype.itemsize)
            row = f"{name:8s} {K:6d} {N:7d} {M:3d} {L:3d}"
            try:
                with jax.default_matmul_precision("highest"):
                    ref = jnp.dot(x, ws[0], preferred_element_type=jnp.float32)
                err, peak = _errors(kernel(x, ws[0]), ref)
                bad = not err <= tol
                failed |= bad
                t_xla = _seconds_per_run(_chain(_xla), x, ws, reps=reps, inner=inner) / L
                t_ker = _seconds_per_run(_chain(kernel), x, ws, reps=reps, inner=inner) / L
            except Exception as e:  # report and keep checking the other cases
                print(f"{row}: FAILED {type(e).__name__}: {e}"[:600])
                failed = True
                continue
            per_call[(name, M)] = dict(xla=t_xla, kernel=t_ker)
            print(f"{row} {err:8.1e} {peak:8.1e} {t_xla * 1e6:8.1f} {nbytes / L / t_xla / 1e9:8.0f} "
                  f"{t_ker * 1e6:8.1f} {nbytes / L / t_ker / 1e9:8.0f} {t_xla / t_ker:7.2f}  {_knobs(d)}"
                  + ("  MISMATCH" if bad else ""))
        del ws

    best: dict[str, float] = {}
    if args.sweep_budget > 0:
        print(f"\nsweep, M in {args.sweep_ms} (budget {args.sweep_budget:.0f} s): "
              f"fastest {args.top} per case, us per call")
        deadline = time.perf_counter() + args.sweep_budget
        cases = [(name, M) for name in shapes for M in args.sweep_ms]
        for i, (name, M) in enumerate(cases):
            if time.perf_counter() > deadline:
                print("  (sweep budget spent)")
                break
            K, N, L, _ = shapes[name]
            # Each case gets an equal share of what is left.
            case_deadline = time.perf_counter() + (deadline - time.perf_counter()) / (len(cases) - i)
            ws = _weights(K, N, L, dtype, seed=len(name))
            x = jax.random.normal(jax.random.key(M), (M, K), jnp.float32).astype(dtype)
            with jax.default_matmul_precision("highest"):
                ref = jnp.dot(x, ws[0], preferred_element_type=jnp.float32)
            results = []
            configs = _parse_grid(args.grid) if args.grid else _sweep_configs(M, K, N, dtype.itemsize)
            configs = configs[:2] if args.small else configs
            for knobs in configs:
                if time.perf_counter() > case_deadline:
                    print(f"  {name} M={M}: (share of the budget spent after {len(results)}/{len(configs)} configs)")
                    break
                fn = functools.partial(kernel, **knobs)
                try:
                    err, _ = _errors(fn(x, ws[0]), ref)
                    t = _seconds_per_run(_chain(fn), x, ws, reps=max(1, reps // 2), inner=inner) / L
                except Exception as e:  # a config that does not compile is a finding, not a crash
                    print(f"  {name:8s} M={M} {_knobs(knobs)}: failed {type(e).__name__}: {e}"[:400])
                    continue
                results.append((t, knobs, err))
            results.sort(key=lambda r: r[0])
            for t, knobs, err in results[: args.top]:
                gbps = K * N * dtype.itemsize / t / 1e9
                print(f"  {name:8s} M={M:2d} {t * 1e6:8.1f} us {gbps:6.0f} GB/s err={err:.1e}  {_knobs(knobs)}"
                      + ("  MISMATCH" if not err <= tol else ""))
            if M == 1 and results and results[0][2] <= tol:
                best[name] = results[0][0]
            del ws

    print("\ndecode step GEMVs (32 x (qkv + wo + gate_up + down) + lm_head), ms:")
    for M in args.ms:
        if not all((name, M) in per_call for name in shapes):
            continue
        total = {k: sum(calls * per_call[(name, M)][k] for name, (_, _, _, calls) in shapes.items())
                 for k in ("xla", "kernel")}
        line = f"  M={M:3d}: xla {total['xla'] * 1e3:7.3f}  kernel {total['kernel'] * 1e3:7.3f}"
        if M == 1 and len(best) == len(shapes):
            swept = sum(calls * min(best[name], per_call[(name, 1)]["kernel"])
                        for name, (_, _, _, calls) in shapes.items())
            line += f"  kernel, best swept {swept * 1e3:7.3f}"
        print(line + f"  (target {TARGET_MS} ms at M=1 for the full 8B shapes)")
    print("FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
