"""CPU timings quoted for session 8's fixes (docs/quality.md, workflow/scripts/gpu_quality.sh).

    python examples/time_cpu_fixes.py metrics   # placement metrics: three functions vs trace_metrics
    python examples/time_cpu_fixes.py loads     # 3 concurrent checkpoint loads, default threads vs 1

`loads` saves a randomly initialised model of the upcycled SmolLM2's shape (the committed
`model/config.json` of quality_upcycle_v2_partial, 2.8 GB) to a temporary folder and loads it from
three processes at once, first with torch's default thread count, then with OMP_NUM_THREADS=1.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "results/nvidia-h200/quality_upcycle_v2_partial/model/config.json"
LOAD = ("import time; from transformers import AutoModelForCausalLM; from transformers.utils import logging; "
        "logging.disable_progress_bar(); t = time.perf_counter(); "
        "AutoModelForCausalLM.from_pretrained({path!r}, local_files_only=True, dtype='auto'); "
        "print(round(time.perf_counter() - t, 1))")


def metrics() -> None:
    from occult.routing.placement import (expected_ct, greedy_occult, intra_device_pair_fraction,
                                  max_device_load_over_mean, trace_metrics)

    rng = np.random.default_rng(0)
    heldout, calib = (np.argsort(rng.random((500_000, 64)), axis=1)[:, :8] for _ in range(2))
    placed = greedy_occult(rng.random((64, 64)), 8)
    paths = {
        "three functions": lambda: (expected_ct(heldout, placed), max_device_load_over_mean(heldout, placed, 8),
                                    intra_device_pair_fraction(heldout, placed, 8), expected_ct(calib, placed)),
        "trace_metrics": lambda: (trace_metrics(heldout, placed, 8), expected_ct(calib, placed)),
    }
    for name, run in paths.items():
        start = time.perf_counter()
        for _ in range(5):
            run()
        print(f"{name}: {(time.perf_counter() - start) / 5:.3f} s per (D, method, layer), 500k-token traces")


def loads() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG.parent)).save_pretrained(tmp)
        for threads in (None, "1"):
            env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            if threads:
                env["OMP_NUM_THREADS"] = threads
            procs = [subprocess.Popen([sys.executable, "-c", LOAD.format(path=tmp)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for _ in range(3)]
            seconds = [p.communicate()[0].strip() for p in procs]
            print(f"OMP_NUM_THREADS={threads or 'unset'} on {os.cpu_count()} cores: 3 concurrent loads took {seconds} s")


if __name__ == "__main__":
    {"metrics": metrics, "loads": loads}[sys.argv[1] if len(sys.argv) > 1 else "metrics"]()
