#!/usr/bin/env bash
# GPU correctness and kernel benchmarks in one call (device machine; CUDA torch + triton present).
# Usage: workflow/scripts/gpu_kernels.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_kernels.sh OUTDIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nvidia-smi topo -m;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)';
  git rev-parse HEAD 2>/dev/null || echo "commit: ${OCCULT_COMMIT:-unknown}"; } > "$out/machine.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || cat "$out/install.log"
timeout 420 python3 -m pytest tests/kernels tests/ep -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -15
timeout 420 python3 -m occult.kernels.bench_kernels --out "$out/kernels.csv" 2>&1 | tee "$out/bench_kernels.log" | tail -40
