"""Calibration: host terms and their fits, per-shape host offsets, kernel curves and floors,
Occult's other GPU work, per_expert rates and the shared expert's A/B terms, each from the
calibration rows only; bad A/B inputs named."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from occult.shapes import get_shape
from occult.sim.calibration import (MeasuredPoint, build_cost_model, graph_replay_host, host_terms, kernel_rows,
                                    measured_points, shared_host_per_launch, shared_scales)
from occult.sim.columns import VALIDATION_COLUMNS, SimulateError
from occult.sim.cost_model import CostModel, HostTerms, fit_host, layer_time, method_spec, shared_expert_ms, shared_launches, weight_read_ms
from occult.sim.inputs import MeasuredSet
from occult.sim.measured import read_measured
from occult.sim.predict import cost_summary
from occult.sim.run import run_simulate
from occult.sim.traces import ShapeTraces
from occult.sim.validation import validate, validation_table
from tests.sim.test_measured import fake_sweep, gemm_csv, measured_csv, settings


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
    history = (MeasuredSet("old", (path,), (path,), ("old/simulator.yaml",)),)
    cfg = settings(measured=(path,), calibration=(f"{path}@tokens_per_gpu=64,1024,4096",), history=history)
    paths = run_simulate(cfg, 0, tmp_path / "out", None)
    old = pd.read_csv(paths["history"])
    assert list(old.columns) == ["set", *VALIDATION_COLUMNS] and set(old["set"]) == {"old"}
    assert set(old["role"]) == {"calibration"} and len(old) == len(pd.read_csv(paths["validation"]))


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
    with pytest.raises(SimulateError, match=r"gemm: .*gemm.csv lacks column\(s\) experts, hidden, ffn"):
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
    """The A/B's two processes ran on hosts of different speed (the GPU machines' CPU speed moves): the
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
