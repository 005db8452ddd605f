#!/usr/bin/env bash
# session 23, call 1: sweeps_v36 (as sweeps_v35, on a new start, to test the session-23 host offsets on unseen rows) — the D=1 Occult methods and the naive EP with both host probes
# (host_probe_us: a pure-Python loop; host_launch_us: 20 tiny launches), decode and train twice (r1, r2),
# then prefill once; one process per (kind, shape). Each finished CSV is copied to $OUT at once, so a call
# cut by the device budget still returns what finished.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OCCULT_COMMIT=$(cat .device/commit)
d=$OUT/sweeps_v36; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || tail -5 /tmp/install.log
M="occult occult-balanced occult-graph occult-graph-balanced occult-nd2 occult-nd1 naive"
for job in decode:r1 decode:r2 train:r1 train:r2 prefill:r1; do
  kind=${job%:*}; rep=${job#*:}
  for shape in olmoe qwen deepseek; do
    echo "== $rep $kind $shape $(date -u +%T)"
    sizes=(); [ $kind = prefill ] && sizes=(--sizes 1024 2048 4096 8192 16384 32768 65536)
    timeout 200 torchrun --nproc_per_node=1 -m occult.sweep --kind $kind --shapes $shape --methods $M "${sizes[@]}" \
      --repeats 20 --warmup 5 --timeout-s 120 --out /tmp/s23a_${kind}_${shape}_$rep.csv > /tmp/s23a_${kind}_${shape}_$rep.log 2>&1 \
      || echo "rc=$? $rep $kind $shape"
  done
  python3 -c "
import glob, pandas as pd
fs = sorted(glob.glob('/tmp/s23a_${kind}_*_$rep.csv'))
pd.concat([pd.read_csv(f) for f in fs], ignore_index=True).to_csv('$d/sweep_${kind}_D1_$rep.csv', index=False)
x = pd.concat([pd.read_csv(f) for f in fs]); x = x[~x.method.str.contains('graph')]
print(x.groupby('shape')[['host_probe_us', 'host_launch_us', 'host_ms']].median().round(3).to_string())"
  tar czf $d/parts.tgz.tmp -C /tmp $(cd /tmp && ls s23a_*) && mv $d/parts.tgz.tmp $d/parts.tgz
done
echo "== all done $(date -u +%T)"
