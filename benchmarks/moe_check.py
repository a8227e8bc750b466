"""The MoE layer on the GPU: kernels against a float32 reference at real shapes, then the time of
one MoE layer (router, routing, experts, combine) per round width, for each implementation.

Shapes: Qwen3-30B-A3B (128 experts, top-8, expert width 768, hidden 2048) and the
Qwen3.5-35B-A3B MoE layer (256 experts, top-8, width 512, hidden 2048). Each timing runs a
chain of `--layers` MoE layers with distinct random weights (x += moe(x), as in the model) so
that no layer's experts sit in L2 from the last call, dispatched back to back; the figure is
the median per layer. "floor" is the bytes of the experts actually routed to (plus the
router) over 4.3 TB/s, the copy bandwidth measured on the H200.

    python benchmarks/moe_check.py [--shapes ...] [--tokens 1,16,64] [--variants ...] [--sweep]

Variants: xla (moe_mlp's ragged_dot path), ours (moe_mlp's kernel dispatch), pairs and
grouped16/32/64 (the kernels with a forced layout / block_m), tokamax-triton and
tokamax-mosaic (tokamax.ragged_dot in place of jax.lax.ragged_dot, where installed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.model.layers import moe_mlp
from jaxllm.model.moe_kernels import moe_ffn
from jaxllm.params import MoeParams

SHAPES = {
    "tiny": dict(E=8, k=2, D=64, F=32),  # a CPU smoke test of this script (interpreted kernels)
    "qwen3-30b-a3b": dict(E=128, k=8, D=2048, F=768),
    "qwen3.5-35b-a3b": dict(E=256, k=8, D=2048, F=512),
}
COPY_BPS = 4.3e12
INTERPRET = jax.default_backend() == "cpu"


def _cfg(s: dict) -> ModelConfig:
    return ModelConfig(
        family="qwen3_moe",
        vocab_size=16,
        d_model=s["D"],
        n_layers=1,
        n_heads=16,
        n_kv_heads=4,
        head_dim=128,
        ffn_dim=0,
        max_position=64,
        n_experts=s["E"],
        n_experts_per_token=s["k"],
        moe_ffn_dim=s["F"],
        norm_topk_prob=True,
    )


def make_layers(s: dict, n: int, seed: int = 0) -> list[MoeParams]:
    E, D, F = s["E"], s["D"], s["F"]

    @jax.jit
    def one(key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        w = lambda k, shape, fan: (jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan)).astype(jnp.bfloat16)
        return MoeParams(
            router=w(k1, (D, E), D), w_gate=w(k2, (E, D, F), D), w_up=w(k3, (E, D, F), D), w_down=w(k4, (E, F, D), F)
        )

    return [one(k) for k in jax.random.split(jax.random.PRNGKey(seed), n)]


def routing(x: jax.Array, p: MoeParams, k: int) -> tuple[jax.Array, jax.Array]:
    """moe_mlp's routing: softmax over experts, top-k, renormalised."""
    probs = jax.nn.softmax(jnp.einsum("td,de->te", x, p.router).astype(jnp.float32), axis=-1)
    top_w, top_e = jax.lax.top_k(probs, k)
    return top_w / top_w.sum(-1, keepdims=True), top_e


def dense_reference(x: jax.Array, p: MoeParams, top_e: jax.Array, top_w: jax.Array) -> jax.Array:
    """Every expert on every token in float32 with full-precision products, weighted by the
    routing (zero for unrouted experts): the oracle at real shapes."""
    hi = jax.lax.Precision.HIGHEST
    E = p.w_gate.shape[0]
    xf = x.astype(jnp.float32)
    g = jnp.einsum("td,edf->etf", xf, p.w_gate.astype(jnp.float32), precision=hi)
    u = jnp.einsum("td,edf->etf", xf, p.w_up.astype(jnp.float32), precision=hi)
    y = jnp.einsum("etf,efd->etd", jax.nn.silu(g) * u, p.w_down.astype(jnp.float32), precision=hi)
    weight = (jax.nn.one_hot(top_e, E, dtype=jnp.float32) * top_w[..., None]).sum(1)  # [T, E]
    return jnp.einsum("etd,te->td", y, weight, precision=hi)


