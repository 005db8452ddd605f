"""Tables and figures from committed GPU results: the EP benchmark's summary and targets, and the
sweeps' speedups, on small hand-made CSVs (values checked by hand)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from occult.report import gpu_runs as gpu_report
from occult.sim.builtin_alltoall import BUILTIN_ALLTOALL_SOURCE


def ep_rows(run: str, kind: str = "prefill") -> pd.DataFrame:
    base = {"kind": kind, "routing": "uniform", "D": 2, "tokens_per_gpu": 16384, "batch": None, "hidden": 2048,
            "ffn": 1024, "status": "ok", "bytes_sent": 2 * 2**27, "mean_devices_per_token": 2.0,
            "pairs_received_max": 131072, "max_rel_err": 0.005, "peak_mem_gib": 10.0}
    methods = {"occult": (7.0, 3.0, 3.5, 0.5), "occult-pe": (7.7, 3.0, 3.2, 1.5), "occult-graph": (5.0, None, None, None),
               "occult-compute": (4.0, None, None, None), "occult-nd1-graph": (4.4, None, None, None),
               "occult-compute-graph": (3.2, None, None, None)}
    return pd.DataFrame([{**base, "method": m, "median_ms": t, "dispatch_ms": d, "experts_ms": e, "combine_ms": c}
                         for m, (t, d, e, c) in methods.items()])


def write_ep_run(run_dir: Path, peak: float = 800.0) -> None:
    run_dir.mkdir(parents=True)
    ep_rows("a").to_csv(run_dir / "ep_prefill_uniform_D2.csv", index=False)
    pd.DataFrame([{"gpu": "x", "op": "matmul", "median_ms": 1.0, "tflops": peak}]).to_csv(run_dir / "peak.csv",
                                                                                       index=False)


def test_algbw_interpolates_in_log_size_and_clamps():
    curve = ((2**20, 10.0), (2**30, 110.0))
    assert gpu_report.nccl_algbw_gbs(2**25, curve) == pytest.approx(60.0)        # halfway in log size
    assert gpu_report.nccl_algbw_gbs(2**31, curve) == 110.0
    assert gpu_report.nccl_algbw_gbs(2**19, curve) == pytest.approx(5.0)          # flat time below the curve
    sizes = [2**k for k in range(16, 32)]
    rates = [gpu_report.nccl_algbw_gbs(s) for s in sizes]
    assert rates == sorted(rates)


def test_ep_summary_and_targets_by_hand(tmp_path):
    run_dir = tmp_path / "results" / "m" / "ep_v1"
    write_ep_run(run_dir, peak=800.0)
    frame, peak = gpu_report.load_ep(run_dir)
    summary = gpu_report.ep_summary(frame, peak).set_index("method")
    flops = 2.0 * 131072 * 3 * 2048 * 1024
    assert summary.loc["occult", "expert_tflops"] == pytest.approx(flops / 3.5 / 1e9)       # experts phase
    assert summary.loc["occult-compute", "expert_tflops"] == pytest.approx(flops / 4.0 / 1e9)   # whole step
    assert summary.loc["occult-compute", "pct_of_peak"] == pytest.approx(flops / 4.0 / 1e9 / 800.0)
    assert summary.loc["occult-compute-graph", "expert_tflops"] == pytest.approx(flops / 3.2 / 1e9)
    assert summary.loc["occult", "flop_floor_ms"] == pytest.approx(flops / 800.0 / 1e9)
    # remote bytes both ways 2^28 -> buffer each way 2^27 remote * 2 (D=2) = 2^28 per direction.
    expected_comm = 2 * 2**28 / gpu_report.nccl_algbw_gbs(2**28) / 1e6
    assert summary.loc["occult", "nccl_comm_ms"] == pytest.approx(expected_comm)
    targets = gpu_report.ep_targets(summary.reset_index()).set_index("target")
    assert targets.loc["occult-graph speedup over per_expert dispatch", "measured"] == pytest.approx(7.7 / 5.0)
    assert bool(targets.loc["occult-graph speedup over per_expert dispatch", "met"])
    assert not bool(targets.loc["occult speedup over per_expert dispatch", "met"])              # 1.1 < 1.4
    assert targets.loc["occult-nd1-graph over the expert-compute floor", "measured"] == pytest.approx(1.1)
    assert bool(targets.loc["occult-nd1-graph over the expert-compute floor", "met"])          # 1.1 <= 1.15
    assert not bool(targets.loc["expert kernels, fraction of bf16 peak", "met"])


def test_ep_report_writes_tables_and_figures_and_names_a_missing_peak(tmp_path):
    run_dir = tmp_path / "results" / "m" / "ep_v1"
    write_ep_run(run_dir)
    figures = tmp_path / "figures"
    gpu_report.make_ep_report(run_dir, figures)
    assert (run_dir / "summary.csv").is_file() and (run_dir / "targets.csv").is_file()
    assert (figures / "ep_latency.png").stat().st_size > 0 and (figures / "ep_phases.png").stat().st_size > 0
    assert set(pd.read_csv(run_dir / "summary.csv")["nccl_curve"]) == {BUILTIN_ALLTOALL_SOURCE}
    (run_dir / "peak.csv").unlink()
    with pytest.raises(FileNotFoundError, match="peak.csv"):
        gpu_report.make_ep_report(run_dir, figures)


def test_a_measured_alltoall_curve_of_the_machine_is_preferred(tmp_path):
    run_dir = tmp_path / "results" / "m" / "ep_v1"
    write_ep_run(run_dir)
    comm = run_dir.parent / "comm_v1"
    comm.mkdir()
    pd.DataFrame([{"D": 2, "pattern": "equal", "dtype": "bfloat16", "bytes_per_rank": b, "algbw_gbps": r}
                  for b, r in ((2**20, 20.0), (2**30, 600.0))]).to_csv(comm / "alltoall.csv", index=False)
    curve, source = gpu_report.measured_alltoall_curve(run_dir)
    assert curve == ((2.0**20, 20.0), (2.0**30, 600.0)) and source.endswith("comm_v1/alltoall.csv")


def test_sweep_speedups_by_hand():
    rows = [{"kind": "prefill", "status": "ok", "tokens_per_gpu": 16384, "shape": "olmoe", "D": 2,
             "method": m, "median_ms": t} for m, t in (("occult", 8.0), ("occult-graph", 4.0), ("megablocks", 6.0))]
    table = gpu_report.speedups(pd.DataFrame(rows)).set_index(["occult", "baseline"])
    assert table.loc[("occult", "megablocks"), "speedup"] == pytest.approx(0.75)
    assert table.loc[("occult-graph", "megablocks"), "speedup"] == pytest.approx(1.5)
    assert ("occult", "occult-graph") not in table.index                  # Occult variants are not baselines


def test_sweep_speedups_at_each_kinds_reference_point():
    """Prefill at 16384 tokens per GPU, training at batch 8, decode at batch 64; other sizes are not in
    the table."""
    times = {("prefill", 16384, None): (2.0, 3.0), ("prefill", 4096, None): (1.0, 9.0),
             ("train", 4096, 8): (4.0, 5.0), ("train", 8192, 16): (4.0, 9.0),
             ("decode", 64, 64): (0.5, 2.0), ("decode", 8, 8): (0.5, 9.0)}
    rows = [{"kind": kind, "status": "ok", "tokens_per_gpu": tokens, "batch": batch, "shape": "qwen", "D": 1,
             "method": method, "median_ms": ms}
            for (kind, tokens, batch), pair in times.items() for method, ms in zip(("occult", "naive"), pair)]
    table = gpu_report.speedups(pd.DataFrame(rows)).set_index("kind")
    assert sorted(table.index) == ["decode", "prefill", "train"]
    assert table.loc["prefill", ["size_column", "size"]].tolist() == ["tokens_per_gpu", 16384]
    assert table.loc["train", ["size_column", "size"]].tolist() == ["batch", 8]
    assert table.loc["prefill", "speedup"] == pytest.approx(1.5)
    assert table.loc["train", "speedup"] == pytest.approx(1.25)
    assert table.loc["decode", "speedup"] == pytest.approx(4.0)


def test_sweep_speedups_use_the_median_of_replicates():
    """Two processes' files of one sweep in a run: each point's median over its replicates."""
    rows = [{"kind": "prefill", "status": "ok", "tokens_per_gpu": 16384, "shape": "olmoe", "D": 1,
             "method": m, "median_ms": t} for m, t in (("occult", 4.0), ("occult", 6.0), ("occult", 5.0),
                                                        ("naive", 9.0), ("naive", 11.0))]
    table = gpu_report.speedups(pd.DataFrame(rows)).set_index(["occult", "baseline"])
    assert len(table) == 1
    assert table.loc[("occult", "naive"), "speedup"] == pytest.approx(10.0 / 5.0)
    points = gpu_report.replicate_medians(pd.DataFrame(rows)).set_index("method")
    assert points.loc["occult", ["low_ms", "high_ms", "replicates"]].tolist() == [4.0, 6.0, 3]


def kernel_rows(swiglu_ms: float, peak_ms: float) -> pd.DataFrame:
    """A bench_kernels CSV: two forward rows and the two peak rows (as the bench writes them)."""
    flops = 2.0 * 8192**3
    peak, burst = flops / peak_ms / 1e9, flops / (0.9 * peak_ms) / 1e9
    rows = [{"routing": "uniform", "op": "grouped_swiglu", "impl": "triton", "pass": "fwd", "median_ms": swiglu_ms,
             "tflops": 600.0 * 2.0 / swiglu_ms},
            {"routing": "uniform", "op": "grouped_swiglu", "impl": "triton", "pass": "fwd+bwd", "median_ms": 3 * swiglu_ms,
             "tflops": 1.0},
            {"op": "matmul_8192", "impl": "cublas", "pass": "fwd", "median_ms": peak_ms, "tflops": peak},
            {"op": "matmul_8192", "impl": "cublas_burst", "pass": "fwd", "median_ms": 0.9 * peak_ms, "tflops": burst}]
    frame = pd.DataFrame(rows)
    return frame.assign(pct_of_peak=100 * frame["tflops"] / peak, pct_of_burst_peak=100 * frame["tflops"] / burst)


def test_kernel_report_takes_the_median_over_repeats_against_each_runs_own_peak(tmp_path):
    run_dir = tmp_path / "results" / "m" / "kernels_v1"
    run_dir.mkdir(parents=True)
    kernel_rows(2.0, 2.0).to_csv(run_dir / "kernels.csv", index=False)          # 600 TFLOP/s, peak 549.8
    kernel_rows(2.4, 2.2).to_csv(run_dir / "kernels_repeat.csv", index=False)   # 500 TFLOP/s, peak 499.8
    gpu_report.make_kernels_report(run_dir, tmp_path / "figures")
    row = pd.read_csv(run_dir / "summary.csv").set_index("impl").loc["triton"]
    assert row["files"] == 2 and row["median_ms"] == pytest.approx(2.2)
    assert (row["tflops_min"], row["tflops_max"]) == (pytest.approx(500.0), pytest.approx(600.0))
    peak_1, peak_2 = 2.0 * 8192**3 / 2.0 / 1e9, 2.0 * 8192**3 / 2.2 / 1e9
    assert row["pct_of_peak"] == pytest.approx((100 * 600 / peak_1 + 100 * 500 / peak_2) / 2, rel=1e-5)
    assert row["pct_of_burst_peak"] == pytest.approx(0.9 * row["pct_of_peak"], rel=1e-5)
    assert (tmp_path / "figures" / "kernels.png").stat().st_size > 0
    pd.read_csv(run_dir / "kernels.csv").drop(columns=["pct_of_burst_peak"]).to_csv(run_dir / "kernels.csv", index=False)
    with pytest.raises(ValueError, match="kernels.csv: no peak columns"):
        gpu_report.make_kernels_report(run_dir, tmp_path / "figures")


def test_kernel_report_pairs_burst_timed_rows_with_the_burst_peak(tmp_path):
    run_dir = tmp_path / "results" / "m" / "kernels_v2"
    run_dir.mkdir(parents=True)
    frame = kernel_rows(2.0, 2.0)
    burst_peak = frame.set_index("impl").loc["cublas_burst", "tflops"]
    burst = {"routing": "uniform", "op": "grouped_swiglu", "impl": "triton", "pass": "fwd_burst", "median_ms": 1.6,
             "tflops": 600.0 * 2.0 / 1.6}
    burst["pct_of_burst_peak"] = 100 * burst["tflops"] / burst_peak
    pd.concat([frame, pd.DataFrame([burst])], ignore_index=True).to_csv(run_dir / "kernels.csv", index=False)
    gpu_report.make_kernels_report(run_dir, tmp_path / "figures")
    summary = pd.read_csv(run_dir / "summary.csv")
    assert len(summary) == 1                                        # the burst row is a column, not an impl row
    row = summary.iloc[0]
    assert row["median_ms"] == pytest.approx(2.0) and row["burst_median_ms"] == pytest.approx(1.6)
    assert row["burst_pct_of_burst_peak"] == pytest.approx(100 * 750.0 / burst_peak, rel=1e-5)
    kernel_rows(2.0, 2.0).to_csv(run_dir / "kernels.csv", index=False)      # runs without burst rows: NaN
    gpu_report.make_kernels_report(run_dir, tmp_path / "figures")
    assert pd.read_csv(run_dir / "summary.csv")["burst_median_ms"].isna().all()


def test_sweep_speedups_per_routing_against_each_baselines_fastest_setting():
    """One row per (routing, Occult variant, baseline); a baseline run in several settings is
    represented by the fastest at that point, named with its setting (values by hand)."""
    times = {
        "synthetic": {"occult": 4.0, "megablocks": 6.0, "megablocks:grouped_gemm=cutlass": 5.0, "tutel": 16.0,
                      "tutel:adaptive_r=0": 12.0},
        "trace": {"occult": 3.0, "megablocks": 4.5, "megablocks:grouped_gemm=cutlass": 6.0, "tutel": 9.0,
                  "tutel:adaptive_r=0": 10.0},
    }
    configs = {"megablocks": "grouped_gemm=cublas", "megablocks:grouped_gemm=cutlass": "grouped_gemm=cutlass",
               "tutel": "capacity_factor=0", "tutel:adaptive_r=0": "capacity_factor=0,adaptive_r=0", "occult": None}
    rows = [{"kind": "prefill", "status": "ok", "tokens_per_gpu": 16384, "shape": "olmoe", "D": 1, "routing": routing,
             "method": method, "baseline_config": configs[method], "median_ms": ms}
            for routing, point in times.items() for method, ms in point.items()]
    rows.append({**rows[0], "method": "megablocks:mlp_impl=sparse", "status": "unsupported: triton", "median_ms": None})
    table = gpu_report.speedups(pd.DataFrame(rows))
    assert list(table.columns) == list(gpu_report.SPEEDUP_COLUMNS)
    table = table.set_index(["routing", "occult", "baseline"])
    assert len(table) == 4
    synthetic = table.loc[("synthetic", "occult", "megablocks")]
    assert synthetic["baseline_config"] == "grouped_gemm=cutlass" and synthetic["configs_compared"] == 2
    assert synthetic["speedup"] == pytest.approx(5.0 / 4.0)
    trace = table.loc[("trace", "occult", "megablocks")]
    assert trace["baseline_method"] == "megablocks" and trace["baseline_config"] == "grouped_gemm=cublas"
    assert trace["speedup"] == pytest.approx(4.5 / 3.0)
    assert table.loc[("synthetic", "occult", "tutel"), "baseline_config"] == "capacity_factor=0,adaptive_r=0"
    assert table.loc[("trace", "occult", "tutel"), "speedup"] == pytest.approx(9.0 / 3.0)
    flat = table.reset_index()
    assert gpu_report._speedup_label(flat, ("synthetic", "olmoe", 1, "megablocks")) == \
        "synthetic: olmoe, D=1, vs megablocks (grouped_gemm=cutlass, fastest of 2)"
    assert gpu_report._speedup_label(flat, ("trace", "olmoe", 1, "megablocks")) == \
        "trace: olmoe, D=1, vs megablocks (grouped_gemm=cublas, fastest of 2)"


def sweep_frame(routings: dict[str, float], methods: dict[str, float], config: dict[str, str] | None = None,
                shapes: tuple[str, ...] = ("olmoe",)) -> pd.DataFrame:
    """prefill rows at 2^10, 2^12, 2^14 tokens: median_ms = routing factor x method factor x size / 2^10."""
    rows = [{"machine": "m", "commit": "c", "kind": "prefill", "status": "ok", "shape": shape, "D": 2,
             "tokens_per_gpu": size, "routing": routing, "method": method,
             "median_ms": r * f * size / 1024, **({"baseline_config": config.get(method)} if config else {})}
            for routing, r in routings.items() for method, f in methods.items() for shape in shapes
            for size in (1024, 4096, 16384)]
    return pd.DataFrame(rows)


@pytest.fixture
def drawn(monkeypatch):
    """The figures plot_kind draws, kept open instead of saved."""
    figures = []
    monkeypatch.setattr(gpu_report, "_save", lambda fig, path: figures.append(fig))
    yield figures
    for fig in figures:
        gpu_report.plt.close(fig)


def test_plot_kind_draws_one_row_of_panels_per_routing(drawn, tmp_path):
    methods = {"occult": 1.0, "megablocks": 2.0, "megablocks:grouped_gemm=cutlass": 3.0, "tutel": 4.0}
    config = {"megablocks": "grouped_gemm=cublas", "megablocks:grouped_gemm=cutlass": "grouped_gemm=cutlass",
              "tutel": "capacity_factor=0"}
    frame = sweep_frame({"trace": 10.0, "synthetic": 1.0}, methods, config, shapes=("olmoe", "qwen"))
    gpu_report.plot_kind(frame, "prefill", tmp_path / "prefill.png")
    (fig,) = drawn
    axes = fig.axes
    assert len(axes) == 4                                               # 2 routings x 2 (shape, D) panels
    titles = [ax.get_title() for ax in axes]
    assert titles == ["prefill: olmoe, D=2, synthetic routing", "prefill: qwen, D=2, synthetic routing",
                      "prefill: olmoe, D=2, trace routing", "prefill: qwen, D=2, trace routing"]
    for ax, factor in zip(axes, (1.0, 1.0, 10.0, 10.0)):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {"occult", "megablocks (grouped_gemm=cublas)", "megablocks (grouped_gemm=cutlass)", "tutel"}
        for line in lines.values():
            xs = list(line.get_xdata())
            assert xs == [1024, 4096, 16384]                             # one point per size: no zigzag
        cutlass = lines["megablocks (grouped_gemm=cutlass)"]
        assert list(cutlass.get_ydata()) == pytest.approx([factor * 3.0 * s for s in (1, 4, 16)])
        default = lines["megablocks (grouped_gemm=cublas)"]
        assert default.get_color() == cutlass.get_color()                # one baseline, one colour
        assert (default.get_linestyle(), default.get_marker()) != (cutlass.get_linestyle(), cutlass.get_marker())
    legend = [text.get_text() for text in fig.legends[0].get_texts()]
    assert sorted(legend) == sorted(["occult", "megablocks (grouped_gemm=cublas)", "megablocks (grouped_gemm=cutlass)",
                                     "tutel"])


def test_a_panel_a_routing_did_not_measure_is_left_blank(drawn, tmp_path):
    frame = pd.concat([sweep_frame({"synthetic": 1.0}, {"occult": 1.0}, shapes=("olmoe", "qwen")),
                       sweep_frame({"uniform": 2.0}, {"occult": 1.0}, shapes=("olmoe",))], ignore_index=True)
    gpu_report.plot_kind(frame, "prefill", tmp_path / "prefill.png")
    (fig,) = drawn
    assert [ax.get_visible() for ax in fig.axes] == [True, True, True, False]


def test_a_sweep_without_routing_column_plots_as_the_synthetic_routing_did(tmp_path):
    """Files written before the sweep recorded its routing: the same figure as rows marked synthetic,
    one row of panels, titles without the routing, baselines named as before."""
    frame = sweep_frame({"synthetic": 1.0}, {"occult": 1.0, "megablocks": 2.0}, shapes=("olmoe", "qwen"))
    old = frame.drop(columns=["routing"])
    gpu_report.plot_kind(old, "prefill", tmp_path / "old.png")
    gpu_report.plot_kind(frame.assign(routing=[None] * len(frame)), "prefill", tmp_path / "blank.png")
    gpu_report.plot_kind(frame, "prefill", tmp_path / "marked.png")
    assert (tmp_path / "old.png").read_bytes() == (tmp_path / "marked.png").read_bytes()
    assert (tmp_path / "blank.png").read_bytes() == (tmp_path / "marked.png").read_bytes()
    assert gpu_report.method_labels(old) == {"occult": "occult", "megablocks": "megablocks"}
    table = gpu_report.speedups(old)
    assert set(table["routing"]) == {"synthetic"}


def test_baseline_labels_from_the_name_where_the_run_recorded_no_settings():
    frame = pd.DataFrame({"method": ["occult-nd2", "tutel", "tutel:adaptive_r=0", "megablocks:mlp_impl=sparse",
                                     "naive", "deepspeed", "deepspeed:use_tutel=1"]})
    assert gpu_report.method_labels(frame) == {
        "occult-nd2": "occult-nd2", "naive": "naive", "tutel": "tutel (defaults)", "tutel:adaptive_r=0": "tutel (adaptive_r=0)",
        "megablocks:mlp_impl=sparse": "megablocks (mlp_impl=sparse)", "deepspeed": "deepspeed (defaults)",
        "deepspeed:use_tutel=1": "deepspeed (use_tutel=1)"}
    styles = gpu_report.method_styles(frame["method"])
    assert styles["tutel"] == "--x" and styles["tutel:adaptive_r=0"] != "--x"       # defaults keep the old style
    assert styles["occult-nd2"] == "-o" and styles["megablocks:mlp_impl=sparse"] == "--x"


def test_the_routing_order_is_the_sweeps():
    from occult.harness.sweep.settings import ROUTINGS

    assert gpu_report.ROUTING_ORDER == ROUTINGS and gpu_report.DEFAULT_ROUTING == ROUTINGS[0]
