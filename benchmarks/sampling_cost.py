"""What each optional part of the sampler costs on the device, per decode step.

    python benchmarks/sampling_cost.py [--vocab 128256] [--batches 1,64]

The sampler's optional parts (random draws, the top-k/top-p/min-p filter, top logprobs, the
grammar mask) sit behind `lax.cond`s, and on a GPU every conditional makes the host wait for
the device to read its predicate. This times each part run unconditionally (median of
back-to-back applications inside one compiled loop, us each), to weigh which ones can simply always run.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sampling import MAX_TOP_LOGPROBS, _filter_mask, apply_token_mask


ITERS = 32


def in_loop(fn):
    """fn applied ITERS times inside one compiled loop, each on logits nudged by the last
    result (so nothing is hoisted out): device time without per-call dispatch."""

    @jax.jit
    def run(x, *rest):
        def body(x, _):
            out = fn(x, *rest)
            nudge = sum(jnp.sum(o).astype(jnp.float32) for o in jax.tree.leaves(out)) * 1e-30
            return x.at[0, 0].add(nudge), None

        return jax.lax.scan(body, x, None, length=ITERS)[0]

    return run


def time_us(fn, *args) -> float:
    """Median us per application of fn, in loops of ITERS back-to-back applications."""
    run = in_loop(fn)
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - t) / ITERS * 1e6)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", default="1,64")
    args = ap.parse_args()
    V = args.vocab
    for B in [int(b) for b in args.batches.split(",")]:
        logits = jax.random.normal(jax.random.PRNGKey(0), (B, V), jnp.float32) * 3
        seeds = jnp.arange(B, dtype=jnp.int32)
        positions = jnp.full((B,), 900, jnp.int32)
        top_k = jnp.full((B,), 50, jnp.int32)
        top_p = jnp.full((B,), 0.9, jnp.float32)
        min_p = jnp.zeros((B,), jnp.float32)
        bits = jnp.full((B, -(-V // 32)), 0xFFFF0000, jnp.uint32)
        constrained = jnp.ones((B,), bool)

        nothing = lambda x: x[0, 0]  # noqa: E731  (the loop's own cost)
        argmax = lambda x: jnp.argmax(x, axis=-1)  # noqa: E731
        log_softmax = lambda x: jax.nn.log_softmax(x, axis=-1)  # noqa: E731
        top = lambda x: jax.lax.top_k(jax.nn.log_softmax(x, axis=-1), MAX_TOP_LOGPROBS)  # noqa: E731

        def draw(x):
            keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seeds, positions)
            noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
            return jnp.argmax(x + noise, axis=-1)

        filt = lambda x: jax.vmap(_filter_mask)(x, top_k, top_p, min_p)  # noqa: E731
        mask = lambda x: apply_token_mask(x, bits, constrained)  # noqa: E731
        cond_greedy = lambda x, p: jax.lax.cond(p, lambda: jnp.argmax(x + 1, -1), lambda: jnp.argmax(x, -1))  # noqa: E731
        rows = [
            ("loop only", nothing, (logits,)),
            ("argmax (greedy)", argmax, (logits,)),
            ("log_softmax", log_softmax, (logits,)),
            (f"top_k {MAX_TOP_LOGPROBS} of log_softmax", top, (logits,)),
            ("gumbel draw + argmax", draw, (logits,)),
            ("top-k/top-p filter (sort)", filt, (logits,)),
            ("grammar mask", mask, (logits,)),
            ("lax.cond around argmax", cond_greedy, (logits, jnp.bool_(False))),
        ]
        for name, fn, a in rows:
            print(f"B={B:3d} V={V}: {name:34s} {time_us(fn, *a):9.1f} us")


if __name__ == "__main__":
    main()
