"""Checks and times the add + RMSNorm Pallas kernel against XLA's fusions on the GPU.

Rows of the 8B (d 4096, bf16) and 135M (d 576, float32) models for 1, 8 and 64 tokens: the
largest difference from `jaxllm.model.layers.rms_norm` (in units of the dtype's epsilon) and
the time of 32 chained calls in one jit (as a step's layers run them). Exits 1 on a mismatch.

    python benchmarks/norm_check.py               # on the GPU
    python benchmarks/norm_check.py --interpret   # CPU smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxllm.model.layers import rms_norm  # noqa: E402
from jaxllm.model.rms_norm_kernel import add_rms_norm  # noqa: E402

CHAIN = 32


def chained(norm):
    """CHAIN dependent add + norm calls, each feeding the next (like a step's layers)."""

    def run(x, delta, w):
        for _ in range(CHAIN):
            x, h = norm(x, delta, w)
            delta = h
        return x, delta

    return jax.jit(run)


def ms(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(20):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interpret", action="store_true")
    args = ap.parse_args()
    ok = True
    print("dtype     D   T  max|diff|/eps  kernel ms  xla ms  (32 chained add+norm)")
    for dtype, D in ((jnp.bfloat16, 4096), (jnp.float32, 576)):
        for T in (1, 8, 64):
            rng = np.random.default_rng(T)
            x = jnp.asarray(rng.normal(size=(T, D)), dtype)
            delta = jnp.asarray(rng.normal(size=(T, D)), dtype)
            w = jnp.asarray(rng.normal(size=(D,)), dtype)
            total, normed = add_rms_norm(x, delta, w, eps=1e-5, interpret=args.interpret)
            ref = rms_norm(x + delta, w, 1e-5)
            eps = float(jnp.finfo(dtype).eps)
            scale = np.maximum(np.abs(np.asarray(ref, np.float32)), 1.0)
            err = float(np.max(np.abs(np.asarray(normed, np.float32) - np.asarray(ref, np.float32)) / scale)) / eps
            same_sum = bool(jnp.all(total == x + delta))
            ok &= same_sum and err <= 4
            kernel = chained(lambda a, b, c: add_rms_norm(a, b, c, eps=1e-5, interpret=args.interpret))
            xla = chained(lambda a, b, c: ((a + b), rms_norm(a + b, c, 1e-5)))
            print(
                f"{jnp.dtype(dtype).name:9} {D:4} {T:3} {err:13.2f}  {ms(kernel, x, delta, w):9.3f} "
                f"{ms(xla, x, delta, w):7.3f}  sum exact: {same_sum}"
            )
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
