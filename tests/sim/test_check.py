"""The pre-registered check (occult.sim.check): measured rows joined with the pre-registered
predictions point by point, the errors, the statuses of points it cannot compare, and bad inputs."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from occult.sim.check import CHECK_COLUMNS, check, read_predictions, read_sweeps, summary
from occult.sim.columns import SimulateError

REPO = Path(__file__).resolve().parents[2]
PREREGISTERED = REPO / "results/preregistered/predictions_D4_D8_90f63fd.csv"


def sweep_rows(predictions: pd.DataFrame, factor: dict[str, float], ct_shift: float = 0.0) -> pd.DataFrame:
    """Sweep-format rows for every ok prediction of `factor`'s methods: time = prediction × factor,
    E[C_T] shifted by `ct_shift`, pairs_received_max from the predicted load."""
    rows = predictions[(predictions["status"] == "ok") & predictions["method"].isin(factor)].copy()
    top_k = rows["shape"].map({"olmoe": 8, "qwen": 4, "deepseek": 6})
    return pd.DataFrame({
        "machine": "test", "commit": "abc", "kind": rows["kind"], "shape": rows["shape"], "method": rows["method"],
        "D": rows["D"], "tokens_per_gpu": rows["tokens_per_gpu"], "batch": rows["batch"],
        "median_ms": rows["layer_ms"] * rows["method"].map(factor), "p10_ms": np.nan, "p90_ms": np.nan,
        "mean_devices_per_token": rows["mean_devices_per_token"] + ct_shift,
        "pairs_received_max": rows["load_max_over_mean"] * rows["tokens_per_gpu"] * top_k,
        "top_k": top_k, "status": "ok", "timing": "step"})


@pytest.fixture(scope="module")
def predictions():
    return read_predictions(PREREGISTERED, "predictions")


def test_errors_and_routing_facts_per_point(predictions):
    measured = sweep_rows(predictions, {"naive": 1.0, "occult": 1.25, "occult-nd2": 0.9}, ct_shift=0.1)
    table = check({"pre": predictions}, measured.assign(source="m.csv"), tolerance=0.15)
    assert list(table.columns) == list(CHECK_COLUMNS) and len(table) == len(measured)
    assert (table["status"] == "ok").all()
    errors = table.groupby("method")["rel_err"].median().to_dict()
    assert errors["naive"] == pytest.approx(0.0, abs=1e-9)
    assert errors["occult"] == pytest.approx(1 / 1.25 - 1, rel=1e-6)      # predicted 20% below measured
    assert errors["occult-nd2"] == pytest.approx(1 / 0.9 - 1, rel=1e-6)
    within = table.groupby("method")["within_tolerance"].all().to_dict()
    assert within == {"naive": True, "occult": False, "occult-nd2": True}
    np.testing.assert_allclose(table["load_rel_err"], 0, atol=1e-9)
    np.testing.assert_allclose(table["ct_rel_err"], -0.1 / table["measured_ct"], rtol=1e-9)
    occult = table[table["method"] == "occult"].set_index(["shape", "kind", "D", "tokens_per_gpu"])
    naive = table[table["method"] == "naive"].set_index(["shape", "kind", "D", "tokens_per_gpu"])
    speedup = (naive["measured_ms"] / occult["measured_ms"]).dropna()
    np.testing.assert_allclose(occult.loc[speedup.index, "measured_speedup_vs_naive"], speedup)
    totals = summary(table)
    row = totals[(totals["method"] == "occult")].iloc[0]
    assert row["within_tolerance"] == 0 and row["median_abs_err"] == pytest.approx(0.2)


def test_points_that_cannot_be_compared_say_why(predictions):
    base = sweep_rows(predictions[(predictions["shape"] == "olmoe") & (predictions["D"] == 4)
                                  & (predictions["kind"] == "prefill") & (predictions["tokens_per_gpu"] == 1024)],
                      {"naive": 1.0, "occult": 1.0})
    megablocks = base.iloc[[0]].assign(method="megablocks", median_ms=0.5)
    off_grid = base.iloc[[0]].assign(tokens_per_gpu=3000)                     # no such point predicted
    qwen8 = base.iloc[[0]].assign(shape="qwen", D=8)                          # predicted: unsupported (60 experts)
    table = check({"pre": predictions}, pd.concat([base, megablocks, off_grid, qwen8]).assign(source="m.csv"), 0.15)
    status = table.set_index(["method", "shape", "D", "tokens_per_gpu"])["status"]
    assert status[("megablocks", "olmoe", 4, 1024)] == "not simulated"
    assert status[("naive", "olmoe", 4, 3000)] == "no prediction at this point"
    assert status[("naive", "qwen", 8, 1024)].startswith("predicted: unsupported")
    mb = table[table["method"] == "megablocks"].iloc[0]
    naive_ms = base.loc[base["method"] == "naive", "median_ms"].iloc[0]
    assert mb["measured_speedup_vs_naive"] == pytest.approx(naive_ms / 0.5)   # methods compared on measured times
    assert len(summary(table)) == 2          # naive and occult at the one compared point


def test_routing_only_compares_no_time(predictions):
    measured = sweep_rows(predictions[predictions["D"] == 8], {"occult": 30.0}).assign(source="cpu.csv")
    table = check({"pre": predictions}, measured, 0.15, routing_only=True)
    assert (table["status"] == "routing only").all()
    assert table["predicted_ms"].isna().all() and table["rel_err"].isna().all()
    totals = summary(table)
    assert totals["within_tolerance"].isna().all() and (totals["median_abs_load_err"] < 1e-9).all()


def test_bad_inputs_are_named(tmp_path, predictions):
    twice = tmp_path / "twice.csv"
    pd.concat([predictions.iloc[:2], predictions.iloc[:1]]).to_csv(twice, index=False)
    with pytest.raises(SimulateError, match="twice.csv holds .* twice"):
        read_predictions(twice, "simulate.prediction_check.predictions")
    lacking = tmp_path / "lacking.csv"
    predictions.drop(columns=["layer_ms"]).to_csv(lacking, index=False)
    with pytest.raises(SimulateError, match="simulate.prediction_check.predictions: .*lacking.csv lacks column.*layer_ms"):
        read_predictions(lacking, "simulate.prediction_check.predictions")
    none_ok = tmp_path / "none_ok.csv"
    sweep_rows(predictions.iloc[:4], {"naive": 1.0, "occult": 1.0}).assign(status="timeout").to_csv(none_ok, index=False)
    with pytest.raises(SimulateError, match="prediction_check: no ok, step-timed row in .*none_ok.csv"):
        read_sweeps([none_ok], "prediction_check")
    with pytest.raises(SimulateError, match="prediction_check: .*absent.csv does not exist"):
        read_sweeps([tmp_path / "absent.csv"], "prediction_check")


def write_results(tmp_path: Path, sweeps: list[Path]) -> Path:
    """A results tree with one run whose simulator.yaml names `sweeps` (its files) for the check."""
    run = tmp_path / "results" / "gpu-a" / "d4_v1"
    run.mkdir(parents=True, exist_ok=True)
    for sweep in sweeps:
        if sweep.exists():
            sweep.replace(run / sweep.name)
    (run / "simulator.yaml").write_text(yaml.safe_dump({"prediction_check": [s.name for s in sweeps]}))
    (run.parent / "index.csv").write_text("run,kind,commit,target,status,superseded_by,in_tree,used_by,note\n"
                                          "d4_v1,sweeps,abc1234,snakemake x,current,,yes,simulator,D=4 sweeps\n")
    return run.parent.parent


def test_command_writes_the_table_summary_and_figure_or_one_error(tmp_path, predictions):
    sweep = tmp_path / "sweep_prefill_D4.csv"
    sweep_rows(predictions[(predictions["D"] == 4) & (predictions["kind"] == "prefill")],
               {"naive": 1.0, "occult": 1.1}).to_csv(sweep, index=False)
    out, figure, log = tmp_path / "out", tmp_path / "check.png", tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "occult.sim.check", "--config", str(REPO / "config/config.yaml"),
           "--results", str(write_results(tmp_path, [sweep])), "--current", str(PREREGISTERED), "--out", str(out),
           "--figure", str(figure), "--log-json", str(log)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = pd.read_csv(out / "prediction_check.csv")
    assert set(table["predictions"]) == {"preregistered", "current"} and (table["status"] == "ok").all()
    assert figure.stat().st_size > 10_000 and (out / "prediction_check_summary.csv").exists()
    assert "occult" in proc.stdout and json.loads(log.read_text().splitlines()[-1])["event"] == "done"

    bad_out = tmp_path / "bad"
    write_results(tmp_path, [tmp_path / "absent.csv"])
    cmd[cmd.index("--out") + 1] = str(bad_out)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "simulator.yaml: prediction_check[0]" in proc.stderr and "absent.csv" in proc.stderr
    assert not bad_out.exists()
