"""Placement study: the long table, sensitivity rows, the CLI on a profile directory."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from occult.routing.placement_methods import synthetic_preset
from occult.stages.placement_latency import heldout_gain_interval, heldout_verdict, latency_summary, layer_cost_at
from occult.stages.placement_study import (
    STUDY_METHODS,
    RoutingSplits,
    SearchConfig,
    default_devices,
    gpus_per_node_for,
    main,
    run_study,
    sensitivity,
    study_tables,
)

FAST = SearchConfig(swap_rounds=3, kicks=1, eps=0.1, gpus_per_node=2)
STUDY_COLUMNS = {"trace", "layer", "D", "method", "expected_ct_heldout", "lower_bound", "upper_bound",
                 "intra_device_pair_fraction", "max_device_load_over_mean", "seconds", "status",
                 "inter_node_ct_heldout", "expected_ct_calibration", "predicted_ms_heldout", "predicted_ms_calibration"}


def test_default_devices_divide_experts():
    assert default_devices(64) == [2, 4, 8, 16, 32, 64]
    assert default_devices(60) == [2, 4, 6, 10, 12, 20, 30, 60]
    assert default_devices(16, [2, 3, 4, 32]) == [2, 4]
    assert gpus_per_node_for(6, 4) == 3 and gpus_per_node_for(16, 4) == 4 and gpus_per_node_for(2, 8) == 2


def test_run_study_writes_expected_columns_and_provenance(tmp_path):
    traces = {"a": synthetic_preset("qwen_moe", 400, 2, seed=0), "b": synthetic_preset("olmoe", 400, 1, seed=1)}
    out = tmp_path / "study.csv"
    frame = run_study(traces, [2, 4, 6], list(STUDY_METHODS), out, seed=0, search=FAST)
    table = pd.read_csv(out)
    assert STUDY_COLUMNS <= set(table.columns)
    assert len(frame) == len(table)
    per_layer = table[table["layer"] != "mean"]
    # qwen (60): D = 2, 4, 6 over 2 layers; olmoe (64): D = 2, 4 over 1 layer
    assert len(per_layer) == (3 * 2 + 2 * 1) * len(STUDY_METHODS)
    ok = per_layer[per_layer["status"] == "ok"]
    assert set(per_layer["status"]) <= {"ok"} | {s for s in per_layer["status"] if s.startswith("unavailable")}
    assert (ok["expected_ct_heldout"] >= ok["lower_bound"]).all()
    assert (ok["expected_ct_heldout"] <= ok["upper_bound"]).all()
    assert (ok["inter_node_ct_heldout"] <= ok["expected_ct_heldout"] + 1e-12).all()
    means = table[table["layer"] == "mean"]
    assert len(means) == len(ok.groupby(["trace", "D", "method"]))
    meta = json.loads((tmp_path / "study.csv.meta.json").read_text())
    assert meta["stage"] == "placement_study" and meta["seed"] == 0 and meta["config_hash"]
    again = run_study(traces, [2, 4, 6], list(STUDY_METHODS), tmp_path / "again.csv", seed=0, search=FAST)
    pd.testing.assert_series_equal(again["expected_ct_heldout"], frame["expected_ct_heldout"])   # seeded


def test_latency_tables_show_the_tradeoff_and_never_lose(tmp_path):
    """`latency`: its search path and the marked methods per (trace, layer, D), replicas at R = 0, 1, 2,
    and a predicted time on the calibration split no worse than any other method's."""
    traces = {"a": synthetic_preset("olmoe", 500, 2, seed=3), "sweep": synthetic_preset("deepseek_moe", 500, 1, seed=4)}
    tables = study_tables(traces, [2, 4, 8], ["contiguous", "greedy", "swap", "load_aware", "eplb", "latency"], 0,
                          FAST)
    per_layer = tables.study[tables.study["layer"] != "mean"]
    assert per_layer["predicted_ms_calibration"].notna().all() and per_layer["predicted_ms_heldout"].notna().all()
    best_other = (per_layer[per_layer["method"] != "latency"]
                  .groupby(["trace", "layer", "D"])["predicted_ms_calibration"].min())
    mine = per_layer[per_layer["method"] == "latency"].set_index(["trace", "layer", "D"])["predicted_ms_calibration"]
    assert (mine <= best_other.loc[mine.index] * (1 + 1e-12)).all()
    summary = latency_summary(tables.study)
    assert len(summary) == 3 * 3 and (summary["gain_calibration"] >= 1 - 1e-12).all()
    assert (summary["gain_heldout_low"] <= summary["gain_heldout_high"]).all()
    assert set(summary["heldout_verdict"]) <= {"faster", "slower", "within sampling error"}
    kinds = tables.tradeoff.groupby(["trace", "layer", "D"])["kind"].agg(set)
    assert len(kinds) == 9 and all(k == {"path", "method"} for k in kinds)
    marked = tables.tradeoff[tables.tradeoff["kind"] == "method"]
    assert {"greedy", "swap", "load_aware", "eplb", "latency"} <= set(marked["method"])
    slots = tables.replicas.groupby(["trace", "layer", "D"])["slots_per_device"].agg(lambda r: tuple(sorted(r)))
    assert len(slots) == 9 and set(slots) == {(0, 1, 2)}
    at_one = study_tables({"a": traces["a"]}, [1], ["contiguous", "greedy", "latency"], 0, FAST).study
    assert at_one["predicted_ms_heldout"].nunique() == 1          # D = 1: every placement is the same


