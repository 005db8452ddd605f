#!/usr/bin/env bash
# session 25 (one H200): Triton launch host cost part by part; the eager training step A/B
# (autograd.Function path vs custom ops vs naive EP) in one process; the combine tests on the GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=$OUT/s25b; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
timeout 120 python3 -m pytest tests/kernels/test_combine.py -q -p no:cacheprovider > $d/tests.log 2>&1; tail -2 $d/tests.log
timeout 120 python3 results/nvidia-h200/sweeps_v41/ab_r1/launch_host_us.py > $d/diag.txt 2>&1; tail -16 $d/diag.txt
timeout 300 python3 workflow/scripts/train_host_ab.py --rounds 100 --batch 1 2 4 --out $d/train_host_ab.csv > $d/train_host_ab.log 2>&1
tail -14 $d/train_host_ab.log
cd $OUT && tar czf s25b.tgz s25b && rm -rf s25b
