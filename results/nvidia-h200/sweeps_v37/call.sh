#!/usr/bin/env bash
# session 23, call 2: DeepSpeed-MoE 0.19.8 (installed from its sdist and carried wheels by
# workflow/scripts/build_baselines.sh with BASELINES=deepspeed) beside Occult (eager and graph) and the
# naive EP at D=1, prefill 2^10..2^14, training and decode, the three shapes, one process per (kind, shape).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OCCULT_COMMIT=$(cat .device/commit)
d=$OUT/sweeps_v37; mkdir -p $d/parts
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || tail -5 /tmp/install.log
BASELINES=deepspeed bash workflow/scripts/build_baselines.sh .thirdparty/ds /tmp/b > $d/build.log 2>&1; tail -3 $d/build.log
M="occult occult-graph naive deepspeed"
for kind in prefill train decode; do
  for shape in olmoe qwen deepseek; do
    echo "== $kind $shape $(date -u +%T)"
    sizes=(); [ $kind = prefill ] && sizes=(--sizes 1024 4096 16384)
    p=$d/parts/sweep_${kind}_${shape}.csv
    timeout 150 torchrun --nproc_per_node=1 -m occult.sweep --kind $kind --shapes $shape --methods $M "${sizes[@]}" \
      --repeats 20 --warmup 5 --timeout-s 100 --out $p > $p.log 2>&1 || echo "rc=$? $kind $shape"
    grep -h "deepspeed" $p.log | grep -iv "warn" | tail -2
  done
  python3 -c "
import glob, pandas as pd
fs = sorted(glob.glob('$d/parts/sweep_${kind}_*.csv'))
x = pd.concat([pd.read_csv(f) for f in fs], ignore_index=True); x.to_csv('$d/sweep_${kind}_D1.csv', index=False)
print(x.pivot_table(index=['shape', 'tokens_per_gpu'], columns='method', values='median_ms').round(3).to_string())
print(x[x.method == 'deepspeed'][['shape', 'tokens_per_gpu', 'status', 'max_rel_err']].to_string())"
done
tar czf $OUT/parts.tgz -C $d parts && rm -rf $d/parts
echo "== all done $(date -u +%T)"
