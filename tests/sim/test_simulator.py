"""The scale simulator: wire-format byte counts by hand, the bandwidth curve, method names, the
host/GPU time terms and their fits, monotonicity, the validation table (roles, replicates), the
sweep's placement reproduced, and bad inputs named."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from occult.harness.baselines import get_shape
from occult.config import SimulateConfig
from occult.sim.simulator import (
    PREDICTION_COLUMNS,
    VALIDATION_COLUMNS,
    CostModel,
    HostTerms,
    LinkModel,
    LogLogCurve,
    MeasuredPoint,
    OtherGpuTerms,
    ShapeTraces,
    SimulateError,
    alltoall_curves,
    build_cost_model,
    cost_summary,
    design_alltoall_curve,
    expert_weight_bytes,
    fit_host,
    fit_weight_streaming,
    graph_replay_host,
    host_scale_column,
    host_scale_of_set,
    host_terms,
    kernel_rows,
    layer_time,
    measured_points,
    method_spec,
    read_measured,
    recorded_traffic,
    run_simulate,
    shared_elementwise_bytes,
    shared_expert_ms,
    shared_host_per_launch,
    shared_launches,
    shared_scales,
    simulate_point,
    static_traffic,
    traffic,
    validate,
    validation_table,
    weight_read_ms,
    wire_row_bytes,
)

PLACEMENT = np.array([0, 0, 1, 1])
IDS = np.array([[0, 1], [0, 2], [2, 3]])
SOURCE = np.array([0, 0, 1])
HIDDEN = 64                     # bf16: 128-byte vectors


def settings(**changes) -> SimulateConfig:
    base = SimulateConfig(
        shapes=("tiny",), methods=("occult", "occult-nd1", "occult-graph", "naive"), devices=(2, 4),
        tokens_per_gpu=(64, 256), issue8_devices=(2,), gpus_per_node=2, inter_node_gbps=400, inter_node_latency_us=15,
        pool_tokens=512, measured=(), calibration=(), alltoall_csv=None, gemm_csv=None, gemm_min_rows_per_expert=1,
        dense_tflops=760, tolerance=0.15)
    return dataclasses.replace(base, **changes)


def gemm_csv(path) -> str:
    """A grouped-GEMM curve for the tiny shape (commbench columns)."""
    shape = get_shape("tiny")
    rows = [{"shape": "tiny", "experts": 8, "hidden": shape.hidden, "ffn": shape.ffn, "rows_per_expert": r, "pass": p,
             "tflops": t * (1 if p == "fwd" else 0.8)}
            for r, t in ((4, 1.0), (64, 10.0), (1024, 100.0)) for p in ("fwd", "fwd+bwd")]
    pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


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


def tiny_cost(tmp_path) -> CostModel:
    """Measured curves of the tiny shape plus hand-set calibrated terms."""
    cost = build_cost_model(settings(gemm_csv=gemm_csv(tmp_path / "gemm.csv")))
    return dataclasses.replace(
        cost, kernel_tflops=LogLogCurve(np.array([4.0, 64.0]), np.array([1.0, 10.0]), extend="flat"),
        kernel_train_scale=3.5, other_gpu=OtherGpuTerms(0.01, 5.0, 2.0, 1), naive_ns_per_pair={"fwd": 20.0},
        host={("occult", "fwd", 2): HostTerms(0.5, 1.0, 1, "test"), ("naive", "fwd", 1): HostTerms(0.1, 0.2, 1, "test")})


def test_method_names_map_to_families_and_modes():
    assert method_spec("naive").family == "naive" and method_spec("naive").contiguous
    spec = method_spec("occult-nd2-graph")
    assert (spec.family, spec.mode, spec.max_devices, spec.static) == ("occult-graph", "dedup", 2, True)
    assert method_spec("occult-pe").mode == "per_expert" and method_spec("occult-pe").family == "occult-pe"
    assert method_spec("occult-static").family == "occult-static"
    assert method_spec("occult-trivial").contiguous and method_spec("occult-compute").family == "occult-compute"
    for bad in ("megablocks", "occult-bogus", "occult-pe-graph"):
        with pytest.raises(SimulateError, match="method"):
            method_spec(bad)


def test_layer_time_is_host_before_the_sync_plus_the_longer_of_host_and_gpu_after(tmp_path):
    cost = tiny_cost(tmp_path)
    eager, graph = method_spec("occult"), method_spec("occult-graph")
    assert layer_time(0.3, eager, "fwd", 2, cost)["layer_ms"] == pytest.approx(0.5 + 1.0)    # host-bound
    assert layer_time(4.0, eager, "fwd", 2, cost)["layer_ms"] == pytest.approx(0.5 + 4.0)    # GPU-bound
    assert layer_time(4.0, eager, "fwd", 8, cost)["layer_ms"] == pytest.approx(4.5)          # D=2 terms used at D=8
    assert cost.host_for("occult", "fwd", 8).source.startswith("D=2 terms")
    assert layer_time(4.0, graph, "fwd", 2, cost)["layer_ms"] == 4.0                         # replay: GPU only
    assert np.isnan(layer_time(4.0, eager, "fwd", 1, cost)["layer_ms"])                      # nothing at D ≤ 1
    assert cost.missing(eager, "fwd", 1).startswith("uncalibrated")
    assert cost.missing(eager, "train", 2).startswith("uncalibrated")


def test_fit_host_recovers_known_terms_and_splits_only_what_it_can():
    gpu = np.array([0.1, 0.5, 2.0, 4.0, 8.0])
    measured = 0.7 + np.maximum(1.2, gpu)
    pre, post, loss = fit_host(gpu, measured)
    assert pre == pytest.approx(0.7, abs=0.005) and post == pytest.approx(1.2, abs=0.005) and loss < 1e-5
    # all host-bound: only pre + post is measured; the split comes from the D that fixes it
    small = np.array([0.1, 0.2])
    fits = {1: (pre, post, gpu, 5), 2: (*fit_host(small, np.array([3.0, 3.0]))[:2], small, 2)}
    terms = host_terms("occult", "fwd", fits)
    assert terms[("occult", "fwd", 2)].pre_ms + terms[("occult", "fwd", 2)].post_ms == pytest.approx(3.0, abs=0.01)
    assert terms[("occult", "fwd", 2)].pre_ms / 3.0 == pytest.approx(0.7 / 1.9, abs=0.01)
    assert "split of D=1" in terms[("occult", "fwd", 2)].source


def test_host_terms_scale_with_the_host_probe(tmp_path):
    """A slower host (s > 1) stretches pre, post and the shared-expert launches, never the GPU time;
    fit_host recovers the typical host's terms from points measured on hosts of different speeds
    (and misfits them when told every host was typical)."""
    cost = tiny_cost(tmp_path)
    eager = method_spec("occult")
    slow = layer_time(0.3, eager, "fwd", 2, cost, shared_host_ms=0.2, host_scale=2.0)
    assert slow["layer_ms"] == pytest.approx(2 * 0.5 + 2 * (1.0 + 0.2))
    assert (slow["host_pre_ms"], slow["host_post_ms"], slow["host_shared_ms"]) == pytest.approx((1.0, 2.0, 0.4))
    assert layer_time(4.0, eager, "fwd", 2, cost, host_scale=2.0)["layer_ms"] == pytest.approx(1.0 + 4.0)
    gpu = np.array([0.1, 0.5, 2.0, 4.0, 8.0, 0.1, 0.5])
    scale = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.8, 1.8])
    measured = scale * 0.7 + np.maximum(scale * 1.2, gpu)
    pre, post, loss = fit_host(gpu, measured, host_scale=scale)
    assert pre == pytest.approx(0.7, abs=0.005) and post == pytest.approx(1.2, abs=0.005) and loss < 1e-5
    assert fit_host(gpu, measured)[2] > 1e-3


def test_host_scale_is_the_probe_over_the_sets_median_and_auto_prefers_the_launch_probe():
    frame = pd.DataFrame({"host_probe_us": [200.0, 400.0, np.nan, 300.0],
                          "host_launch_us": [np.nan, np.nan, np.nan, np.nan]})
    np.testing.assert_allclose(host_scale_column(frame["host_probe_us"]), [200 / 300, 400 / 300, 1.0, 1.0])
    np.testing.assert_allclose(host_scale_column(frame["host_launch_us"]), [1.0] * 4)     # no probe: typical
    for name, column in (("python", "host_probe_us"), ("launch", "host_launch_us")):
        frame[f"host_scale_{name}"] = host_scale_column(frame[column])
    np.testing.assert_allclose(host_scale_of_set(frame, "auto"), frame["host_scale_python"])   # only Python probed
    np.testing.assert_allclose(host_scale_of_set(frame, "none"), [1.0] * 4)
    frame["host_launch_us"] = [100.0, 150.0, 200.0, np.nan]
    frame["host_scale_launch"] = host_scale_column(frame["host_launch_us"])
    np.testing.assert_allclose(host_scale_of_set(frame, "auto"), [100 / 150, 1.0, 200 / 150, 1.0])
    with pytest.raises(SimulateError, match="host_speed"):
        host_scale_of_set(frame, "cpu")


def test_static_and_recorded_traffic():
    base = traffic(IDS, PLACEMENT, 2, "dedup", HIDDEN, source_N=np.array([0, 1, 1]))
    fixed = static_traffic(base, HIDDEN)
    np.testing.assert_array_equal(fixed.rows_SD, np.full((2, 2), 1.5))          # T rows to every device
    np.testing.assert_array_equal(fixed.pairs_SD, base.pairs_SD)
    shape = get_shape("olmoe")
    rec = recorded_traffic(2, 1024, "dedup", shape, bytes_sent=100 * (4160 + 4096), mean_devices_per_token=1.5,
                           pairs_received_max=5000)
    assert rec.rows_SD[0, 1] == pytest.approx(100) and rec.rows_SD.sum(1)[0] == pytest.approx(1024 * 1.5)
    np.testing.assert_allclose(rec.pairs_in_D, [5000, 5000])
    with pytest.raises(SimulateError, match="recorded traffic"):
        recorded_traffic(1, 1024, "dedup", shape, 0.0, 1.0, 10.0)


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


@pytest.mark.parametrize("method", ["occult", "occult-balanced"])
def test_the_simulators_placement_is_the_sweeps_placement(method):
    from occult.harness.ranks import run_ranks
    from occult.harness.sweep.inputs import occult_placement

    shape = get_shape("olmoe")
    traces = ShapeTraces(shape, 2048, seed=3)

    def in_rank(rank, world):
        return occult_placement(shape, traces.router, world, 3, balanced=method.endswith("balanced")).tolist()

    from_sweep = run_ranks(in_rank, 2, timeout_s=60)[0]
    assert traces.placement(method, 2).tolist() == from_sweep
    assert traces.placement(method, 2).tolist() != traces.placement("occult-trivial", 2).tolist()


def measured_csv(path, rows):
    frame = pd.DataFrame(rows)
    frame["status"] = "ok"
    frame.to_csv(path, index=False)
    return str(path)


def fake_sweep(tmp_path, name: str, shift_d2: float = 0.3) -> str:
    """Measured rows of the tiny shape: eager occult/naive at D = 1, 2, graph and compute at D = 2."""
    rows = []
    for d in (1, 2):
        for t in (64, 256, 1024):
            for m in ("occult", "occult-nd1", "naive"):
                rows.append({"kind": "prefill", "shape": "tiny", "method": m, "D": d, "tokens_per_gpu": t,
                             "median_ms": 1.0 + t / 1000 + (shift_d2 if d == 2 else 0.0)})
            if d == 2:
                rows.append({"kind": "prefill", "shape": "tiny", "method": "occult-graph", "D": 2, "tokens_per_gpu": t,
                             "median_ms": 0.01 + t / 20000})
                rows.append({"kind": "prefill", "shape": "tiny", "method": "occult-compute", "D": 2,
                             "tokens_per_gpu": t, "median_ms": 0.001 + t / 100000, "pairs_received_max": 2 * t})
    return measured_csv(tmp_path / name, rows)


def test_validation_table_separates_calibration_and_validation(tmp_path):
    path = fake_sweep(tmp_path, "sweep.csv")
    cfg = settings(measured=(path,), calibration=(f"{path}@tokens_per_gpu=64,1024",),
                   gemm_csv=gemm_csv(tmp_path / "gemm.csv"))
    measured = read_measured(cfg.measured, cfg.calibration)
    traces = {"tiny": ShapeTraces(get_shape("tiny"), cfg.pool_tokens, 0)}
    table, fitted = validate(cfg, traces, build_cost_model(cfg), measured)
    assert tuple(table.columns) == VALIDATION_COLUMNS
    assert len(table) == 24
    assert set(table.loc[table["tokens_per_gpu"] == 256, "role"]) == {"validation"}
    assert set(table.loc[table["tokens_per_gpu"] != 256, "role"]) == {"calibration"}
    assert {("occult", "fwd", 1), ("occult", "fwd", 2), ("naive", "fwd", 1), ("naive", "fwd", 2)} <= set(fitted.host)
    assert fitted.kernel_tflops is not None and fitted.other_gpu is not None and "fwd" in fitted.naive_ns_per_pair
    assert np.allclose(table["rel_err"], (table["predicted_ms"] - table["measured_ms"]) / table["measured_ms"])
    fitted_rows = table[(table["role"] == "calibration") & (table["family"] == "occult") & (table["D"] == 1)]
    # GPU work is negligible there: the host-bound fit is one constant inside the measured range
    assert len(fitted_rows) == 4 and fitted_rows["predicted_ms"].nunique() <= 2
    assert fitted_rows["measured_ms"].min() < fitted_rows["predicted_ms"].min() <= fitted_rows["predicted_ms"].max() \
        < fitted_rows["measured_ms"].max()
    # at D = 1, occult and occult-nd1 are the same computation: replicates of each other
    d1 = table[(table["D"] == 1) & (table["method"] != "naive")]
    assert set(d1["replicates"]) == {2} and np.allclose(d1["replicate_ratio"], 1.0) and d1["reachable"].all()
    assert set(table.loc[(table["D"] == 2) & (table["method"] == "occult"), "replicates"]) == {1}


def test_rows_without_the_shared_experts_are_not_replicates_of_rows_with_them():
    from types import SimpleNamespace

    from occult.sim.simulator import replicate_key

    def row(method: str, shared_ffn: float) -> SimpleNamespace:
        return SimpleNamespace(kind="decode", shape="qwen", method=method, D=1, tokens_per_gpu=8, routing="synthetic",
                               shared_ffn=shared_ffn)

    shared = get_shape("qwen").shared_ffn
    assert replicate_key(row("occult", shared)) != replicate_key(row("occult", 0))
    assert replicate_key(row("occult", float("nan"))) == replicate_key(row("occult-nd1", shared))   # old files: with


def test_each_shape_and_sweep_kind_gets_its_own_host_offset(tmp_path):
    """The family's host terms are one fit over every shape and sweep kind of a pass; each (family,
    kind, D, shape) then takes the median residual of its host-bound calibration rows as an offset
    on `pre`. Here decode steps pay 0.25 ms more host than prefill calls: one (pre, post) misses both
    kinds' validation rows, the offsets put each kind on its own level. Other shapes, kinds without
    terms and D without calibration below them get no offset."""
    rows = [{"kind": kind, "shape": "tiny", "method": method, "D": 1, "tokens_per_gpu": t,
             "median_ms": 1.0 + (0.25 if kind == "decode" else 0.0)}
            for kind in ("prefill", "decode") for method in ("occult", "naive") for t in (1, 4, 16)]
    for t in (64, 256, 1024):       # the kernel curve and Occult's other GPU work
        rows.append({"kind": "prefill", "shape": "tiny", "method": "occult-graph", "D": 2, "tokens_per_gpu": t,
                     "median_ms": 0.01 + t / 20000})
        rows.append({"kind": "prefill", "shape": "tiny", "method": "occult-compute", "D": 2, "tokens_per_gpu": t,
                     "median_ms": 0.001 + t / 100000, "pairs_received_max": 2 * t})
    path = measured_csv(tmp_path / "kinds.csv", rows)
    cfg = settings(measured=(path,), calibration=(f"{path}@tokens_per_gpu=1,16,64,256,1024",),
                   gemm_csv=gemm_csv(tmp_path / "gemm.csv"))
    traces = {"tiny": ShapeTraces(get_shape("tiny"), cfg.pool_tokens, 0)}
    table, fitted = validate(cfg, traces, build_cost_model(cfg), read_measured(cfg.measured, cfg.calibration))
    for family in ("occult", "naive"):
        decode, prefill = (fitted.host_shape_for(family, kind, 1, "tiny") for kind in ("decode", "prefill"))
        assert decode - prefill == pytest.approx(0.25, abs=1e-9)
        assert fitted.host_shape_for(family, "decode", 4, "tiny") == decode          # D=1's offset at D=4
    assert fitted.host_shape_for("occult", "decode", 1, "olmoe") == 0.0
    assert fitted.host_shape_for("occult", "train", 1, "tiny") == 0.0               # no training terms
    summary = cost_summary(fitted)["host_offset_ms_by_shape"]
    assert summary["occult/decode/D=1/tiny"] - summary["occult/prefill/D=1/tiny"] == pytest.approx(0.25, abs=1e-3)
    checked = table[(table["role"] == "validation") & table["family"].isin(["occult", "naive"])]
    assert len(checked) == 4 and np.allclose(checked["rel_err"], 0.0, atol=1e-6)
    plain = dataclasses.replace(fitted, host_shape_ms={})
    errors = validation_table(measured_points(read_measured(cfg.measured, cfg.calibration), traces)[0], plain,
                              0.15)
    errors = errors[(errors["role"] == "validation") & errors["family"].isin(["occult", "naive"])]
    assert (errors["rel_err"].abs() > 0.05).all()
    # a negative offset larger than pre takes the rest from post, and never takes either below zero
    eager, terms = method_spec("occult"), {("occult", "fwd", 1): HostTerms(0.3, 1.0, 1, "test")}
    for offset, pre, post in ((-0.5, 0.0, 0.8), (-100.0, 0.0, 0.0), (0.2, 0.5, 1.0)):
        moved = dataclasses.replace(fitted, host=terms, host_shape_ms={("occult", "decode", 1, "tiny"): offset})
        out = layer_time(0.1, eager, "fwd", 1, moved, shape="tiny", kind="decode")
        assert (out["host_pre_ms"], out["host_post_ms"]) == pytest.approx((pre, post))
        assert out["layer_ms"] == pytest.approx(pre + max(post, 0.1))


def test_validation_points_do_not_move_the_calibration(tmp_path):
    """Changing a validation point's measurement changes its error, never the fitted terms."""
    fits = []
    for shift in (0.3, 5.0):
        path = fake_sweep(tmp_path, f"sweep{shift}.csv")
        frame = pd.read_csv(path)
        frame.loc[frame["tokens_per_gpu"] == 256, "median_ms"] += shift
        frame.to_csv(path, index=False)
        cfg = settings(measured=(path,), calibration=(f"{path}@tokens_per_gpu=64,1024",),
                       gemm_csv=gemm_csv(tmp_path / "gemm.csv"))
        traces = {"tiny": ShapeTraces(get_shape("tiny"), cfg.pool_tokens, 0)}
        fits.append(validate(cfg, traces, build_cost_model(cfg), read_measured(cfg.measured, cfg.calibration))[1])
    assert fits[0].host == fits[1].host and fits[0].naive_ns_per_pair == fits[1].naive_ns_per_pair
    assert fits[0].host_shape_ms == fits[1].host_shape_ms and fits[0].host_shape_ms
    assert fits[0].other_gpu == fits[1].other_gpu


