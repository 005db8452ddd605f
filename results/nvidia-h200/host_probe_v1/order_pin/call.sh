#!/usr/bin/env bash
# session 21, call 1: is the eager decode's host time a property of the method or of when and where the
# process ran? At D = 1 occult, occult-balanced, occult-nd2 and occult-nd1 run the same computation
# (one device: pruning keeps every expert), yet sweeps_v31 measured DeepSeek's host time per step at
# 0.57-1.77 ms across them. Four runs of the same decode sweep: method order A and reversed (B), each
# unpinned and pinned to one CPU core (taskset), DeepSeek and OLMoE shapes.
set -uo pipefail
export OCCULT_COMMIT=$(cat .device/commit) PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s21a; rm -rf $d; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
{ nproc; lscpu | head -20; cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1; } > $d/cpu.txt 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
A="occult occult-balanced occult-nd2 occult-nd1 naive"
B="naive occult-nd1 occult-nd2 occult-balanced occult"
for run in plainA plainB pinA pinB plainA2 pinA2; do
  case $run in plain*) pre="";; pin*) pre="taskset -c 7";; esac
  case $run in *B) m=$B;; *) m=$A;; esac
  echo "== $run $(date -u +%T)"
  timeout 150 $pre torchrun --nproc_per_node=1 -m occult.sweep --kind decode --shapes deepseek olmoe --methods $m \
    --repeats 20 --warmup 5 --timeout-s 60 --out $d/decode_$run.csv > $d/decode_$run.log 2>&1 || echo "rc=$? $run"
done
python3 - $d <<'PY'
import sys, glob, os
import pandas as pd
d = sys.argv[1]
rows = []
for f in sorted(glob.glob(f"{d}/decode_*.csv")):
    x = pd.read_csv(f); x["run"] = os.path.basename(f)[7:-4]; rows.append(x)
x = pd.concat(rows)
x.to_csv(f"{d}/host_pin.csv", index=False)
print(x.pivot_table(index=["shape", "run"], columns="method", values="host_ms", aggfunc="median").round(2).to_string())
print(x.pivot_table(index=["shape", "run"], columns="method", values="median_ms", aggfunc="median").round(2).to_string())
PY
tar czf $OUT/s21a.tgz -C $d .
