#!/usr/bin/env bash
# session 25 (one H200): where the eager training step's host time goes (Occult vs naive EP, small
# batches) and what a Triton launch costs on the host, part by part.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=$OUT/s25a; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
timeout 120 python3 results/nvidia-h200/sweeps_v41/ab_r1/launch_host_us.py 2>&1 | tee $d/diag.txt | tail -25
timeout 300 python3 -m occult.sweep --kind train --shapes deepseek qwen olmoe --methods occult naive --sizes 1 2 4 \
  --repeats 20 --warmup 5 --timeout-s 60 --host-profile $d/hp --out $d/train_hp.csv > $d/train_hp.log 2>&1
tail -3 $d/train_hp.log
python3 - <<'PY'
import pandas as pd, os
d = pd.read_csv(os.environ["OUT"] + "/s25a/train_hp.csv")
print(d.pivot_table(index=["shape", "batch"], columns="method", values=["median_ms", "host_ms"]).round(2).to_string())
PY
cd $OUT && tar czf s25a.tgz s25a && rm -rf s25a
