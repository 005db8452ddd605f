"""occult.routing.inheritance: how far routing follows the groups a model was initialised with."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from occult.routing.inheritance import (
    COLUMNS,
    group_inheritance,
    group_map_of_model,
    load_matched_null,
    main,
    random_routing_expectation,
    split_name,
    token_group_stats,
    virtual_group_map,
)


def uniform_routing(tokens: int, experts: int, top_k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]


def group_routing(tokens: int, experts: int, top_k: int, seed: int) -> np.ndarray:
    """Each token takes one whole virtual group (expert j in group j mod E/k), as upcycling starts."""
    groups = experts // top_k
    picked = np.random.default_rng(seed).integers(0, groups, tokens)
    return picked[:, None] + groups * np.arange(top_k)[None, :]


@pytest.mark.parametrize("sizes,top_k", [((8,) * 8, 8), ((4,) * 4, 4), ((3, 2, 1), 2), ((5, 1, 1, 1), 3)])
def test_random_expectation_is_exact(sizes, top_k):
    group_of = np.repeat(np.arange(len(sizes)), sizes)
    spanned, share = random_routing_expectation(group_of, top_k)
    mc_spanned, mc_share = token_group_stats(uniform_routing(200_000, len(group_of), top_k, 1), group_of)
    assert spanned == pytest.approx(mc_spanned, abs=0.01)
    assert share == pytest.approx(mc_share, abs=0.003)


def test_random_expectation_small_case_by_hand():
    # experts {0,1,2} in group 0, {3,4} in 1, {5} in 2; pairs: 15, same-group pairs 3 + 1 = 4
    spanned, share = random_routing_expectation(np.array([0, 0, 0, 1, 1, 2]), 2)
    assert spanned == pytest.approx((4 * 1 + 11 * 2) / 15)
    assert share == pytest.approx((4 * 1.0 + 11 * 0.5) / 15)


def test_whole_group_routing_is_fully_inherited_and_uniform_routing_is_not():
    group_of = virtual_group_map(64, 8)
    grouped = group_inheritance(group_routing(4000, 64, 8, 0), group_of)
    row = grouped[grouped["layer"] == "0"].iloc[0]
    assert row["groups_spanned"] == 1.0 and row["main_group_share"] == 1.0 and row["inheritance_index"] == 1.0
    assert row["groups_spanned_random"] == pytest.approx(5.4326, abs=1e-4)
    uniform = group_inheritance(uniform_routing(20_000, 64, 8, 2), group_of)
    row = uniform.iloc[0]
    assert abs(row["inheritance_index"]) < 0.01
    assert row["groups_spanned"] == pytest.approx(row["groups_spanned_random"], abs=0.03)
    assert row["main_group_share_load_null"] == pytest.approx(row["main_group_share_random"], abs=0.01)


def test_load_matched_null_follows_unequal_loads():
    """All load on one group's experts: the null, which keeps the loads, stays in that group too,
    while the uniform random value does not."""
    group_of = virtual_group_map(16, 4)                 # 4 groups of 4
    hot = np.array([0, 4, 8, 12])                       # group 0
    ids = np.tile(hot, (500, 1))
    ids[:5] = [1, 5, 9, 13]                             # a few tokens elsewhere
    spanned, share = load_matched_null(ids, group_of, np.random.default_rng(0))
    assert share > 0.95 and spanned < 1.2
    assert random_routing_expectation(group_of, 4)[1] < 0.6


def test_table_has_a_mean_row_and_refuses_bad_input():
    ids = np.stack([group_routing(300, 16, 4, 0), uniform_routing(300, 16, 4, 1)])
    table = group_inheritance(ids, virtual_group_map(16, 4), layers=[3, 7], basis="reference")
    assert table["layer"].tolist() == ["3", "7", "mean"]
    assert set(table["basis"]) == {"reference"}
    assert table.iloc[2]["main_group_share"] == pytest.approx(table.iloc[:2]["main_group_share"].mean())
    with pytest.raises(ValueError, match="expert ids outside 0..15"):
        group_inheritance(ids + 1, virtual_group_map(16, 4))
    with pytest.raises(ValueError, match="basis: 'own'"):
        group_inheritance(ids, virtual_group_map(16, 4), basis="own")
    with pytest.raises(ValueError, match="layers: 1 names for 2 layers"):
        group_inheritance(ids, virtual_group_map(16, 4), layers=[0])
    with pytest.raises(ValueError, match="not a multiple of top_k 3"):
        virtual_group_map(16, 3)


def test_group_map_of_model_says_whether_the_groups_are_inherited():
    vg = {"num_local_experts": 64, "num_experts_per_tok": 8, "occult_upcycle": {"groups": 8}}
    group_of, basis = group_map_of_model(vg)
    assert basis == "inherited" and group_of[9] == 1 and group_of.max() == 7
    drop = {**vg, "occult_upcycle": {"init": "drop", "drop_ratio": 0.5}}
    assert group_map_of_model(drop)[1] == "reference"
    scratch = {"num_experts": 64, "num_experts_per_tok": 8}         # OLMoE from scratch: no record
    assert group_map_of_model(scratch)[1] == "reference"
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        group_map_of_model({"num_local_experts": 8})


def test_cli_writes_one_split_per_trace(tmp_path):
    for split, ids in (("calibration", group_routing(256, 16, 4, 0)), ("heldout", uniform_routing(256, 16, 4, 1))):
        np.savez(tmp_path / f"routing_{split}_sample.npz", ids=ids[None].astype(np.uint8),
                 sources=np.zeros(256, np.uint8), source_names=np.array(["kjv"]), layers=np.array([5]))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_local_experts": 16, "num_experts_per_tok": 4, "occult_upcycle": {"groups": 4}}))
    out = tmp_path / "inheritance.csv"
    assert main(["--routing", str(tmp_path / "routing_calibration_sample.npz"),
                 str(tmp_path / "routing_heldout_sample.npz"), "--model-config", str(config), "--out", str(out)]) == 0
    table = pd.read_csv(out)
    assert list(table.columns) == COLUMNS
    assert table["split"].tolist() == ["calibration", "calibration", "heldout", "heldout"]
    assert table.loc[0, "inheritance_index"] == 1.0 and abs(table.loc[2, "inheritance_index"]) < 0.15
    with pytest.raises(FileNotFoundError, match="nope.json: no such model config"):
        main(["--routing", str(tmp_path / "routing_heldout_sample.npz"), "--model-config",
              str(tmp_path / "nope.json"), "--out", str(tmp_path / "x.csv")])
    assert not (tmp_path / "x.csv").exists()
    assert split_name(tmp_path / "routing_heldout.npz") == "heldout"
