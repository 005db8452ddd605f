"""Predictions of the placements at the sweep's points: one joinable table per routing, and the
committed pre-registered tables that a future GPU run is checked against."""

from pathlib import Path

import numpy as np
import pytest

from occult.sim.check import check, read_predictions
from occult.sim.columns import PREDICTION_COLUMNS
from occult.sim.cost_model_json import builtin_cost_model
from occult.sim.placement_predictions import DEVICES, KINDS, METHODS, ROUTINGS, SHAPES, routing_predictions
from occult.sim.predict import sweep_points
from tests.sim.test_check import sweep_rows

REPO = Path(__file__).resolve().parents[2]
KEY = ["shape", "method", "kind", "D", "tokens_per_gpu"]


def test_one_routings_table_has_the_prediction_columns_and_one_row_per_point():
    table = routing_predictions("synthetic", builtin_cost_model()[0], shapes=("olmoe",), devices=(2,),
                                kinds=("prefill",), pool_tokens=4096)
    assert tuple(table.columns) == PREDICTION_COLUMNS
    assert not table.duplicated(KEY).any() and len(table) == len(METHODS) * len(sweep_points(("prefill",)))
    ok = table[table["status"] == "ok"].set_index(["method", "tokens_per_gpu"])
    assert set(ok.index.get_level_values(0)) == set(METHODS)
    for tokens in (1024, 16384, 65536):
        assert ok.loc[("occult-latency", tokens), "load_max_over_mean"] < ok.loc[("occult", tokens), "load_max_over_mean"]


def test_a_trace_that_does_not_fit_a_shape_gives_status_rows():
    table = routing_predictions("trace", builtin_cost_model()[0], shapes=("qwen",), devices=(2,), kinds=("prefill",))
    assert len(table) == len(METHODS) * 7 and table["status"].str.contains("cannot be widened to qwen").all()
def committed_tables() -> dict[str, Path]:
    found = {}
    for routing in ROUTINGS:
        files = sorted((REPO / "results" / "preregistered").glob(f"predictions_placement_{routing}_*.csv"))
        assert files, f"no pre-registered placement predictions for routing {routing}"
        found[routing] = files[-1]
    return found


@pytest.mark.parametrize("routing", ROUTINGS)
def test_committed_predictions_cover_the_grid_and_join_a_measured_run(routing):
    path = committed_tables()[routing]
    table = read_predictions(path, "predictions")           # one row per point, or it raises
    assert path.with_name(path.name + ".meta.json").is_file()
    grid = {(s, m, k, d, t) for s in SHAPES for m in METHODS for d in DEVICES for k, t, _ in sweep_points(KINDS)}
    assert set(map(tuple, table[KEY].itertuples(index=False))) == grid
    ok = table[table["status"] == "ok"]
    assert "occult-latency" in set(ok["method"]) and set(ok["D"]) == set(DEVICES)
    measured = sweep_rows(ok, {"occult-latency": 1.0, "occult": 1.1, "naive": 1.0})
    measured["source"] = "fake run"
    joined = check({"preregistered": table}, measured, tolerance=0.15)
    mine = joined[joined["method"] == "occult-latency"]
    assert (mine["status"] == "ok").all() and np.allclose(mine["rel_err"], 0.0)
    assert np.allclose(joined.loc[joined["method"] == "occult", "rel_err"], 1 / 1.1 - 1)       # measured 10% slower
