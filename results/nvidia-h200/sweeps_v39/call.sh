#!/usr/bin/env bash
# session 24 (one H200): every method of issue 4 at D=1 in one run at this commit, DeepSpeed and FSDP included:
# the bf16 GPU tests (pytest -m gpu) while MegaBlocks 0.10.0 + DeepSpeed 0.19.8 (build_baselines.sh) and
# Tutel 82af7aa build on the CPU; then workflow/scripts/gpu_sweeps.sh prefill train decode at D=1; then the
# expert compute alone replayed from a CUDA graph on the three expert shapes (the simulator's kernel rows).
# Started detached so that it outlives the call; waits up to WAIT_STEPS*5 s, then packs what is there.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s24
if [ ! -e /tmp/s24_started ]; then
  touch /tmp/s24_started; rm -rf $d; mkdir -p $d
  cat > /tmp/s24_driver.sh <<'DRV'
set -uo pipefail
d=/tmp/s24
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
echo "== install $(date -u +%T)"
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
( rm -rf /tmp/tutel-src && mkdir -p /tmp/tutel-src && tar xzf .thirdparty/sdist/tutel-82af7aa.tar.gz -C /tmp/tutel-src \
  && cd /tmp/tutel-src/* && python3 -m pip install -q --no-deps --no-build-isolation --no-index . ) > $d/tutel_build.log 2>&1 &
tb=$!
bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $d/build.log 2>&1 &
bb=$!
echo "== gpu tests $(date -u +%T)"
timeout 240 python3 -m pytest tests -m gpu -q -p no:cacheprovider > $d/gpu_tests.log 2>&1; tail -3 $d/gpu_tests.log
wait $bb; tail -6 $d/build.log
wait $tb; (cd /tmp && python3 -c "import tutel; print('import tutel: ok')") >> $d/tutel_build.log 2>&1; tail -1 $d/tutel_build.log
echo "== sweeps $(date -u +%T)"
SWEEP_DS=1 bash workflow/scripts/gpu_sweeps.sh $d prefill train decode
echo "== compute-graph $(date -u +%T)"
timeout 150 python3 -m occult.sweep --kind prefill --shapes olmoe qwen deepseek --no-shared --routing uniform --methods occult-compute-graph --repeats 20 --warmup 5 --timeout-s 60 --out $d/ep_prefill_uniform_compute_D1.csv > $d/ep_prefill_uniform_compute_D1.log 2>&1; grep -v "point/s\]" $d/ep_prefill_uniform_compute_D1.log | tail -6
echo "== all done $(date -u +%T)"
DRV
  setsid nohup env OCCULT_COMMIT=$OCCULT_COMMIT bash -c "bash /tmp/s24_driver.sh > /tmp/s24_driver.log 2>&1; touch /tmp/s24_done" > /dev/null 2>&1 < /dev/null &
fi
for i in $(seq 1 ${WAIT_STEPS:-110}); do [ -e /tmp/s24_done ] && break; sleep 5; done
cp /tmp/s24_driver.log $d/driver.log 2>/dev/null
grep -v "point/s\]\|it/s\]" /tmp/s24_driver.log | tail -50
tar czf $OUT/s24.tgz --exclude='*.tgz' -C $d .
[ -e /tmp/s24_done ] && echo "== S24 DONE" || echo "== still running $(date -u +%T)"
