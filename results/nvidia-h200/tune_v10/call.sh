#!/usr/bin/env bash
# session 17, call 4: the forward SwiGLU with one accumulator over a tile's gate and up columns
# (ONE_ACC, new: W viewed as [E, 2, F, D], one descriptor load of both halves, one 128x256 product
# per K step): GPU tests in bf16, interleaved config A/B at the OLMoE and F = 1408 shapes, then the
# layer with the fastest ONE_ACC config against the tree's pins (base x x base).
set -uo pipefail
export PYTHONUNBUFFERED=1
d=/tmp/s17d; rm -rf $d; mkdir -p $d
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
WHEEL_CACHE=.thirdparty/wheels bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $d/build.log 2>&1 &
bb=$!
echo "== gpu tests $(date -u +%T)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_grouped_swiglu.py -k "forward_descriptor" > $d/gpu_tests.log 2>&1; tail -3 $d/gpu_tests.log
C="128x128x64:w8:s4:WARP_SPEC=1 128x128x64:w8:s4:ONE_ACC=1 128x128x64:w8:s3:ONE_ACC=1 128x128x64:w8:s4:WARP_SPEC=1:ONE_ACC=1"
echo "== tune olmoe $(date -u +%T)"
timeout 80 python3 -m occult.kernels.tune_kernels --kernels swiglu_fwd --out $d/tune_fwd.csv --time-limit-s 70 --configs $C $C > $d/tune_olmoe.log 2>&1; tail -4 $d/tune_olmoe.log
echo "== tune f1408 $(date -u +%T)"
timeout 80 python3 -m occult.kernels.tune_kernels --tokens-per-rank 16384 --ranks 2 --experts 64 --top-k 6 --ffn 1408 --kernels swiglu_fwd --out $d/tune_fwd_f1408.csv --time-limit-s 70 --configs $C $C > $d/tune_f1408.log 2>&1; tail -4 $d/tune_f1408.log
X=$(python3 .device/s17_pick.py $d/tune_fwd.csv 2>> $d/pick.log); echo "picked: $X" | tee $d/pick.log
wait $bb
if [ -n "$X" ]; then
  for cfg in base $X $X base; do
    tag=base; [ $cfg = $X ] && tag=oneacc
    n=$(ls $d/layer_${tag}_r*.csv 2>/dev/null | wc -l); r=$((n + 1))
    echo "== layer $tag r$r $(date -u +%T)"
    timeout 60 python3 .device/s17_layer_ab.py $cfg -- --kind prefill --shapes olmoe deepseek --no-shared --sizes 16384 65536 \
      --methods occult occult-graph megablocks --repeats 20 --warmup 5 --timeout-s 40 --out $d/layer_${tag}_r$r.csv > $d/layer_${tag}_r$r.log 2>&1
    grep -v "point/s\]\|^W1\|Capacity" $d/layer_${tag}_r$r.log | tail -9
  done
fi
tar czf $OUT/s17d.tgz -C $d .
echo "== done $(date -u +%T)"
