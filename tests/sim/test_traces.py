"""The sweep's routing on the CPU: predicted time grows with tokens, dedup sends less, and the
placements are the sweep's own (greedy and load-aware)."""

import dataclasses

import numpy as np
import pytest

from occult.shapes import get_shape
from occult.sim.columns import SimulateError
from occult.sim.cost_model import LogLogCurve, method_spec
from occult.sim.traces import ShapeTraces, simulate_point
from occult.sim.traffic import wire_row_bytes
from tests.sim.test_cost_model import tiny_cost


def test_predicted_time_grows_with_tokens_and_dedup_sends_less(tmp_path):
    traces = ShapeTraces(get_shape("tiny"), 2048, seed=0)
    cost = tiny_cost(tmp_path)
    times = [simulate_point(traces, "occult", 2, tokens, "fwd", cost)["gpu_ms"] for tokens in (64, 256, 1024, 4096)]
    assert np.all(np.diff(times) > 0)
    exact = simulate_point(traces, "occult", 4, 256, "fwd", cost)
    nd1 = simulate_point(traces, "occult-nd1", 4, 256, "fwd", cost)
    naive = simulate_point(traces, "naive", 4, 256, "fwd", cost)
    graph = simulate_point(traces, "occult-graph", 4, 256, "fwd", cost)
    assert nd1["mean_devices_per_token"] == 1.0 <= exact["mean_devices_per_token"] <= 2
    assert nd1["dispatch_bytes_per_rank"] < exact["dispatch_bytes_per_rank"]
    assert exact["return_bytes_per_rank"] < naive["return_bytes_per_rank"]
    assert graph["dispatch_bytes_per_rank"] == pytest.approx(3 * 256 * wire_row_bytes("dedup", traces.shape.hidden, 2, graph_slots(traces))[0])
    assert graph["layer_ms"] == pytest.approx(graph["gpu_ms"])
    slow = dataclasses.replace(cost, kernel_tflops=LogLogCurve(np.array([4.0]), np.array([0.1]), extend="flat"))
    fast = dataclasses.replace(cost, kernel_tflops=LogLogCurve(np.array([4.0]), np.array([1.0]), extend="flat"))
    assert simulate_point(traces, "occult", 2, 256, "fwd", slow)["kernels_ms"] == pytest.approx(
        10 * simulate_point(traces, "occult", 2, 256, "fwd", fast)["kernels_ms"])


def graph_slots(traces: ShapeTraces) -> int:
    return traces.traffic_at("occult-graph", 4, 256)[0].slots


@pytest.mark.parametrize("method", ["occult", "occult-balanced", "occult-latency"])
def test_the_simulators_placement_is_the_sweeps_placement(method):
    from occult.harness.ranks import run_ranks
    from occult.harness.sweep.inputs import occult_placement

    shape = get_shape("olmoe")
    traces = ShapeTraces(shape, 2048, seed=3)

    def in_rank(rank, world):
        return occult_placement(shape, traces.router, world, 3, balanced=method.endswith("balanced"),
                                latency=method.endswith("latency")).tolist()

    from_sweep = run_ranks(in_rank, 2, timeout_s=60)[0]
    assert traces.placement(method, 2).tolist() == from_sweep
    assert traces.placement(method, 2).tolist() != traces.placement("occult-trivial", 2).tolist()


def test_balanced_methods_use_the_sweeps_load_aware_placement():
    """`-balanced` predicts on occult.harness.sweep's load-aware placement: busiest device <= 1.1x the mean
    pairs of the trace where the greedy one is far above it; bad combinations are refused."""
    import torch

    assert method_spec("occult-graph-balanced").balanced and method_spec("occult-graph-balanced").static
    for bad in ("occult-nd1-balanced", "occult-trivial-balanced"):
        with pytest.raises(SimulateError, match="-balanced is a placement of exact routing"):
            method_spec(bad)
    traces = ShapeTraces(get_shape("olmoe"), 8192, seed=0)

    def busiest_over_mean(method):
        load = torch.bincount(traces.placement(method, 2)[traces.ids(method, 2)].flatten(), minlength=2).float()
        return (load.max() / load.mean()).item()

    assert busiest_over_mean("occult") > 1.5
    assert busiest_over_mean("occult-balanced") <= 1.15