def test_run_simulate_writes_tables_and_figures(tmp_path):
    path = fake_sweep(tmp_path, "m.csv")
    cfg = settings(measured=(path,), calibration=(path,), gemm_csv=gemm_csv(tmp_path / "gemm.csv"))
    paths = run_simulate(cfg, 0, tmp_path / "out", tmp_path / "fig")
    predictions = pd.read_csv(paths["predictions"])
    assert tuple(predictions.columns) == PREDICTION_COLUMNS
    ok = predictions[predictions["status"] == "ok"]
    assert set(ok["D"]) == {2, 4} and set(ok["method"]) == {"occult", "occult-nd1", "occult-graph", "naive"}
    assert np.allclose(ok.loc[ok["method"] == "naive", "speedup_vs_naive"], 1.0)
    issue8 = pd.read_csv(paths["issue8"])
    assert set(issue8["kind"]) == {"prefill", "decode", "train"}
    assert set(issue8.loc[issue8["kind"] == "train", "status"]) == {"uncalibrated: no occult-compute train rows in "
                                                                    "simulate.calibration",
                                                                    "uncalibrated: no naive train points in "
                                                                    "simulate.calibration"}
    meta = paths["validation"].with_name("validation.csv.meta.json")
    assert meta.exists() and "host" in meta.read_text()
    for key in ("fig_speedup", "fig_validation"):
        assert paths[key].stat().st_size > 1000


