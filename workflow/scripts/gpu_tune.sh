#!/usr/bin/env bash
# Config sweep of the six grouped GEMM kernels (occult.harness.kernel_tune) on this machine's
# first GPU: OLMoE layer shape, rank 0's pairs at 2^14 tokens x 2 ranks, uniform routing, the
# autotuner's configs and a seeded sample of a wider grid, each checked against the default.
# One device call: the sweep stops starting configs after TUNE_LIMIT_S (default 420 s).
# Usage: workflow/scripts/gpu_tune.sh OUTDIR   (then copy OUTDIR/tune.csv* to results/<machine>/tune_vN/)
set -uo pipefail
out=${1:?usage: gpu_tune.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/common.sh"
machine_facts > "$out/machine.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || tail -5 "$out/install.log"
limit=${TUNE_LIMIT_S:-420}
echo "== tune_kernels ($(date -u +%T)), limit ${limit}s"
timeout $((limit + 120)) python3 -m occult.harness.kernel_tune --out "$out/tune.csv" \
  --time-limit-s "$limit" --max-configs "${TUNE_MAX_CONFIGS:-24}" 2>&1 | tee "$out/tune.log" | tail -12