def test_every_row_carries_its_layer_s_inheritance_against_the_virtual_group_map():
    """Routing that keeps each token in one virtual group (expert j in group j mod E/k) has index 1
    on every row of its layer, whatever the method or D; k not dividing E gives NaN."""
    num_experts, top_k, tokens = 16, 4, 300
    rng = np.random.default_rng(0)
    group_NK = rng.integers(0, num_experts // top_k, tokens)[:, None]
    in_group_NK = group_NK + (num_experts // top_k) * np.arange(top_k)[None, :]    # the k experts of one group
    random_NK = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)])
    splits = RoutingSplits(np.stack([in_group_NK, random_NK]), np.stack([in_group_NK, random_NK]), num_experts,
                           layers=(0, 1))
    odd = RoutingSplits(random_NK[None, :, :3], random_NK[None, :, :3], num_experts, layers=(0,))
    table = study_tables({"grouped": splits, "k3": odd}, [2, 4], ["contiguous", "greedy"], 0, FAST).study
    rows = table[table["trace"] == "grouped"].set_index("layer")
    assert rows.loc["0", "inheritance_index"].eq(1.0).all() and rows.loc["0", "groups_spanned"].eq(1.0).all()
    assert rows.loc["0", "main_group_share_random"].nunique() == 1
    assert rows.loc["1", "inheritance_index"].abs().max() < 0.15       # random routing: near 0
    assert rows.loc["mean", "inheritance_index"].to_numpy() == pytest.approx(
        (1.0 + rows.loc["1", "inheritance_index"].iloc[0]) / 2)
    assert table.loc[table["trace"] == "k3", "inheritance_index"].isna().all()


def test_run_study_rejects_unknown_method(tmp_path):
    with pytest.raises(ValueError, match="methods: 'random'"):
        run_study({"a": synthetic_preset("olmoe", 50, 1, 0)}, [2], ["random"], tmp_path / "x.csv", 0)


def with_sources(calib_LNK: np.ndarray, heldout_LNK: np.ndarray, num_experts: int) -> RoutingSplits:
    """Two 'sources' routed by different structures: tokens of source 1 use reversed expert ids."""
    half = calib_LNK.shape[1] // 2
    calib, heldout = calib_LNK.copy(), heldout_LNK.copy()
    calib[:, half:] = num_experts - 1 - calib[:, half:]
    heldout[:, half:] = num_experts - 1 - heldout[:, half:]
    sources = (np.arange(calib.shape[1]) >= half).astype(np.int64)
    return RoutingSplits(calib, heldout, num_experts, calib_sources=sources, heldout_sources=sources,
                         source_names=("left", "right"))


def test_sensitivity_rows_cover_size_and_domain_shift():
    calib, heldout = synthetic_preset("deepseek_moe", 1200, 1, seed=2)
    traces = {"two_sources": with_sources(calib, heldout, 64), "plain": (calib, heldout)}
    rows = sensitivity(traces, [4], ["greedy", "swap"], [0.25, 1.0], seed=0, search=FAST)
    size = rows[rows["study"] == "calibration_size"]
    assert len(size) == 2 * 2 * 2                  # traces x fractions x methods
    assert sorted(size["calib_tokens"].unique()) == [300, 1200]
    shift = rows[rows["study"] == "domain_shift"]
    assert set(shift["trace"]) == {"two_sources"}
    assert len(shift) == 4 * 2                     # (calibration source, eval source) pairs x methods
    assert (rows["status"] == "ok").all()
    table = shift.pivot_table(index=["method", "calib_source"], columns="eval_source", values="expected_ct_heldout")
    for method in ("greedy", "swap"):
        for source, other in (("left", "right"), ("right", "left")):
            assert table.loc[(method, source), source] <= table.loc[(method, source), other]   # in-domain wins


def write_routing(splits: RoutingSplits, profile_dir, layers: list[int]):
    """`splits` as a profile directory's routing_{calibration,heldout}.npz (the profiling stage's format)."""
    profile_dir.mkdir()
    for name, ids, sources in (("calibration", splits.calib_LNK, splits.calib_sources),
                               ("heldout", splits.heldout_LNK, splits.heldout_sources)):
        np.savez(profile_dir / f"routing_{name}.npz", ids=ids.astype(np.int16), sources=sources.astype(np.int16),
                 source_names=np.asarray(splits.source_names), layers=np.array(layers))
    return profile_dir


