#!/usr/bin/env bash
# The GPU benchmark plan in one script (an H200 with JAX 0.11 + CUDA plugin, no network).
# Usage (repo root, with the wheels of the packages the machine lacks in .whl/):
#   bash benchmarks/gpu.sh [engine|serve|all|flags|profile|decode|kv8|moe|moe_prefill|moe_engine|hybrid|spec|gemv|explain|prefill_profile][,...] [OUT_DIR]
# Installs the project without touching the machine's jax (--no-deps --no-index), then runs
# the engine cases (benchmarks/gpu_engine.py) and/or the server cases (jaxllm bench-serve
# against `jaxllm serve --load-format dummy`), printing one table each.
set -uo pipefail
what=${1:-all}
out=${2:-${OUT:-/tmp/jaxllm-bench}}
mkdir -p "$out"
site=/tmp/jaxllm-site
if [[ $what == *,* ]]; then  # several cases, one install
  skip=
  for w in ${what//,/ }; do JAXLLM_SKIP_INSTALL=$skip bash "$0" "$w" "$out"; skip=1; done
  exit
fi
[[ -n ${JAXLLM_SKIP_INSTALL:-} ]] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade --target "$site" .whl/*.whl . || exit 1
export PYTHONPATH="$site" JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

if [[ $what == engine || $what == all ]]; then
  python3 benchmarks/gpu_engine.py --config configs/llama3-8b.json --out "$out/engine.json" ${ENGINE_ARGS:-} 2>&1 | grep -v "^ "
fi

if [[ $what == serve || $what == all ]]; then
  bash benchmarks/gpu_serve.sh "$out"
fi

# The 8-bit K/V cache: the decode kernel's checks and bandwidth with every pool type (the
# "8B fp8" rows), then a width-64 decode step at the mean context of 64 x 1k-in/1k-out
# requests with a bfloat16 and an 8-bit cache.
if [[ $what == kv8 ]]; then
  timeout 240 python3 benchmarks/paged_decode_check.py --no-layer-loop 2>&1 | grep -v "^W0\|^I0"
  for kv in auto float8_e4m3fn; do
    timeout 150 python3 benchmarks/gpu_engine.py --config configs/llama3-8b.json --cases c --c-context 1536 --kv-dtype $kv 2>&1 \
      | grep -E "^C |Error|error:" | sed "s/^/8B kv=$kv /"
  done
fi

# Kernel-level profiles of batch-1 decode calls (benchmarks/profile_step.py), both shapes.
if [[ $what == profile ]]; then
  python3 benchmarks/profile_step.py --config configs/smollm2-135m.json --dtype float32 --steps 16 --out "$out/profile-135m" 2>&1 | grep -v "^W0\|^I0"
  python3 benchmarks/profile_step.py --config configs/llama3-8b.json --dtype bfloat16 --steps 8 --calls 2 --out "$out/profile-8b" 2>&1 | grep -v "^W0\|^I0"
  rm -rf "$out"/profile-*/raw
fi

# XLA flag sets against batch-1 decode (135M float32 at 16 steps per call, 8B bf16 at 8):
# is the small model's step bound by kernel launches, and do CUDA graphs (command buffers)
# of the decode loop's body remove that? FLAG_SETS: '|'-separated XLA_FLAGS values.
if [[ $what == flags ]]; then
  default_sets="|--xla_gpu_enable_command_buffer=|--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
  IFS='|' read -ra sets <<< "${FLAG_SETS:-$default_sets}"
  for flags in "${sets[@]}"; do
    echo "== XLA_FLAGS='$flags'"
    XLA_FLAGS="$flags" python3 benchmarks/gpu_engine.py --config configs/smollm2-135m.json --dtype float32 \
      --cases a_steps --steps 16 2>&1 | grep -E "^A |Error|error:" | sed 's/^/135M f32 /'
    XLA_FLAGS="$flags" python3 benchmarks/gpu_engine.py --config configs/llama3-8b.json \
      --cases a_steps --steps 8 2>&1 | grep -E "^A |Error|error:" | sed 's/^/8B bf16 /'
  done
fi

# The batch-1 decode step's kernels: the Pallas kernels against their oracles at real shapes,
# the 8B step under each XLA flag set of DECODE_FLAG_SETS ('|'-separated; the first, empty, is
# XLA's defaults), the 135M step with and without the add + RMSNorm kernel, and where an 8B
# step's time goes.
if [[ $what == decode ]]; then
  [[ ${KERNEL_CHECKS:-1} == 1 ]] && timeout 150 python3 benchmarks/paged_decode_check.py --no-layer-loop 2>&1 | grep -v "^W0\|^I0"
  [[ -n ${NORM_CHECK:-} ]] && timeout 60 python3 benchmarks/norm_check.py 2>&1 | grep -v "^W0\|^I0"
  IFS='|' read -ra sets <<< "${DECODE_FLAG_SETS:-}"
  [[ ${#sets[@]} == 0 ]] && sets=("")
  for flags in "${sets[@]}"; do
    XLA_FLAGS="$flags" timeout 150 python3 benchmarks/gpu_engine.py --config configs/llama3-8b.json --cases ${DECODE_8B_CASES:-a_steps} \
      --steps 8 2>&1 | grep -E "^A |Error|error:" | sed "s/^/8B bf16 [$flags] /"
  done
  for dt in float32 bfloat16; do
    timeout 60 python3 benchmarks/gpu_engine.py --config configs/smollm2-135m.json --dtype $dt --cases ${DECODE_135M_CASES:-a_steps,anorm} --steps 16 2>&1 \
      | grep -E "^A |Error|error:" | sed "s/^/135M $dt /"
  done
  timeout 90 python3 benchmarks/profile_step.py --config configs/llama3-8b.json --dtype bfloat16 --steps 8 --calls 2 --top 25 \
    --out "$out/profile-8b" 2>&1 | grep -v "^W0\|^I0"
  rm -rf "$out"/profile-*/raw
fi

# The MoE layer (issue 18): kernels against a float32 reference at real shapes, per-layer time
# by round width for each implementation, a one-knob-at-a-time sweep of the kernels' tiles
# (MOE_SWEEP, 'variant:tokens' list), both MoE shapes (benchmarks/moe_check.py).
if [[ $what == moe ]]; then
  timeout ${MOE_CHECK_S:-330} python3 benchmarks/moe_check.py --shapes qwen3-30b-a3b --out "$out/moe-30b.json" \
    --sweep "${MOE_SWEEP:-pairs:1,grouped16:16,grouped16:64}" ${MOE_ARGS:-} 2>&1 | grep -v "^W0\|^I0\|^E0"
  timeout ${MOE_CHECK35_S:-180} python3 benchmarks/moe_check.py --shapes qwen3.5-35b-a3b --out "$out/moe-35b.json" \
    ${MOE35_ARGS:-} 2>&1 | grep -v "^W0\|^I0\|^E0"
fi

# MoE prompt rounds (the TTFT targets): rows per grouped block and tiles at 2k tokens, both shapes.
if [[ $what == moe_prefill ]]; then
  timeout ${MOE_CHECK_S:-300} python3 benchmarks/moe_check.py --shapes qwen3.5-35b-a3b,qwen3-30b-a3b --tokens 2048 \
    --parity-tokens 2048 --variants ours,grouped32,grouped64,grouped128 --sweep grouped64:2048,grouped128:2048 \
    --sweep-set prefill --out "$out/moe-prefill.json" 2>&1 | grep -v "^W0\|^I0\|^E0"
fi

# Qwen3-30B-A3B in the engine: batch-1 decode, then 16 and 64 concurrent sequences at the mean
# context of 1k-in/1k-out requests (1536); XLA's rematerialization warnings are printed.
if [[ $what == moe_engine ]]; then
  timeout ${MOE_ENGINE_S:-560} python3 benchmarks/gpu_engine.py --config configs/qwen3-30b-a3b.json --cases ${MOE_ENGINE_CASES:-a_steps,c} \
    --c-slots ${MOE_SLOTS:-16,64} --c-context 1536 --out "$out/engine-30b.json" 2>&1 | tee "$out/engine-30b.log" \
    | grep -E "^A |^C |rematerial|Can't reduce|Error|error:"
fi

# The hybrid family (issue 17) at Qwen3.5-35B-A3B's shape: batch-1 decode with and without
# the Pallas DeltaNet decode kernel, a 2k-token prompt's first token, 16 and 64 concurrent.
if [[ $what == hybrid ]]; then
  timeout ${HYBRID_S:-540} python3 -m benchmarks.hybrid_gpu --config ${HYBRID_CONFIG:-configs/qwen3.5-35b-a3b.json} \
    --cases ${HYBRID_CASES:-a,aref,b,c} --out "$out/hybrid.json" 2>&1 | grep -E "^A |^B |^C |params ready|Error|error:|rematerial"
fi

# Speculative decoding's verify cost at batch 1 and drafting's cost at 64 concurrent (issue 19).
if [[ $what == spec ]]; then
  for c in ${SPEC_CONFIGS:-configs/llama3-8b.json configs/qwen3.5-35b-a3b.json}; do
    timeout ${SPEC_S:-280} python3 -m benchmarks.spec_gpu --config $c --cases ${SPEC_CASES:-verify,wide} 2>&1 \
      | grep -E "^VERIFY|^WIDE|Error|error:"
  done
fi

# One-row products by weight layout (the batch-1 MoE steps' non-expert time).
if [[ $what == gemv ]]; then
  timeout ${GEMV_S:-150} python3 -m benchmarks.gemv_layout_check 2>&1 | grep -E "^GEMV|Error|error:"
fi

# The Gated DeltaNet decode kernel (Qwen3-Next / Qwen3.5 linear attention) against its jnp
# oracle at W = 1, 16, 64 windows of a 30 x 64-slot pool: errors and times.
if [[ $what == gated_delta ]]; then
  timeout ${GDN_CHECK_S:-200} python3 benchmarks/gated_delta_check.py ${GDN_ARGS:-} 2>&1 | grep -v "^W0\|^I0\|^E0"
fi

# What the top kernels of a batch-1 decode step compute, at a few layers of each MoE shape
# (the per-layer kernels are those of the whole model; fits any card): trace + optimized HLO.
if [[ $what == explain ]]; then
  for c in ${EXPLAIN_CONFIGS:-configs/qwen3-30b-a3b.json configs/qwen3.5-35b-a3b.json}; do
    timeout ${PROFILE_S:-150} python3 benchmarks/profile_step.py --config $c --layers ${EXPLAIN_LAYERS:-8} --dtype bfloat16 \
      --steps 8 --calls 2 --top ${EXPLAIN_TOP:-14} --explain --out "$out/explain-$(basename $c .json)" 2>&1 | grep -v "^W0\|^I0"
    rm -rf "$out"/explain-*/raw "$out"/explain-*/hlo
  done
fi

# Where a prompt round's time goes (the TTFT targets of issues 17 and 18): a lone fresh
# prompt at the GPU server's derived shapes, the top kernels named from the optimized HLO.
if [[ $what == prefill_profile ]]; then
  for spec in ${PREFILL_PROFILES:-configs/llama3-8b.json:1024:64:0 configs/qwen3.5-35b-a3b.json:2048:16:8}; do
    IFS=: read -r c tokens slots layers <<< "$spec"
    timeout ${PROFILE_S:-200} python3 benchmarks/profile_step.py --config $c --layers $layers --dtype bfloat16 \
      --prefill $tokens --slots $slots --calls 4 --top ${EXPLAIN_TOP:-16} --explain \
      --out "$out/prefill-$(basename $c .json)" 2>&1 | grep -v "^W0\|^I0"
    rm -rf "$out"/prefill-*/raw "$out"/prefill-*/hlo
  done
fi

# Batch invariance on the GPU (issue 21): tokens / bitwise logprobs alone vs among neighbours,
# and the throughput of each engine setting; "invariant" against "derived" is the mode's cost.
if [[ $what == invariance ]]; then
  timeout ${INV_S:-300} python3 -m benchmarks.batch_invariance --config ${INV_CONFIG:-configs/smollm2-135m.json} --dtype bfloat16 \
    --slots 32 --context 1024 --rows 128 --settings derived,widths,drafts,invariant 2>&1 | grep -v "^W0\|^I0\|^E0"
fi

# The chunked WY form of the DeltaNet prefill at each matmul precision (2k-prompt TTFT lead).
if [[ $what == wy_precision ]]; then
  timeout ${GDN_CHECK_S:-200} python3 benchmarks/gated_delta_check.py --prefill-only --runs 10 2>&1 | grep -E "^prefill|Error|error:"
fi

# Where a hybrid batch-1 decode step's time goes (kernel-level profile of the 35B-A3B shape).
if [[ $what == profile_hybrid ]]; then
  timeout ${PROFILE_S:-150} python3 benchmarks/profile_step.py --config configs/qwen3.5-35b-a3b.json --dtype bfloat16 --steps 8 \
    --calls 2 --top 30 --out "$out/profile-35b" 2>&1 | grep -v "^W0\|^I0"
  rm -rf "$out"/profile-*/raw
fi
