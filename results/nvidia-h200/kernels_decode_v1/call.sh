#!/usr/bin/env bash
# session 22, call 4: kernels_decode_v1 — the expert compute alone, replayed from a CUDA graph, at
# decode-sized calls: decode batches 1 8 64 512 (the sweeps' router) and prefill 1…512 tokens (uniform).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OCCULT_COMMIT=$(cat .device/commit)
d=$OUT/kernels_decode_v1; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || tail -5 /tmp/install.log
timeout 200 python3 -m occult.sweep --kind decode --shapes olmoe qwen deepseek --no-shared --methods occult-compute-graph occult-graph \
  --repeats 30 --warmup 5 --timeout-s 60 --out $d/decode_compute_D1.csv > $d/decode_compute_D1.log 2>&1 || echo "rc=$? decode"
grep -v "point/s\]" $d/decode_compute_D1.log | tail -12
timeout 200 python3 -m occult.sweep --kind prefill --sizes 1 2 4 8 16 32 64 128 256 512 --shapes olmoe qwen deepseek --no-shared \
  --routing uniform --methods occult-compute-graph --repeats 30 --warmup 5 --timeout-s 60 --out $d/small_compute_uniform_D1.csv \
  > $d/small_compute_uniform_D1.log 2>&1 || echo "rc=$? small"
grep -v "point/s\]" $d/small_compute_uniform_D1.log | tail -8
