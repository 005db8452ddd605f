#!/usr/bin/env bash
# session 15, call 4: the final code against MegaBlocks and the naive EP at D=1: prefill 2^12..2^16 and
# training at batch 1..16 on the three shapes (same machine start as the D=1 set)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
o=/tmp/s15d; rm -rf $o; mkdir -p $o
. workflow/scripts/common.sh
machine_facts > $o/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $o/machine.txt
python3 -c "import megablocks" 2>/dev/null || (WHEEL_CACHE=.thirdparty/wheels bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $o/build.log 2>&1)
echo "== prefill $(date -u +%T)"
timeout 200 python3 -m occult.sweep --kind prefill --shapes olmoe qwen deepseek --methods occult occult-graph megablocks naive --sizes 4096 16384 65536 --repeats 20 --warmup 5 --timeout-s 60 --out $o/sweep_prefill_D1.csv > $o/sweep_prefill.log 2>&1; grep -v "point/s\]" $o/sweep_prefill.log | tail -16
echo "== train $(date -u +%T)"
timeout 200 python3 -m occult.sweep --kind train --shapes olmoe qwen deepseek --methods occult occult-graph megablocks naive --repeats 20 --warmup 5 --timeout-s 60 --out $o/sweep_train_D1.csv > $o/sweep_train.log 2>&1; grep -v "point/s\]" $o/sweep_train.log | tail -16
tar czf $OUT/s15_call4.tgz -C $o .
echo "== done $(date -u +%T)"
