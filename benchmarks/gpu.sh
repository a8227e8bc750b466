#!/usr/bin/env bash
# The GPU benchmark plan in one script (an H200 with JAX 0.11 + CUDA plugin, no network).
# Usage (repo root, with the wheels of the packages the machine lacks in .whl/):
#   bash benchmarks/gpu.sh [engine|serve|all] [OUT_DIR]
# Installs the project without touching the machine's jax (--no-deps --no-index), then runs
# the engine cases (benchmarks/gpu_engine.py) and/or the server cases (jaxllm bench-serve
# against `jaxllm serve --load-format dummy`), printing one table each.
set -uo pipefail
what=${1:-all}
out=${2:-${OUT:-/tmp/jaxllm-bench}}
mkdir -p "$out"
site=/tmp/jaxllm-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade --target "$site" .whl/*.whl . || exit 1
export PYTHONPATH="$site" JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

if [[ $what == engine || $what == all ]]; then
  python3 benchmarks/gpu_engine.py --config configs/llama3-8b.json --out "$out/engine.json" ${ENGINE_ARGS:-} 2>&1 | grep -v "^ "
fi

if [[ $what == serve || $what == all ]]; then
  bash benchmarks/gpu_serve.sh "$out"
fi
