#!/usr/bin/env bash
# Issue 8's sweep code on CPU gloo ranks at D=4 and 8 with the real shapes: routing facts (E[C_T], load) vs the pre-registered predictions.
set -u
cd /work/main && . .venv/bin/activate
for D in 4 8; do
  shapes="olmoe qwen deepseek"; [ "$D" = 8 ] && shapes="olmoe deepseek"
  for kind in prefill decode; do
    sizes=1024; [ "$kind" = decode ] && sizes=512
    timeout 2400 nice -n 5 python -m occult.sweep --device cpu --dtype float32 --D $D --kind $kind --shapes $shapes \
      --sizes $sizes --methods occult occult-balanced occult-nd2 occult-nd1 --repeats 1 --warmup 0 --input-sets 1 \
      --timeout-s 1200 --out /tmp/cpu8/sweep_${kind}_D${D}.csv > /tmp/cpu8/sweep_${kind}_D${D}.log 2>&1
    echo "$kind D=$D rc=$? $(date +%T)" >> /tmp/cpu8/progress.txt
  done
done
echo DONE >> /tmp/cpu8/progress.txt
# Then, on this CPU at 300e6e1's code (issue8_routing_check.csv, issue8_routing_check_summary.csv):
# python - <<'PY'
# import glob
# from occult.prediction_check import read_sweeps, read_predictions, check, summary
# D = 'results/cpu-gloo/routing_D4_D8_v1'
# m = read_sweeps(sorted(glob.glob(D + '/sweep_*.csv')), 'measured')
# t = check({'preregistered': read_predictions('results/preregistered/issue8_predictions_90f63fd.csv', 'p')}, m, 0.15, routing_only=True)
# t.to_csv(D + '/issue8_routing_check.csv', index=False, float_format='%.6g')
# summary(t).to_csv(D + '/issue8_routing_check_summary.csv', index=False, float_format='%.4g')
# PY
