#!/usr/bin/env bash
# session 22, call 1: sweeps_v34 — the shared experts' host cost with host probes on every row.
# With / without the shapes' shared experts in separate processes, alternating A B A B A B (r1..r3):
# decode (batch 1 8 64 512) and training (batch 2 4 8) with occult-graph (the replay is one launch, the
# shared expert runs eagerly after it) and eager occult; prefill 4096 16384 with occult-graph (r1, r2).
# OLMoE (no shared expert) is in the forward runs as the control. Detached: poll $d/phases.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OCCULT_COMMIT=$(cat .device/commit)
d=/tmp/s22a; rm -rf $d; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
run() {  # tag, args
  local tag=$1; shift
  echo "== $tag $(date -u +%T)" >> $d/phases.txt
  timeout 150 python3 -m occult.sweep "$@" --repeats 20 --warmup 5 --timeout-s 60 --out $d/$tag.csv > $d/$tag.log 2>&1 \
    || echo "rc=$? $tag" >> $d/phases.txt
}
for r in 1 2 3; do
  for v in shared noshared; do
    flag=(); [ $v = noshared ] && flag=(--no-shared)
    run decode_${v}_r$r --kind decode --shapes olmoe qwen deepseek --methods occult-graph occult "${flag[@]}"
    run train_${v}_r$r --kind train --shapes qwen deepseek --sizes 2 4 8 --methods occult-graph occult "${flag[@]}"
    [ $r -le 2 ] && run prefill_${v}_r$r --kind prefill --shapes olmoe qwen deepseek --sizes 4096 16384 --methods occult-graph "${flag[@]}"
  done
done
echo "== end $(date -u +%T)" >> $d/phases.txt