def test_cli_on_profile_directory(tmp_path):
    calib, heldout = synthetic_preset("qwen_moe", 600, 2, seed=4)
    splits = with_sources(calib.astype(np.int16), heldout.astype(np.int16), 60)
    profile_dir = write_routing(splits, tmp_path / "profile", layers=[1, 3])
    out = tmp_path / "out" / "study.csv"
    main(["--profile-dir", str(profile_dir), "--out", str(out), "--synthetic", "olmoe", "--synthetic-tokens", "300",
          "--synthetic-layers", "1", "--devices", "2", "4", "--methods", "contiguous", "greedy", "swap", "eplb",
          "--sensitivity-devices", "4", "--sensitivity-methods", "greedy", "--fractions", "0.5", "1.0",
          "--swap-rounds", "2", "--kicks", "0"])
    table = pd.read_csv(out)
    assert set(table["trace"]) == {"model", "synthetic_olmoe"}
    assert set(table.loc[table["trace"] == "model", "layer"].astype(str)) == {"1", "3", "mean"}
    sens = pd.read_csv(tmp_path / "out" / "study_sensitivity.csv")
    assert {"calibration_size", "domain_shift"} == set(sens["study"])
    assert (tmp_path / "out" / "study_sensitivity.csv.meta.json").is_file()
    with pytest.raises(Exception, match="routing_calibration.npz"):
        main(["--profile-dir", str(tmp_path / "missing"), "--out", str(out)])


def test_cli_on_a_gpu_runs_routing_sample_and_its_figure(tmp_path):
    """A GPU run returns routing_{split}_sample.npz (profiling.sample_routing): the study reads them
    where the full traces are absent, names the trace, and `--plot` draws its figure."""
    from occult.routing.profiling import sample_routing

    calib, heldout = synthetic_preset("olmoe", 400, 2, seed=6)
    splits = with_sources(calib.astype(np.int16), heldout.astype(np.int16), 64)
    full = write_routing(splits, tmp_path / "full", layers=[0, 1])
    profile_dir = tmp_path / "profile"
    profile_dir.mkdir()
    for name in ("calibration", "heldout"):
        sample_routing(full / f"routing_{name}.npz", profile_dir / f"routing_{name}_sample.npz", 300)
    out = tmp_path / "study" / "study.csv"
    main(["--profile-dir", str(profile_dir), "--trace-name", "gpu_sample", "--out", str(out), "--synthetic",
          "--devices", "4", "8", "--methods", "contiguous", "greedy", "--sensitivity-methods", "--swap-rounds", "1"])
    table = pd.read_csv(out)
    assert set(table["trace"]) == {"gpu_sample"} and set(table["D"]) == {4, 8}
    meta = json.loads(out.with_name("study.csv.meta.json").read_text())
    assert meta["calibration_shapes"]["gpu_sample"] == [2, 300, 8]          # the sample's 300 tokens
    figure = tmp_path / "figures" / "placement_study.png"
    main(["--plot", str(out), "--figure", str(figure)])
    assert figure.stat().st_size > 1000
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        main(["--plot", str(tmp_path / "missing.csv"), "--figure", str(figure)])


def test_heldout_interval_brackets_the_comparison_and_names_a_clear_loss():
    """The block bootstrap of latency's held-out gain: exactly 1 when latency is the other method's
    placement; wholly below 1 (`slower`) for a placement that puts the hot experts on one device."""
    from occult.routing.placement import contiguous
    from occult.routing.placement_methods import expert_load
    from occult.shapes import get_shape
    from occult.sim.cost_model_json import builtin_cost_model

    ids = synthetic_preset("olmoe", 2000, 1, seed=5)[1][0]
    layer = layer_cost_at(builtin_cost_model()[0], get_shape("olmoe"), 16384, 4)
    even = contiguous(64, 4)
    assert heldout_gain_interval(ids, even, {"contiguous": even}, layer, 4, seed=0, resamples=20) == (1.0, 1.0)
    hot_first = np.empty(64, dtype=np.int64)
    hot_first[np.argsort(-expert_load(ids, 64))] = np.repeat(np.arange(4), 16)
    low, high = heldout_gain_interval(ids, hot_first, {"contiguous": even}, layer, 4, seed=0, resamples=20)
    assert low <= high < 1.0 and heldout_verdict(low, high) == "slower"
    assert heldout_verdict(0.99, 1.01) == "within sampling error" and heldout_verdict(1.01, 1.02) == "faster"
    assert np.isnan(heldout_gain_interval(ids[:10], even, {"contiguous": even}, layer, 4, seed=0)).all()
