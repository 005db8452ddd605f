#!/usr/bin/env bash
# session 29 (one H200, a new machine start; session 28 got no machine: session 27 call 1's machine went back mid-run before training and decode finished): autotuned kernels launched past the autotuner (kernels/launch.py launch_tuned).
# The two GPU tests that session 27 changed (tests/ep/test_launches.py, tests/kernels/test_launch.py) while
# MegaBlocks 0.10.0 + DeepSpeed 0.19.8 (build_baselines.sh) and Tutel 82af7aa build on the CPU; then every
# method of issue 4 at D=1, train and decode (workflow/scripts/gpu_sweeps.sh; prefill came from call 1);
# then the expert compute alone from a CUDA graph (the simulator's kernel rows). Started detached so that
# it outlives the call; waits up to WAIT_STEPS*5 s.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s28
if [ ! -e /tmp/s28_started ]; then
  touch /tmp/s28_started; rm -rf $d; mkdir -p $d
  cat > /tmp/s28_driver.sh <<'DRV'
set -uo pipefail
d=/tmp/s28
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
timeout 200 python3 -m pytest tests/ep/test_launches.py tests/kernels/test_launch.py -m gpu -q -p no:cacheprovider > $d/gpu_tests.log 2>&1; tail -3 $d/gpu_tests.log
wait $bb; tail -6 $d/build.log
wait $tb; (cd /tmp && python3 -c "import tutel; print('import tutel: ok')") >> $d/tutel_build.log 2>&1; tail -1 $d/tutel_build.log
echo "== sweeps $(date -u +%T)"
SWEEP_DS=1 bash workflow/scripts/gpu_sweeps.sh $d train decode
echo "== compute-graph $(date -u +%T)"
timeout 150 python3 -m occult.sweep --kind prefill --shapes olmoe qwen deepseek --no-shared --routing uniform --methods occult-compute-graph --repeats 20 --warmup 5 --timeout-s 60 --out $d/ep_prefill_uniform_compute_D1.csv > $d/ep_prefill_uniform_compute_D1.log 2>&1; grep -v "point/s\]" $d/ep_prefill_uniform_compute_D1.log | tail -6
python3 - <<'PY'
import pandas as pd
for kind in ("prefill", "train", "decode"):
    try:
        d = pd.read_csv(f"/tmp/s28/sweep_{kind}_D1.csv")
    except FileNotFoundError:
        continue
    print(kind, d.groupby("method")["status"].value_counts().unstack(fill_value=0).to_string() if "status" in d else len(d))
PY
echo "== all done $(date -u +%T)"
DRV
  setsid nohup env OCCULT_COMMIT=$OCCULT_COMMIT bash -c "bash /tmp/s28_driver.sh > /tmp/s28_driver.log 2>&1; touch /tmp/s28_done" > /dev/null 2>&1 < /dev/null &
fi
for i in $(seq 1 ${WAIT_STEPS:-110}); do [ -e /tmp/s28_done ] && break; sleep 5; done
cp /tmp/s28_driver.log $d/driver.log 2>/dev/null
grep -v "point/s\]\|it/s\]\|Capacity" /tmp/s28_driver.log | tail -40
tar czf $OUT/s28.tgz --exclude='*.tgz' -C $d .
[ -e /tmp/s28_done ] && echo "== S28 DONE" || echo "== still running $(date -u +%T)"
