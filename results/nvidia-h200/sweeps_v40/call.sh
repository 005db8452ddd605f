#!/usr/bin/env bash
# session 24, second run (one H200): peak memory per method after the teardown fix. MegaBlocks 0.10.0 +
# DeepSpeed 0.19.8 (build_baselines.sh) and Tutel 82af7aa built first; then per (kind, shape) one process with
# gpu_sweeps.sh's method order and one with the order reversed (prefill 2^14 tokens, training batch 8):
# a method's peak must not depend on what ran before it. Tutel: a process of its own, as gpu_sweeps.sh runs it.
# Started detached so that it outlives the call; waits up to WAIT_STEPS*5 s, then packs what is there.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s24b
if [ ! -e /tmp/s24b_started ]; then
  touch /tmp/s24b_started; rm -rf $d; mkdir -p $d/parts
  cat > /tmp/s24b_driver.sh <<'DRV'
set -uo pipefail
d=/tmp/s24b
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
echo "== install $(date -u +%T)"
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
( rm -rf /tmp/tutel-src && mkdir -p /tmp/tutel-src && tar xzf .thirdparty/sdist/tutel-82af7aa.tar.gz -C /tmp/tutel-src \
  && cd /tmp/tutel-src/* && python3 -m pip install -q --no-deps --no-build-isolation --no-index . ) > $d/tutel_build.log 2>&1 &
tb=$!
bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $d/build.log 2>&1; tail -5 $d/build.log
wait $tb; (cd /tmp && python3 -c "import tutel; print('import tutel: ok')") >> $d/tutel_build.log 2>&1; tail -1 $d/tutel_build.log
A="occult occult-balanced occult-graph occult-graph-balanced occult-nd2 occult-nd1 naive megablocks hf fsdp deepspeed"
B="deepspeed fsdp hf megablocks naive occult-nd1 occult-nd2 occult-graph-balanced occult-graph occult-balanced occult"
for job in prefill:16384 train:8; do
  kind=${job%:*}; size=${job#*:}
  for shape in olmoe qwen deepseek; do
    for order in A B T; do
      case $order in A) m=$A;; B) m=$B;; T) m=tutel;; esac
      echo "== $kind $shape order $order $(date -u +%T)"
      timeout 150 torchrun --nproc_per_node=1 -m occult.sweep --kind $kind --shapes $shape --methods $m --sizes $size \
        --repeats 20 --warmup 5 --timeout-s 60 --out $d/parts/${kind}_${shape}_$order.csv > $d/parts/${kind}_${shape}_$order.log 2>&1 \
        || echo "rc=$? $kind $shape $order"
    done
  done
done
echo "== all done $(date -u +%T)"
DRV
  setsid nohup env OCCULT_COMMIT=$OCCULT_COMMIT bash -c "bash /tmp/s24b_driver.sh > /tmp/s24b_driver.log 2>&1; touch /tmp/s24b_done" > /dev/null 2>&1 < /dev/null &
fi
for i in $(seq 1 ${WAIT_STEPS:-110}); do [ -e /tmp/s24b_done ] && break; sleep 5; done
cp /tmp/s24b_driver.log $d/driver.log 2>/dev/null
grep -v "point/s\]\|it/s\]\|Capacity =" /tmp/s24b_driver.log | tail -30
python3 - <<'PY' 2>/dev/null
import glob, pandas as pd
fs = sorted(glob.glob('/tmp/s24b/parts/*.csv'))
if fs:
    x = pd.concat([pd.read_csv(f).assign(order=f.rsplit('_', 1)[1][0]) for f in fs], ignore_index=True)
    print(x.pivot_table(index=['kind', 'shape', 'method'], columns='order', values='peak_mem_gib').round(2).to_string())
PY
tar czf $OUT/s24b.tgz -C $d .
[ -e /tmp/s24b_done ] && echo "== S24B DONE" || echo "== still running $(date -u +%T)"
