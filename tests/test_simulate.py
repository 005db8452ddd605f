"""The scale simulator: wire-format byte counts by hand, the bandwidth curve, monotonicity, the
validation table, the sweep's placement reproduced, and bad inputs named."""

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch

from occult.baselines import get_shape
from occult.config import SimulateConfig
from occult.simulate import (
    PREDICTION_COLUMNS,
    VALIDATION_COLUMNS,
    CostModel,
    LinkModel,
    LogLogCurve,
    ShapeTraces,
    SimulateError,
    Throughput,
    alltoall_curves,
    build_cost_model,
    design_alltoall_curve,
    read_measured,
    run_simulate,
    simulate_point,
    sweep_placement,
    traffic,
    validate,
    wire_row_bytes,
)

PLACEMENT = np.array([0, 0, 1, 1])
IDS = np.array([[0, 1], [0, 2], [2, 3]])
SOURCE = np.array([0, 0, 1])
HIDDEN = 64                     # bf16: 128-byte vectors


def settings(**changes) -> SimulateConfig:
    base = SimulateConfig(
        shapes=("tiny",), methods=("occult", "occult-nd1", "naive"), devices=(2, 4), tokens_per_gpu=(64, 256),
        issue8_devices=(2,), gpus_per_node=2, inter_node_gbps=400, inter_node_latency_us=15, pool_tokens=512,
        measured=(), calibration_devices=(1,), alltoall_csv=None, gemm_csv=None, occult_tflops_fwd=450,
        occult_tflops_train=262, naive_tflops_fwd=610, naive_tflops_train=285, dense_tflops=760, tolerance=0.15)
    return dataclasses.replace(base, **changes)


def test_wire_row_bytes_match_the_runtime_format():
    assert wire_row_bytes("dedup", 2048, 2, 8) == (4160, 4096)       # 4096 + 64 B of slots
    assert wire_row_bytes("per_expert", 2048, 2, 1) == (4160, 4096)  # 4104 padded to 64
    assert wire_row_bytes("naive", 2048, 2, 1) == (4096, 4096)
    assert wire_row_bytes("dedup", 64, 2, 2) == (192, 128)           # 128 + 16 → 192
    with pytest.raises(SimulateError, match="mode"):
        wire_row_bytes("bogus", 8, 2, 1)


def test_traffic_dedup_counts_one_row_per_token_and_device():
    t = traffic(IDS, PLACEMENT, 2, "dedup", HIDDEN, source_N=SOURCE)
    np.testing.assert_array_equal(t.rows_SD, [[2, 1], [0, 1]])
    np.testing.assert_array_equal(t.pairs_SD, [[3, 1], [0, 2]])
    assert t.slots == 2
    np.testing.assert_array_equal(t.dispatch_bytes_SD, np.array([[2, 1], [0, 1]]) * 192)
    np.testing.assert_array_equal(t.return_bytes_SD, np.array([[2, 0], [1, 1]]) * 128)
    assert t.mean_devices_per_token == pytest.approx(4 / 3)
    np.testing.assert_array_equal(t.pairs_in_D, [3, 3])
    # sweep accounting of rank 0: 1 remote row out (128 B) + 1 remote pair (8 B); rank 1: 1 row back
    assert t.sweep_bytes_sent(HIDDEN, 2) == pytest.approx(((128 + 8) + 128) / 2)


def test_traffic_per_expert_and_naive_send_one_row_per_pair():
    per_expert = traffic(IDS, PLACEMENT, 2, "per_expert", HIDDEN, source_N=SOURCE)
    naive = traffic(IDS, PLACEMENT, 2, "naive", HIDDEN, source_N=SOURCE)
    for t in (per_expert, naive):
        np.testing.assert_array_equal(t.rows_SD, [[3, 1], [0, 2]])
    np.testing.assert_array_equal(per_expert.dispatch_bytes_SD, np.array([[3, 1], [0, 2]]) * 192)  # 136 → 192
    np.testing.assert_array_equal(naive.dispatch_bytes_SD, np.array([[3, 1], [0, 2]]) * 128)
    assert per_expert.slots == 1


