#!/usr/bin/env bash
# session 15, call 5: a replicate of call 3 on the same machine start: the D=1 simulator set (workflow/scripts/gpu_d1_set.sh),
# started detached so that it outlives this call; waits up to ~560 s, then packs what is there
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
d=/tmp/d1_set_b
if [ ! -e /tmp/d1b_started ]; then
  touch /tmp/d1b_started
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/d1_install.log 2>&1
  echo "OCCULT_COMMIT=$OCCULT_COMMIT" > /tmp/d1b_commit.txt
  setsid nohup env OCCULT_COMMIT=$OCCULT_COMMIT bash -c "bash workflow/scripts/gpu_d1_set.sh $d > /tmp/d1b_driver.log 2>&1; touch /tmp/d1b_done" > /dev/null 2>&1 < /dev/null &
fi
for i in $(seq 1 ${WAIT_STEPS:-112}); do [ -e /tmp/d1b_done ] && break; sleep 5; done
cat /tmp/d1b_driver.log | tail -40
cp /tmp/d1b_commit.txt /tmp/d1b_driver.log $d/ 2>/dev/null
tar czf $OUT/d1_set_b.tgz -C $d .
[ -e /tmp/d1b_done ] && echo "== D1 SET DONE" || echo "== still running $(date -u +%T)"
