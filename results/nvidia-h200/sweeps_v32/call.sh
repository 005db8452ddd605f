#!/usr/bin/env bash
# session 21, call 3 (and later calls to collect): the D=1 Occult methods and the naive EP with the host
# probe (host_probe_us per row), prefill/train/decode, three shapes, one process per (kind, shape) as
# gpu_sweeps.sh runs them (MegaBlocks, Tutel, HF and FSDP left out: not built, not simulated); then
# train and decode again (r2: replicates of the host-bound rows). Detached; waits up to WAIT_STEPS*5 s.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s21c
if [ ! -e /tmp/s21c_started ]; then
  touch /tmp/s21c_started; rm -rf $d; mkdir -p $d
  cat > /tmp/s21c_driver.sh <<'DRV'
set -uo pipefail
d=/tmp/s21c
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 500 > $d/telemetry.csv 2>&1 &
M="occult occult-balanced occult-graph occult-graph-balanced occult-nd2 occult-nd1 naive"
for rep in r1 r2; do
  kinds="prefill train decode"; [ $rep = r2 ] && kinds="train decode"
  for kind in $kinds; do
    for shape in olmoe qwen deepseek; do
      echo "== $rep $kind $shape $(date -u +%T)"
      sizes=(); [ $kind = prefill ] && sizes=(--sizes 1024 2048 4096 8192 16384 32768 65536)
      timeout 300 torchrun --nproc_per_node=1 -m occult.sweep --kind $kind --shapes $shape --methods $M "${sizes[@]}" \
        --repeats 20 --warmup 5 --timeout-s 120 --out $d/parts/${kind}_${shape}_$rep.csv > $d/parts/${kind}_${shape}_$rep.log 2>&1 \
        || echo "rc=$? $rep $kind $shape"
    done
    python3 -c "
import sys, glob, pandas as pd
fs = sorted(glob.glob('$d/parts/${kind}_*_$rep.csv'))
pd.concat([pd.read_csv(f) for f in fs], ignore_index=True).to_csv('$d/sweep_${kind}_D1_$rep.csv', index=False)
print('$kind $rep', len(fs), 'parts')"
  done
done
echo "== all done $(date -u +%T)"
DRV
  mkdir -p $d/parts
  setsid nohup env OCCULT_COMMIT=$(cat .device/commit) bash -c "bash /tmp/s21c_driver.sh > /tmp/s21c_driver.log 2>&1; touch /tmp/s21c_done" > /dev/null 2>&1 < /dev/null &
fi
for i in $(seq 1 ${WAIT_STEPS:-100}); do [ -e /tmp/s21c_done ] && break; sleep 5; done
cp /tmp/s21c_driver.log $d/driver.log 2>/dev/null
tail -30 /tmp/s21c_driver.log
tar czf $OUT/s21c.tgz --exclude='*.log' -C $d . ; tar czf $OUT/s21c_logs.tgz -C $d parts driver.log 2>/dev/null
[ -e /tmp/s21c_done ] && echo "== S21C DONE" || echo "== still running $(date -u +%T)"
