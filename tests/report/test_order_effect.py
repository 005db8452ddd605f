"""The order effect (`occult.report.order_effect`) on synthetic sweeps: an injected slowdown per
position is found and called so, pure noise stays within the run-to-run spread, an ordinary sweep
(one order per point) is fitted too, and bad input stops with one error naming the file and column."""

from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest

from occult.report import order_effect

SHAPES = ("olmoe", "qwen", "deepseek")
METHODS = ("occult", "megablocks", "naive", "fsdp")


def order_check_rows(effect: float, noise: float, seed: int, replicates: int = 6, sizes=(16384,),
                     alone: tuple[str, ...] = ()) -> pd.DataFrame:
    """Rows as an order check writes them: per replicate and point the methods in a random order, each
    median_ms = a level of its own * (1 + effect)^position * lognormal noise; methods in `alone` run
    in a process of their own (always position 0)."""
    rng = np.random.default_rng(seed)
    shuffle = random.Random(seed)
    level = {(shape, size, m): rng.uniform(1, 8) * size / sizes[0] for shape in SHAPES for size in sizes for m in METHODS}
    shared = [m for m in METHODS if m not in alone]
    rows = []
    for replicate in range(replicates):
        for shape in SHAPES:
            for size in sizes:
                placed = [(p, m) for p, m in enumerate(shuffle.sample(shared, len(shared)))] + [(0, m) for m in alone]
                for position, method in placed:
                    rows.append({"kind": "prefill", "D": 1, "routing": "synthetic", "shape": shape,
                                 "tokens_per_gpu": size, "batch": None, "method": method, "status": "ok",
                                 "order_position": position, "replicate": replicate, "order_seed": replicate,
                                 "median_ms": level[(shape, size, method)] * (1 + effect) ** position
                                 * float(np.exp(rng.normal(0, noise)))})
    return pd.DataFrame(rows)


def analyse(tmp_path, frame: pd.DataFrame, name: str = "order_check_prefill_D1.csv") -> pd.DataFrame:
    path = tmp_path / name
    frame.to_csv(path, index=False)
    table = order_effect.make_order_effect([path], tmp_path / "order_effect.csv", tmp_path / "fig" / "order_effect.png")
    assert pd.read_csv(tmp_path / "order_effect.csv").shape == table.shape
    assert (tmp_path / "fig" / "order_effect.png").stat().st_size > 0
    return table


def test_an_injected_slowdown_per_position_is_found_and_moves_the_median(tmp_path):
    table = analyse(tmp_path, order_check_rows(effect=0.10, noise=0.02, seed=1))
    assert len(table) == len(SHAPES) * len(METHODS) and (table["replicates"] == 6).all()
    assert (table["verdict"] == order_effect.MOVES).all(), table[["shape", "method", "verdict"]]
    assert (table["model"] == order_effect.CELL_FE).all() and (table["position_range"] == 3).all()
    assert ((table["effect_low_pct"] < 10) & (10 < table["effect_high_pct"])).all()
    assert table["effect_low_pct"].gt(7).all() and table["effect_high_pct"].lt(13).all()
    assert table["first_vs_last_pct"].dropna().between(20, 50).all()
    assert (table["spread_pct"] < table["range_pct"] / 2).all()        # the order effect is not counted as noise


def test_pure_noise_stays_within_the_run_to_run_spread(tmp_path):
    tables = [analyse(tmp_path, order_check_rows(effect=0.0, noise=0.02, seed=seed)) for seed in range(8)]
    verdicts = pd.concat(tables)["verdict"]
    assert set(verdicts) <= {order_effect.WITHIN, order_effect.MOVES}
    assert (verdicts == order_effect.WITHIN).mean() >= 0.9, verdicts.value_counts()
    effects = pd.concat(tables).drop_duplicates(["method", "effect_pct_per_position"])
    assert effects["effect_pct_per_position"].abs().lt(2).all()
    covered = (effects["effect_low_pct"] < 0) & (0 < effects["effect_high_pct"])
    assert covered.mean() >= 0.8                                        # a 95% interval


def test_a_method_alone_in_its_process_is_not_varied(tmp_path):
    table = analyse(tmp_path, order_check_rows(effect=0.0, noise=0.02, seed=3, alone=("fsdp",)))
    alone = table[table["method"] == "fsdp"]
    assert (alone["verdict"] == order_effect.NOT_VARIED).all() and alone["effect_pct_per_position"].isna().all()
    assert (alone["spread_pct"] > 0).all() and (alone["positions"] == 1).all()
    assert (table.loc[table["method"] != "fsdp", "position_range"] == 2).all()


def test_two_replicates_of_one_shape_leave_too_few_rows_to_fit(tmp_path):
    frame = order_check_rows(effect=0.0, noise=0.02, seed=8, replicates=2)
    table = analyse(tmp_path, frame[frame["shape"] == "olmoe"])
    assert (table["positions"] == 2).any()
    assert (table["verdict"] == table["positions"].map({1: order_effect.NOT_VARIED, 2: order_effect.TOO_FEW})).all()
    assert table["effect_pct_per_position"].isna().all() and (table["replicates"] == 2).all()


