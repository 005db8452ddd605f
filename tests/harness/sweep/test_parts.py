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
    assert split["grouped_gemm=cublas"] == ["megablocks", "megablocks:mlp_impl=sparse"]
    assert split["tutel"] == ["tutel", "tutel:adaptive_r=0", "tutel:megablocks_size=1", "deepspeed:use_tutel=1"]
    assert not any(name.startswith("megablocks") for name in split[parts.MAIN]) and "deepspeed" in split[parts.MAIN]
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
    assert crashed == ("error: process exited with code 1 during this point (started again after it): "   # the rank's
                       "rank 0 of 1 died (exit code 9) without a result")                               # death, in its words
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
    before = {record["part"]: sum(len(other["methods"]) for other in meta["parts"]
                                  if other["position"] < record["position"]) for record in meta["parts"]}
    placed = frame.dropna(subset=["order_position"])
    offset = placed["method"].map(lambda name: before[parts.process_key(name)])
    assert (placed["point_position"] == placed["order_position"] + offset).all()    # the place over every part
    assert not placed.duplicated(["routing", "batch", "point_position"]).any()
    assert placed["point_position"].between(0, len(methods) - 1).all()
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, out.name + ".meta.json"]   # no part left over


DYING_CHILD = """
import sys
print("RuntimeError: a method's own error, which the sweep survived", file=sys.stderr)
print("step rows written so far: 0")
print({line!r}, file=sys.stderr)
sys.exit(1)
"""


def run_dying_part(tmp_path, line: str, restarts: int = 1):
    child = tmp_path / "child.py"
    child.write_text(DYING_CHILD.format(line=line))
    sequence = [("synthetic", "tiny", 8, "occult"), ("synthetic", "tiny", 8, "naive"), ("synthetic", "tiny", 16, "naive")]
    fields = {"kind": "prefill", "D": 1, "dtype": "float32", "repeats": 1, "warmup": 0, "timing": "step",
              "seq_len": None}
    frame, runs = parts.run_part([sys.executable, str(child)], ["--kind", "prefill"], ["occult", "naive"], sequence,
                                 tmp_path / "part0", 0.0, restarts, fields)
    return frame, runs


def test_a_lost_points_status_carries_the_processs_last_error_line_and_its_stderr_still_shows(tmp_path, capfd):
    line = ("occult.sweep: error: CUDA error: an illegal memory access was encountered | Search for "
            "`cudaErrorIllegalAddress' in the docs | CUDA kernel errors might be asynchronously reported "
            "[AcceleratorError at occult/harness/ranks.py:229 _release_before_teardown]")
    frame, runs = run_dying_part(tmp_path, line)
    assert [run["returncode"] for run in runs] == [1, 1]
    status = frame.set_index(["tokens_per_gpu", "method"])["status"]
    error = "CUDA error: an illegal memory access was encountered"
    assert status[(8, "occult")] == f"error: process exited with code 1 during this point (started again after it): {error}"
    assert status[(8, "naive")] == status[(16, "naive")] == f"error: process exited with code 1 before this point: {error}"
    captured = capfd.readouterr()
    assert captured.err.count(line) == 2 and captured.err.count("a method's own error") == 2   # passed on, both runs
    assert captured.out.count("step rows written so far: 0") == 2


def test_a_long_error_line_is_cut_and_a_process_without_one_keeps_the_plain_status(tmp_path):
    frame, _ = run_dying_part(tmp_path, "occult.sweep: error: " + "x" * 500 + " [RuntimeError]", restarts=0)
    assert frame["status"].str.len().max() <= parts.STATUS_CHARS
    assert frame["status"].str.startswith("error: process exited with code 1 before this point: xxx").all()
    assert frame["status"].str.endswith("...").all()
    frame, _ = run_dying_part(tmp_path, "Segmentation fault", restarts=0)
    assert (frame["status"] == "error: process exited with code 1 before this point").all()
