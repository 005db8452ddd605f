#!/usr/bin/env bash
# session 15, call 1: bf16 GPU tests of HEAD (7a40c38's BRIM_1 change, e4a05d3's direct calls);
# host µs per part: new (HEAD), mid (2605545, direct calls absent), old (17cd79b, before 7a40c38) interleaved; cProfile of the
# eager forward's host work; OLMoE prefill at 2^14 against MegaBlocks (eager ratio on this start)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
o=/tmp/s15a; rm -rf $o; mkdir -p $o
. workflow/scripts/common.sh
machine_facts > $o/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $o/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $o/install.log 2>&1 || tail -5 $o/install.log
(WHEEL_CACHE=.thirdparty/wheels bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $o/build.log 2>&1; echo "build rc=$?" >> $o/build.log) &
echo "== gpu tests $(date -u +%T)"
timeout 200 python3 -m pytest tests/kernels tests/ep -m gpu -q -p no:cacheprovider > $o/gpu_tests.log 2>&1; tail -3 $o/gpu_tests.log
wait
echo "== host A/B $(date -u +%T)"
for v in old mid; do ln -sfn ../kernels .device/$v/occult/kernels; done
for r in 1 2; do
  echo "-- new $r" >> $o/host_ab.txt; timeout 60 python3 -m occult.ep.launches --host-us --tokens 1024 16384 >> $o/host_ab.txt 2>&1
  for v in old mid; do
    echo "-- $v $r" >> $o/host_ab.txt; (cd .device/$v && PYTHONPATH=. timeout 60 python3 -c 'import occult, sys; print(occult.__file__); from occult.ep.launches import main; sys.exit(main(["--host-us","--tokens","1024","16384"]))') >> $o/host_ab.txt 2>&1
  done
done
grep -E "^--|total |group_pairs|swiglu |triton_launch|occult/__init__" $o/host_ab.txt
echo "== cProfile $(date -u +%T)"
timeout 90 python3 .device/launcher_profile.py 16384 > $o/launcher_profile.txt 2>&1; head -40 $o/launcher_profile.txt | tail -30
echo "== prefill $(date -u +%T)"
timeout 90 python3 -m occult.sweep --kind prefill --shapes olmoe --methods occult occult-graph megablocks naive --sizes 16384 --repeats 20 --warmup 5 --timeout-s 60 --out $o/sweep_prefill_D1.csv > $o/sweep_prefill.log 2>&1; tail -6 $o/sweep_prefill.log
tar czf $OUT/s15_call1.tgz -C $o .
echo "== done $(date -u +%T)"
