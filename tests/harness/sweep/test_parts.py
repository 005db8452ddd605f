"""A sweep split into processes (`occult.harness.sweep.parts`): which methods share a process, the
parts' seeded order, and a CPU run whose Tutel part dies: every point still has a row."""

from __future__ import annotations

import json
import sys

import pandas as pd

from occult.harness.sweep import parts, settings


def test_methods_that_cannot_share_a_process_get_their_own():
    split = parts.split_methods(settings.FAIR_METHODS)
    assert list(split)[0] == parts.MAIN
    assert split["grouped_gemm=cutlass"] == ["megablocks:grouped_gemm=cutlass"]
    assert split["tutel"] == ["tutel", "tutel:adaptive_r=0", "tutel:megablocks_size=1", "deepspeed:use_tutel=1"]
    assert "megablocks" in split[parts.MAIN] and "megablocks:mlp_impl=sparse" in split[parts.MAIN]
    assert sorted(sum(split.values(), [])) == sorted(settings.FAIR_METHODS)
    assert parts.split_methods(["occult", "naive"]) == {parts.MAIN: ["occult", "naive"]}
    keys = list(split)
    orders = {tuple(parts.part_order(keys, seed, "prefill", 1)) for seed in range(8)}
    assert len(orders) > 1 and all(sorted(order) == sorted(keys) for order in orders)
    assert parts.part_order(keys, 3, "prefill", 1) == parts.part_order(keys, 3, "prefill", 1)


LAUNCHER = """
import os, runpy, sys
from pathlib import Path
args = sys.argv[1:]                       # -m occult.harness.sweep ...
if "tutel" in args:                       # the Tutel part dies at once, every time
    sys.exit(7)
marker = Path({marker!r})
if "naive" in args and not marker.exists():
    import occult.harness.sweep.points as points
    real = points.run_point
    def crash(run, name, size):           # the main part dies once, on one point
        if (run.routing, name, size) == ("synthetic", "naive", 5):
            marker.touch()
            os._exit(9)
        return real(run, name, size)
    points.run_point = crash
sys.argv = ["occult.harness.sweep", *args[2:]]
runpy.run_module("occult.harness.sweep", run_name="__main__")
"""


def test_a_part_that_dies_is_started_again_and_every_point_gets_a_row(tmp_path):
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER.format(marker=str(tmp_path / "crashed")))
    out = tmp_path / "runs" / "sweep_decode_D1_synthetic.csv"
    methods = ["occult", "naive", "megablocks:grouped_gemm=cutlass", "tutel", "deepspeed:use_tutel=1"]
    code = parts.main(["--device", "cpu", "--dtype", "float32", "--D", "1", "--kind", "decode", "--shapes", "tiny",
                       "--sizes", "2", "5", "--repeats", "1", "--warmup", "0", "--routings", "synthetic", "uniform",
                       "--methods", *methods, "--launch", f"{sys.executable} {launcher}", "--restarts", "1",
                       "--out", str(out)])
    assert code == 0
    frame = pd.read_csv(out)
    assert list(frame.columns) == list(settings.COLUMNS)
    assert len(frame) == 2 * len(methods) * 2                     # routings x methods x sizes, each once
    assert not frame.duplicated(["routing", "method", "batch"]).any()
    status = frame.set_index(["routing", "method", "batch"])["status"]
    crashed = status[("synthetic", "naive", 5)]
    assert crashed.startswith("error: process exited with code ") and crashed.endswith("during this point "
                                                                                     "(started again after it)")
    main = frame[frame["method"].isin(["occult", "naive"])].drop(frame.index[(frame["routing"] == "synthetic")
                                                                           & (frame["method"] == "naive")
                                                                           & (frame["batch"] == 5)])
    assert (main["status"] == "ok").all(), main[["routing", "method", "batch", "status"]]
    tutel = frame[frame["method"].isin(["tutel", "deepspeed:use_tutel=1"])]["status"]
    assert tutel.str.startswith("error: process exited with code 7 ").all()
    assert tutel.str.endswith("during this point (started again after it)").sum() == 1   # the first, then
    assert tutel.str.endswith("before this point").sum() == len(tutel) - 1               # the restart gave up
    assert len(frame.loc[frame["method"] == "megablocks:grouped_gemm=cutlass", "status"].unique()) == 1

    meta = json.loads((out.parent / (out.name + ".meta.json")).read_text())
    ran = {record["part"]: record for record in meta["parts"]}
    assert set(ran) == {parts.MAIN, "grouped_gemm=cutlass", "tutel"}
    assert [p["returncode"] != 0 for p in ran[parts.MAIN]["processes"]] == [True, False]
    assert "--skip-points" in ran[parts.MAIN]["processes"][1]["command"]
    assert [p["returncode"] for p in ran["tutel"]["processes"]] == [7, 7]
    assert sorted(record["position"] for record in meta["parts"]) == [0, 1, 2]
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, out.name + ".meta.json"]   # no part left over
