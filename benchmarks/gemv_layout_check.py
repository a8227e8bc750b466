"""One-row products on the GPU: does the weight's layout decide XLA's GEMV speed?

    python -m benchmarks.gemv_layout_check

The batch-1 MoE and hybrid steps spend most of their time outside the experts, in one-row
products that XLA lowers to reduction fusions (docs/lab/moe-h200.md, run 5: 535 GB/s for a
[1, 4096] x [4096, 2048] product). Our weights are stored [in, out] (the contraction over the
leading, slow axis: a column reduction). This times, for the projection shapes of the 30B /
35B MoE models, a chain of `--layers` distinct weights times one row (and 8 rows) with the
weight as [in, out] and as [out, in] (a row reduction: each output a contiguous dot), and
prints microseconds and GB/s for each.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.gpu_engine import timed

SHAPES = {  # (in, out)
    "q/gate proj 2048 -> 4096": (2048, 4096),
    "o proj 4096 -> 2048": (4096, 2048),
    "DeltaNet qkvz 2048 -> 12288": (2048, 12288),
    "lm_head 2048 -> 151936": (2048, 151936),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    key = jax.random.PRNGKey(0)
    for name, (k_in, n_out) in SHAPES.items():
        layers = 4 if n_out > 20000 else args.layers
        ws = jax.random.normal(key, (layers, k_in, n_out), jnp.bfloat16)
        wts = jnp.swapaxes(ws, 1, 2).copy()  # [L, out, in]
        ws_list = [ws[i] for i in range(layers)]
        wts_list = [wts[i] for i in range(layers)]
        del ws, wts
        for rows in (1, 8):
            x = jax.random.normal(key, (rows, k_in), jnp.bfloat16)
            # Each product's input depends on the last one's output (a chain, as in a step).
            in_out = jax.jit(lambda x, ws: sum(jnp.dot(x + i, w).astype(jnp.float32).sum() for i, w in enumerate(ws)))
            out_in = jax.jit(
                lambda x, ws: sum(jnp.einsum("rk,nk->rn", x + i, w).astype(jnp.float32).sum() for i, w in enumerate(ws))
            )
            bytes_ = layers * k_in * n_out * 2
            for label, fn, w in (("[in, out]", in_out, ws_list), ("[out, in]", out_in, wts_list)):
                s = timed(lambda: jax.block_until_ready(fn(x, w)))
                print(
                    f"GEMV {name}, {rows} row(s), weight {label}: {s / layers * 1e6:.1f} us a product, "
                    f"{bytes_ / s / 1e9:.0f} GB/s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
