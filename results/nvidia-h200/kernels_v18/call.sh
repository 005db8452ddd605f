#!/usr/bin/env bash
# session 18, call 3: (1) every GPU test of the kernels and the EP layer after the one-copy fix (f49f748);
# (2) the OLMoE headline point (prefill 2^14) in two processes against MegaBlocks; (3) the expert compute
# at F = 1408 replayed from a CUDA graph (the kernel rate of this machine start), with clock telemetry.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s18c; rm -rf $d; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
echo "== gpu tests $(date -u +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/ep -m gpu > $d/gpu_tests.log 2>&1; tail -3 $d/gpu_tests.log
WHEEL_CACHE=.thirdparty/wheels bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $d/build.log 2>&1; tail -2 $d/build.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 200 > $d/telemetry.csv 2>/dev/null &
tele=$!
for r in 1 2; do
  m="occult occult-graph megablocks naive"; [ $r = 2 ] && m="naive megablocks occult-graph occult"
  echo "== headline r$r $(date -u +%T)" | tee -a $d/phases.txt
  timeout 80 python3 -m occult.sweep --kind prefill --shapes olmoe --sizes 16384 --methods $m --repeats 20 --warmup 5 --timeout-s 60 \
    --out $d/headline_r$r.csv > $d/headline_r$r.log 2>&1
  grep -v "point/s\]\|^W1\|Capacity" $d/headline_r$r.log | tail -6
done
echo "== f1408 compute $(date -u +%T)" | tee -a $d/phases.txt
timeout 90 python3 -m occult.sweep --kind prefill --shapes qwen deepseek --no-shared --routing uniform --methods occult-compute-graph \
  --repeats 20 --warmup 5 --timeout-s 60 --out $d/ep_prefill_uniform_f1408_D1.csv > $d/ep_prefill_uniform_f1408_D1.log 2>&1
grep -v "point/s\]" $d/ep_prefill_uniform_f1408_D1.log | tail -4
echo "== end $(date -u +%T)" >> $d/phases.txt
kill $tele 2>/dev/null
tar czf $OUT/s18c.tgz -C $d .
echo "== done $(date -u +%T)"
