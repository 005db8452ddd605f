#!/usr/bin/env bash
# The latency sweeps of one MoE layer on the GPUs of this machine, every method in the same run.
# Usage: workflow/scripts/gpu_sweeps.sh OUTDIR [KIND ...]   (KIND: prefill decode train; default all)
# Builds nothing: run workflow/scripts/build_baselines.sh first for MegaBlocks (Tutel: its own
# install); missing baselines produce rows that say so.
set -uo pipefail
out=${1:?usage: gpu_sweeps.sh OUTDIR [KIND ...]}; shift
kinds=${*:-prefill train decode}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L | wc -l)
methods="occult occult-nd2 occult-nd1 naive megablocks tutel hf fsdp"
for kind in $kinds; do
  for D in 2 1; do
    [ "$D" -le "$gpus" ] || continue
    echo "== sweep $kind D=$D ($(date -u +%T))"
    timeout 900 torchrun --nproc_per_node="$D" -m occult.sweep --kind "$kind" --shapes olmoe qwen deepseek \
      --methods $methods --repeats 20 --warmup 5 --timeout-s 120 \
      --out "$out/sweep_${kind}_D${D}.csv" 2>&1 | grep -v "^W1\|^\*\*\*\|it/s\]\|point/s\]" | tail -25
  done
done
echo "== sweeps done ($(date -u +%T))"
