#!/usr/bin/env bash
# session 27 (one H200): autotuned kernels launched past the autotuner (kernels/launch.py launch_tuned).
# The bf16 GPU tests while MegaBlocks 0.10.0 + DeepSpeed 0.19.8 (build_baselines.sh) and Tutel 82af7aa
# build on the CPU; the training-step A/B in one process (workflow/scripts/train_host_ab.py, four arms
# incl. occult-tuned-normal); then every method of issue 4 at D=1, prefill, train and decode
# (workflow/scripts/gpu_sweeps.sh); then the expert compute alone from a CUDA graph (the simulator's
# kernel rows). Started detached so that it outlives the call; waits up to WAIT_STEPS*5 s.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s27
if [ ! -e /tmp/s27_started ]; then
  touch /tmp/s27_started; rm -rf $d; mkdir -p $d
  cat > /tmp/s27_driver.sh <<'DRV'
set -uo pipefail
d=/tmp/s27
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
timeout 300 python3 -m pytest tests -m gpu -q -p no:cacheprovider > $d/gpu_tests.log 2>&1; tail -3 $d/gpu_tests.log
wait $bb; tail -6 $d/build.log
wait $tb; (cd /tmp && python3 -c "import tutel; print('import tutel: ok')") >> $d/tutel_build.log 2>&1; tail -1 $d/tutel_build.log
echo "== train host A/B $(date -u +%T)"
timeout 240 python3 workflow/scripts/train_host_ab.py --rounds 150 --batch 1 2 4 \
  --arms occult occult-tuned-normal occult-normal-launch naive --out $d/train_host_ab.csv > $d/train_host_ab.log 2>&1
tail -14 $d/train_host_ab.log
echo "== sweeps $(date -u +%T)"
SWEEP_DS=1 bash workflow/scripts/gpu_sweeps.sh $d prefill train decode
echo "== compute-graph $(date -u +%T)"
timeout 150 python3 -m occult.sweep --kind prefill --shapes olmoe qwen deepseek --no-shared --routing uniform --methods occult-compute-graph --repeats 20 --warmup 5 --timeout-s 60 --out $d/ep_prefill_uniform_compute_D1.csv > $d/ep_prefill_uniform_compute_D1.log 2>&1; grep -v "point/s\]" $d/ep_prefill_uniform_compute_D1.log | tail -6
python3 - <<'PY'
import pandas as pd
for kind in ("prefill", "train", "decode"):
    try:
        d = pd.read_csv(f"/tmp/s27/sweep_{kind}_D1.csv")
    except FileNotFoundError:
        continue
    print(kind, d.groupby("method")["status"].value_counts().unstack(fill_value=0).to_string() if "status" in d else len(d))
PY
echo "== all done $(date -u +%T)"
DRV
  setsid nohup env OCCULT_COMMIT=$OCCULT_COMMIT bash -c "bash /tmp/s27_driver.sh > /tmp/s27_driver.log 2>&1; touch /tmp/s27_done" > /dev/null 2>&1 < /dev/null &
fi
for i in $(seq 1 ${WAIT_STEPS:-110}); do [ -e /tmp/s27_done ] && break; sleep 5; done
cp /tmp/s27_driver.log $d/driver.log 2>/dev/null
grep -v "point/s\]\|it/s\]" /tmp/s27_driver.log | tail -60
tar czf $OUT/s27.tgz --exclude='*.tgz' -C $d .
[ -e /tmp/s27_done ] && echo "== S27 DONE" || echo "== still running $(date -u +%T)"
