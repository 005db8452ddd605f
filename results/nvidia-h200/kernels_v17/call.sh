#!/usr/bin/env bash
# session 18, call 1: (1) the pinned-config GPU test, then every GPU test of the kernels and the EP layer;
# (2) the shared experts' cost, A B A B: Qwen/DeepSeek with and without their shared experts, replayed
# from a CUDA graph, training (batch 2, 4, 8, 16 x 512 tokens) and prefill (2^12, 2^14, 2^16).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s18a; rm -rf $d; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
echo "== pinned test $(date -u +%T)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels -m gpu -k pinned > $d/gpu_tests_pinned.log 2>&1; tail -3 $d/gpu_tests_pinned.log
echo "== gpu tests $(date -u +%T)"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/ep -m gpu > $d/gpu_tests.log 2>&1; tail -3 $d/gpu_tests.log
for r in 1 2; do
  for v in shared noshared; do
    flag=""; [ $v = noshared ] && flag="--no-shared"
    echo "== train $v r$r $(date -u +%T)"
    timeout 70 python3 -m occult.sweep --kind train --shapes qwen deepseek $flag --sizes 2 4 8 16 --methods occult-graph \
      --repeats 20 --warmup 5 --timeout-s 40 --out $d/train_${v}_r$r.csv > $d/train_${v}_r$r.log 2>&1
    grep -v "point/s\]\|^W1" $d/train_${v}_r$r.log | tail -3
    echo "== prefill $v r$r $(date -u +%T)"
    timeout 60 python3 -m occult.sweep --kind prefill --shapes qwen deepseek $flag --sizes 4096 16384 65536 --methods occult-graph \
      --repeats 20 --warmup 5 --timeout-s 40 --out $d/prefill_${v}_r$r.csv > $d/prefill_${v}_r$r.log 2>&1
    grep -v "point/s\]\|^W1" $d/prefill_${v}_r$r.log | tail -3
  done
done
tar czf $OUT/s18a.tgz -C $d .
echo "== done $(date -u +%T)"
