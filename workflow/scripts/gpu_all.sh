#!/usr/bin/env bash
# Every GPU measurement of issues 3 and 4 in priority order, for one device session:
#   0. the bf16 GPU tests of the kernels and the EP layer (tests -m gpu),
#   1. MegaBlocks (cached wheels or a build) and Tutel from carried sources,
#   2. the EP runtime's benchmark (gpu_ep_bench.sh),
#   3. the baselines' sweeps at D = all GPUs: prefill, train, decode (gpu_sweeps.sh),
#   4. the all-to-all / grouped-GEMM microbenchmark for the simulator (occult.harness.commbench), if present,
#   5. the sweeps at D = 1 (prefill) when time is left.
# Usage: gpu_all.sh OUTDIR SDIST_DIR ROUTING_NPZ   (long: start it with setsid and poll OUTDIR/done)
set -uo pipefail
out=${1:?usage: gpu_all.sh OUTDIR SDIST_DIR ROUTING_NPZ}; sdist=$(realpath "${2:?}"); trace=$(realpath "${3:?}")
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L | wc -l)
machine_facts > "$out/machine.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || tail -5 "$out/install.log"
echo "== GPU tests ($(date -u +%T))"
timeout 300 python3 -m pytest tests/kernels tests/ep -m gpu -q -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
tail -2 "$out/gpu_tests.log"
{
  echo "== baselines ($(date -u +%T))"
  WHEEL_CACHE=${WHEEL_CACHE:-} bash "$here/build_baselines.sh" "$sdist" /tmp/occult-baselines
  tutel=$(ls "$sdist"/tutel-*.tar.gz 2>/dev/null | head -1)
  if [ -n "$tutel" ]; then
    mkdir -p /tmp/occult-tutel && tar xzf "$tutel" -C /tmp/occult-tutel
    ( cd /tmp/occult-tutel/*/ && python3 -m pip install -q --no-deps --no-build-isolation --no-index . ) \
      && python3 -c 'import tutel; print("import tutel: ok")' || echo "tutel: FAILED to install"
  fi
} > "$out/build.log" 2>&1
tail -6 "$out/build.log"
mkdir -p "$out/wheels" && cp /tmp/occult-baselines/wheels/*.whl "$out/wheels/" 2>/dev/null
bash "$here/gpu_ep_bench.sh" "$out/ep" "$trace" 2>&1 | tee "$out/ep.log"
SWEEP_DS=$gpus bash "$here/gpu_sweeps.sh" "$out/sweeps" prefill train decode 2>&1 | tee "$out/sweeps.log"
if [ -f occult/harness/commbench.py ]; then
  echo "== commbench ($(date -u +%T))"
  timeout 180 torchrun --nproc_per_node="$gpus" -m occult.harness.commbench --out "$out/comm" > "$out/comm.log" 2>&1
  tail -5 "$out/comm.log"
fi
if [ "$gpus" -gt 1 ]; then SWEEP_DS=1 bash "$here/gpu_sweeps.sh" "$out/sweeps" prefill 2>&1 | tee -a "$out/sweeps.log"; fi
touch "$out/done"
