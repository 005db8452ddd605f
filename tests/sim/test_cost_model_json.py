"""The calibrated cost model as JSON: a lossless round trip, the model shipped with the package, and
one error naming a malformed file."""

import math

import numpy as np
import pytest

from occult.sim.columns import SimulateError
from occult.sim.cost_model import CostModel, HostTerms, LinkModel, LogLogCurve, OtherGpuTerms, builtin_alltoall_curve
from occult.sim.cost_model_json import (
    builtin_cost_model,
    cost_model_from_dict,
    cost_model_to_dict,
    read_cost_model,
    write_cost_model,
)


def full_model() -> CostModel:
    """Every field set, tuple keys and infinite rates included."""
    curve = LogLogCurve(np.array([0.5, 4.0, 64.0]), np.array([80.0, 300.0, 610.0]), extend="flat")
    return CostModel(
        link=LinkModel({2: builtin_alltoall_curve(), 8: curve}, 8, 5e7, 0.015),
        kernel_tflops=curve, kernel_train_scale=2.7, grouped_tflops={("fwd", "olmoe"): curve},
        dense_tflops=755.0, hbm_bytes_per_ms=math.inf, kernel_floor_ms=0.14, kernel_stream_bytes_per_ms=2e9,
        other_gpu=OtherGpuTerms(0.01, 3.5, None, 4, 0.27, 16.2), naive_ns_per_pair={"fwd": 12.0},
        pe_per_row_ns=4.0, host={("occult", "fwd", np.int64(2)): HostTerms(0.3, 0.2, 5, "fit on 5 points")},
        kernel_train_tflops=curve, kernel_tflops_by_ffn={1024: curve}, kernel_train_tflops_by_ffn={1408: curve},
        shared_scale={"fwd": 1.1}, shared_host_per_launch_ms={"fwd": 0.004},
        shared_host_by_shape_ms={"fwd": {"qwen": 0.05}}, graph_host_ms={("fwd", 2): 0.02},
        host_shape_ms={("occult", "prefill", 2, "qwen"): -0.01})


def assert_same(a: CostModel, b: CostModel) -> None:
    assert cost_model_to_dict(a) == cost_model_to_dict(b)
    for value in (0.1, 3.0, 1e4):
        assert a.kernel_tflops(value) == b.kernel_tflops(value)
    assert a.host == b.host and a.host_shape_ms == b.host_shape_ms and a.graph_host_ms == b.graph_host_ms
    assert a.other_gpu == b.other_gpu and math.isinf(b.hbm_bytes_per_ms)


def test_round_trip_is_lossless(tmp_path):
    model = full_model()
    path = tmp_path / "cost_model.json"
    write_cost_model(path, model, {"commit": "abc"})
    again, source = read_cost_model(path)
    assert source == {"commit": "abc"}
    assert_same(model, again)
    assert_same(model, read_cost_model(str(path))[0])
    assert_same(model, cost_model_from_dict(cost_model_to_dict(model)))
    assert again.link.alltoall_ms(np.array([[0.0, 1e6], [2e6, 0.0]])) == model.link.alltoall_ms(
        np.array([[0.0, 1e6], [2e6, 0.0]]))


def test_shipped_model_is_calibrated_and_names_its_source():
    model, source = builtin_cost_model()
    assert model.kernel_tflops is not None and model.other_gpu is not None
    assert model.host_for("occult", "fwd", 8) is not None and model.host_for("occult", "train", 2) is not None
    assert source["commit"] and "simulate" in source["made_by"] and source["calibration"]


@pytest.mark.parametrize("text, why", [
    ("{not json", "not valid JSON"),
    ('{"format": 1, "model": []}', "not a cost-model file"),
    ('{"format": 1, "source": {}, "model": {"link": {}}}', "malformed cost model"),
])
def test_malformed_file_gives_one_error_naming_it(tmp_path, text, why):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(SimulateError, match=why) as err:
        read_cost_model(path)
    assert str(path) in str(err.value)
    with pytest.raises(SimulateError, match="does not exist"):
        read_cost_model(tmp_path / "missing.json")


def test_curve_evaluates_arrays_as_points():
    curve = LogLogCurve(np.array([1.0, 10.0, 100.0]), np.array([2.0, 5.0, 7.0]))
    values = np.array([[0.5, 1.0, 3.0], [10.0, 50.0, 400.0]])
    assert np.allclose(curve.many(values), [[curve(v) for v in row] for row in values], rtol=1e-12)
    flat = LogLogCurve(curve.x, curve.y, extend="flat")
    assert flat.many(np.array([1e3]))[0] == flat(1e3) == 7.0
