#!/usr/bin/env bash
# session 16, call 4: --timing step against --timing stream (new in 79e464c) at D=1: prefill 2^12,
# 2^14, 2^16 on the three shapes, Occult eager and graph, MegaBlocks, naive EP, four processes in
# the order step stream step stream on one machine start
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
o=/tmp/s16d; rm -rf $o; mkdir -p $o
. workflow/scripts/common.sh
machine_facts > $o/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $o/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $o/install.log 2>&1 || tail -5 $o/install.log
python3 -c "import megablocks" 2>/dev/null || WHEEL_CACHE=.thirdparty/wheels bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $o/build.log 2>&1
for r in 1 2; do
  for t in step stream; do
    echo "== $t r$r $(date -u +%T)"
    timeout 150 python3 -m occult.sweep --kind prefill --timing $t --shapes olmoe qwen deepseek --sizes 4096 16384 65536 --methods occult occult-graph megablocks naive --repeats 20 --warmup 5 --timeout-s 60 --out $o/timing_${t}_r$r.csv > $o/timing_${t}_r$r.log 2>&1
    grep -v "point/s\]" $o/timing_${t}_r$r.log | tail -14
  done
done
tar czf $OUT/s16d.tgz -C $o .
echo "== done $(date -u +%T)"
