#!/usr/bin/env bash
# GPU correctness and kernel benchmarks in one call (device machine; CUDA torch + triton present):
# the bf16 GPU tests of the kernels and the EP layer, `bench_kernels` (Triton with tensor-descriptor
# operands and with pointer operands, torch._grouped_mm, the no-gather and dense cuBLAS ceilings, and
# the cuBLAS peak, all in one process), then optionally a config sweep of chosen GEMM kernels.
# Usage: workflow/scripts/gpu_kernels.sh OUTDIR
# env: GPU_TESTS (test paths, default "tests/kernels tests/ep"; "none": skip), BENCH_ARGS (extra bench_kernels options), TUNE_KERNELS (e.g. "swiglu_fwd down_fwd"; empty:
#      no sweep), TUNE_LIMIT_S (default 150), TUNE_MAX_CONFIGS (default 16)
set -uo pipefail
out=${1:?usage: gpu_kernels.sh OUTDIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
. "$(dirname "$0")/common.sh"
machine_facts > "$out/machine.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || cat "$out/install.log"
tests=${GPU_TESTS:-tests/kernels tests/ep}
if [ "$tests" != none ]; then
  echo "== gpu tests: $tests ($(date -u +%T))"
  # shellcheck disable=SC2086
  timeout 420 python3 -m pytest $tests -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -15
fi
# SM clock, power and the clock-limit reasons every 200 ms beside the bench (rows carry their start
# and end times, `started_unix_ms`, `ended_unix_ms`): what sets the rate under sustained load
if command -v nvidia-smi > /dev/null; then
  reasons=clocks_event_reasons.active
  nvidia-smi --query-gpu=$reasons --format=csv > /dev/null 2>&1 || reasons=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,$reasons \
    --format=csv -lms 200 > "$out/telemetry.csv" 2>&1 &
  telemetry=$!
fi
echo "== bench_kernels ($(date -u +%T))"
# shellcheck disable=SC2086
timeout 420 python3 -m occult.harness.kernel_bench --out "$out/kernels.csv" ${BENCH_ARGS:-} 2>&1 \
  | tee "$out/bench_kernels.log" | grep -v "it/s\]" | tail -40
[ -n "${telemetry:-}" ] && kill "$telemetry" 2> /dev/null
if [ -n "${TUNE_KERNELS:-}" ]; then
  echo "== tune_kernels $TUNE_KERNELS ($(date -u +%T))"
  # shellcheck disable=SC2086
  timeout $((${TUNE_LIMIT_S:-150} + 120)) python3 -m occult.harness.kernel_tune --out "$out/tune.csv" \
    --kernels $TUNE_KERNELS --time-limit-s "${TUNE_LIMIT_S:-150}" --max-configs "${TUNE_MAX_CONFIGS:-16}" 2>&1 \
    | tee "$out/tune.log" | tail -12
fi
echo "== done ($(date -u +%T))"
