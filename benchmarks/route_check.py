"""Checks and times the MoE routing kernel (`jaxllm.model.route_kernel`) against XLA's routing
(`layers.route` + `layers.expert_counts`) on the GPU.

    python -m benchmarks.route_check               # on the GPU
    python -m benchmarks.route_check --interpret   # CPU smoke test, tiny shapes

For rounds of 1, 16 and 64 tokens at the routing shapes of Qwen3-30B-A3B (128 experts, top-8)
and Qwen3.5-35B-A3B (256, top-8):

1. parity: the kernel's expert ids and counts equal XLA's, and its largest weight difference,
   on float32 logits and on bfloat16-rounded ones (the model's bf16 router product, where
   equal logits are common);
2. routing alone: microseconds per call of each, as `--calls` calls on distinct logits in one
   jit (dispatched once, so the figure is the device's kernels and launch gaps), and the
   kernel's launch parameters swept (warps x rows per block). The calls are independent, so
   XLA may merge their small fusions (horizontal fusion), which favours it here;
3. in the layer: microseconds per MoE layer (router, routing, experts, combine) of
   `benchmarks.moe_check`'s chain of layers with distinct weights, routed by each.

Exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from benchmarks.gpu_engine import timed
from benchmarks.moe_check import SHAPES, _cfg, chain_seconds, make_layers
from jaxllm.model.layers import expert_counts, moe_mlp, route
from jaxllm.model.route_kernel import route_and_count

ROUTINGS = {  # (E, k) and the moe_check shape of the same routing
    "qwen3-30b-a3b": (128, 8),
    "qwen3.5-35b-a3b": (256, 8),
}
TINY = {"tiny": (8, 2)}  # --interpret: moe_check's tiny shape
WARPS = (1, 2, 4, 8)


def xla_routing(E: int, k: int):
    cfg = _cfg(dict(E=E, k=k, D=64, F=32))

    def fn(logits: jax.Array, valid: jax.Array):
        top_w, top_e = route(logits, cfg)
        return top_w, top_e, expert_counts(top_e, valid, E)

    return fn


def kernel_routing(k: int, interpret: bool, **knobs: int):
    return lambda logits, valid: route_and_count(logits, valid, k=k, norm_topk_prob=True, interpret=interpret, **knobs)


def us_per_call(fn, logits: list[jax.Array], valid: jax.Array) -> float:
    """Median microseconds per routing of `len(logits)` independent calls in one jit."""
    many = jax.jit(lambda ls, v: [fn(l, v) for l in ls])
    return timed(lambda: jax.block_until_ready(many(logits, valid)), repeats=50) / len(logits) * 1e6


def parity(ours, ref) -> tuple[bool, float]:
    """(ids and counts equal, largest weight difference)."""
    (w, e, c), (rw, re, rc) = ours, ref
    same = bool(jnp.array_equal(e, re)) and bool(jnp.array_equal(c, rc))
    return same, float(jnp.max(jnp.abs(w - rw)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpret", action="store_true", help="the kernel in the Pallas interpreter (CPU)")
    ap.add_argument("--tokens", default=None, help="round widths (default 1,16,64; 1,5 with --interpret)")
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    interpret = args.interpret
    routings = TINY if interpret else ROUTINGS
    tokens = [int(t) for t in (args.tokens or ("1,5" if interpret else "1,16,64")).split(",")]
    calls = 2 if interpret else args.calls
    ok = True
    print("shape              T  routing alone                  us/call")
    for name, (E, k) in routings.items():
        xla = xla_routing(E, k)
        for T in tokens:
            key = jax.random.PRNGKey(T)
            logits = [2 * jax.random.normal(jax.random.fold_in(key, i), (T, E), jnp.float32) for i in range(calls)]
            valid = jnp.arange(T) < max(T - 1, 1)  # one padding row where the round has several
            default = kernel_routing(k, interpret)
            for rounding in ("float32", "bfloat16"):
                l = logits[0].astype(rounding).astype(jnp.float32)
                same, err = parity(jax.jit(default)(l, valid), jax.jit(xla)(l, valid))
                ok &= same and err <= 1e-6
                print(f"{name:16s} {T:3d}  parity, {rounding} logits: ids and counts equal {same}, max |dw| {err:.1e}")
            variants = [("xla", xla), ("kernel (defaults)", default)]
            block_rows = [r for r in (1, 4, 16, 64) if r <= max(1, 1 << (T - 1).bit_length())]
            for warps in (1,) if interpret else WARPS:  # the interpreter has no warps
                variants += [
                    (f"kernel warps={warps} rows={r}", kernel_routing(k, interpret, _num_warps=warps, _block_rows=r))
                    for r in block_rows
                ]
            for label, fn in variants:
                print(f"{name:16s} {T:3d}  {label:28s} {us_per_call(fn, logits, valid):8.2f}", flush=True)

    print("\nshape              T  routing in the MoE layer      us/layer")
    for name in routings:
        s = SHAPES[name]
        cfg = _cfg(s)
        layers = make_layers(s, 2 if interpret else args.layers)
        for T in tokens:
            x = jax.random.normal(jax.random.PRNGKey(7 + T), (T, s["D"]), jnp.float32).astype(jnp.bfloat16)
            for label, kernel in (("xla", None), ("kernel", "interpret" if interpret else "pallas")):
                layer = lambda x, p, kernel=kernel: moe_mlp(x, p, cfg, jnp.ones((T,), bool), route_kernel=kernel)[0]
                print(f"{name:16s} {T:3d}  {label:26s} {chain_seconds(layer, x, layers) * 1e6:9.1f}")
        del layers
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
