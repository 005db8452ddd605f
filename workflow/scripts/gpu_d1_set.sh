#!/usr/bin/env bash
# Every file a D = 1 set of the scale simulator is calibrated and validated on (config.yaml,
# simulate.history; docs/simulator.md), measured on GPU 0 in one call, so that the host terms of
# all of them come from the same machine start (eager rows move up to 2.4x between starts):
#   ep_prefill_{uniform,trace}_D1.csv  OLMoE layer without shared expert, 2^10 ... 2^16 tokens:
#                                      occult, occult-graph, occult-compute and occult-compute-graph
#                                      (the compute replayed from a CUDA graph: the kernel curve)
#   ep_train_uniform_D1.csv            fwd+bwd of the expert compute alone (eager and replayed), the three shapes
#   sweep_{prefill,train,decode}_D1.csv  occult, occult-graph and the naive EP, the three shapes
# Usage: workflow/scripts/gpu_d1_set.sh OUTDIR   (then copy OUTDIR to results/<machine>/sweeps_vN/)
# TRACE: the routing sample of the trace rows (default: the committed quality_upcycle_v4 sample).
# D1_SET_PART_S (default 150): time limit of each of the six sweeps.
set -uo pipefail
out=${1:?usage: gpu_d1_set.sh OUTDIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
. "$(dirname "$0")/common.sh"
machine_facts > "$out/machine.txt" 2>&1
trace=${TRACE:-results/nvidia-h200/quality_upcycle_v4/profile/routing_heldout_sample.npz}
limit=${D1_SET_PART_S:-150}
sweep() {   # NAME, then occult.harness.sweep's arguments
    local name=$1; shift
    echo "== $name ($(date -u +%T))"
    timeout "$limit" python3 -m occult.harness.sweep "$@" --repeats 20 --warmup 5 --timeout-s 60 --out "$out/$name.csv" \
        > "$out/$name.log" 2>&1
    echo "   exit $? ($(date -u +%T))"
    grep -v "point/s\]" "$out/$name.log" | tail -12
}
for routing in uniform trace; do
    sweep "ep_prefill_${routing}_D1" --kind prefill --shapes olmoe --no-shared --routing "$routing" --trace "$trace" \
        --methods occult occult-graph occult-compute occult-compute-graph
done
sweep ep_train_uniform_D1 --kind train --shapes olmoe qwen deepseek --methods occult-compute occult-compute-graph
sweep sweep_prefill_D1 --kind prefill --shapes olmoe qwen deepseek --methods occult occult-graph naive \
    --sizes 1024 4096 16384 65536
sweep sweep_train_D1 --kind train --shapes olmoe qwen deepseek --methods occult occult-graph naive
sweep sweep_decode_D1 --kind decode --shapes olmoe qwen deepseek --methods occult occult-graph naive
echo "== D=1 set done ($(date -u +%T))"
