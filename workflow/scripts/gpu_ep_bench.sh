#!/usr/bin/env bash
# The EP runtime's benchmark (issue 3) on all GPUs of this machine, every Occult variant in one run:
# OLMoE layer shape (d=2048, expert ffn 1024, E=64, k=8), bf16, prefill 2^10 … 2^16 tokens per
# GPU, routing uniform and replayed from a measured trace of our model (widened to 64 experts,
# `occult.harness.sweep.inputs.TraceRouter`); per-phase times (dispatch, expert kernels, combine), wire bytes,
# pairs per GPU; plus forward+backward at 2^14 tokens, the bf16 matmul peak of the same GPU, and
# torch.profiler tables with the host syncs of one forward at 2^14 and 64 tokens (occult.harness.ep_profile).
# Usage: workflow/scripts/gpu_ep_bench.sh OUTDIR ROUTING_NPZ
# env: EP_BENCH_AB=0 leaves out the fused-plan A/B; EP_BENCH_ORDER=0 the reversed-order rerun at 2^14;
# EP_BENCH_COMPUTE_GRAPH=0 the compute-graph rows; EP_BENCH_PROFILES (default "16384 64"; empty: none): tokens/GPU profiled.
set -uo pipefail
out=${1:?usage: gpu_ep_bench.sh OUTDIR ROUTING_NPZ}; trace=${2:?routing_heldout.npz of occult.routing.profiling}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
. "$(dirname "$0")/common.sh"
gpus=$(visible_gpus)
methods="occult occult-pe occult-trivial occult-static occult-graph occult-nd2 occult-nd1 occult-compute"
python3 - "$out/peak.csv" <<'PY'
import sys, torch
from occult.harness.kernel_bench import dense_peak     # its burst timing: median of 20 calls after 10
burst = dense_peak(25, 200)["cublas_burst"]
open(sys.argv[1], "w").write(f"gpu,op,median_ms,tflops\n{torch.cuda.get_device_name()},bf16 matmul 8192^3,"
                             f"{burst['median_ms']:.4f},{burst['tflops']:.1f}\n")
print(f"bf16 peak: {burst['tflops']:.0f} TFLOP/s")
PY
for routing in uniform trace; do
  echo "== ep bench prefill routing=$routing D=$gpus ($(date -u +%T))"
  timeout 420 torchrun --nproc_per_node="$gpus" -m occult.harness.sweep --kind prefill --shapes olmoe --no-shared \
    --routing "$routing" --trace "$trace" --methods $methods --repeats 20 --warmup 5 --timeout-s 120 \
    --out "$out/ep_prefill_${routing}_D${gpus}.csv" 2>&1 | grep -v "^W1\|^\*\*\*\|it/s\]\|point/s\]" | tail -14
done
if [ "${EP_BENCH_ORDER:-1}" = 1 ]; then
  # ep_v6 and ep_v7 measured the first method (occult) with ~1 ms more host time than the identical
  # occult-nd2 at D=2 later in the same process: the same eager methods again, in the reverse order
  echo "== order check: eager methods reversed, 2^14 tokens/GPU ($(date -u +%T))"
  timeout 240 torchrun --nproc_per_node="$gpus" -m occult.harness.sweep --kind prefill --shapes olmoe --no-shared \
    --routing uniform --sizes 16384 --methods occult-nd1 occult-nd2 occult-pe occult --repeats 20 --warmup 5 \
    --timeout-s 120 --out "$out/ep_prefill_uniform_D${gpus}_reversed.csv" 2>&1 | grep -v "^W1\|^\*\*\*\|it/s\]\|point/s\]" | tail -6
fi
if [ "${EP_BENCH_AB:-1}" = 1 ]; then
  echo "== A/B: the same eager methods with the plain-torch plan, pack and BRIM_1 (OCCULT_FUSED_PLAN=0) ($(date -u +%T))"
  OCCULT_FUSED_PLAN=0 timeout 300 torchrun --nproc_per_node="$gpus" -m occult.harness.sweep --kind prefill --shapes olmoe --no-shared \
    --routing uniform --methods occult occult-pe occult-nd1 --repeats 20 --warmup 5 --timeout-s 120 \
    --out "$out/ep_prefill_uniform_D${gpus}_torchplan.csv" 2>&1 | grep -v "^W1\|^\*\*\*\|it/s\]\|point/s\]" | tail -8
fi
echo "== ep bench train (fwd+bwd, 32 x 512 = 2^14 tokens) D=$gpus ($(date -u +%T))"
timeout 180 torchrun --nproc_per_node="$gpus" -m occult.harness.sweep --kind train --shapes olmoe --no-shared \
  --routing uniform --sizes 32 --methods occult occult-pe occult-static occult-graph occult-nd1 occult-compute \
  --repeats 20 --warmup 5 --timeout-s 120 --out "$out/ep_train_uniform_D${gpus}.csv" 2>&1 \
  | grep -v "^W1\|^\*\*\*\|it/s\]\|point/s\]" | tail -10
if [ "${EP_BENCH_COMPUTE_GRAPH:-1}" = 1 ]; then
  # host-free kernel rows for the simulator's kernel curves (docs/simulator.md, set v12-D1), in a
  # process of their own: the first run of occult-compute-graph at D > 1
  echo "== the expert compute replayed from a CUDA graph, prefill and train ($(date -u +%T))"
  timeout 180 torchrun --nproc_per_node="$gpus" -m occult.harness.sweep --kind prefill --shapes olmoe --no-shared \
    --routing uniform --methods occult-compute-graph --repeats 20 --warmup 5 --timeout-s 120 \
    --out "$out/ep_prefill_uniform_D${gpus}_compute_graph.csv" 2>&1 | grep -v "^W1\|^\*\*\*\|it/s\]\|point/s\]" | tail -5
  timeout 120 torchrun --nproc_per_node="$gpus" -m occult.harness.sweep --kind train --shapes olmoe --no-shared \
    --routing uniform --sizes 32 --methods occult-compute-graph --repeats 20 --warmup 5 --timeout-s 120 \
    --out "$out/ep_train_uniform_D${gpus}_compute_graph.csv" 2>&1 | grep -v "^W1\|^\*\*\*\|it/s\]\|point/s\]" | tail -5
fi
for tokens in ${EP_BENCH_PROFILES-16384 64}; do     # where the host time goes: torch.profiler tables and the host syncs of one forward
  echo "== profile ${tokens} tokens/GPU D=$gpus ($(date -u +%T))"
  timeout 180 torchrun --nproc_per_node="$gpus" -m occult.harness.ep_profile --tokens "$tokens" --repeats 20 \
    --out "$out/profile_T${tokens}" > "$out/profile_T${tokens}.log" 2>&1
  grep "host syncs\|forward median" "$out/profile_T${tokens}.log" | head -6
done
echo "== ep bench done ($(date -u +%T))"
