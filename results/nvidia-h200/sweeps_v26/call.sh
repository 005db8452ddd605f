#!/usr/bin/env bash
# session 17, call 3: (1) the training step (batch 8 and 16 × 512 tokens) of the Qwen1.5-MoE and
# DeepSeek-MoE shapes with and without their shared experts, Occult against MegaBlocks in the same
# process, A B A B; (2) the OLMoE headline point (prefill 2^14) in two more processes.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s17c; rm -rf $d; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
WHEEL_CACHE=.thirdparty/wheels bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $d/build.log 2>&1; tail -3 $d/build.log
for r in 1 2; do
  for v in shared noshared; do
    flag=""; [ $v = noshared ] && flag="--no-shared"
    echo "== train $v r$r $(date -u +%T)"
    timeout 100 python3 -m occult.sweep --kind train --shapes qwen deepseek $flag --sizes 8 16 --methods occult occult-graph megablocks \
      --repeats 20 --warmup 5 --timeout-s 60 --out $d/train_${v}_r$r.csv > $d/train_${v}_r$r.log 2>&1
    grep -v "point/s\]\|^W1\|Capacity" $d/train_${v}_r$r.log | tail -9
  done
done
for r in 1 2; do
  m="occult occult-graph megablocks naive"; [ $r = 2 ] && m="naive megablocks occult-graph occult"
  echo "== headline r$r $(date -u +%T)"
  timeout 80 python3 -m occult.sweep --kind prefill --shapes olmoe --sizes 16384 --methods $m --repeats 20 --warmup 5 --timeout-s 60 \
    --out $d/headline_r$r.csv > $d/headline_r$r.log 2>&1
  grep -v "point/s\]\|^W1\|Capacity" $d/headline_r$r.log | tail -7
done
tar czf $OUT/s17c.tgz -C $d .
echo "== done $(date -u +%T)"
