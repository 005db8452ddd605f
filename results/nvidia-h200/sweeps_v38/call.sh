#!/usr/bin/env bash
# session 23, call 3: every baseline at D=1 at the headline points in one run on one machine start, DeepSpeed
# included: MegaBlocks 0.10.0 and DeepSpeed 0.19.8 installed by workflow/scripts/build_baselines.sh from the
# carried sdists (and DeepSpeed's wheels), Tutel 82af7aa built from its carried source; then per (kind, shape)
# a process for Occult/naive/MegaBlocks/HF/DeepSpeed and one for Tutel: prefill 2^14 tokens, training
# batch 8 (4,096 tokens), decode batch 1 and 64. Each merged CSV goes to $OUT as soon as its kind is done.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OCCULT_COMMIT=$(cat .device/commit)
d=$OUT/sweeps_v38; mkdir -p $d /tmp/s23c
. workflow/scripts/common.sh
machine_facts > $d/machine.txt 2>&1; echo "OCCULT_COMMIT=$OCCULT_COMMIT" >> $d/machine.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || tail -5 /tmp/install.log
( rm -rf /tmp/tutel-src && mkdir -p /tmp/tutel-src && tar xzf .thirdparty/sdist/tutel-82af7aa.tar.gz -C /tmp/tutel-src \
  && cd /tmp/tutel-src/* && python3 -m pip install -q --no-deps --no-build-isolation --no-index . ) > $d/tutel_build.log 2>&1 &
tb=$!
echo "== build $(date -u +%T)"
bash workflow/scripts/build_baselines.sh .thirdparty/sdist /tmp/b > $d/build.log 2>&1; tail -5 $d/build.log
wait $tb; (cd /tmp && python3 -c "import tutel; print('import tutel: ok')") >> $d/tutel_build.log 2>&1; tail -1 $d/tutel_build.log
G0="occult occult-graph occult-nd1 naive megablocks hf deepspeed"
for job in prefill:16384 train:8 decode:1,64; do
  kind=${job%:*}; sizes=${job#*:}
  for shape in olmoe qwen deepseek; do
    for g in 0 1; do
      m=$G0; [ $g = 1 ] && m=tutel
      echo "== $kind $shape group$g $(date -u +%T)"
      timeout 100 torchrun --nproc_per_node=1 -m occult.sweep --kind $kind --shapes $shape --methods $m --sizes ${sizes//,/ } \
        --repeats 20 --warmup 5 --timeout-s 60 --out /tmp/s23c/${kind}_${shape}_g$g.csv > /tmp/s23c/${kind}_${shape}_g$g.log 2>&1 \
        || echo "rc=$? $kind $shape g$g"
    done
  done
  python3 -c "
import glob, pandas as pd
fs = sorted(glob.glob('/tmp/s23c/${kind}_*_g*.csv'))
x = pd.concat([pd.read_csv(f) for f in fs], ignore_index=True); x.to_csv('$d/sweep_${kind}_D1.csv', index=False)
print(x.pivot_table(index=['shape', 'tokens_per_gpu'], columns='method', values='median_ms').round(2).to_string())
bad = x[x.status != 'ok']; print(bad[['shape', 'method', 'status']].to_string() if len(bad) else 'all ok')"
  tar czf $d/parts.tgz.tmp -C /tmp s23c && mv $d/parts.tgz.tmp $d/parts.tgz
done
echo "== all done $(date -u +%T)"
