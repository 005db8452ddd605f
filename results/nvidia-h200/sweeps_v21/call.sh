#!/usr/bin/env bash
# session 16, call 2 (a new machine start): (1) the training sweep of call 1 (sweeps_v20) for the
# Qwen and DeepSeek shapes, whose process crashed (SIGSEGV after the OLMoE rows): every method but
# Tutel (whose rows call 1 has), one process per shape; (2) the shared expert's share of the layer
# time: decode and small prefill of occult, occult-graph and naive with and without the shapes'
# shared experts, alternating A B A B in separate processes on this machine start.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
o=/tmp/s16b; rm -rf $o; mkdir -p $o
. workflow/scripts/common.sh
machine_facts > $o/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $o/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $o/install.log 2>&1 || tail -5 $o/install.log
WHEEL_CACHE=.thirdparty/wheels bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $o/build.log 2>&1; tail -3 $o/build.log
M="occult occult-balanced occult-graph occult-graph-balanced occult-nd2 occult-nd1 naive megablocks hf fsdp"
for shape in qwen deepseek; do
  echo "== train $shape $(date -u +%T)"
  timeout 200 python3 -m occult.sweep --kind train --shapes $shape --methods $M --repeats 20 --warmup 5 --timeout-s 120 --out $o/sweep_train_D1_$shape.csv > $o/sweep_train_$shape.log 2>&1
  grep -v "point/s\]\|^W1\|Capacity" $o/sweep_train_$shape.log | tail -14
done
S="olmoe qwen deepseek"; E="occult occult-graph naive"
for r in 1 2; do
  for v in shared noshared; do
    flag=""; [ $v = noshared ] && flag="--no-shared"
    echo "== decode $v r$r $(date -u +%T)"
    timeout 120 python3 -m occult.sweep --kind decode --shapes $S --methods $E $flag --repeats 20 --warmup 5 --timeout-s 60 --out $o/shared_ab_decode_${v}_r$r.csv > $o/shared_ab_decode_${v}_r$r.log 2>&1
    grep -v "point/s\]" $o/shared_ab_decode_${v}_r$r.log | tail -11
    echo "== prefill $v r$r $(date -u +%T)"
    timeout 120 python3 -m occult.sweep --kind prefill --sizes 1024 4096 16384 --shapes $S --methods $E $flag --repeats 20 --warmup 5 --timeout-s 60 --out $o/shared_ab_prefill_${v}_r$r.csv > $o/shared_ab_prefill_${v}_r$r.log 2>&1
    grep -v "point/s\]" $o/shared_ab_prefill_${v}_r$r.log | tail -11
  done
done
tar czf $OUT/s16b.tgz -C $o .
echo "== done $(date -u +%T)"
