"""The Gated DeltaNet Pallas kernels on the GPU against their jnp oracles at real shapes, then timed.

`gated_delta_decode` (one token per window) on a pool of every layer's slot states
[layers, slots, H, Dk, Dv], against `gated_delta_recurrent` with T = 1 over the gathered
states plus a scatter back (the jnp path, timed the same way, pool donated). One line per
width: max abs and relative L2 error of out and state, median ms of each path (20 runs after
warm-up), the bytes of state read and written and the achieved GB/s.

`gated_delta_decode_from_projections` (the conv and the gates as the rule kernel's prologue) the
same way against XLA's conv, gates, step and scatters, from bfloat16 projections.

Then the chunked prefill (`check_prefill`): XLA's WY form by matmul precision, and the same
form with its chunk-to-chunk state pass as one Pallas kernel (`chunk_state_pass`), end to end
and alone over a sweep of its launch parameters, each with its errors against the form at
HIGHEST precision.

    python benchmarks/gated_delta_check.py                  # GPU, real shapes
    python benchmarks/gated_delta_check.py --prefill-only   # GPU, the prefill rows only
    python benchmarks/gated_delta_check.py --interpret      # CPU smoke test, tiny shapes
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxllm.model.gated_delta import (
    ChunkTerms,
    causal_conv,
    chunk_terms,
    gated_delta_chunked,
    gated_delta_recurrent,
    unit_lower_solve,
)
from jaxllm.model.gated_delta_chunk_kernel import chunk_state_pass
from jaxllm.model.gated_delta_kernel import gated_delta_decode, gated_delta_decode_from_projections

# Qwen3.5-35B-A3B's DeltaNet layers; `tokens`: the prompt lengths of the prefill rows.
REAL = dict(H=32, Dk=128, Dv=128, layers=30, slots=64, widths=(1, 16, 64), tokens=(512, 2048))
TINY = dict(H=2, Dk=16, Dv=32, layers=2, slots=4, widths=(1, 2), tokens=(64, 100))
CHUNK = 64  # the model's (delta_mixer._DELTA_CHUNK)
# The state kernel's launch sweep; block sizes that do not divide Dv are skipped.
SWEEP = dict(block_v=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 2))
Rule = tuple[jax.Array, jax.Array]  # (out, new state)


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


@functools.partial(jax.jit, static_argnames=("n_k_heads",), donate_argnums=(7,))
def jnp_decode_from_projections(qkv, a, b, conv, conv_w, a_log, dt_bias, pool, slots, layer, *, n_k_heads):
    """The XLA path of a decode row from its projections (as `delta_mixer._rule_inputs` then
    the recurrence): conv over the gathered windows, gates, one step, states scattered back."""
    W, H, Dk, Dv = qkv.shape[0], pool.shape[2], pool.shape[3], pool.shape[4]
    y, windows = causal_conv(qkv[:, None].astype(jnp.float32), conv[layer, slots], conv_w, jnp.ones((W,), jnp.int32))
    q, k, v = jnp.split(y[:, 0], [n_k_heads * Dk, 2 * n_k_heads * Dk], axis=-1)
    q = jnp.repeat(q.reshape(W, n_k_heads, Dk), H // n_k_heads, axis=1)
    k = jnp.repeat(k.reshape(W, n_k_heads, Dk), H // n_k_heads, axis=1)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
    out, new = gated_delta_recurrent(
        q[:, None], k[:, None], v.reshape(W, 1, H, Dv), g[:, None], beta[:, None], pool[layer, slots]
    )
    return out[:, 0], pool.at[layer, slots].set(new), windows


def check_decode_from_projections(shape: dict, runs: int, interpret: bool) -> None:
    """`gated_delta_decode_from_projections` (conv, gates and rule in one kernel) against the
    XLA path, bfloat16 projections as the model feeds them; one line per width."""
    H, Dk, Dv, n_layers, n_slots = shape["H"], shape["Dk"], shape["Dv"], shape["layers"], shape["slots"]
    Hk, taps = H // 2, 4
    C = 2 * Hk * Dk + H * Dv
    keys = jax.random.split(jax.random.PRNGKey(7), 6)
    pool = jax.random.normal(keys[0], (n_layers, n_slots, H, Dk, Dv), jnp.float32) * 0.1
    conv = jax.random.normal(keys[1], (n_layers, n_slots, taps - 1, C), jnp.float32)
    conv_w = (jax.random.normal(keys[2], (C, taps), jnp.float32) * 0.5).astype(jnp.bfloat16)
    a_log, dt_bias = jax.random.normal(keys[3], (H,)), jax.random.normal(keys[4], (H,))
    kernel = jax.jit(
        functools.partial(gated_delta_decode_from_projections, n_k_heads=Hk, interpret=interpret), donate_argnums=(7,)
    )
    layer = jnp.int32(n_layers // 2)
    for W in shape["widths"]:
        kq, ka, kb = jax.random.split(jax.random.PRNGKey(200 + W), 3)
        qkv = jax.random.normal(kq, (W, C), jnp.float32).astype(jnp.bfloat16)
        a = jax.random.normal(ka, (W, H), jnp.float32).astype(jnp.bfloat16)
        b = jax.random.normal(kb, (W, H), jnp.float32).astype(jnp.bfloat16)
        slots = jax.random.permutation(jax.random.PRNGKey(W), n_slots)[:W].astype(jnp.int32)
        args = (qkv, a, b, conv, conv_w, a_log, dt_bias)
        ref_out, ref_pool, ref_win = jnp_decode_from_projections(*args, jnp.copy(pool), slots, layer, n_k_heads=Hk)
        out, pool, win = kernel(*args, pool, slots, layer=layer)
        errs = errors(out, ref_out), errors(pool[layer, slots], ref_pool[layer, slots]), errors(win, ref_win)

        def run_kernel():  # each call advances the same slots again, in place
            nonlocal pool
            o, pool, _ = kernel(*args, pool, slots, layer=layer)
            return o

        def run_jnp():
            nonlocal pool
            o, pool, _ = jnp_decode_from_projections(*args, pool, slots, layer, n_k_heads=Hk)
            return o

        t_kernel, t_jnp = median_seconds(run_kernel, runs), median_seconds(run_jnp, runs)
        print(
            f"decode from projections W={W:3d} H={H} Hk={Hk} Dk={Dk} Dv={Dv}  out rel {errs[0][1]:.2e}  "
            f"state rel {errs[1][1]:.2e}  window max {errs[2][0]:.2e}  kernel {t_kernel * 1e3:.4f} ms  "
            f"jnp {t_jnp * 1e3:.4f} ms  x{t_jnp / t_kernel:.2f}",
            flush=True,
        )


def check_prefill(shape: dict, runs: int, interpret: bool) -> None:
    """The chunked WY form (`gated_delta_chunked`) of one segment, float32 inputs as the model
    passes them; errors of out and state against the form at HIGHEST precision.

    Rows: XLA's form (its chunk loop unrolled) by matmul precision (HIGHEST: float32 on the
    FMA units; HIGH: three bf16 passes on the tensor cores; DEFAULT: TF32 / one bf16 pass,
    what the model's prompt chunks ask for); the Pallas state pass end to end at DEFAULT and
    HIGHEST (whose errors, near float32's, tell a kernel bug from TF32 rounding); the state-free
    part alone (`chunk_terms`, what the kernel leaves to XLA); the kernel alone on those terms
    for each launch setting of `SWEEP` (the end-to-end rows use the kernel's defaults)."""
    H, Dk, Dv = shape["H"], shape["Dk"], shape["Dv"]
    kernel = "interpret" if interpret else "pallas"
    for T in shape["tokens"]:
        args = rule_inputs(jax.random.PRNGKey(T), 1, T, H, Dk, Dv, jnp.float32)
        ref = gated_delta_chunked(*args, chunk=CHUNK, precision=lax.Precision.HIGHEST)

        def row(label: str, fn: Callable[[], Rule]) -> None:
            out, state = fn()
            t = median_seconds(fn, runs)
            out_err, state_err = errors(out[:, :T], ref[0]), errors(state, ref[1])
            print(
                f"prefill {label:36s} T={T:5d} {t * 1e3:.3f} ms  out rel {out_err[1]:.2e}  state rel {state_err[1]:.2e}",
                flush=True,
            )

        for name in ("HIGHEST", "HIGH", "DEFAULT"):
            fn = jax.jit(functools.partial(gated_delta_chunked, chunk=CHUNK, precision=getattr(lax.Precision, name)))
            row(f"jnp WY precision={name}", lambda fn=fn: fn(*args))
        for name in ("DEFAULT", "HIGHEST"):
            fn = jax.jit(
                functools.partial(
                    gated_delta_chunked, chunk=CHUNK, precision=getattr(lax.Precision, name), kernel=kernel
                )
            )
            row(f"pallas WY precision={name}", lambda fn=fn: fn(*args))

        terms_fn = jax.jit(functools.partial(chunk_terms, chunk=CHUNK, qk_l2norm=True, precision=lax.Precision.DEFAULT))
        terms = terms_fn(*args[:5])
        t = median_seconds(lambda: terms_fn(*args[:5]), runs)
        print(f"prefill {'terms alone (XLA) precision=DEFAULT':36s} T={T:5d} {t * 1e3:.3f} ms", flush=True)
        sweep_state_pass(terms, args[5], row, interpret)


def sweep_state_pass(
    terms: ChunkTerms, state: jax.Array, row: Callable[[str, Callable[[], Rule]], None], interpret: bool
) -> None:
    """The Pallas state pass alone (DEFAULT precision) at each launch setting of `SWEEP`; a
    setting that fails to compile (e.g. out of shared memory) is reported and skipped."""
    Dv = state.shape[-1]
    for block_v, warps, stages in itertools.product(*SWEEP.values()):
        if block_v > Dv or Dv % block_v:
            continue
        fn = jax.jit(
            functools.partial(
                chunk_state_pass,
                precision=lax.Precision.DEFAULT,
                interpret=interpret,
                _block_v=block_v,
                _num_warps=warps,
                _num_stages=stages,
            )
        )
        label = f"state pass alone bv={block_v} w={warps} s={stages}"
        try:
            row(label, lambda fn=fn: fn(terms.q, terms.k, terms.uw, terms.intra, terms.cum, state))
        except Exception as e:  # a launch setting Triton cannot compile is a result too
            print(f"prefill {label:36s} failed: {str(e).splitlines()[0][:160]}", flush=True)


def check_solve(shape: dict, runs: int) -> None:
    """The WY form's per-chunk unit-triangular solve alone, both forms of `unit_lower_solve`
    (cuBLAS trsm, and the inverse as products, full float32); errors against the solve."""
    H, Dk, Dv = shape["H"], shape["Dk"], shape["Dv"]
    for T in shape["tokens"]:
        q, k, v, g, beta, _ = rule_inputs(jax.random.PRNGKey(T), 1, T, H, Dk, Dv, jnp.float32)
        terms = jax.jit(functools.partial(chunk_terms, chunk=CHUNK, qk_l2norm=True, precision=lax.Precision.HIGHEST))
        t = terms(q, k, v, g, beta)
        C = t.k.shape[2]
        # A system and right-hand side of the model's scale: keys' Gram matrix, decays, betas.
        kk = jnp.einsum("nhcid,nhcjd->nhcij", t.k, t.k, precision=lax.Precision.HIGHEST)
        b = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(1), (1, H, C, CHUNK)))
        system = b[..., None] * kk * jnp.tril(jnp.exp(t.cum[..., :, None] - t.cum[..., None, :]))
        rhs = jnp.concatenate([t.uw, t.k], axis=-1)
        solve = jax.jit(functools.partial(unit_lower_solve, solve="triangular"))
        ref = solve(system, rhs)
        ms = median_seconds(lambda: solve(system, rhs), runs) * 1e3
        print(f"solve {'triangular_solve':28s} T={T:5d} {ms:.3f} ms", flush=True)
        fn = jax.jit(functools.partial(unit_lower_solve, solve="products"))
        got = fn(system, rhs)
        ms = median_seconds(lambda: fn(system, rhs), runs) * 1e3
        print(f"solve {'inverse products':28s} T={T:5d} {ms:.3f} ms  rel {errors(got, ref)[1]:.2e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interpret", action="store_true", help="Pallas interpreter on the CPU, tiny shapes")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="q, k, v dtypes")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill rows (check_prefill)")
    ap.add_argument("--solve-only", action="store_true", help="only the WY solve rows (check_solve)")
    args = ap.parse_args()
    shape = TINY if args.interpret else REAL
    print("jax", jax.__version__, jax.devices(), flush=True)
    if args.solve_only:
        check_solve(shape, args.runs)
        return
    for dtype in [] if args.prefill_only else args.dtypes.split(","):
        check_decode(shape, jnp.dtype(dtype), args.runs, args.interpret)
    if not args.prefill_only:
        check_decode_from_projections(shape, args.runs, args.interpret)
    check_prefill(shape, args.runs, args.interpret)


if __name__ == "__main__":
    main()