def test_bad_measured_inputs_are_named(tmp_path):
    with pytest.raises(SimulateError, match="nowhere.csv does not exist"):
        read_measured([str(tmp_path / "nowhere.csv")])
    bad = tmp_path / "bad.csv"
    pd.DataFrame({"shape": ["tiny"], "method": ["occult"]}).to_csv(bad, index=False)
    with pytest.raises(SimulateError, match=r"bad\.csv lacks column\(s\) kind"):
        read_measured([str(bad)])
    good = fake_sweep(tmp_path, "good.csv")
    with pytest.raises(SimulateError, match="simulate.calibration: .*bad.csv is not one of simulate.measured"):
        read_measured([good], [str(bad)])
    with pytest.raises(SimulateError, match="tokens_per_gpu=N"):
        read_measured([good], [f"{good}@batch=3"])
    a2a = tmp_path / "alltoall.csv"
    pd.DataFrame({"D": [2], "pattern": ["equal"]}).to_csv(a2a, index=False)
    with pytest.raises(SimulateError, match="alltoall_csv: .*alltoall.csv lacks column"):
        alltoall_curves(str(a2a))


def test_entry_selectors_and_folders_choose_the_rows(tmp_path):
    """`$folder` expands; `@methods=` keeps a file's rows of those methods; bad entries are named."""
    from occult.config import ConfigError

    path = fake_sweep(tmp_path, "sweep.csv")
    folders = {"run": str(tmp_path)}
    naive_only = read_measured(["$run/sweep.csv@methods=naive"], ["$run/sweep.csv@tokens_per_gpu=64"], folders)
    assert set(naive_only["method"]) == {"naive"} and len(naive_only) == 6
    assert set(naive_only.loc[naive_only["tokens_per_gpu"] == 64, "role"]) == {"calibration"}
    assert set(naive_only.loc[naive_only["tokens_per_gpu"] != 64, "role"]) == {"validation"}
    assert set(naive_only["source"]) == {path}
    both = read_measured([path], [f"{path}@methods=occult@tokens_per_gpu=64,256"])
    chosen = both[both["role"] == "calibration"]
    assert set(chosen["method"]) == {"occult"} and set(chosen["tokens_per_gpu"]) == {64, 256}
    with pytest.raises(ConfigError, match=r"simulate.measured: '\$nope/sweep.csv' names folder \$nope"):
        read_measured(["$nope/sweep.csv"], [], folders)
    with pytest.raises(SimulateError, match="simulate.calibration: .*expected FILE"):
        read_measured([path], [f"{path}@tokens_per_gpu=a"])
    with pytest.raises(SimulateError, match="simulate.measured: .*unknown option 'bogus'"):
        read_measured([f"{path}@methods=occult-bogus"])
    with pytest.raises(SimulateError, match="listed twice"):
        read_measured([path, f"{path}@methods=naive"])
    with pytest.raises(SimulateError, match="selects no ok, step-timed Occult / naive row"):
        read_measured([f"{path}@tokens_per_gpu=7"])


