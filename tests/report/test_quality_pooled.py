"""occult.report.quality_pooled: claims per base model, pooled with the base model as a random effect."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import yaml

from occult.report.quality_pooled import (
    COLUMNS,
    FAMILY_COLUMNS,
    INHERITANCE_COLUMNS,
    MARGIN_PP,
    BaseModel,
    claims_at,
    load_arms,
    main,
    pool,
    pooled_tables,
    verdict,
)

ARMS = ["raw", "sft-moe", "prune2-router-D8-keep-moe", "prune2-sim-D8-keep-moe", "prune1-router-D8-keep-moe",
        "prune1-sim-D8-keep-moe", "prune2-sim-D8-renormalise-moe", "prune1-sim-D8-renormalise-moe"]


def write_run(root, name: str, shifts: dict[str, float], documents: int = 20000, seed: int = 0):
    """A run folder whose arms answer the same `documents` piqa documents: SFT's answers, each other
    arm's differing from them on just enough documents to move its accuracy by `shifts[arm]`."""
    rng = np.random.default_rng(seed)
    sft = rng.random(documents) < 0.5
    run = root / name
    (run / "evaluate").mkdir(parents=True)
    for arm in ARMS:
        bits = sft.copy()
        shift = shifts.get(arm, 0.0)
        flips = int(round(abs(shift) * documents))
        candidates = np.flatnonzero(~sft if shift > 0 else sft)
        bits[rng.choice(candidates, flips, replace=False)] = shift > 0
        per_doc = "".join("1" if b else "0" for b in bits)
        (run / "evaluate" / f"{arm}.json").write_text(json.dumps({"arm": arm, "variant": arm.split("-D")[0],
                                                                   "per_doc": {"piqa": per_doc}}))
    return run


def test_pool_is_dersimonian_laird():
    mu, se, tau = pool([1.0, 1.0, 1.0], [0.5, 1.0, 2.0])
    assert (mu, tau) == (1.0, 0.0) and se == pytest.approx(1 / math.sqrt(4 + 1 + 0.25))
    y, s = np.array([2.0, -1.0, 0.5]), np.array([0.5, 0.5, 1.0])
    w = 1 / s**2
    fixed = (w * y).sum() / w.sum()
    tau2 = ((w * (y - fixed) ** 2).sum() - 2) / (w.sum() - (w**2).sum() / w.sum())
    mu, se, tau = pool(list(y), list(s))
    assert tau == pytest.approx(math.sqrt(tau2))
    w_star = 1 / (s**2 + tau2)
    assert mu == pytest.approx((w_star * y).sum() / w_star.sum()) and se == pytest.approx(w_star.sum() ** -0.5)
    one = pool([0.3], [0.2])
    assert one[:2] == (0.3, 0.2) and math.isnan(one[2])
    with pytest.raises(ValueError, match="not negative"):
        pool([0.1, 0.2], [0.1, -1.0])
    assert pool([0.0, 0.0], [0.0, 0.0])[0] == 0.0          # identical arms: no error at all


def test_verdict_rules():
    near, below, above, either = (next(c for c in claims_at(8) if c.kind == k) for k in ("near", "below", "above", "either"))
    two = [(0.0, 1.0), (0.0, 1.0)]
    assert verdict(near, -0.4, 0.2, two) == "holds"                     # lo = -0.8 > -1
    assert verdict(near, -1.8, 0.3, two) == "does not hold"             # hi = -1.2 < -1
    assert verdict(near, -1.0, 0.5, two) == "not settled"
    assert verdict(below, -1.0, 0.3, two) == "holds"
    assert verdict(below, 0.2, 0.4, two) == "does not hold"             # lo = -0.6 > -1: no loss beyond the margin
    assert verdict(above, 0.8, 0.3, two) == "holds"
    assert verdict(above, 0.1, 0.2, two) == "does not hold"             # hi = 0.5 < 1: no gain as large as the margin
    assert verdict(either, -0.9, 0.3, two) == "kept better"
    assert verdict(either, 0.1, 0.3, two) == "no difference beyond the margin"
    assert verdict(below, -1.0, 0.3, [(-1.0, 0.3)]) == "holds (one base model)"
    # two base models each clearly beyond their own error, in opposite directions
    assert verdict(below, 0.0, 2.0, [(-2.0, 0.3), (2.0, 0.3)]) == "mixed"
    assert MARGIN_PP == 1.0


