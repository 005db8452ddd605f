#!/usr/bin/env bash
# session 17, call 1: the MoE-only ratio against MegaBlocks on the Qwen1.5-MoE and DeepSeek-MoE
# shapes (both methods without the shapes' shared experts, `--no-shared`), prefill 2^12 ... 2^16,
# two processes in opposite method order; SM clock / power telemetry over the whole call (the
# power-cap explanation of the F = 1408 kernel-rate drop past 2^14 was never measured).
# MegaBlocks built from its sdists here; the wheels come back for later calls.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
o=/tmp/s17a; rm -rf $o; mkdir -p $o
. workflow/scripts/common.sh
machine_facts > $o/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $o/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $o/install.log 2>&1 || tail -5 $o/install.log
echo "== build $(date -u +%T)"
bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $o/build.log 2>&1; tail -4 $o/build.log
mkdir -p /tmp/wh && cp /tmp/b/wheels/*.whl /tmp/wh/ 2>/dev/null; ls -la /tmp/wh
reasons=clocks_event_reasons.active
nvidia-smi --query-gpu=$reasons --format=csv > /dev/null 2>&1 || reasons=clocks_throttle_reasons.active
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,$reasons \
  --format=csv -lms 200 > $o/telemetry.csv 2>&1 &
tel=$!
A="occult occult-graph occult-compute-graph megablocks naive"
B="naive megablocks occult-compute-graph occult-graph occult"
for r in 1 2; do
  m=$A; [ $r = 2 ] && m=$B
  echo "== noshared prefill r$r $(date -u +%T.%N)" | tee -a $o/phases.txt
  timeout 170 python3 -m occult.sweep --kind prefill --sizes 4096 16384 32768 65536 --shapes qwen deepseek --no-shared \
    --methods $m --repeats 20 --warmup 5 --timeout-s 90 --out $o/noshared_prefill_D1_r$r.csv > $o/noshared_prefill_r$r.log 2>&1
  echo "== end r$r $(date -u +%T.%N)" | tee -a $o/phases.txt
  grep -v "point/s\]\|^W1\|Capacity" $o/noshared_prefill_r$r.log | tail -24
done
kill $tel
tar czf $OUT/s17a.tgz -C $o .
tar czf $OUT/s17_wheels.tgz -C /tmp/wh . && ls -la $OUT
echo "== done $(date -u +%T)"
