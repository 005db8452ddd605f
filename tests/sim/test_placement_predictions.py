"""Predictions of the placements at the sweep's points: one joinable table per routing, and the
committed pre-registered tables that a future GPU run is checked against."""

from occult.sim.columns import PREDICTION_COLUMNS
from occult.sim.cost_model_json import builtin_cost_model
from occult.sim.placement_predictions import METHODS, routing_predictions
from occult.sim.predict import sweep_points

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