def test_consistent_base_models_settle_a_claim(tmp_path):
    shifts = {"prune1-router-D8-keep-moe": -0.03, "prune1-sim-D8-keep-moe": -0.03, "raw": -0.02}
    runs = [write_run(tmp_path, f"b{i}", shifts, seed=i) for i in range(2)]
    table, bases = pooled_tables({"family": [BaseModel(r) for r in runs]}, devices=8)
    assert list(table.columns) == COLUMNS + FAMILY_COLUMNS
    assert table["inheritance_base_models"].eq(0).all() and table["inheritance_index"].isna().all()
    assert table["base_heldout_ppl"].isna().all() and bases["base_heldout_ppl"].isna().all()   # no pretrain logs
    row = table.set_index("claim").loc["N_d=1 hurts (kept gates)"]
    assert row["estimate_pp"] == pytest.approx(-3.0, abs=1e-9) and row["base_models"] == 2
    assert row["between_base_sd_pp"] == pytest.approx(0.0) and row["verdict"] == "holds"
    assert table.set_index("claim").loc["N_d=2 near SFT (kept gates)", "verdict"] == "holds"
    assert table.set_index("claim").loc["SFT beats the raw model", "verdict"] == "holds"
    assert len(bases) == 2 * len(table)


def write_inheritance(path, heldout_index: float, basis: str, calibration_index: float = 0.9) -> None:
    """An inheritance table (occult.routing.inheritance's columns that the pooled table reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"split": split, "layer": layer, "basis": basis, "inheritance_index": value}
            for split, mean in (("calibration", calibration_index), ("heldout", heldout_index))
            for layer, value in (("0", mean - 0.1), ("1", mean + 0.1), ("mean", mean))]
    pd.DataFrame(rows).to_csv(path, index=False)


def test_each_family_carries_its_base_models_inheritance(tmp_path):
    groups = [write_run(tmp_path, f"g{i}", {}, seed=i) for i in range(3)]
    drop = [write_run(tmp_path, f"d{i}", {}, seed=10 + i) for i in range(2)]
    write_inheritance(groups[0] / "tables" / "inheritance.csv", 0.5, "inherited")      # a committed run
    write_inheritance(groups[1] / "placement" / "inheritance.csv", 0.4, "inherited")   # a base model's folder
    write_inheritance(drop[0] / "placement" / "inheritance.csv", 0.02, "reference")
    write_inheritance(drop[1] / "placement" / "inheritance.csv", -0.04, "reference")
    table, _ = pooled_tables({"virtual_groups": [BaseModel(r) for r in groups],
                              "drop": [BaseModel(r) for r in drop]}, devices=8)
    families = table.groupby("model_family")[INHERITANCE_COLUMNS].agg(lambda c: c.unique().tolist())
    assert families.loc["virtual_groups", "inheritance_index"] == [pytest.approx(0.45)]     # held-out means, g2 has none
    assert families.loc["virtual_groups", "inheritance_basis"] == ["inherited"]
    assert families.loc["virtual_groups", "inheritance_base_models"] == [2]
    assert families.loc["drop", "inheritance_index"] == [pytest.approx(-0.01)]
    assert families.loc["drop", "inheritance_basis"] == ["reference"]


def write_pretrain_log(run, heldout_ppl: list[float | None]) -> None:
    """A pre-training log (occult.stages.pretrain's columns) evaluated where `heldout_ppl` is not None."""
    (run / "model").mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"step": range(1, len(heldout_ppl) + 1), "train_loss": 2.0,
                  "heldout_ppl": heldout_ppl}).to_csv(run / "model" / "pretrain_log.csv", index=False)


def test_each_family_and_base_model_carries_its_final_heldout_perplexity(tmp_path):
    groups = [write_run(tmp_path, f"g{i}", {}, seed=i) for i in range(2)]
    drop = [write_run(tmp_path, f"d{i}", {}, seed=10 + i) for i in range(2)]
    write_pretrain_log(groups[0], [6.1, None, 5.1, None])        # the last evaluation, not the last row
    write_pretrain_log(groups[1], [6.2, 5.3])
    write_pretrain_log(drop[0], [90.0, 7.0, 6.4])
    table, bases = pooled_tables({"virtual_groups": [BaseModel(r) for r in groups],
                                  "drop": [BaseModel(r) for r in drop]}, devices=8)
    per_family = table.groupby("model_family")["base_heldout_ppl"].agg(lambda c: c.unique().tolist())
    assert per_family["virtual_groups"] == [pytest.approx(5.2)]
    assert per_family["drop"] == [pytest.approx(6.4)]               # d1 has no log: left out of the mean
    per_base = bases.groupby("base_model")["base_heldout_ppl"].first()
    assert per_base["g0"] == pytest.approx(5.1) and per_base["d0"] == pytest.approx(6.4) and np.isnan(per_base["d1"])
    write_pretrain_log(drop[1], [None, None])
    with pytest.raises(ValueError, match=r"d1/model/pretrain_log.csv: column 'heldout_ppl' has no value"):
        pooled_tables({"drop": [BaseModel(r) for r in drop]}, devices=8)