def test_traffic_of_nd1_routing_stays_on_one_device():
    pruned = np.array([[0, 1], [0, 1], [2, 3]])
    t = traffic(pruned, PLACEMENT, 2, "dedup", HIDDEN, source_N=SOURCE)
    np.testing.assert_array_equal(t.rows_SD, [[2, 0], [0, 1]])
    assert t.mean_devices_per_token == 1.0
    assert t.remote(t.dispatch_bytes_SD).sum() == 0


def test_traffic_scaling_and_bad_inputs():
    t = traffic(IDS, PLACEMENT, 2, "dedup", HIDDEN, source_N=SOURCE).scaled(10)
    np.testing.assert_array_equal(t.rows_SD, [[20, 10], [0, 10]])
    with pytest.raises(SimulateError, match="device_of_expert_E"):
        traffic(IDS, np.array([0, 0, 1, 2]), 2, "dedup", HIDDEN)
    with pytest.raises(SimulateError, match="ids_NK"):
        traffic(np.array([[0, 4]]), PLACEMENT, 2, "dedup", HIDDEN)


def test_bandwidth_curve_interpolates_in_log_space():
    curve = LogLogCurve(np.array([1e6, 1e8]), np.array([0.01, 0.1]))
    assert curve(1e6) == pytest.approx(0.01) and curve(1e8) == pytest.approx(0.1)
    assert curve(1e7) == pytest.approx(np.sqrt(0.01 * 0.1))           # geometric midpoint
    assert curve(10.0) == pytest.approx(0.01)                          # latency floor
    assert curve(2e8) == pytest.approx(0.2)                            # best bandwidth beyond
    design = design_alltoall_curve()
    sizes = np.geomspace(1e3, 4e9, 60)
    times = [design(s) for s in sizes]
    assert np.all(np.diff(times) >= 0)
    # 1 GiB buffer on 2 GPUs at 660 GB/s: half of it remote
    assert design(2**29) == pytest.approx(2**30 / 660e9 * 1e3)
    with pytest.raises(SimulateError, match="increasing"):
        LogLogCurve(np.array([2.0, 1.0]), np.array([1.0, 1.0]))


def test_link_model_adds_the_network_between_nodes():
    link = LinkModel({2: design_alltoall_curve()}, gpus_per_node=2, inter_node_bytes_per_ms=50e9 / 1e3,
                     inter_node_latency_ms=0.015)
    bytes_SD = np.full((4, 4), 1e8)
    one_node = LinkModel({2: design_alltoall_curve()}, 4, 50e9 / 1e3, 0.015)
    assert link.alltoall_ms(bytes_SD) == pytest.approx(0.015 + 2e8 / 50e9 * 1e3)
    assert one_node.alltoall_ms(bytes_SD) < link.alltoall_ms(bytes_SD)
    assert link.alltoall_ms(np.zeros((1, 1))) == 0.0


def tiny_cost(overheads=None) -> CostModel:
    shape = get_shape("tiny")
    cost = build_cost_model(settings(), [shape])
    return dataclasses.replace(cost, overheads=overheads or {})


def test_predicted_time_grows_with_tokens_and_dedup_sends_less():
    traces = ShapeTraces(get_shape("tiny"), 2048, seed=0)
    cost = tiny_cost()
    times = [simulate_point(traces, "occult", 2, tokens, "fwd", cost)["layer_ms"] for tokens in (64, 256, 1024, 4096)]
    assert np.all(np.diff(times) > 0)
    exact = simulate_point(traces, "occult", 4, 256, "fwd", cost)
    nd1 = simulate_point(traces, "occult-nd1", 4, 256, "fwd", cost)
    naive = simulate_point(traces, "naive", 4, 256, "fwd", cost)
    assert nd1["mean_devices_per_token"] == 1.0 <= exact["mean_devices_per_token"] <= 2
    assert nd1["dispatch_bytes_per_rank"] < exact["dispatch_bytes_per_rank"]
    assert exact["return_bytes_per_rank"] < naive["return_bytes_per_rank"]
    slow = dataclasses.replace(cost, throughput={k: Throughput(v.level_tflops / 10) for k, v in cost.throughput.items()})
    assert simulate_point(traces, "occult", 2, 256, "fwd", slow)["compute_ms"] == pytest.approx(
        10 * simulate_point(traces, "occult", 2, 256, "fwd", cost)["compute_ms"])


