#!/usr/bin/env bash
# session 20, call 1: the kernel bench with the ONE_ACC forward pin (issue 3's "expert kernels >= 80% of
# the measured bf16 peak at 2^14 tokens/GPU"), uniform routing, the three kernels the target is about.
set -uo pipefail
export OCCULT_COMMIT=$(cat .device/commit)   # 830dd4d in this run
GPU_TESTS=none BENCH_ARGS="--routing uniform --ops grouped_swiglu grouped_down_reduce expert_ffn --rep-ms 100 --warmup-ms 20" \
  timeout 520 bash workflow/scripts/gpu_kernels.sh /tmp/k19
cp /tmp/k19/kernels.csv /tmp/k19/bench_kernels.log /tmp/k19/machine.txt /tmp/k19/telemetry.csv $OUT/ 2>/dev/null
echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $OUT/machine.txt