def test_config_folders_point_every_entry_at_one_run(tmp_path):
    """The repository's config resolves; an unknown $folder or a reused history name is a ConfigError."""
    import yaml

    from occult.config import ConfigError, load_config

    cfg = load_config("config/config.yaml")
    files = cfg.simulate.input_files()
    assert files and all("$" not in f and "@" not in f for f in files)
    assert any(f.startswith(cfg.simulate.folders["ep"]) for f in files)
    raw = yaml.safe_load(open("config/config.yaml"))
    raw["simulate"]["measured"] = [*raw["simulate"]["measured"], "$elsewhere/x.csv"]
    with pytest.raises(ConfigError, match=r"simulate.measured: '\$elsewhere/x.csv' names folder \$elsewhere"):
        load_config(raw)
    raw = yaml.safe_load(open("config/config.yaml"))
    raw["simulate"]["history"] = [{"name": "current", "measured": ["a.csv"], "calibration": []}]
    with pytest.raises(ConfigError, match="simulate.history: set names"):
        load_config(raw)
    assert any(f.startswith(cfg.simulate.folders["v15"]) and "noshared" in f for f in files)     # shared_ab files
    raw = yaml.safe_load(open("config/config.yaml"))
    raw["simulate"]["shared_ab"] = [["a.csv", "b.csv", "c.csv"]]
    with pytest.raises(ConfigError, match="simulate.shared_ab"):
        load_config(raw)
    assert cfg.simulate.kernel_stream_csv in files                      # the streaming rate's file
    raw = yaml.safe_load(open("config/config.yaml"))
    raw["simulate"]["kernel_stream_gbps"] = 2600
    with pytest.raises(ConfigError, match="simulate.kernel_stream_csv: set it or simulate.kernel_stream_gbps"):
        load_config(raw)


def streaming_csv(path, rates_gbps: dict[str, float], intercept_ms: float = 0.08, extra: list | None = None) -> str:
    """`occult-compute-graph` uniform rows whose time is intercept + the expected active experts'
    weight bytes / rate (1-16 tokens), plus a plateau row at 512 tokens that the fit must leave out."""
    rows = []
    for name, rate in rates_gbps.items():
        shape = get_shape(name)
        for tokens in (1, 2, 4, 8, 16, 512):
            active = shape.num_experts * (1 - (1 - shape.top_k / shape.num_experts) ** tokens)
            ms = intercept_ms + active * expert_weight_bytes(shape, shape.ffn) / (rate * 1e6)
            rows.append({"status": "ok", "method": "occult-compute-graph", "routing": "uniform", "shape": name,
                         "tokens_per_gpu": tokens, "median_ms": ms if tokens <= 16 else 0.4})
    pd.DataFrame(rows + (extra or [])).to_csv(path, index=False)
    return str(path)


def test_the_streaming_rate_is_fitted_from_the_kernels_alone(tmp_path):
    """fit_weight_streaming recovers each shape's rate and intercept from decode-sized rows only;
    the cost model takes the median over shapes where simulate.kernel_stream_csv is set; rows of
    another method, routing or status do not count; unusable files name the field and the file."""
    other = {"status": "ok", "method": "occult-graph", "routing": "uniform", "shape": "olmoe", "tokens_per_gpu": 4,
             "median_ms": 9.0}
    path = streaming_csv(tmp_path / "k.csv", {"olmoe": 2600.0, "qwen": 2400.0, "deepseek": 2800.0}, extra=[other])
    fits = {fit["shape"]: fit for fit in fit_weight_streaming(path)}
    assert {s: f["rate_gbps"] for s, f in fits.items()} == pytest.approx({"olmoe": 2600, "qwen": 2400, "deepseek": 2800})
    assert all(f["intercept_ms"] == pytest.approx(0.08) and f["rows"] == 5 for f in fits.values())
    cost = build_cost_model(settings(kernel_stream_csv=path))
    assert cost.kernel_stream_bytes_per_ms == pytest.approx(2600e9 / 1e3)
    assert cost_summary(cost)["kernel_stream_gbps"] == pytest.approx(2600)
    assert build_cost_model(settings(kernel_stream_gbps=3000)).kernel_stream_bytes_per_ms == pytest.approx(3000e6)
    one_size = tmp_path / "one.csv"
    pd.read_csv(path).query("tokens_per_gpu == 4 or tokens_per_gpu == 512").to_csv(one_size, index=False)
    with pytest.raises(SimulateError, match=r"simulate.kernel_stream_csv: .*one.csv has deepseek rows at one size"):
        fit_weight_streaming(one_size)
    flat = tmp_path / "flat.csv"
    pd.read_csv(path).assign(median_ms=0.3).to_csv(flat, index=False)
    with pytest.raises(SimulateError, match="does not grow with its weight bytes"):
        fit_weight_streaming(flat)
    with pytest.raises(SimulateError, match="no ok occult-compute-graph rows with uniform routing"):
        fit_weight_streaming(path, max_tokens=0)
    with pytest.raises(SimulateError, match=r"simulate.kernel_stream_csv: .*missing.csv does not exist"):
        build_cost_model(settings(kernel_stream_csv=str(tmp_path / "missing.csv")))


def test_weights_set_a_floor_under_small_batches():
    """Decode-sized calls wait on the active experts' weights (bytes / HBM), large ones on FLOPs."""
    shape = get_shape("olmoe")
    ids = np.array([[e for e in range(8)]])                     # one token, experts 0..7
    one = traffic(ids, np.zeros(64, dtype=np.int64), 1, "dedup", shape.hidden)
    assert one.active_experts_D.tolist() == [8.0]
    cost = CostModel(LinkModel({2: design_alltoall_curve()}, 8, 1e9, 0.0), LogLogCurve(np.array([1.0]),
                     np.array([400.0]), extend="flat"), 3.0, {}, 760.0, hbm_bytes_per_ms=4e9,
                     other_gpu=OtherGpuTerms(0.0, 0.0, 1.0, 0))
    from occult.sim.simulator import gpu_components

    spec = method_spec("occult-graph")
    floor = 8 * 3 * shape.hidden * shape.ffn * 2 / 4e9
    math_one = 8 * 6 * shape.hidden * shape.ffn / 400e12 * 1e3
    assert gpu_components(one, shape, spec, "fwd", cost, 1)["kernels_ms"] == pytest.approx(floor + math_one)
    assert gpu_components(one, shape, spec, "train", cost, 1)["kernels_ms"] == pytest.approx(3 * floor + 3 * math_one)
    no_floor = dataclasses.replace(cost, hbm_bytes_per_ms=float("inf"))
    assert gpu_components(one, shape, spec, "fwd", no_floor, 1)["kernels_ms"] < floor / 50
    # the expert kernels' latency floor sits above the weight reads (× 3 passes in fwd+bwd)
    latency = dataclasses.replace(cost, kernel_floor_ms=0.1)
    assert gpu_components(one, shape, spec, "fwd", latency, 1)["kernels_ms"] == pytest.approx(floor + 0.1)
    assert gpu_components(one, shape, spec, "train", latency, 1)["kernels_ms"] == pytest.approx(3 * (floor + 0.1))
    # small calls stream their weights at their own measured rate (kernel_stream_bytes_per_ms), below HBM's
    streamed = dataclasses.replace(latency, kernel_stream_bytes_per_ms=2e9)
    assert gpu_components(one, shape, spec, "fwd", streamed, 1)["kernels_ms"] == pytest.approx(2 * floor + 0.1)
    assert streamed.stream_bytes_per_ms == 2e9 and latency.stream_bytes_per_ms == 4e9
    many = traffic(np.random.default_rng(0).integers(0, 64, (65536, 8)), np.zeros(64, dtype=np.int64), 1, "dedup",
                   shape.hidden)
    flops_ms = 65536 * 8 * 6 * shape.hidden * shape.ffn / 400e12 * 1e3
    # large calls: the math dominates; the weights are read once more on top of it
    assert gpu_components(many, shape, spec, "fwd", cost, 65536)["kernels_ms"] == pytest.approx(flops_ms + 64 * floor / 8)
    assert gpu_components(many, shape, spec, "fwd", streamed, 65536)["kernels_ms"] == pytest.approx(flops_ms + 64 * floor / 8)


