"""The Gated DeltaNet decode kernel on the GPU against its jnp oracle at real shapes, then timed.

`gated_delta_decode` (one token per window) on a pool of every layer's slot states
[layers, slots, H, Dk, Dv], against `gated_delta_recurrent` with T = 1 over the gathered
states plus a scatter back (the jnp path, timed the same way, pool donated). One line per
width: max abs and relative L2 error of out and state, median ms of each path (20 runs after
warm-up), the bytes of state read and written and the achieved GB/s.

A Pallas kernel for the chunked prefill was measured here too and retired: 8-12x slower than
XLA's jnp WY form at T = 64..2048 (docs/lab/hybrid-h200.md).

    python benchmarks/gated_delta_check.py                  # GPU, real shapes
    python benchmarks/gated_delta_check.py --interpret      # CPU smoke test, tiny shapes
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxllm.model.gated_delta import gated_delta_chunked, gated_delta_recurrent
from jaxllm.model.gated_delta_kernel import gated_delta_decode

REAL = dict(H=32, Dk=128, Dv=128, layers=30, slots=64, widths=(1, 16, 64))
TINY = dict(H=2, Dk=16, Dv=32, layers=2, slots=4, widths=(1, 2))


def median_seconds(fn: Callable[[], object], runs: int, warmup: int = 3) -> float:
    """Median wall time of fn() with its results blocked on, after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def errors(got: jax.Array, ref: jax.Array) -> tuple[float, float]:
    """max |got - ref| and ||got - ref|| / ||ref||, in float64 on the host."""
    g, r = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(g - r).max()), float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))


def rule_inputs(key: jax.Array, N: int, T: int, H: int, Dk: int, Dv: int, dtype) -> tuple[jax.Array, ...]:
    """q, k, v in `dtype`, g <= 0 (decay rates as the model makes them), beta in (0, 1),
    a float32 state of the size a long prompt leaves."""
    kq, kk, kv, kg, kb, ks = jax.random.split(key, 6)
    q = jax.random.normal(kq, (N, T, H, Dk), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (N, T, H, Dk), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (N, T, H, Dv), jnp.float32).astype(dtype)
    g = -jax.nn.softplus(jax.random.normal(kg, (N, T, H), jnp.float32) - 2.0)  # mostly slow decay
    beta = jax.nn.sigmoid(jax.random.normal(kb, (N, T, H), jnp.float32))
    state = jax.random.normal(ks, (N, H, Dk, Dv), jnp.float32) * 0.1
    return q, k, v, g, beta, state


@functools.partial(jax.jit, donate_argnums=(5,))
def jnp_decode(q, k, v, g, beta, pool, slots, layer):
    """The XLA path: gather the windows' states, one recurrent step, scatter them back."""
    states = pool[layer, slots]  # [W, H, Dk, Dv]
    out, new = gated_delta_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], states)
    return out[:, 0], pool.at[layer, slots].set(new)


def check_decode(shape: dict, dtype, runs: int, interpret: bool) -> None:
    H, Dk, Dv, n_layers, n_slots = shape["H"], shape["Dk"], shape["Dv"], shape["layers"], shape["slots"]
    pool = jax.random.normal(jax.random.PRNGKey(0), (n_layers, n_slots, H, Dk, Dv), jnp.float32) * 0.1
    kernel = jax.jit(functools.partial(gated_delta_decode, interpret=interpret), donate_argnums=(5,))
    layer = jnp.int32(n_layers // 2)
    for W in shape["widths"]:
        q, k, v, g, beta, _ = rule_inputs(jax.random.PRNGKey(100 + W), W, 1, H, Dk, Dv, dtype)
        q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
        slots = jax.random.permutation(jax.random.PRNGKey(W), n_slots)[:W].astype(jnp.int32)
        before = pool[layer, slots]  # a copy: the kernel updates the pool in place
        ref_out, ref_new = gated_delta_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], before)
        out, pool = kernel(q, k, v, g, beta, pool, slots, layer=layer)
        out_err, state_err = errors(out, ref_out[:, 0]), errors(pool[layer, slots], ref_new)

        def run_kernel():  # each call advances the same slots again, in place
            nonlocal pool
            o, pool = kernel(q, k, v, g, beta, pool, slots, layer=layer)
            return o

        def run_jnp():
            nonlocal pool
            o, pool = jnp_decode(q, k, v, g, beta, pool, slots, layer)
            return o

        t_kernel = median_seconds(run_kernel, runs)
        t_jnp = median_seconds(run_jnp, runs)
        state_bytes = 2 * W * H * Dk * Dv * 4  # each window's state read once and written once
        token_bytes = W * H * (2 * Dk + 2 * Dv) * jnp.dtype(dtype).itemsize + 2 * W * H * 4  # q, k, v, out; g, beta
        moved = state_bytes + token_bytes
        print(
            f"decode  {jnp.dtype(dtype).name:8s} W={W:3d} pool={n_layers}x{n_slots} H={H} Dk={Dk} Dv={Dv}  "
            f"out max {out_err[0]:.2e} rel {out_err[1]:.2e}  state max {state_err[0]:.2e} rel {state_err[1]:.2e}  "
            f"kernel {t_kernel * 1e3:.4f} ms  jnp {t_jnp * 1e3:.4f} ms  x{t_jnp / t_kernel:.2f}  "
            f"{moved / 1e6:.2f} MB  kernel {moved / t_kernel / 1e9:.3g} GB/s  jnp {moved / t_jnp / 1e9:.3g} GB/s",
            flush=True,
        )


def check_prefill(runs: int, tokens: tuple[int, ...] = (512, 2048)) -> None:
    """XLA's chunked WY form (`gated_delta_chunked`, its chunk loop unrolled) by matmul
    precision (HIGHEST: float32 on the FMA units; HIGH: three bf16 passes on the tensor cores;
    DEFAULT: TF32 / one bf16 pass, what the model's prompt chunks ask for); errors against
    HIGHEST. The prefill of every DeltaNet layer runs this form."""
    H, Dk, Dv = REAL["H"], REAL["Dk"], REAL["Dv"]
    for T in tokens:
        args = rule_inputs(jax.random.PRNGKey(T), 1, T, H, Dk, Dv, jnp.bfloat16)
        ref = None
        for name in ("HIGHEST", "HIGH", "DEFAULT"):
            precision = getattr(lax.Precision, name)
            fn = jax.jit(functools.partial(gated_delta_chunked, chunk=64, precision=precision))
            out, state = fn(*args)
            if ref is None:
                ref = (out, state)
            t = median_seconds(lambda: fn(*args), runs)
            out_err, state_err = errors(out, ref[0]), errors(state, ref[1])
            print(
                f"prefill jnp WY T={T:5d} precision={name:8s} {t * 1e3:.3f} ms  "
                f"out rel {out_err[1]:.2e}  state rel {state_err[1]:.2e}",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interpret", action="store_true", help="Pallas interpreter on the CPU, tiny shapes")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="q, k, v dtypes")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill form's precision timings")
    args = ap.parse_args()
    shape = TINY if args.interpret else REAL
    print("jax", jax.__version__, jax.devices(), flush=True)
    for dtype in [] if args.prefill_only else args.dtypes.split(","):
        check_decode(shape, jnp.dtype(dtype), args.runs, args.interpret)
    if not args.interpret:
        check_prefill(args.runs)


if __name__ == "__main__":
    main()
