"""Measured inputs: the simulate settings and fake sweep files the simulator tests share, row
selectors, the host-speed probes, the weight-streaming fit, and bad files named."""

import dataclasses

import numpy as np
import pandas as pd
import pytest

from occult.shapes import get_shape
from occult.sim.calibration import build_cost_model
from occult.sim.columns import SimulateError
from occult.sim.cost_model import expert_weight_bytes
from occult.sim.inputs import SimulatorSettings
from occult.sim.measured import alltoall_curves, fit_weight_streaming, host_scale_column, host_scale_of_set, read_measured
from occult.sim.predict import cost_summary


def settings(**changes) -> SimulatorSettings:
    base = SimulatorSettings(
        shapes=("tiny",), methods=("occult", "occult-nd1", "occult-graph", "naive"), devices=(2, 4),
        tokens_per_gpu=(64, 256), prediction_devices=(2,), gpus_per_node=2, inter_node_gbps=400, inter_node_latency_us=15,
        pool_tokens=512, gemm_min_rows_per_expert=1, tolerance=0.15, dense_tflops=760)
    return dataclasses.replace(base, **changes)


def gemm_csv(path) -> str:
    """A grouped-GEMM curve for the tiny shape (commbench columns)."""
    shape = get_shape("tiny")
    rows = [{"shape": "tiny", "experts": 8, "hidden": shape.hidden, "ffn": shape.ffn, "rows_per_expert": r, "pass": p,
             "tflops": t * (1 if p == "fwd" else 0.8)}
            for r, t in ((4, 1.0), (64, 10.0), (1024, 100.0)) for p in ("fwd", "fwd+bwd")]
    pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


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
    with pytest.raises(SimulateError, match="alltoall: .*alltoall.csv lacks column"):
        alltoall_curves(str(a2a))


def test_entry_selectors_choose_the_rows(tmp_path):
    """`@methods=` keeps a file's rows of those methods, `@tokens_per_gpu=` of those sizes; the source
    is the file as written; bad entries are named."""
    path = fake_sweep(tmp_path, "sweep.csv")
    naive_only = read_measured([f"{path}@methods=naive"], [f"{path}@tokens_per_gpu=64"])
    assert set(naive_only["method"]) == {"naive"} and len(naive_only) == 6
    assert set(naive_only.loc[naive_only["tokens_per_gpu"] == 64, "role"]) == {"calibration"}
    assert set(naive_only.loc[naive_only["tokens_per_gpu"] != 64, "role"]) == {"validation"}
    assert set(naive_only["source"]) == {path}
    both = read_measured([path], [f"{path}@methods=occult@tokens_per_gpu=64,256"])
    chosen = both[both["role"] == "calibration"]
    assert set(chosen["method"]) == {"occult"} and set(chosen["tokens_per_gpu"]) == {64, 256}
    with pytest.raises(SimulateError, match="simulate.calibration: .*expected FILE"):
        read_measured([path], [f"{path}@tokens_per_gpu=a"])
    with pytest.raises(SimulateError, match="simulate.measured: .*unknown option 'bogus'"):
        read_measured([f"{path}@methods=occult-bogus"])
    with pytest.raises(SimulateError, match="listed twice"):
        read_measured([path, f"{path}@methods=naive"])
    with pytest.raises(SimulateError, match="selects no ok, step-timed Occult / naive row"):
        read_measured([f"{path}@tokens_per_gpu=7"])


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
    the cost model takes the median over shapes where a kernel_stream file is named and no rate is
    set; rows of another method, routing or status do not count; unusable files name the role and
    the file."""
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
    given = build_cost_model(settings(kernel_stream_gbps=3000, kernel_stream_csv=path))    # the set rate wins
    assert given.kernel_stream_bytes_per_ms == pytest.approx(3000e6)
    one_size = tmp_path / "one.csv"
    pd.read_csv(path).query("tokens_per_gpu == 4 or tokens_per_gpu == 512").to_csv(one_size, index=False)
    with pytest.raises(SimulateError, match=r"kernel_stream: .*one.csv has deepseek rows at one size"):
        fit_weight_streaming(one_size)
    flat = tmp_path / "flat.csv"
    pd.read_csv(path).assign(median_ms=0.3).to_csv(flat, index=False)
    with pytest.raises(SimulateError, match="does not grow with its weight bytes"):
        fit_weight_streaming(flat)
    with pytest.raises(SimulateError, match="no ok occult-compute-graph rows with uniform routing"):
        fit_weight_streaming(path, max_tokens=0)
    with pytest.raises(SimulateError, match=r"kernel_stream: .*missing.csv does not exist"):
        build_cost_model(settings(kernel_stream_csv=str(tmp_path / "missing.csv")))
