#!/usr/bin/env bash
# session 20, call 2 (and later calls to collect): every method of issue 4 at D=1 in one run at this
# commit: MegaBlocks 0.10.0 (built from its sdists), Tutel 82af7aa (built here from its source archive),
# workflow/scripts/gpu_sweeps.sh prefill train decode; then the expert compute alone, replayed from a
# CUDA graph, on the three expert shapes (this start's kernel rate, the simulator's kernel rows).
# Started detached so that it outlives the call; waits up to WAIT_STEPS*5 s, then packs what is there.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s20b
if [ ! -e /tmp/s20b_started ]; then
  touch /tmp/s20b_started; rm -rf $d; mkdir -p $d
  cat > /tmp/s20b_driver.sh <<'DRV'
set -uo pipefail
d=/tmp/s20b
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
echo "== install $(date -u +%T)"
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
( rm -rf /tmp/tutel-src && mkdir -p /tmp/tutel-src && tar xzf .thirdparty/sdist/tutel-82af7aa.tar.gz -C /tmp/tutel-src \
  && cd /tmp/tutel-src/* && python3 -m pip install -q --no-deps --no-build-isolation --no-index . ) > $d/tutel_build.log 2>&1 &
tb=$!
bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $d/build.log 2>&1
echo "== gpu test $(date -u +%T)"
timeout 150 python3 -m pytest tests/test_sweep.py -m gpu -q -p no:cacheprovider > $d/gpu_tests.log 2>&1; tail -2 $d/gpu_tests.log
wait $tb; (cd /tmp && python3 -c "import tutel; print('import tutel: ok')") >> $d/tutel_build.log 2>&1; tail -1 $d/tutel_build.log
echo "== sweeps $(date -u +%T)"
SWEEP_DS=1 bash workflow/scripts/gpu_sweeps.sh $d prefill train decode
echo "== compute-graph F=1408 $(date -u +%T)"
timeout 150 python3 -m occult.sweep --kind prefill --shapes olmoe qwen deepseek --no-shared --routing uniform --methods occult-compute-graph --repeats 20 --warmup 5 --timeout-s 60 --out $d/ep_prefill_uniform_compute_D1.csv > $d/ep_prefill_uniform_compute_D1.log 2>&1; grep -v "point/s\]" $d/ep_prefill_uniform_compute_D1.log | tail -6
echo "== all done $(date -u +%T)"
DRV
  setsid nohup env OCCULT_COMMIT=$OCCULT_COMMIT bash -c "bash /tmp/s20b_driver.sh > /tmp/s20b_driver.log 2>&1; touch /tmp/s20b_done" > /dev/null 2>&1 < /dev/null &
fi
for i in $(seq 1 ${WAIT_STEPS:-112}); do [ -e /tmp/s20b_done ] && break; sleep 5; done
cp /tmp/s20b_driver.log $d/driver.log 2>/dev/null
grep -v "point/s\]\|it/s\]" /tmp/s20b_driver.log | tail -60
tar czf $OUT/s20b.tgz -C $d .
[ -e /tmp/s20b_done ] && echo "== S16A DONE" || echo "== still running $(date -u +%T)"
