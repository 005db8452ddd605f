#!/usr/bin/env bash
# session 19, call 1: where the per-shape host time of eager decode goes (issue 6's largest misses).
# Decode at batch 8 and 64, D = 1, OLMoE / Qwen / DeepSeek (Qwen and DeepSeek with and without their
# shared experts), methods naive, occult, occult-graph: step-timed with a cProfile of as many more steps
# per row (--host-profile), then the same rows timed as a stream (GPU time, host hidden).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s19a; rm -rf $d; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
M="naive occult occult-graph"
run() {  # tag, extra args
  local tag=$1; shift
  echo "== $tag $(date -u +%T)" | tee -a $d/phases.txt
  timeout 120 python3 -m occult.sweep --kind decode --sizes 8 64 --methods $M --repeats 30 --warmup 5 --timeout-s 60 \
    --out $d/$tag.csv "$@" > $d/$tag.log 2>&1
  grep -v "point/s\]\|^W1\|Capacity" $d/$tag.log | tail -8
}
run step_shared --shapes olmoe qwen deepseek --host-profile $d/hp_shared
run step_noshared --shapes qwen deepseek --no-shared --host-profile $d/hp_noshared
run stream_shared --shapes olmoe qwen deepseek --timing stream
run step_shared_r2 --shapes deepseek olmoe qwen
echo "== end $(date -u +%T)" >> $d/phases.txt
tar czf $OUT/s19a.tgz -C $d .
echo "== done $(date -u +%T)"
