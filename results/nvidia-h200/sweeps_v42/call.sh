#!/usr/bin/env bash
# session 25 (one H200): direct launches of the compiled Triton kernels (kernels/launch.py) on top of
# the eager autograd.Functions. The bf16 GPU tests; the training-step A/B in one
# process (workflow/scripts/train_host_ab.py, four arms); D=1 training and decode sweeps of Occult eager,
# balanced, graph and the naive EP. Started detached so that it outlives the call; waits up to WAIT_STEPS*5 s.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/s25f
if [ ! -e /tmp/s25f_started ]; then
  touch /tmp/s25f_started; rm -rf $d; mkdir -p $d
  cat > /tmp/s25f_driver.sh <<'DRV'
set -uo pipefail
d=/tmp/s25f
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
echo "== gpu tests $(date -u +%T)"
timeout 300 python3 -m pytest tests -m gpu -q -p no:cacheprovider > $d/gpu_tests.log 2>&1; tail -3 $d/gpu_tests.log
echo "== train host A/B $(date -u +%T)"
timeout 200 python3 workflow/scripts/train_host_ab.py --rounds 150 --batch 1 2 4 --out $d/train_host_ab.csv > $d/train_host_ab.log 2>&1
tail -14 $d/train_host_ab.log
echo "== sweeps $(date -u +%T)"
for kind in train decode; do
  for shape in olmoe qwen deepseek; do
    timeout 200 python3 -m occult.sweep --kind $kind --shapes $shape --methods occult occult-balanced occult-graph naive \
      --repeats 20 --warmup 5 --timeout-s 60 --out $d/parts/sweep_${kind}_D1_$shape.csv > $d/sweep_${kind}_D1_$shape.log 2>&1
    tail -1 $d/sweep_${kind}_D1_$shape.log
  done
done
python3 - <<'PY'
import glob, json, pandas as pd
for kind in ("train", "decode"):
    parts = sorted(glob.glob(f"/tmp/s25f/parts/sweep_{kind}_D1_*.csv"))
    if not parts:
        continue
    pd.concat([pd.read_csv(p) for p in parts], ignore_index=True).to_csv(f"/tmp/s25f/sweep_{kind}_D1.csv", index=False)
    metas = [json.load(open(p + ".meta.json")) for p in parts]
    merged = {**metas[0], "parts": [{"file": p.rsplit("/", 1)[-1], "created": m.get("created"), "shapes": m["settings"]["shapes"]} for p, m in zip(parts, metas)]}
    merged["settings"] = {**metas[0]["settings"], "shapes": [s for m in metas for s in m["settings"]["shapes"]]}
    json.dump(merged, open(f"/tmp/s25f/sweep_{kind}_D1.csv.meta.json", "w"), indent=2)
    d = pd.read_csv(f"/tmp/s25f/sweep_{kind}_D1.csv")
    print(d.pivot_table(index=["shape", "batch"], columns="method", values="median_ms").round(2).to_string())
PY
echo "== all done $(date -u +%T)"
DRV
  setsid nohup env OCCULT_COMMIT=$OCCULT_COMMIT bash -c "bash /tmp/s25f_driver.sh > /tmp/s25f_driver.log 2>&1; touch /tmp/s25f_done" > /dev/null 2>&1 < /dev/null &
fi
for i in $(seq 1 ${WAIT_STEPS:-110}); do [ -e /tmp/s25f_done ] && break; sleep 5; done
cp /tmp/s25f_driver.log $d/driver.log 2>/dev/null
grep -v "point/s\]\|it/s\]" /tmp/s25f_driver.log | tail -50
tar czf $OUT/s25f.tgz --exclude='*.tgz' -C $d .
[ -e /tmp/s25f_done ] && echo "== S25F DONE" || echo "== still running $(date -u +%T)"
