"""Does XLA turn a one-token projection with two contracting axes ([1, H, Dh] x [H, Dh, D],
the attention output projection `project(attn, wo, 2)`) into a multiply + reduce instead of
a GEMV? Times 48 distinct such weights as written and through 2-D views, and prints which
kernels each compiles to.

    python benchmarks/dot_form_check.py [--heads 32 --head-dim 128 --d-model 2048 --layers 48]
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import time

import jax
import jax.numpy as jnp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=48)
    args = ap.parse_args()
    H, Dh, D, L = args.heads, args.head_dim, args.d_model, args.layers
    keys = jax.random.split(jax.random.PRNGKey(0), L + 1)
    ws = [jax.random.normal(k, (H, Dh, D), jnp.bfloat16) for k in keys[:L]]
    x = jax.random.normal(keys[L], (1, H, Dh), jnp.bfloat16)

    forms = {
        "tensordot 2 axes": lambda a, w: jnp.tensordot(a, w, axes=2),
        "2-D views": lambda a, w: a.reshape(a.shape[0], -1) @ w.reshape(-1, w.shape[-1]),
    }
    for name, form in forms.items():

        def chain(x, ws):
            out = jnp.zeros((1, D), jnp.float32)
            for w in ws:
                out = out + form(x, w).astype(jnp.float32)
            return out

        fn = jax.jit(chain)
        hlo = fn.lower(x, ws).compile().as_text()
        entry = hlo[hlo.index("ENTRY") :]
        kinds = collections.Counter(
            re.findall(r"kind=(k\w+)", entry)
            + re.findall(r'custom_call_target="([^"]+)"', entry)
            + re.findall(r"calls=%?(\w*(?:multiply|reduce|dot|gemm)\w*)", entry)
        )
        fn(x, ws).block_until_ready()
        times = []
        for _ in range(7):
            t = time.perf_counter()
            outs = [fn(x, ws) for _ in range(10)]
            jax.block_until_ready(outs)
            times.append((time.perf_counter() - t) / 10)
        per = statistics.median(times) / L
        gbs = H * Dh * D * 2 / per / 1e9
        print(
            f"{name:18s} {per * 1e6:7.2f} us per projection ({gbs:5.0f} GB/s); entry computation: {dict(kinds.most_common(6))}",
            flush=True,
        )


if __name__ == "__main__":
    main()
