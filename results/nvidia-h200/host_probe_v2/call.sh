#!/usr/bin/env bash
# session 22, call 2: host_probe_v2 — the shared expert's eager decode cost per shape with both arms
# interleaved step by step in one process (workflow/scripts/shared_host_ab.py), two processes.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OCCULT_COMMIT=$(cat .device/commit)
d=$OUT/host_probe_v2; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || tail -5 /tmp/install.log
for r in 1 2; do
  timeout 240 python3 workflow/scripts/shared_host_ab.py --rounds 500 --batch 1 8 64 512 --out $d/shared_host_ab_r$r.csv \
    > $d/shared_host_ab_r$r.log 2>&1 || echo "rc=$? r$r"
  tail -30 $d/shared_host_ab_r$r.log
done