def test_per_expert_rows_get_their_own_rate_and_history_sets_validate_apart(tmp_path):
    """A per_expert row rate is fitted from calibration rows only; a history set is its own table."""
    rows = []
    for t in (64, 256, 1024, 4096):
        for m in ("occult-pe", "occult-graph", "occult-compute"):
            base = {"occult-pe": 2.0 + t / 500, "occult-graph": 0.01 + t / 20000, "occult-compute": 0.001 + t / 100000}
            rows.append({"kind": "prefill", "shape": "tiny", "method": m, "D": 2, "tokens_per_gpu": t,
                         "median_ms": base[m], "pairs_received_max": 2 * t})
    rates = []
    for shift in (0.0, 3.0):
        frame = pd.DataFrame(rows)
        frame.loc[frame["tokens_per_gpu"] == 256, "median_ms"] += shift
        path = measured_csv(tmp_path / f"pe{shift}.csv", frame.to_dict("records"))
        cfg = settings(measured=(path,), calibration=(f"{path}@tokens_per_gpu=64,1024,4096",))
        traces = {"tiny": ShapeTraces(get_shape("tiny"), cfg.pool_tokens, 0)}
        fitted = validate(cfg, traces, build_cost_model(cfg), read_measured(cfg.measured, cfg.calibration))[1]
        rates.append(fitted.pe_per_row_ns)
    assert rates[0] is not None and rates[0] > 0 and rates[0] == rates[1]
    history = ({"name": "old", "measured": [path], "calibration": [path]},)
    cfg = settings(measured=(path,), calibration=(f"{path}@tokens_per_gpu=64,1024,4096",), history=history)
    paths = run_simulate(cfg, 0, tmp_path / "out", None)
    old = pd.read_csv(paths["history"])
    assert list(old.columns) == ["set", *VALIDATION_COLUMNS] and set(old["set"]) == {"old"}
    assert set(old["role"]) == {"calibration"} and len(old) == len(pd.read_csv(paths["validation"]))


def test_balanced_methods_use_the_sweeps_load_aware_placement():
    """`-balanced` predicts on occult.harness.sweep's load-aware placement: busiest device <= 1.1x the mean
    pairs of the trace where the greedy one is far above it; bad combinations are refused."""
    import torch

    from occult.sim.simulator import ShapeTraces, SimulateError, method_spec

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


def test_kernel_floor_and_train_other_work_come_from_calibration_rows_only(tmp_path):
    """Graph replays smaller than every `-compute` row fit the expert kernels' latency floor;
    fwd+bwd graph rows of two sizes fit their own fixed + per-row other work; neither moves when a
    validation measurement does. A grouped-GEMM file without its work columns is named."""
    fits = []
    for shift in (0.0, 2.0):
        rows = []
        for t in (16, 64, 256, 1024, 4096):
            rows.append({"kind": "prefill", "shape": "tiny", "method": "occult-graph", "D": 2, "tokens_per_gpu": t,
                         "median_ms": 0.15 + t / 20000 + (shift if t == 64 else 0.0)})
            if t >= 256:
                rows.append({"kind": "prefill", "shape": "tiny", "method": "occult-compute", "D": 2,
                             "tokens_per_gpu": t, "median_ms": 0.001 + t / 100000, "pairs_received_max": 2 * t})
        rows.append({"kind": "train", "shape": "tiny", "method": "occult-compute", "D": 2, "tokens_per_gpu": 512,
                     "median_ms": 3.2 * (0.001 + 512 / 100000), "pairs_received_max": 2 * 512})
        for t in (512, 2048, 8192):
            rows.append({"kind": "train", "shape": "tiny", "method": "occult-graph", "D": 2, "tokens_per_gpu": t,
                         "median_ms": 0.3 + t / 5000 + (shift if t == 2048 else 0.0)})
        path = measured_csv(tmp_path / f"floor{shift}.csv", rows)
        cfg = settings(measured=(path,), calibration=(f"{path}@tokens_per_gpu=16,256,1024,4096,512,8192",))
        traces = {"tiny": ShapeTraces(get_shape("tiny"), cfg.pool_tokens, 0)}
        table, fitted = validate(cfg, traces, build_cost_model(cfg), read_measured(cfg.measured, cfg.calibration))
        fits.append(fitted)
    assert set(table.loc[table["tokens_per_gpu"].isin([64, 2048]), "role"]) == {"validation"}
    assert fits[0].kernel_floor_ms > 0 and fits[0].other_gpu.train_per_row_ns is not None
    assert fits[0].kernel_floor_ms == fits[1].kernel_floor_ms and fits[0].other_gpu == fits[1].other_gpu
    bad = tmp_path / "gemm.csv"
    pd.DataFrame([{"shape": "tiny", "rows_per_expert": 64, "pass": "fwd", "tflops": 1.0}]).to_csv(bad, index=False)
    with pytest.raises(SimulateError, match=r"simulate.gemm_csv: .*gemm.csv lacks column\(s\) experts, hidden, ffn"):
        build_cost_model(settings(gemm_csv=str(bad)))


def test_kernel_floor_prefers_shapes_without_a_shared_expert(tmp_path):
    """A small replay followed by the shared expert's eager launches can be host-bound; the latency
    floor then comes from the shapes without one (here `tiny`, where `tiny-shared`'s small replays
    are 1 ms slower), and from the others only when no such shape was measured."""
    def floor(shapes):
        rows = []
        for name in shapes:
            for t in (16, 256, 1024, 4096):
                slow = 1.0 if name == "tiny-shared" and t == 16 else 0.0
                rows.append({"kind": "prefill", "shape": name, "method": "occult-graph", "D": 2, "tokens_per_gpu": t,
                             "median_ms": 0.15 + t / 20000 + slow})
                if t >= 256:
                    rows.append({"kind": "prefill", "shape": name, "method": "occult-compute", "D": 2, "tokens_per_gpu": t,
                                 "median_ms": 0.001 + t / 100000, "pairs_received_max": 2 * t})
        path = measured_csv(tmp_path / f"{'_'.join(shapes)}.csv", rows)
        cfg = settings(shapes=shapes, measured=(path,), calibration=(path,))
        traces = {n: ShapeTraces(get_shape(n), cfg.pool_tokens, 0) for n in shapes}
        return validate(cfg, traces, build_cost_model(cfg), read_measured(cfg.measured, cfg.calibration))[1].kernel_floor_ms

    plain, both, shared_only = floor(("tiny",)), floor(("tiny", "tiny-shared")), floor(("tiny-shared",))
    assert plain > 0 and both == pytest.approx(plain, abs=0.01)      # not the median with +1 ms
    assert shared_only > plain + 0.5


