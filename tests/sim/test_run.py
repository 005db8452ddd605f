"""run_simulate: the tables, sidecars and figures it writes, and predictions on a recorded trace."""

import numpy as np
import pandas as pd
import pytest

from occult.shapes import get_shape
from occult.sim.columns import PREDICTION_COLUMNS, SimulateError
from occult.sim.cost_model_json import read_cost_model
from occult.sim.predict import RecordedRequest
from occult.sim.run import run_simulate
from tests.sim.test_measured import fake_sweep, gemm_csv, settings


def test_run_simulate_writes_tables_and_figures(tmp_path):
    path = fake_sweep(tmp_path, "m.csv")
    cfg = settings(measured=(path,), calibration=(path,), gemm_csv=gemm_csv(tmp_path / "gemm.csv"))
    paths = run_simulate(cfg, 0, tmp_path / "out", tmp_path / "fig")
    predictions = pd.read_csv(paths["predictions"])
    assert tuple(predictions.columns) == PREDICTION_COLUMNS
    ok = predictions[predictions["status"] == "ok"]
    assert set(ok["D"]) == {2, 4} and set(ok["method"]) == {"occult", "occult-nd1", "occult-graph", "naive"}
    assert np.allclose(ok.loc[ok["method"] == "naive", "speedup_vs_naive"], 1.0)
    at_sweep_sizes = pd.read_csv(paths["predictions_D4_D8"])
    assert set(at_sweep_sizes["kind"]) == {"prefill", "decode", "train"}
    train = at_sweep_sizes.loc[at_sweep_sizes["kind"] == "train", "status"]
    assert set(train) == {"uncalibrated: no occult-compute train rows in simulate.calibration",
                          "uncalibrated: no naive train points in simulate.calibration"}
    meta = paths["validation"].with_name("validation.csv.meta.json")
    assert meta.exists() and "host" in meta.read_text()
    model, source = read_cost_model(paths["cost_model"])          # the calibrated model, for the placement
    assert model.kernel_tflops is not None and source["calibration"] == [path]
    for key in ("fig_speedup", "fig_validation"):
        assert paths[key].stat().st_size > 1000


def test_predictions_on_a_recorded_trace(tmp_path):
    """A GPU run's routing sample (ids only) is predicted layer by layer with the calibrated model:
    the greedy placement of its clustered co-activation sends a token to fewer devices than the
    naive EP's contiguous one; N_d pruning is unsupported (no logits), and a trace of another
    expert count is refused by name."""
    from occult.routing.profiling import sample_routing

    rng = np.random.default_rng(0)
    shape = get_shape("tiny")                           # E = 8, k = 2

    def clustered(tokens):                              # each token picks one expert pair (0,4), (1,5), ...
        first = rng.integers(0, shape.num_experts, tokens)
        return np.stack([first, (first + 4) % shape.num_experts], axis=1)

    full, profile = tmp_path / "full", tmp_path / "profile"
    full.mkdir(), profile.mkdir()
    for split in ("calibration", "heldout"):
        ids = np.stack([clustered(600), clustered(600)])            # 2 layers
        np.savez(full / f"routing_{split}.npz", ids=ids.astype(np.int16), sources=np.zeros(600, dtype=np.int16),
                 source_names=np.asarray(["text"]), layers=np.array([0, 3]))
        sample_routing(full / f"routing_{split}.npz", profile / f"routing_{split}_sample.npz", 512)
    path = fake_sweep(tmp_path, "m.csv")
    cfg = settings(measured=(path,), calibration=(path,), gemm_csv=gemm_csv(tmp_path / "gemm.csv"))
    paths = run_simulate(cfg, 0, tmp_path / "out", None,
                         recorded=RecordedRequest(profile, "sample", "tiny", None, tmp_path / "trace.csv"))
    table = pd.read_csv(paths["trace"])
    assert set(table["layer"].astype(str)) == {"0", "3", "mean"} and set(table["trace"]) == {"sample"}
    mean = table[(table["layer"].astype(str) == "mean") & (table["status"] == "ok")].set_index(["method", "D", "tokens_per_gpu"])
    occult, naive = mean.loc[("occult", 2, 256)], mean.loc[("naive", 2, 256)]
    assert occult["mean_devices_per_token"] == pytest.approx(1.0) and naive["mean_devices_per_token"] == pytest.approx(2.0)
    assert naive["speedup_vs_naive"] == pytest.approx(1.0)
    assert occult["model_ms"] == pytest.approx(occult["layer_ms"] * occult["moe_layers"], rel=1e-5)   # 6 digits in the CSV
    nd1 = table[table["method"] == "occult-nd1"]
    assert len(nd1) and nd1["status"].str.contains("needs the router's logits").all()
    with pytest.raises(SimulateError, match="routes over 8 experts, shape olmoe has 64"):
        run_simulate(cfg, 0, tmp_path / "out2", None,
                     recorded=RecordedRequest(profile, "sample", "olmoe", None, tmp_path / "t2.csv"))
