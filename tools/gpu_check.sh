#!/usr/bin/env bash
# The accelerator checks the CPU test suite cannot make, as one prepared script for a
# lent GPU machine (about 10 minutes; each step has its own time limit, and a failed
# step does not stop the next):
#
#   bash tools/gpu_check.sh [OUT_DIR]      # from the repository root
#
# 1. the engine's log-prob contract and row independence with each paged-attention
#    kernel (gather, the Pallas Triton kernel), float32 at full matmul precision and
#    SmolLM2's shape in bfloat16 (tools/check_engine.py);
# 2. the GPU-only tests (`pytest -m gpu`: the compiled Triton kernel against the
#    gather loop);
# 3. decode tok/s with each kernel, SmolLM2's shape in bfloat16, batch 1/16/64,
#    max_seq_len 1024 and 8192, with the triton/gather ratio (tools/bench_rollout.py);
# 4. group speculative decoding against plain decoding (tools/bench_speculative.py).
# Each step's output goes to OUT_DIR/<step>.log; a summary line per step is printed.
set -u
FAILED=""
case "${1:-}" in -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
OUT=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || FAILED="$FAILED $name"
  echo "== $name: rc=$rc in $((SECONDS - t0)) s ($*)"
  tail -n 25 "$OUT/$name.log"
}

$PY -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/devices.log"
step check_engine_f32 90 env JAX_DEFAULT_MATMUL_PRECISION=highest \
  $PY tools/check_engine.py --kernels gather,triton
step check_engine_bf16 90 $PY tools/check_engine.py --preset smollm2-135m --dtype bfloat16 \
  --kernels gather,triton
step gpu_tests 90 $PY -m pytest -q -m gpu -p no:cacheprovider tests/models/test_paged_kernel.py
step bench_kernels 200 $PY tools/bench_rollout.py --presets smollm2-135m --vocab 0 \
  --dtype bfloat16 --kernels gather,triton --batches 1,16,64 --seq-lens 1024,8192 \
  --repeats 3 --skip sessions,grpo,scheduling,turns --json
step speculative 120 $PY tools/bench_speculative.py --preset smollm2-135m --dtype bfloat16 \
  --temperature 0
# (every step's status: the script ended 0 whatever failed; a reviewer)
if [ -n "$FAILED" ]; then
  echo "== failed:$FAILED"
  exit 1
fi
