#!/usr/bin/env bash
# session 17, call 5: the GPU tests of the kernels and the EP layer with the ONE_ACC forward pin.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s17e; rm -rf $d; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/ep -m gpu > $d/gpu_tests.log 2>&1; tail -4 $d/gpu_tests.log
tar czf $OUT/s17e.tgz -C $d .