def tokamax_experts(impl: str):
    """moe_mlp's sorted ragged_dot path with tokamax.ragged_dot(implementation=impl)."""
    # tokamax imports xprof's kernel-stats tool at start (for its own benchmarking); the
    # machine has no xprof, and nothing here uses it.
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
    import tokamax

    def experts(x, top_e, top_w, p):
        T, k = top_e.shape
        E = p.w_gate.shape[0]
        flat_e = top_e.reshape(-1)
        order = jnp.argsort(flat_e, stable=True)
        xs = x[order // k]
        sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
        rd = lambda a, w: tokamax.ragged_dot(a, w, sizes, implementation=impl)
        h = jax.nn.silu(rd(xs, p.w_gate)) * rd(xs, p.w_up)
        ys = rd(h, p.w_down) * top_w.reshape(-1)[order].astype(x.dtype)[:, None]
        return jnp.zeros_like(x).at[order // k].add(ys)

    return experts


def layer_fn(variant: str, s: dict, config: tuple = ()):
    """x -> MoE(x) for one layer's params, by `variant`."""
    cfg = _cfg(s)
    if variant in ("xla", "ours"):
        kernel = None if variant == "xla" else ("interpret" if INTERPRET else "pallas")
        return lambda x, p: moe_mlp(x, p, cfg, jnp.ones(x.shape[:1], bool), kernel=kernel)[0]
    if variant.startswith("tokamax-"):
        experts = tokamax_experts(variant.removeprefix("tokamax-"))
    else:
        layout = "pairs" if variant == "pairs" else "grouped"
        bm = int(variant.removeprefix("grouped")) if variant.startswith("grouped") else None
        experts = lambda x, e, w, p: moe_ffn(
            x, e, w, p.w_gate, p.w_up, p.w_down, _layout=layout, _block_m=bm, _config=config, interpret=INTERPRET
        )

    def fn(x, p):
        top_w, top_e = routing(x, p, s["k"])
        return experts(x, top_e, top_w, p)

    return fn


def chain_seconds(fn, x, layers, calls: int = 10) -> float:
    """Median seconds per layer of the jitted chain, `calls` calls dispatched back to back."""

    @jax.jit
    def chain(x, layers):
        for p in layers:
            x = x + fn(x, p)
        return x

    chain(x, layers).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        out = [chain(x, layers) for _ in range(calls)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / calls / len(layers))
    return statistics.median(times)


def floor_seconds(x, layers, s) -> float:
    """Bytes of the routed experts' weights (each distinct expert once) and the router, over
    the copy bandwidth, per layer, with each layer routing this same x."""
    per = 3 * s["D"] * s["F"] * 2
    total = 0
    for p in layers:
        _, top_e = routing(x, p, s["k"])
        total += len(np.unique(np.asarray(top_e))) * per + s["D"] * s["E"] * 2
    return total / len(layers) / COPY_BPS


SWEEP = [  # one knob at a time from the layout's defaults (moe_kernels.DEFAULTS)
    (),
    (("gu_block_n", 32),),
    (("gu_block_n", 64),),
    (("gu_block_n", 128),),
    (("gu_block_k", 64),),
    (("gu_block_k", 128),),
    (("dn_block_n", 128),),
    (("dn_block_k", 128),),
    (("num_stages", 3),),
    (("num_stages", 4),),
    (("num_stages", 5),),
    (("num_warps", 8),),
]


# Prompt rounds (hundreds of rows per expert): larger tiles and more warps together, which the
# one-knob sweep above (from the decode-tuned defaults) never tries.
PREFILL_SWEEP = [
    (),
    (("num_warps", 8),),
    (("gu_block_n", 64), ("num_warps", 8)),
    (("gu_block_k", 32), ("num_warps", 8)),
    (("dn_block_n", 128), ("num_warps", 8)),
    (("dn_block_n", 128), ("dn_block_k", 32), ("num_warps", 8)),
    (("gu_block_n", 64), ("dn_block_n", 128), ("num_warps", 8), ("num_stages", 4)),
    (("gu_block_n", 64), ("gu_block_k", 32), ("dn_block_n", 128), ("dn_block_k", 32), ("num_warps", 8)),
    (("gu_block_n", 128), ("gu_block_k", 32), ("dn_block_n", 128), ("dn_block_k", 32), ("num_warps", 8)),
]


# Decode rounds, knobs together (SWEEP moves one at a time): narrower column tiles (more
# programs in flight), deeper pipelines, fewer warps. The defaults run first and last, so
# their two figures bound the run's drift (results: docs/lab/server-rows-and-first-tokens.md).
DECODE_GRID_SWEEP = [
    (),
    (("gu_block_n", 16),),
    (("gu_block_n", 16), ("num_warps", 2)),
    (("gu_block_n", 16), ("gu_block_k", 256), ("num_warps", 2)),
    (("gu_block_n", 64),),
    (("gu_block_n", 64), ("num_stages", 5)),
    (("gu_block_k", 256),),
    (("gu_block_k", 256), ("num_stages", 3)),
    (("num_stages", 6),),
    (("num_warps", 2),),
    (("dn_block_n", 32),),
    (("dn_block_n", 32), ("num_warps", 2)),
    (("dn_block_n", 32), ("dn_block_k", 128)),
    (("dn_block_n", 128), ("dn_block_k", 32)),
    (("gu_block_n", 16), ("dn_block_n", 32), ("num_warps", 2), ("num_stages", 5)),
    (),
]


SWEEP_SETS = {"decode": SWEEP, "prefill": PREFILL_SWEEP, "decode-grid": DECODE_GRID_SWEEP}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-30b-a3b,qwen3.5-35b-a3b")
    ap.add_argument("--tokens", default="1,2,4,8,16,64,256,1024")
    ap.add_argument("--variants", default="xla,ours,pairs,grouped16,grouped32,grouped64,tokamax-triton,tokamax-mosaic")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--parity-tokens", default="1,16,64,1024")
    ap.add_argument(
        "--sweep", default="", help="sweep the configs at these 'variant:tokens' (e.g. pairs:1,grouped16:64)"
    )
    ap.add_argument("--sweep-set", choices=tuple(SWEEP_SETS), default="decode", help="which configs --sweep tries")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sweep_configs = SWEEP_SETS[args.sweep_set]
    results: list[dict] = []

    def record(**row):
        results.append(row)
        print(json.dumps(row), flush=True)

    for shape_name in args.shapes.split(","):
        s = SHAPES[shape_name]
        layers = make_layers(s, args.layers)
        key = jax.random.PRNGKey(1)
        for T in [int(t) for t in args.parity_tokens.split(",") if t]:
            x = jax.random.normal(jax.random.fold_in(key, T), (T, s["D"]), jnp.float32).astype(jnp.bfloat16)
            p = layers[0]
            top_w, top_e = jax.jit(routing, static_argnums=2)(x, p, s["k"])
            ref = jax.jit(dense_reference)(x, p, top_e, top_w)
            for variant in args.variants.split(","):
                if variant == "xla" and T > 64:
                    continue
                try:
                    fn = layer_fn(variant, s)
                    got = jax.jit(fn)(x, p).astype(jnp.float32)
                    err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                    record(kind="parity", shape=shape_name, T=T, variant=variant, rel_err=err)
                except Exception as e:  # a candidate that fails to compile is a result too
                    record(kind="parity", shape=shape_name, T=T, variant=variant, error=repr(e)[:300])

        for T in [int(t) for t in args.tokens.split(",") if t]:
            x = jax.random.normal(jax.random.fold_in(key, 7 + T), (T, s["D"]), jnp.float32).astype(jnp.bfloat16)
            floor = floor_seconds(x, layers, s)
            for variant in args.variants.split(","):
                if variant == "xla" and T not in (1, 16, 64):
                    continue
                if variant == "pairs" and T > 16:
                    continue
                try:
                    sec = chain_seconds(layer_fn(variant, s), x, layers)
                    record(
                        kind="time",
                        shape=shape_name,
                        T=T,
                        variant=variant,
                        us=sec * 1e6,
                        floor_us=floor * 1e6,
                        of_floor=floor / sec,
                    )
                except Exception as e:
                    record(kind="time", shape=shape_name, T=T, variant=variant, error=repr(e)[:300])
        for spec in [v for v in args.sweep.split(",") if v]:
            variant, T = spec.split(":")
            T = int(T)
            x = jax.random.normal(jax.random.fold_in(key, 7 + T), (T, s["D"]), jnp.float32).astype(jnp.bfloat16)
            floor = floor_seconds(x, layers, s)
            for config in sweep_configs:
                try:
                    sec = chain_seconds(layer_fn(variant, s, config), x, layers)
                    record(
                        kind="sweep",
                        shape=shape_name,
                        T=T,
                        variant=variant,
                        config=dict(config),
                        us=sec * 1e6,
                        of_floor=floor / sec,
                    )
                except Exception as e:
                    record(
                        kind="sweep", shape=shape_name, T=T, variant=variant, config=dict(config), error=repr(e)[:300]
                    )
        del layers

    print("\nshape            T  variant          us/layer  of floor (routed experts at 4.3 TB/s)")
    for r in results:
        if r["kind"] == "time" and "us" in r:
            print(f"{r['shape']:16s} {r['T']:4d} {r['variant']:16s} {r['us']:9.1f}  {r['of_floor']:.0%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
