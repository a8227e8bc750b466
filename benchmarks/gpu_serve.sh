#!/usr/bin/env bash
# Server cases of the GPU plan, through HTTP (called by benchmarks/gpu.sh with the project installed).
# Random bf16 weights at real shapes with the synthetic tokenizer; prompts as token ids.
set -uo pipefail
out=${1:-/tmp/jaxllm-bench}
port=8000

serve_and_bench() {  # name, then `jaxllm serve` arguments
  local name=$1; shift
  local t0=$SECONDS
  python3 -m serving.cli serve --port $port "$@" > "$out/serve-$name.log" 2>&1 &
  local pid=$!
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "server $name died"; tail -20 "$out/serve-$name.log"; return 1; }
    sleep 1
  done
  echo "$name: ready in $((SECONDS - t0)) s (load + warm-up of every bucket)"
  echo $pid > /tmp/jaxllm-serve.pid
}

stop() {  # name: also says how many tokens the server drew from nan logits (the report line's flag)
  kill "$(cat /tmp/jaxllm-serve.pid)" 2>/dev/null; wait "$(cat /tmp/jaxllm-serve.pid)" 2>/dev/null
  echo "$1: report lines flagging NAN LOGITS: $(grep -c 'NAN LOGITS' "$out/serve-$1.log")"
}

bench() {  # label, bench-serve args...
  local label=$1; shift
  echo "== $label"
  python3 -m benchmarks.bench_serve --port $port --server-pid "$(cat /tmp/jaxllm-serve.pid)" --json "$out/$label.json" "$@" 2>&1 | tail -25
}

cases=${SERVE_CASES:-8b,135m}  # which servers to run

if [[ $cases == *8b* ]]; then
serve_and_bench llama3-8b --load-format dummy --model configs/llama3-8b.json --dtype bfloat16 --unroll-layers \
  --config configs/gpu-llama3-8b.toml ${SERVE_8B_ARGS:-} || exit 1   # e.g. SERVE_8B_ARGS="--kv-cache-dtype fp8"
bench 8b-single-1k --vocab-size 128256 --input-len 1000 --output-len 128 --concurrency 1 --num-prompts 4
bench 8b-prefill-2k --vocab-size 128256 --input-len 2048 --output-len 1 --concurrency 1 --num-prompts 4
bench 8b-64x1k --vocab-size 128256 --input-len 1024 --output-len 1024 --concurrency 64 --num-prompts 128
stop llama3-8b
fi

# The same server started again: XLA's persistent compilation cache (gpu.sh points it at
# /tmp/jax-cache) now holds every variant, so this is a warm restart's ready time.
if [[ $cases == *restart* ]]; then
serve_and_bench llama3-8b-restart --load-format dummy --model configs/llama3-8b.json --dtype bfloat16 --unroll-layers \
  --config configs/gpu-llama3-8b.toml || exit 1
grep -h "warm-up:" "$out"/serve-llama3-8b*.log
stop llama3-8b-restart
fi

if [[ $cases == *135m* ]]; then
serve_and_bench smollm2 --load-format dummy --model configs/smollm2-135m.json --unroll-layers \
  --config configs/gpu-smollm2.toml || exit 1
bench smollm2-single --vocab-size 49152 --input-len 128 --output-len 256 --concurrency 1 --num-prompts 4
stop smollm2
fi

# The Qwen3-30B-A3B MoE shape (issue 18): single stream, a 2k prompt, 16 and 64 concurrent.
if [[ $cases == *30b* ]]; then
serve_and_bench qwen3-30b --load-format dummy --model configs/qwen3-30b-a3b.json --dtype bfloat16 --unroll-layers \
  --config configs/gpu-qwen3-30b.toml || exit 1
bench 30b-single-1k --vocab-size 151000 --input-len 1000 --output-len 128 --concurrency 1 --num-prompts 4
bench 30b-prefill-2k --vocab-size 151000 --input-len 2048 --output-len 1 --concurrency 1 --num-prompts 4
bench 30b-16x1k --vocab-size 151000 --input-len 1024 --output-len 256 --concurrency 16 --num-prompts 32
bench 30b-64x1k --vocab-size 151000 --input-len 1024 --output-len 1024 --concurrency 64 --num-prompts 128
grep -h "warm-up:" "$out"/serve-qwen3-30b.log
stop qwen3-30b
fi

# The hybrid Qwen3.5-35B-A3B shape (issue 17): single stream, a 2k prompt, 16 and 64 concurrent
# (Q35_CONFIG: the same shape cut to fewer layers, for an 80 GB card).
if [[ $cases == *qwen35* ]]; then
serve_and_bench qwen3.5-35b --load-format dummy --model ${Q35_CONFIG:-configs/qwen3.5-35b-a3b.json} --dtype bfloat16 --unroll-layers \
  --config configs/gpu-qwen3.5-35b.toml || exit 1
bench 35b-single-1k --vocab-size 248000 --input-len 1000 --output-len 128 --concurrency 1 --num-prompts 4
bench 35b-prefill-2k --vocab-size 248000 --input-len 2048 --output-len 1 --concurrency 1 --num-prompts 4
bench 35b-16x1k --vocab-size 248000 --input-len 1024 --output-len 256 --concurrency 16 --num-prompts 32
bench 35b-64x1k --vocab-size 248000 --input-len 1024 --output-len 1024 --concurrency 64 --num-prompts 128
grep -h "warm-up:" "$out"/serve-qwen3.5-35b.log
stop qwen3.5-35b
fi

# The 35B shape's server started again (`q35warm`, run after `qwen35`: the persistent compilation cache
# then holds every variant): a warm restart's ready time against issue 17's 90 s.
if [[ $cases == *q35warm* ]]; then
serve_and_bench qwen3.5-35b-restart --load-format dummy --model ${Q35_CONFIG:-configs/qwen3.5-35b-a3b.json} --dtype bfloat16 \
  --unroll-layers --config configs/gpu-qwen3.5-35b.toml || exit 1
grep -h "warm-up:" "$out"/serve-qwen3.5-35b*.log | cut -c1-200
stop qwen3.5-35b-restart
fi
