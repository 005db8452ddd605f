#!/usr/bin/env bash
# session 19, call 2: Occult against MegaBlocks on the Qwen and DeepSeek shapes with the current pins
# (ONE_ACC forward since f2344d6), shared experts included: prefill 2^14 .. 2^16 and training at batch 8
# and 16, two processes in opposite method order each, with clock telemetry (issue 4's "ahead on Qwen and
# DeepSeek" at D = 1).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s19b; rm -rf $d; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
echo "== build $(date -u +%T)"
bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $d/build.log 2>&1; tail -2 $d/build.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 200 > $d/telemetry.csv 2>/dev/null &
tele=$!
for r in 1 2; do
  m="occult occult-graph megablocks"; [ $r = 2 ] && m="megablocks occult-graph occult"
  echo "== prefill r$r $(date -u +%T)" | tee -a $d/phases.txt
  timeout 150 python3 -m occult.sweep --kind prefill --shapes qwen deepseek --sizes 16384 32768 65536 --methods $m \
    --repeats 20 --warmup 5 --timeout-s 60 --out $d/prefill_r$r.csv > $d/prefill_r$r.log 2>&1
  grep -v "point/s\]\|^W1\|Capacity" $d/prefill_r$r.log | tail -8
  echo "== train r$r $(date -u +%T)" | tee -a $d/phases.txt
  timeout 150 python3 -m occult.sweep --kind train --shapes qwen deepseek --sizes 8 16 --methods $m \
    --repeats 20 --warmup 5 --timeout-s 60 --out $d/train_r$r.csv > $d/train_r$r.log 2>&1
  grep -v "point/s\]\|^W1\|Capacity" $d/train_r$r.log | tail -8
done
echo "== end $(date -u +%T)" >> $d/phases.txt
kill $tele 2>/dev/null
tar czf $OUT/s19b.tgz -C $d .
echo "== done $(date -u +%T)"
