#!/usr/bin/env bash
# session 17, call 2: the forward SwiGLU with x gathered once in pair order and loaded through a
# descriptor (X_TMA, new): GPU tests in bf16, an interleaved config A/B of the forward GEMM at the
# OLMoE and DeepSeek expert shapes, then the layer (prefill, D = 1) with the tree's pins against the
# X_TMA pins, alternating in separate processes, MegaBlocks in each process as the control; then the
# shared expert's cost in Occult's and MegaBlocks' layers at 2^14 and 2^16 (with / without, A B A B).
# Started detached so that it outlives the call; waits up to WAIT_STEPS*5 s, then packs what is there.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s17b
if [ ! -e /tmp/s17b_started ]; then
  touch /tmp/s17b_started; rm -rf $d; mkdir -p $d
  cat > /tmp/s17b_driver.sh <<'DRV'
set -uo pipefail
d=/tmp/s17b
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
echo "== install $(date -u +%T)"
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
WHEEL_CACHE=.thirdparty/wheels bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $d/build.log 2>&1 &
bb=$!
echo "== gpu tests $(date -u +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_grouped_swiglu.py -k "pair_order or persistent_forward or bf16 or dw_options" > $d/gpu_tests.log 2>&1; tail -3 $d/gpu_tests.log
C="128x128x64:w8:s4:WARP_SPEC=1 128x128x64:w8:s4:WARP_SPEC=1:X_TMA=1 128x128x64:w8:s3:X_TMA=1 128x128x64:w8:s4:X_TMA=1:PERSISTENT=1"
echo "== tune olmoe $(date -u +%T)"
timeout 130 python3 -m occult.kernels.tune_kernels --kernels swiglu_fwd --out $d/tune_fwd.csv --time-limit-s 110 --configs $C $C > $d/tune_olmoe.log 2>&1; tail -12 $d/tune_olmoe.log
echo "== tune f1408 $(date -u +%T)"
timeout 130 python3 -m occult.kernels.tune_kernels --tokens-per-rank 16384 --ranks 2 --experts 64 --top-k 6 --ffn 1408 --kernels swiglu_fwd --out $d/tune_fwd.csv --time-limit-s 110 --configs $C $C > $d/tune_f1408.log 2>&1; tail -12 $d/tune_f1408.log
wait $bb; tail -4 $d/build.log
X1=128x128x64:w8:s4:WARP_SPEC=1:X_TMA=1; X2=128x128x64:w8:s3:X_TMA=1
for r in 1 2; do
  order="base $X1 $X2"; [ $r = 2 ] && order="$X2 $X1 base"
  for cfg in $order; do
    tag=base; [ $cfg = $X1 ] && tag=x1; [ $cfg = $X2 ] && tag=x2
    echo "== layer $tag r$r $(date -u +%T)"
    timeout 100 python3 .device/s17_layer_ab.py $cfg -- --kind prefill --shapes olmoe deepseek --no-shared --sizes 16384 65536 \
      --methods occult occult-graph megablocks --repeats 20 --warmup 5 --timeout-s 60 --out $d/layer_${tag}_r$r.csv > $d/layer_${tag}_r$r.log 2>&1
    grep -v "point/s\]\|^W1\|Capacity" $d/layer_${tag}_r$r.log | tail -9
  done
done
for r in 1 2; do
  for v in shared noshared; do
    flag=""; [ $v = noshared ] && flag="--no-shared"
    echo "== shared A/B $v r$r $(date -u +%T)"
    timeout 90 python3 -m occult.sweep --kind prefill --shapes qwen deepseek $flag --sizes 16384 65536 --methods occult megablocks \
      --repeats 20 --warmup 5 --timeout-s 60 --out $d/shared_ab_${v}_r$r.csv > $d/shared_ab_${v}_r$r.log 2>&1
    grep -v "point/s\]\|^W1\|Capacity" $d/shared_ab_${v}_r$r.log | tail -7
  done
done
echo "== all done $(date -u +%T)"
DRV
  setsid nohup env OCCULT_COMMIT=$OCCULT_COMMIT bash -c "bash /tmp/s17b_driver.sh > /tmp/s17b_driver.log 2>&1; touch /tmp/s17b_done" > /dev/null 2>&1 < /dev/null &
fi
for i in $(seq 1 ${WAIT_STEPS:-108}); do [ -e /tmp/s17b_done ] && break; sleep 5; done
cp /tmp/s17b_driver.log $d/driver.log 2>/dev/null
grep -v "point/s\]\|it/s\]" /tmp/s17b_driver.log | tail -80
tar czf $OUT/s17b.tgz -C $d .
[ -e /tmp/s17b_done ] && echo "== S17B DONE" || echo "== still running $(date -u +%T)"
