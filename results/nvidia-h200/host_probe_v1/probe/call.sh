#!/usr/bin/env bash
# session 21, call 2: host_probe.py for 90 s (pure-Python loop, 50 tiny launches, one eager D=1 DeepSeek
# decode layer call per round), with /proc/stat (steal) every second and nvidia-smi clocks every 200 ms.
set -uo pipefail
export OCCULT_COMMIT=$(cat .device/commit) PYTHONUNBUFFERED=1
d=/tmp/s21b; rm -rf $d; mkdir -p $d
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 200 > $d/smi.csv 2>&1 &
smi=$!
( for i in $(seq 1 200); do echo "$(date +%s.%N) $(head -1 /proc/stat)"; sleep 1; done ) > $d/procstat.txt &
ps_=$!
timeout 200 python3 workflow/scripts/host_probe.py --seconds 90 --out $d/host_probe.csv > $d/probe.log 2>&1; echo "rc=$?"
kill $smi $ps_ 2>/dev/null
tail -3 $d/probe.log
python3 - $d <<'PY'
import sys
import pandas as pd
d = sys.argv[1]
x = pd.read_csv(f"{d}/host_probe.csv")
x["window"] = (x.t_s // 2).astype(int)
w = x.groupby("window")[["python_us", "launch_us", "layer_us"]].median()
print(w.round(1).to_string())
print("corr of 2 s medians:\n", w.corr().round(2).to_string())
print("cpus seen:", x.cpu.value_counts().head(8).to_dict())
PY
tar czf $OUT/s21b.tgz -C $d .
