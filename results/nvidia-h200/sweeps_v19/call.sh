#!/usr/bin/env bash
# session 15, call 6: the GPU test of occult-compute-graph; the expert compute alone, eager and replayed
# from a CUDA graph, prefill (OLMoE, no shared expert, uniform) and training (three shapes) at D=1
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
o=/tmp/s15f; rm -rf $o; mkdir -p $o
. workflow/scripts/common.sh
machine_facts > $o/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $o/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $o/install.log 2>&1 || tail -5 $o/install.log
echo "== gpu test $(date -u +%T)"
timeout 120 python3 -m pytest tests/test_sweep.py -m gpu -q -p no:cacheprovider > $o/gpu_tests.log 2>&1; tail -3 $o/gpu_tests.log
echo "== prefill $(date -u +%T)"
timeout 120 python3 -m occult.sweep --kind prefill --shapes olmoe --no-shared --routing uniform --methods occult-compute occult-compute-graph --repeats 20 --warmup 5 --timeout-s 60 --out $o/ep_prefill_uniform_D1.csv > $o/ep_prefill_uniform_D1.log 2>&1; grep -v "point/s\]" $o/ep_prefill_uniform_D1.log | tail -6
echo "== train $(date -u +%T)"
timeout 150 python3 -m occult.sweep --kind train --shapes olmoe qwen deepseek --methods occult-compute occult-compute-graph --repeats 20 --warmup 5 --timeout-s 60 --out $o/ep_train_uniform_D1.csv > $o/ep_train_uniform_D1.log 2>&1; grep -v "point/s\]" $o/ep_train_uniform_D1.log | tail -10
tar czf $OUT/s15_call6.tgz -C $o .
echo "== done $(date -u +%T)"
