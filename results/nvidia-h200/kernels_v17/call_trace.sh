#!/usr/bin/env bash
# session 18, call 2: trace the forward SwiGLU launches of the pinned-config test inside the full GPU test run
set -uo pipefail
export PYTHONUNBUFFERED=1
d=/tmp/s18b; rm -rf $d; mkdir -p $d
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
timeout 200 python3 .device/s18_debug.py > $d/debug_full.log 2>&1; echo "rc $?"
grep -n "MODULE\|LAUNCH\|passed\|failed" $d/debug_full.log | head -40
tar czf $OUT/s18b.tgz -C $d .
