#!/usr/bin/env bash
# session 15, call 2: bf16 GPU tests of HEAD; host µs A/B of the direct calls in one process; the
# code's host µs against 2605545 (mid) in interleaved processes; OLMoE prefill at 2^14 vs MegaBlocks
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
o=/tmp/s15b; rm -rf $o; mkdir -p $o
. workflow/scripts/common.sh
machine_facts > $o/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $o/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $o/install.log 2>&1 || tail -5 $o/install.log
python3 -c "import megablocks" 2>/dev/null || (WHEEL_CACHE=.thirdparty/wheels bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $o/build.log 2>&1; echo "build rc=$?" >> $o/build.log) &
echo "== gpu tests $(date -u +%T)"
timeout 200 python3 -m pytest tests/kernels tests/ep -m gpu -q -p no:cacheprovider > $o/gpu_tests.log 2>&1; tail -1 $o/gpu_tests.log
wait
echo "== direct-call A/B $(date -u +%T)"
timeout 90 python3 .device/direct_ab.py $o/direct_ab.json > $o/direct_ab.txt 2>&1; cat $o/direct_ab.txt | tail -17
echo "== new vs mid $(date -u +%T)"
ln -sfn ../kernels .device/mid/occult/kernels
for r in 1 2 3; do
  echo "-- new $r" >> $o/host_ab.txt; timeout 60 python3 -m occult.ep.launches --host-us --tokens 1024 16384 >> $o/host_ab.txt 2>&1
  echo "-- mid $r" >> $o/host_ab.txt; (cd .device/mid && PYTHONPATH=. timeout 60 python3 -c 'import occult, sys; print(occult.__file__); from occult.ep.launches import main; sys.exit(main(["--host-us","--tokens","1024","16384"]))') >> $o/host_ab.txt 2>&1
done
grep -E "^--| total " $o/host_ab.txt | paste - - 
echo "== prefill $(date -u +%T)"
timeout 90 python3 -m occult.sweep --kind prefill --shapes olmoe --methods occult occult-graph megablocks naive --sizes 16384 --repeats 20 --warmup 5 --timeout-s 60 --out $o/sweep_prefill_D1.csv > $o/sweep_prefill.log 2>&1; tail -6 $o/sweep_prefill.log
tar czf $OUT/s15_call2.tgz -C $o .
echo "== done $(date -u +%T)"