def test_an_ordinary_sweep_with_one_order_per_point_is_fitted_across_points(tmp_path):
    frame = order_check_rows(effect=0.10, noise=0.02, seed=4, replicates=1, sizes=(1024, 4096, 16384, 65536))
    table = analyse(tmp_path, frame.drop(columns=["replicate"]), name="sweep_prefill_D1.csv")
    assert (table["model"] == order_effect.ADDITIVE_FE).all()
    assert (table["verdict"] == order_effect.NO_REPLICATES).all() and table["spread_pct"].isna().all()
    assert ((table["effect_low_pct"] < 10) & (10 < table["effect_high_pct"])).all()


def test_the_command_line_writes_beside_its_input(tmp_path):
    path = tmp_path / "run" / "order_check_decode_D2.csv"
    path.parent.mkdir()
    order_check_rows(effect=0.0, noise=0.02, seed=5, replicates=2).assign(kind="decode", D=2).to_csv(path, index=False)
    assert order_effect.main([str(path)]) == 0
    assert sorted(p.name for p in path.parent.iterdir()) == ["order_check_decode_D2.csv", "order_effect.csv",
                                                            "order_effect.png"]
    table = pd.read_csv(path.parent / "order_effect.csv")
    assert set(table["kind"]) == {"decode"} and set(table["D"]) == {2} and (table["replicates"] == 2).all()


@pytest.mark.parametrize("damage, message", [
    (lambda f: f.drop(columns=["order_position"]), r"order_check_prefill_D1.csv: no column 'order_position'"),
    (lambda f: f.drop(columns=["median_ms", "shape"]), r"order_check_prefill_D1.csv: no column 'shape' \(nor \['median_ms'\]\)"),
    (lambda f: f.iloc[:0], r"order_check_prefill_D1.csv: no rows"),
    (lambda f: f.assign(status="error: setup: boom"), r"order_check_prefill_D1.csv: no ok rows"),
    (None, r"order_check_prefill_D1.csv: empty file"),
])
def test_bad_input_names_the_file_and_column_and_writes_nothing(tmp_path, damage, message):
    path = tmp_path / "order_check_prefill_D1.csv"
    if damage is None:
        path.write_text("")
    else:
        damage(order_check_rows(effect=0.0, noise=0.02, seed=6, replicates=2)).to_csv(path, index=False)
    with pytest.raises(order_effect.OrderEffectError, match=message):
        order_effect.make_order_effect([path], tmp_path / "out" / "order_effect.csv", tmp_path / "out" / "f.png")
    assert not (tmp_path / "out").exists()
    with pytest.raises(order_effect.OrderEffectError, match="missing.csv: no such file"):
        order_effect.read_runs([tmp_path / "missing.csv"])


def test_a_committed_run_with_an_order_check_adds_its_summary_to_the_default_dag(tmp_path):
    """`rule all` summarises the order checks of indexed runs (rule summarise_order_check), beside the
    run's sweep figures, and never measures it again; in the committed tree, one job per run holding
    an order check."""
    from tests.workflow.test_gpu_targets import jobs
    from tests.workflow.test_workflow import REPO, dry_run

    run = tmp_path / "results" / "gpu-a" / "sweeps_v1"
    run.mkdir(parents=True)
    order_check_rows(effect=0.0, noise=0.02, seed=7, replicates=2).to_csv(run / "order_check_prefill_D1.csv",
                                                                         index=False)
    (run / "sweep_prefill_D1.csv").write_text("kind,shape,method,D,tokens_per_gpu,median_ms,status\n"
                                              "prefill,olmoe,occult,1,1024,1.0,ok\n")
    (run.parent / "index.csv").write_text("run,kind,commit,target,status,superseded_by,in_tree,used_by,note\n"
                                          "sweeps_v1,sweeps,abc1234,snakemake x,current,,yes,,order check\n")
    out = dry_run("-p", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                  "--configfile", str(REPO / "config" / "config.yaml"))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    (job,) = jobs(out.stdout)["summarise_order_check"]
    assert "python -m occult.report.order_effect results/gpu-a/sweeps_v1/order_check_prefill_D1.csv " in job
    assert "--figure figures/gpu-a/sweeps_v1_order/order_effect.png" in job
    assert "plot_gpu_sweeps" in jobs(out.stdout) and "run_order_check" not in jobs(out.stdout)   # never measured again
    committed = sorted(str(p.parent) for p in (REPO / "results").glob("*/sweeps_*/order_check_*_D*.csv"))
    tree = dry_run("--forceall", "-p")
    assert committed and len(jobs(tree.stdout).get("summarise_order_check", [])) == len(set(committed))
