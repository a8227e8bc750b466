#!/usr/bin/env bash
# A/B of the 8B's first token through HTTP on one GPU: this tree against an older one.
# Prepare the older tree here (an ignored folder, carried to the device machine):
#   mkdir -p benchmarks/.old && git archive REV jaxllm serving configs | tar -x -C benchmarks/.old
# then on the GPU machine (wheels in .whl/, as benchmarks/gpu.sh):
#   TREES="new old new" CASES="1000:128:8 2048:1:4" bash benchmarks/ab_first_token.sh $OUT
# Each tree's server (`configs/gpu-llama3-8b.toml`, dummy bf16 weights) warms up, then
# bench-serve (this tree's client) sends single-stream requests of each case
# (input:output:requests) and prints TTFT p50 / p99 and TPOT p50.
set -uo pipefail
out=${1:-${OUT:-/tmp/jaxllm-ab}}
mkdir -p "$out"
root=$PWD
site=/tmp/jaxllm-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade --target $site .whl/*.whl . || exit 1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for tree in ${TREES:-new old}; do
  dir=$root
  [[ $tree == old ]] && dir=$root/benchmarks/.old
  t0=$SECONDS
  (cd "$dir" && PYTHONPATH=$dir:$site python3 -m serving.cli serve --port 8000 --load-format dummy \
    --model configs/llama3-8b.json --dtype bfloat16 --unroll-layers --config configs/gpu-llama3-8b.toml \
    > "$out/serve-$tree.log" 2>&1) &
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=1)" 2>/dev/null; do
    sleep 1
    (( SECONDS - t0 > 240 )) && { echo "$tree: not ready after 240 s"; break; }
  done
  echo "$tree: ready in $((SECONDS - t0)) s"
  for c in ${CASES:-1000:128:8 2048:1:4}; do
    IFS=: read -r n_in n_out n <<< "$c"
    PYTHONPATH=$site python3 -m benchmarks.bench_serve --port 8000 --vocab-size 128256 --input-len "$n_in" \
      --output-len "$n_out" --concurrency 1 --num-prompts "$n" --json "$out/$tree-$n_in.json" 2>&1 \
      | grep -E "P50 TTFT|P99 TTFT|P50 TPOT" | sed "s/^/$tree in=$n_in /"
  done
  pkill -f serving.cli
  sleep 3
done
