#!/usr/bin/env bash
# The latency sweeps of one MoE layer on the GPUs of this machine, every method in the same run.
# Usage: workflow/scripts/gpu_sweeps.sh OUTDIR [KIND ...]   (KIND: prefill decode train; default all)
# SWEEP_DS (default "2 1"): the expert-parallel degrees to run, each ≤ the GPUs present (counted
#   from CUDA_VISIBLE_DEVICES when it is set).
# SWEEP_PREFILL_SIZES (default: occult.harness.sweep's 2^10 … 2^16): tokens per GPU of the prefill kind.
# SWEEP_SHAPES (default "olmoe qwen deepseek"): the layer shapes; each (group, shape) runs in a
#   process of its own, so that a crash (a SIGSEGV at a shape change in results/nvidia-h200/sweeps_v20)
#   loses that shape's rows only.
# SWEEP_GROUP_S (default 900): time limit of each process's torchrun.
# SWEEP_TIMING (default step): occult.harness.sweep --timing (step: from a drained GPU; stream: back to back).
# Builds nothing: run workflow/scripts/build_baselines.sh first for MegaBlocks and DeepSpeed (Tutel: its own
# install); missing baselines produce rows that say so.
set -uo pipefail
out=${1:?usage: gpu_sweeps.sh OUTDIR [KIND ...]}; shift
kinds=${*:-prefill train decode}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
. "$(dirname "$0")/common.sh"
gpus=$(visible_gpus)
# Tutel runs in a process of its own: at 2^16 tokens it has hit an illegal memory access, which
# ends the CUDA context of the process (results/nvidia-h200/README.md), so its prefill stops at 2^14.
groups=("occult occult-balanced occult-graph occult-graph-balanced occult-nd2 occult-nd1 naive megablocks hf fsdp deepspeed" "tutel")
for kind in $kinds; do
  for D in ${SWEEP_DS:-2 1}; do
    [ "$D" -le "$gpus" ] || continue
    parts=()
    for g in 0 1; do
      sizes=()
      if [ "$kind" = prefill ]; then
        sizes=(--sizes)
        for n in ${SWEEP_PREFILL_SIZES:-1024 2048 4096 8192 16384 32768 65536}; do
          [ "$g" = 1 ] && [ "$n" -gt 16384 ] || sizes+=("$n")
        done
      fi
      for shape in ${SWEEP_SHAPES:-olmoe qwen deepseek}; do
        part="$out/parts/sweep_${kind}_D${D}_group${g}_${shape}.csv"
        mkdir -p "$out/parts"
        echo "== sweep $kind D=$D $shape methods: ${groups[$g]} ($(date -u +%T))"
        timeout "${SWEEP_GROUP_S:-900}" torchrun --nproc_per_node="$D" -m occult.harness.sweep --kind "$kind" \
          --timing "${SWEEP_TIMING:-step}" --shapes "$shape" --methods ${groups[$g]} "${sizes[@]}" --repeats 20 --warmup 5 --timeout-s 120 \
          --out "$part" 2>&1 | tee "$part.log" | grep -v "^W1\|^\*\*\*\|it/s\]\|point/s\]" | tail -25
        [ -f "$part" ] && parts+=("$part")
      done
    done
    python3 - "$out/sweep_${kind}_D${D}.csv" "${parts[@]}" <<'PY'
import json, sys
import pandas as pd
out, parts = sys.argv[1], sys.argv[2:]
if parts:
    pd.concat([pd.read_csv(p) for p in parts], ignore_index=True).to_csv(out, index=False)
    metas = [json.load(open(p + ".meta.json")) for p in parts]
    merged = {**metas[0], "parts": [{"file": p.rsplit("/", 1)[-1], "created": m.get("created"),
                                     "shapes": m["settings"]["shapes"], "methods": m["settings"]["methods"]}
                                    for p, m in zip(parts, metas)]}
    merged["settings"] = {**metas[0]["settings"],
                          "shapes": list(dict.fromkeys(s for m in metas for s in m["settings"]["shapes"])),
                          "methods": list(dict.fromkeys(x for m in metas for x in m["settings"]["methods"]))}
    with open(out + ".meta.json", "w") as fh:
        json.dump(merged, fh, indent=2)
PY
  done
done
echo "== sweeps done ($(date -u +%T))"