def test_predictions_on_a_recorded_trace(tmp_path):
    """A GPU run's routing sample (ids only) is predicted layer by layer with the calibrated model:
    the greedy placement of its clustered co-activation sends a token to fewer devices than the
    naive EP's contiguous one; N_d pruning is unsupported (no logits), and a trace of another
    expert count is refused by name."""
    from occult.routing.profiling import sample_routing
    from occult.sim.simulator import RecordedRequest

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
    assert occult["model_ms"] == pytest.approx(occult["layer_ms"] * occult["moe_layers"])
    nd1 = table[table["method"] == "occult-nd1"]
    assert len(nd1) and nd1["status"].str.contains("needs the router's logits").all()
    with pytest.raises(SimulateError, match="routes over 8 experts, shape olmoe has 64"):
        run_simulate(cfg, 0, tmp_path / "out2", None,
                     recorded=RecordedRequest(profile, "sample", "olmoe", None, tmp_path / "t2.csv"))


def test_fwd_bwd_kernels_get_their_own_curve_from_two_or_more_sizes(tmp_path):
    """One fwd+bwd `-compute` size gives one time ratio to the forward curve; two or more sizes give
    the fwd+bwd kernels their own curve, which then predicts a size between them (here the
    backward's relative cost falls 4x from the small to the large call, which no single ratio fits)."""
    def run(train_sizes):
        rows = [{"kind": "prefill", "shape": "tiny", "method": "occult-compute", "D": 2, "tokens_per_gpu": t,
                 "median_ms": t / 100000, "pairs_received_max": 2 * t} for t in (256, 1024, 4096)]
        for t, ratio in ((512, 8.0), (2048, 4.0), (8192, 2.0)):     # log-linear in size
            rows.append({"kind": "train", "shape": "tiny", "method": "occult-compute", "D": 2, "tokens_per_gpu": t,
                         "median_ms": ratio * t / 100000, "pairs_received_max": 2 * t})
        path = measured_csv(tmp_path / f"train{len(train_sizes)}.csv", rows)
        sizes = ",".join(str(t) for t in (256, 1024, 4096, *train_sizes))
        cfg = settings(measured=(path,), calibration=(f"{path}@tokens_per_gpu={sizes}",), hbm_gbps=None)
        traces = {"tiny": ShapeTraces(get_shape("tiny"), cfg.pool_tokens, 0)}
        table, fitted = validate(cfg, traces, build_cost_model(cfg), read_measured(cfg.measured, cfg.calibration))
        middle = table[(table["kind"] == "train") & (table["tokens_per_gpu"] == 2048)].iloc[0]
        assert middle["role"] == "validation"
        return fitted, middle

    one, middle_one = run((8192,))
    assert one.kernel_train_scale is not None and one.kernel_train_tflops is None
    assert abs(middle_one["rel_err"]) > 0.15            # one ratio, taken at the large call, misses
    two, middle_two = run((512, 8192))
    assert two.kernel_train_tflops is not None and len(two.kernel_train_tflops.x) == 2
    # the rest of the error is the trace's busiest-device pairs against the rows' recorded ones
    assert abs(middle_two["rel_err"]) < 0.12 and abs(middle_two["rel_err"]) < abs(middle_one["rel_err"]) / 3


def test_kernel_curves_are_per_expert_width_when_the_calibration_has_two_widths(tmp_path):
    """Compute rows of OLMoE (F = 1024) at 400 TFLOP/s and Qwen (F = 1408) at 200: one curve pooled
    over both zig-zags between the widths and misses the middle sizes; a curve per width predicts
    them. With one width the pooled curve is the only one (no per-width entries)."""
    rate = {"olmoe": 400.0, "qwen": 200.0}

    def run(shapes):
        rows = []
        for name in shapes:
            shape = get_shape(name)
            for t in (256, 1024, 4096):
                pairs = t * shape.top_k
                ms = pairs * 6.0 * shape.hidden * shape.ffn / (rate[name] * 1e12) * 1e3
                rows.append({"kind": "prefill", "shape": name, "method": "occult-compute", "D": 1, "tokens_per_gpu": t,
                             "median_ms": ms, "pairs_received_max": pairs, "shared_ffn": 0})
        path = measured_csv(tmp_path / f"{'_'.join(shapes)}.csv", rows)
        cfg = settings(shapes=tuple(shapes), measured=(path,), calibration=(f"{path}@tokens_per_gpu=256,4096",),
                       hbm_gbps=None)
        traces = {name: ShapeTraces(get_shape(name), cfg.pool_tokens, 0) for name in shapes}
        table, fitted = validate(cfg, traces, build_cost_model(cfg), read_measured(cfg.measured, cfg.calibration))
        return table[table["role"] == "validation"].set_index("shape"), fitted

    middle, fitted = run(["olmoe", "qwen"])
    assert set(fitted.kernel_tflops_by_ffn) == {1024, 1408}
    assert (middle["rel_err"].abs() < 0.02).all()
    pooled = dataclasses.replace(fitted, kernel_tflops_by_ffn={})
    assert fitted.kernel_curve(1024)(1.0) != pooled.kernel_curve(1024)(1.0)     # the pooled one mixes widths
    one, fitted_one = run(["olmoe"])
    assert fitted_one.kernel_tflops_by_ffn == {} and abs(one.loc["olmoe", "rel_err"]) < 0.02


