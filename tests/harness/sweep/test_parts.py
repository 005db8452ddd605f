"""A sweep split into processes (`occult.harness.sweep.parts`): which methods share a process, the
parts' seeded order, and a CPU run whose Tutel part dies: every point still has a row."""

from __future__ import annotations

import json
import sys
import textwrap

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


def test_a_part_that_dies_leaves_error_rows_and_the_others_are_merged(tmp_path):
    launcher = tmp_path / "launch.py"
    launcher.write_text(textwrap.dedent("""
        import os, sys
        if "tutel" in sys.argv:            # the Tutel part dies before writing a row
            sys.exit(7)
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    """))
    out = tmp_path / "runs" / "sweep_decode_D1_synthetic.csv"
    methods = ["occult", "naive", "megablocks:grouped_gemm=cutlass", "tutel", "deepspeed:use_tutel=1"]
    code = parts.main(["--device", "cpu", "--dtype", "float32", "--D", "1", "--kind", "decode", "--shapes", "tiny",
                       "--sizes", "2", "5", "--repeats", "1", "--warmup", "0", "--routings", "synthetic", "uniform",
                       "--methods", *methods, "--launch", f"{sys.executable} {launcher}", "--out", str(out)])
    assert code == 0
    frame = pd.read_csv(out)
    assert list(frame.columns) == list(settings.COLUMNS)
    assert len(frame) == 2 * len(methods) * 2                     # routings x methods x sizes
    assert not frame.duplicated(["routing", "method", "batch"]).any()
    status = frame.groupby("method")["status"].agg(set)
    assert status["occult"] == status["naive"] == {"ok"}
    assert status["tutel"] == status["deepspeed:use_tutel=1"] == {"error: process exited with code 7 before this point"}
    assert len(status["megablocks:grouped_gemm=cutlass"]) == 1      # its own process ran (unavailable on a CPU)
    assert frame.loc[frame["method"] == "naive", "command"].str.contains("--methods occult naive").all()

    meta = json.loads((out.parent / (out.name + ".meta.json")).read_text())
    ran = {record["part"]: record for record in meta["parts"]}
    assert set(ran) == {parts.MAIN, "grouped_gemm=cutlass", "tutel"}
    assert ran["tutel"]["returncode"] == 7 and ran[parts.MAIN]["returncode"] == 0
    assert sorted(record["position"] for record in meta["parts"]) == [0, 1, 2]
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, out.name + ".meta.json"]   # no part left over