def test_between_base_spread_that_dominates_leaves_a_claim_unsettled_or_mixed(tmp_path):
    """N_d = 1 costs 2.5 points on one base model and gains 2.5 on the other, each far beyond its own
    per-document error: the verdict is `mixed`, and the pooled error is the spread's, not the documents'.
    Smaller opposite moves, each within 2 errors of zero: `not settled`."""
    big = [write_run(tmp_path, "big0", {"prune1-router-D8-keep-moe": -0.025, "prune1-sim-D8-keep-moe": -0.025}, seed=0),
           write_run(tmp_path, "big1", {"prune1-router-D8-keep-moe": 0.025, "prune1-sim-D8-keep-moe": 0.025}, seed=1)]
    table, bases = pooled_tables({"family": [BaseModel(r) for r in big]}, devices=8)
    row = table.set_index("claim").loc["N_d=1 hurts (kept gates)"]
    own = bases[bases["claim"] == "N_d=1 hurts (kept gates)"]
    assert (own["estimate_pp"].abs() > 2 * own["stderr_pp"]).all()
    assert row["verdict"] == "mixed" and row["between_base_sd_pp"] > 3.0
    assert row["stderr_pp"] > 5 * own["stderr_pp"].max()
    small = [write_run(tmp_path, "small0", {"prune1-router-D8-keep-moe": -0.0008, "prune1-sim-D8-keep-moe": -0.0008},
                       documents=2000, seed=2),
             write_run(tmp_path, "small1", {"prune1-router-D8-keep-moe": -0.012, "prune1-sim-D8-keep-moe": -0.012},
                       documents=2000, seed=3)]
    table, bases = pooled_tables({"family": [BaseModel(r) for r in small]}, devices=8)
    assert table.set_index("claim").loc["N_d=1 hurts (kept gates)", "verdict"] == "not settled"


def test_renames_and_missing_arms(tmp_path):
    run = write_run(tmp_path, "old", {"prune2-sim-D8-keep-moe": 0.01})
    renamed = load_arms(BaseModel(run, (("prune2-sim-D8-keep-moe", "prune2-sim-D8-ablation-moe"),)))
    assert "prune2-sim-D8-keep-moe" not in renamed and "prune2-sim-D8-ablation-moe" in renamed
    with pytest.raises(ValueError, match="rename names 'nope'"):
        load_arms(BaseModel(run, (("nope", "x"),)))
    with pytest.raises(ValueError, match="collides"):
        load_arms(BaseModel(run, (("prune2-sim-D8-keep-moe", "sft-moe"),)))
    (run / "evaluate" / "prune1-router-D8-keep-moe.json").unlink()
    table, _ = pooled_tables({"f": [BaseModel(run)]}, devices=8)
    claims = set(table["claim"])
    assert "N_d=1 hurts (kept gates)" not in claims and "N_d=2 near SFT (kept gates)" in claims
    assert all(v.endswith("(one base model)") for v in table["verdict"])


def test_cli_reads_a_spec_and_writes_the_table_bases_and_figure(tmp_path):
    runs = [write_run(tmp_path, f"r{i}", {"prune1-sim-D8-keep-moe": -0.02}, seed=i) for i in range(2)]
    spec = tmp_path / "pooled.yaml"
    spec.write_text(yaml.safe_dump({"devices": 8, "families": {"drop": [{"run": str(runs[0])}, {"run": str(runs[1])}],
                                                               "virtual_groups": [{"run": str(runs[0])}]}}))
    out = tmp_path / "tables" / "verdicts_pooled.csv"
    assert main(["--spec", str(spec), "--out", str(out), "--figure", str(tmp_path / "pooled.png")]) == 0
    table = pd.read_csv(out)
    assert list(table.columns) == COLUMNS + FAMILY_COLUMNS and set(table["model_family"]) == {"drop", "virtual_groups"}
    assert pd.read_csv(tmp_path / "tables" / "verdicts_pooled_bases.csv")["base_model"].nunique() == 2
    assert (tmp_path / "pooled.png").stat().st_size > 1000
    assert main(["--family", "drop", "--runs", str(runs[0]), "--out", str(tmp_path / "one.csv")]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"devices": 8}))
    with pytest.raises(ValueError, match="missing field 'families'"):
        main(["--spec", str(bad), "--out", str(tmp_path / "x.csv")])
    assert not (tmp_path / "x.csv").exists()
    lonely = tmp_path / "lonely" / "evaluate"
    lonely.mkdir(parents=True)
    (lonely / "raw.json").write_text((runs[0] / "evaluate" / "raw.json").read_text())
    with pytest.raises(ValueError, match="no claim could be measured"):
        main(["--family", "f", "--runs", str(lonely.parent), "--out", str(tmp_path / "y.csv")])
