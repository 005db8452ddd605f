#!/usr/bin/env bash
# session 16, call 3: the headline point (OLMoE layer, 2^14 tokens, D=1) in four fresh processes on one
# machine start: occult, occult-graph, MegaBlocks and the naive EP, each process timing all four, so
# that the spread of the Occult / MegaBlocks ratio between processes is measured, not assumed.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
o=/tmp/s16c; rm -rf $o; mkdir -p $o
. workflow/scripts/common.sh
machine_facts > $o/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $o/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $o/install.log 2>&1 || tail -5 $o/install.log
python3 -c "import megablocks" 2>/dev/null || WHEEL_CACHE=.thirdparty/wheels bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $o/build.log 2>&1
for r in 1 2 3 4; do
  m="occult occult-graph megablocks naive"; [ $((r % 2)) = 0 ] && m="megablocks naive occult occult-graph"
  echo "== r$r $(date -u +%T)"
  timeout 100 python3 -m occult.sweep --kind prefill --shapes olmoe --sizes 16384 --methods $m --repeats 20 --warmup 5 --timeout-s 60 --out $o/headline_r$r.csv > $o/headline_r$r.log 2>&1
  grep -v "point/s\]" $o/headline_r$r.log | tail -6
done
tar czf $OUT/s16c.tgz -C $o .
echo "== done $(date -u +%T)"