def test_shared_expert_elementwise_bytes_match_the_sweeps_shared_expert():
    """The model's element-wise HBM bytes of the shared expert equal what the sweep's `SharedExpert`
    (and the step's `y + shared(x)`) reads and writes in its non-GEMM ops, counted under a dispatch
    mode on the CPU; the term adds bytes / HBM rate to the shared expert's time (x 3 in fwd+bwd)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from occult.harness.sweep.inputs import SharedExpert

    gemms = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.linear.default,
             torch.ops.aten.t.default, torch.ops.aten.slice.Tensor, torch.ops.aten.view.default,
             torch.ops.aten._unsafe_view.default, torch.ops.aten.expand.default}

    class ElementwiseBytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func not in gemms:
                tensors = [a for a in args if isinstance(a, torch.Tensor)] + [out]
                ElementwiseBytes.total += sum(t.numel() * t.element_size() for t in tensors)
            return out

    tokens = 16
    for name in ("tiny-shared", "tiny"):
        shape = get_shape(name)
        if not shape.shared_ffn:
            assert shared_elementwise_bytes(shape, tokens) == 0.0
            continue
        module = SharedExpert(shape, 0, torch.device("cpu"), torch.bfloat16)
        x, y = torch.randn(tokens, shape.hidden, dtype=torch.bfloat16), torch.randn(tokens, shape.hidden, dtype=torch.bfloat16)
        with torch.no_grad(), ElementwiseBytes():
            _ = y + module(x)
        # the [T, 1] sigmoid gate's own reads and writes are the only bytes the model leaves out
        assert ElementwiseBytes.total - shared_elementwise_bytes(shape, tokens) == 3 * tokens * 2
    qwen = get_shape("qwen")
    hbm = 4300e9 / 1e3
    extra = shared_expert_ms(qwen, 16384, "fwd", 755, hbm) - max(
        2 * 3 * qwen.hidden * qwen.shared_ffn * 16384 / 755e12 * 1e3, 0.0)
    assert extra == pytest.approx(shared_elementwise_bytes(qwen, 16384) / hbm)
    assert shared_expert_ms(qwen, 16384, "train", 755, hbm) == pytest.approx(3 * shared_expert_ms(qwen, 16384, "fwd", 755, hbm))


def test_kernel_curve_is_net_of_the_whole_shared_expert_model(tmp_path):
    """`-compute` rows that include a shared expert calibrate the kernel curve net of the same
    shared-expert time the layer is priced with (GEMMs and element-wise passes), so a measured rate
    comes back unchanged."""
    shape = get_shape("tiny-shared")          # 8 experts: all active at these sizes
    hbm = 4300e9 / 1e3
    rows = []
    for t in (256, 1024, 4096):
        pairs = t * shape.top_k
        ms = (pairs * 6.0 * shape.hidden * shape.ffn / 3e12 * 1e3 + shared_expert_ms(shape, t, "fwd", 760, hbm)
              + weight_read_ms(shape.num_experts, shape, "fwd", hbm))      # every expert is active here
        rows.append({"kind": "prefill", "shape": "tiny-shared", "method": "occult-compute", "D": 1, "tokens_per_gpu": t,
                     "median_ms": ms, "pairs_received_max": pairs})
    path = measured_csv(tmp_path / "c.csv", rows)
    cfg = settings(shapes=("tiny-shared",), measured=(path,), calibration=(path,), hbm_gbps=4300)
    cost = build_cost_model(cfg)
    traces = {"tiny-shared": ShapeTraces(shape, cfg.pool_tokens, 0)}
    points, _ = measured_points(read_measured(cfg.measured, cfg.calibration), traces)
    fitted = kernel_rows(points, "fwd", cost)
    assert [round(t, 6) for _, t, _ in fitted] == [3, 3, 3]


def shared_ab_files(tmp_path, scale: dict[str, float], name: str = "ab",
                    host_per_launch: dict[str, float] | None = None) -> list[str]:
    """A graph-replay A/B of the qwen shape: with its shared expert each row is the same MoE time plus
    `scale[pass]` x the modelled shared expert; rows below the A/B size floor are off by 10x. Host
    time: 0.03 ms for the replay plus, with the shared expert, `host_per_launch[pass]` x its launches."""
    shape = get_shape("qwen")
    hbm = 4300e9 / 1e3
    host_per_launch = host_per_launch or {"fwd": 0.01, "train": 0.02}
    files = []
    for shared in (True, False):
        rows = []
        for kind, pass_, sizes in (("prefill", "fwd", (1024, 4096, 16384)), ("train", "train", (1024, 4096, 8192))):
            for t in sizes:
                extra = shared_expert_ms(shape, t, pass_, 760, hbm) * (scale[pass_] if t >= 4096 else 10.0)
                host = 0.03 + (shared_launches(shape, pass_) * host_per_launch[pass_] if shared else 0.0)
                for method in ("occult-graph", "occult"):        # eager rows carry host time: not read
                    rows.append({"kind": kind, "shape": "qwen", "method": method, "D": 1, "tokens_per_gpu": t,
                                 "median_ms": 1.0 + t / 1e4 + (extra if shared else 0.0) + (0.5 if method == "occult" else 0),
                                 "host_ms": host + (0.7 if method == "occult" else 0.0),
                                 "shared_ffn": shape.shared_ffn if shared else 0})
        files.append(measured_csv(tmp_path / f"{name}_{'shared' if shared else 'noshared'}.csv", rows))
    return files


def test_shared_expert_scale_is_measured_from_graph_replay_ab_rows(tmp_path):
    """The A/B difference of graph replays over the modelled shared expert, per pass, from the
    GPU-bound sizes only; the layer and the kernel curve's net rows are priced with it."""
    pair = shared_ab_files(tmp_path, {"fwd": 1.25, "train": 1.4})
    scales, points = shared_scales([pair], 760, 4300e9 / 1e3)
    assert scales == pytest.approx({"fwd": 1.25, "train": 1.4})
    assert sorted({p["tokens_per_gpu"] for p in points}) == [4096, 8192, 16384]
    cfg = settings(dense_tflops=760, hbm_gbps=4300, shared_ab=(tuple(pair),))
    cost = build_cost_model(cfg)
    shape = get_shape("qwen")
    assert cost.shared_ms(shape, 4096, "train") == pytest.approx(1.4 * shared_expert_ms(shape, 4096, "train", 760, 4300e9 / 1e3))
    assert cost_summary(cost)["shared_expert_scale_by_pass"] == pytest.approx({"fwd": 1.25, "train": 1.4})
    assert build_cost_model(settings()).shared_ms(shape, 4096, "fwd") == shared_expert_ms(shape, 4096, "fwd", 760)


def test_shared_expert_launches_are_counted_on_the_sweeps_module():
    """The ops `occult.harness.sweep.inputs.SharedExpert` adds to a call: Qwen's sigmoid gate adds its own GEMM,
    sigmoid and product; the backward adds more than the forward; no shared expert, no ops."""
    qwen, deepseek = get_shape("qwen"), get_shape("deepseek")
    # forward: gate_up (t, mm), 2 slices, silu, product, down (t, mm), the sum into the output = 9
    assert shared_launches(deepseek, "fwd") == 9
    assert shared_launches(qwen, "fwd") == 9 + 4                      # gate: t, mm, sigmoid, mul
    assert shared_launches(dataclasses.replace(qwen, shared_gate=False), "fwd") == 9
    assert shared_launches(qwen, "train") > 2 * shared_launches(qwen, "fwd")
    assert shared_launches(get_shape("olmoe"), "train") == 0
    assert shared_launches(dataclasses.replace(qwen, shared_ffn=0), "fwd") == 0


def test_shared_expert_host_is_measured_per_launch_and_added_after_the_sync(tmp_path):
    """Host ms per launch from the graph replays' host_ms A/B (every size, eager rows not read);
    an eager layer pays it after its sync (`pre + max(post + S, G)`), a graph replay where it outlasts
    the GPU work, and the host fit takes each point's S as known."""
    pair = shared_ab_files(tmp_path, {"fwd": 1.0, "train": 1.0}, host_per_launch={"fwd": 0.012, "train": 0.021})
    per_launch, by_shape, points = shared_host_per_launch([pair])
    assert per_launch == pytest.approx({"fwd": 0.012, "train": 0.021})
    assert by_shape.keys() == {"fwd", "train"} and by_shape["fwd"].keys() == by_shape["train"].keys() == {"qwen"}
    assert (by_shape["fwd"]["qwen"], by_shape["train"]["qwen"]) == pytest.approx((13 * 0.012, 48 * 0.021))
    assert sorted({p["tokens_per_gpu"] for p in points}) == [1024, 4096, 8192, 16384]
    cost = build_cost_model(settings(shared_ab=(tuple(pair),)))
    qwen, deepseek = get_shape("qwen"), get_shape("deepseek")
    assert cost.shared_host_ms(qwen, "fwd") == pytest.approx(13 * 0.012)
    assert cost.shared_host_ms(get_shape("olmoe"), "train") == 0.0
    # a shape the A/B did not measure: its own launches at the pass's rate
    assert cost.shared_host_ms(deepseek, "fwd") == pytest.approx(shared_launches(deepseek, "fwd") * 0.012)
    # a measured shape takes its own time, whatever its launch count says
    other = dataclasses.replace(cost, shared_host_by_shape_ms={"fwd": {"qwen": 0.5}})
    assert other.shared_host_ms(qwen, "fwd") == 0.5 and other.shared_host_ms(qwen, "train") == pytest.approx(48 * 0.021)
    assert cost_summary(cost)["shared_expert_host_ms_per_launch_by_pass"] == pytest.approx(per_launch)
    assert cost_summary(cost)["shared_expert_host_ms_by_pass_and_shape"] == by_shape
    host = dataclasses.replace(cost, host={("occult", "fwd", 1): HostTerms(0.2, 0.3, 1, "test")})
    eager = layer_time(0.1, method_spec("occult"), "fwd", 1, host, shared_host_ms=0.156)
    assert eager["layer_ms"] == pytest.approx(0.2 + 0.3 + 0.156) and eager["host_shared_ms"] == 0.156
    # a graph replay (no replay launch term here) hides it behind its GPU time, unless it is longer
    assert layer_time(0.2, method_spec("occult-graph"), "fwd", 1, host, shared_host_ms=0.156)["layer_ms"] == 0.2
    assert layer_time(0.1, method_spec("occult-graph"), "fwd", 1, host, shared_host_ms=0.156)["layer_ms"] == 0.156
    # a host-bound shape with a shared expert beside one without: S known, pre and post come back
    gpu = np.array([0.1, 0.1, 0.3, 2.0, 0.1, 2.0])
    shared = np.array([0.0, 0.0, 0.0, 0.0, 0.4, 0.4])
    measured = 0.25 + np.maximum(0.35 + shared, gpu)
    pre, post, loss = fit_host(gpu, measured, shared)
    assert (pre, post) == pytest.approx((0.25, 0.35), abs=2e-3) and loss < 1e-5
    assert fit_host(gpu, measured)[2] > 1e-3                  # without S one (pre, post) fits neither shape