def test_sweep_placement_is_the_sweeps_placement():
    from occult.ep.dist import run_ranks
    from occult.sweep import SyntheticRouter, occult_placement

    shape = get_shape("tiny")

    def in_rank(rank, world):
        return occult_placement(shape, SyntheticRouter.make(shape, 3), world, 3).tolist()

    from_sweep = run_ranks(in_rank, 2, timeout_s=30)[0]
    assert sweep_placement(shape, SyntheticRouter.make(shape, 3), 2, 3).tolist() == from_sweep


def measured_csv(path, rows):
    frame = pd.DataFrame(rows)
    frame["status"] = "ok"
    frame.to_csv(path, index=False)
    return str(path)


def test_validation_table_separates_calibration_and_validation(tmp_path):
    rows = [{"kind": "prefill", "shape": "tiny", "method": m, "D": d, "tokens_per_gpu": t,
             "median_ms": 1.0 + t / 1000 + (0.3 if d == 2 else 0.0)}
            for m in ("occult", "naive") for d in (1, 2) for t in (64, 256, 1024)]
    path = measured_csv(tmp_path / "sweep.csv", rows)
    cfg = settings(measured=(path,))
    measured = read_measured(cfg.measured, cfg.methods)
    traces = {"tiny": ShapeTraces(get_shape("tiny"), cfg.pool_tokens, 0)}
    table, fitted = validate(cfg, traces, build_cost_model(cfg, [get_shape("tiny")]), measured)
    assert tuple(table.columns) == VALIDATION_COLUMNS
    assert len(table) == 12
    assert set(table.loc[table["D"] == 1, "role"]) == {"calibration"}
    assert set(table.loc[table["D"] == 2, "role"]) == {"validation"}
    assert set(fitted.overheads) == {("occult", "fwd"), ("naive", "fwd")}
    calibration = table[table["role"] == "calibration"]
    assert calibration["rel_err"].abs().max() < 0.2
    assert np.allclose(table["rel_err"], (table["predicted_ms"] - table["measured_ms"]) / table["measured_ms"])


def test_run_simulate_writes_tables_and_figures(tmp_path):
    rows = [{"kind": k, "shape": "tiny", "method": m, "D": 1, "tokens_per_gpu": t, "median_ms": 1.0 + t / 500}
            for k in ("prefill", "train") for m in ("occult", "occult-nd1", "naive") for t in (64, 512)]
    cfg = settings(measured=(measured_csv(tmp_path / "m.csv", rows),))
    paths = run_simulate(cfg, 0, tmp_path / "out", tmp_path / "fig")
    predictions = pd.read_csv(paths["predictions"])
    assert tuple(predictions.columns) == PREDICTION_COLUMNS
    ok = predictions[predictions["status"] == "ok"]
    assert set(ok["D"]) == {2, 4} and set(ok["method"]) == {"occult", "occult-nd1", "naive"}
    assert np.allclose(ok.loc[ok["method"] == "naive", "speedup_vs_naive"], 1.0)
    issue8 = pd.read_csv(paths["issue8"])
    assert set(issue8["kind"]) == {"prefill", "decode", "train"}
    assert (paths["validation"].with_name("validation.csv.meta.json")).exists()
    for key in ("fig_speedup", "fig_validation"):
        assert paths[key].stat().st_size > 1000


def test_bad_measured_inputs_are_named(tmp_path):
    with pytest.raises(SimulateError, match="nowhere.csv does not exist"):
        read_measured([str(tmp_path / "nowhere.csv")], ["occult"])
    bad = tmp_path / "bad.csv"
    pd.DataFrame({"shape": ["tiny"], "method": ["occult"]}).to_csv(bad, index=False)
    with pytest.raises(SimulateError, match=r"bad\.csv lacks column\(s\) kind"):
        read_measured([str(bad)], ["occult"])
    a2a = tmp_path / "alltoall.csv"
    pd.DataFrame({"D": [2], "pattern": ["equal"]}).to_csv(a2a, index=False)
    with pytest.raises(SimulateError, match="alltoall_csv: .*alltoall.csv lacks column"):
        alltoall_curves(str(a2a))
