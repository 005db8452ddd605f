#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1
d=$OUT/s25d; mkdir -p $d
python3 -m pip install -q --no-deps --no-build-isolation -e . > $d/install.log 2>&1 || tail -5 $d/install.log
timeout 200 python3 results/nvidia-h200/sweeps_v42/launcher_parts/launcher_parts.py 2>&1 | tee $d/launcher_parts.txt | tail -30