def test_shared_expert_host_ab_is_taken_at_each_process_host_speed(tmp_path):
    """The A/B's two processes ran on hosts of different speed (the lent machines' CPU moves): the
    process without the shared expert ran 1.5x slower, and its probes say so. Unscaled, the difference
    loses that slowness; scaled by each row's probe over the pair's median, it is the shared expert's
    host time at the pair's median speed. Files without probes are read at scale 1."""
    shape = get_shape("qwen")
    launches = shared_launches(shape, "fwd")
    files = []
    for shared, slowness, probe in ((True, 1.0, 200.0), (False, 1.5, 300.0)):
        rows = [{"kind": "decode", "shape": "qwen", "method": "occult-graph", "D": 1, "tokens_per_gpu": t,
                 "median_ms": 0.3, "host_ms": slowness * (0.03 + (launches * 0.015 if shared else 0.0)),
                 "host_launch_us": probe, "host_probe_us": 1000.0, "shared_ffn": shape.shared_ffn if shared else 0}
                for t in (1, 8, 64, 512, 4096)]
        files.append(measured_csv(tmp_path / f"probed_{shared}.csv", rows))
    true_ms = launches * 0.015
    none = shared_host_per_launch([files], host_speed="none")[1]["fwd"]["qwen"]
    assert none == pytest.approx(true_ms - 0.015)
    for speed in ("launch", "auto"):   # the median probe is 250: the shared process ran at 200/250
        assert shared_host_per_launch([files], host_speed=speed)[1]["fwd"]["qwen"] == pytest.approx(true_ms * 1.25)
    # the Python probe did not move here: no correction
    assert shared_host_per_launch([files], host_speed="python")[1]["fwd"]["qwen"] == pytest.approx(none)
    unprobed = [measured_csv(tmp_path / f"plain_{i}.csv", pd.read_csv(f).drop(columns=["host_launch_us", "host_probe_us"]).to_dict("records"))
                for i, f in enumerate(files)]
    assert shared_host_per_launch([unprobed], host_speed="auto")[1]["fwd"]["qwen"] == pytest.approx(none)
    cost = build_cost_model(settings(shared_ab=(tuple(files),), host_speed="launch"))
    assert cost.shared_host_ms(shape, "fwd") == pytest.approx(true_ms * 1.25)


def graph_point(shape: str, host_ms: float, scale: float = 1.0, pass_: str = "fwd", num_devices: int = 1,
                family_method: str = "occult-graph") -> MeasuredPoint:
    row = SimpleNamespace(D=num_devices, median_ms=1.0, tokens_per_gpu=8, host_ms=host_ms, host_scale=scale,
                          role="calibration")
    return MeasuredPoint(row, method_spec(family_method), get_shape(shape), pass_, [], "test")


def test_a_graph_replay_pays_its_launch_and_the_eager_shared_expert_on_the_host():
    """`t = s·r + max(s·S, G)`: the replay's launch precedes its GPU work; the shared expert, launched
    eagerly after it, hides behind G unless its host time is longer. r comes from the calibration's
    forward graph rows (host_ms at the row's host speed, less S); training rows, whose host time
    overlaps the GPU, and rows without host_ms do not count."""
    cost = CostModel(None, None, None, {}, 760, graph_host_ms={("fwd", 1): 0.05})
    graph = method_spec("occult-graph")
    assert layer_time(0.3, graph, "fwd", 1, cost, 0.0, 2.0)["layer_ms"] == pytest.approx(0.1 + 0.3)
    out = layer_time(0.3, graph, "fwd", 1, cost, 0.2, 2.0)
    assert out["layer_ms"] == pytest.approx(0.1 + 0.4) and out["host_pre_ms"] == pytest.approx(0.1)
    assert layer_time(0.3, graph, "fwd", 2, cost, 0.0)["layer_ms"] == pytest.approx(0.35)   # D=1's term at D=2
    assert layer_time(0.3, graph, "train", 1, cost, 0.0)["layer_ms"] == pytest.approx(0.3)  # none for training
    assert layer_time(0.3, method_spec("occult-compute"), "fwd", 1, cost, 0.2, 2.0)["layer_ms"] == 0.3

    base = CostModel(None, None, None, {}, 760, shared_host_by_shape_ms={"fwd": {"qwen": 0.2}})
    points = [graph_point("olmoe", 0.05 * s, s) for s in (1.6, 1.4, 1.0)]        # unscaled, the median moves
    points += [graph_point("qwen", (0.05 + 0.2) * s, s) for s in (1.3, 1.5, 1.0, 1.2)]   # without S, too
    points += [graph_point("olmoe", 0.9, 1.0, pass_="train"), graph_point("olmoe", float("nan")),
               graph_point("olmoe", 0.7, 1.0, family_method="occult")]
    fitted = graph_replay_host(points, base)
    assert fitted.graph_host_ms.keys() == {("fwd", 1)} and fitted.graph_host_ms[("fwd", 1)] == pytest.approx(0.05)
    assert fitted.graph_host_for("fwd", 2) == pytest.approx(0.05) and fitted.graph_host_for("train", 1) == 0.0
    assert graph_replay_host([graph_point("olmoe", float("nan"))], base).graph_host_ms == {}
    assert cost_summary(fitted)["graph_replay_host_ms"] == {"fwd/D=1": pytest.approx(0.05)}


def test_bad_shared_ab_inputs_are_named(tmp_path):
    shared, plain = shared_ab_files(tmp_path, {"fwd": 1.0, "train": 1.0})
    with pytest.raises(SimulateError, match=r"shared_ab\[0\]: .*ab_shared.csv has no occult-graph rows without"):
        shared_scales([[shared, shared]], 760, 4300e9 / 1e3)
    with pytest.raises(SimulateError, match=r"shared_ab\[1\]: expected \[file with shared experts, file without\]"):
        shared_scales([[shared, plain], [shared]], 760, 4300e9 / 1e3)
    other = pd.read_csv(plain).assign(shape="deepseek")
    other.to_csv(tmp_path / "other.csv", index=False)
    with pytest.raises(SimulateError, match="no .* is measured both with and without"):
        shared_scales([[shared, str(tmp_path / "other.csv")]], 760, 4300e9 / 1e3)
    small = pd.read_csv(plain).query("tokens_per_gpu < 4096")
    small.to_csv(tmp_path / "small.csv", index=False)
    with pytest.raises(SimulateError, match="no .* of >= 4096 tokens/GPU is measured both"):
        shared_scales([[shared, str(tmp_path / "small.csv")]], 760, 4300e9 / 1e3)
    assert shared_host_per_launch([[shared, str(tmp_path / "small.csv")]])[0]["fwd"] > 0    # every size counts
    with pytest.raises(SimulateError, match=r"shared_ab\[0\]: .*nowhere.csv does not exist"):
        shared_scales([[str(tmp_path / "nowhere.csv"), plain]], 760, 4300e9 / 1e3)
