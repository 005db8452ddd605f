"""occult.stages.pretrain: schedule, the structure measure, and a short seeded pre-training run."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from occult.config import load_config
from occult.models.moe import load_checkpoint, moe_layers
from occult.routing.structure import best_random_placement_ct, null_routing, pair_mutual_information
from occult.stages.pretrain import EVAL_TOKENS, heldout_nll, lr_at, pretrain
from occult.routing.profiling import coactivation_counts, corpus_windows
from tests.models.test_moe import tiny_model_cfg, write_standin_data

REPO = Path(__file__).resolve().parents[2]


def small_config(steps: int = 40, **model_changes):
    return load_config(REPO / "config" / "config.yaml", overrides={
        "model": dataclasses.asdict(tiny_model_cfg(**model_changes)),
        "pretrain": {"steps": steps, "batch_size": 8, "seq_len": 32, "lr": 0.01, "warmup_steps": 5,
                     "router_aux_loss": 0.01},
    })


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    cfg = small_config(steps=100).pretrain
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(cfg.lr / 5) and lrs[4] == pytest.approx(cfg.lr)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lr_at(100, cfg) == pytest.approx(0.1 * cfg.lr)


def test_pair_information_separates_grouped_from_random_routing():
    rng = np.random.default_rng(0)
    E, k, N = 8, 2, 4000
    groups = rng.integers(0, 4, N)                        # each token uses one of 4 fixed pairs
    grouped = np.stack([2 * groups, 2 * groups + 1], axis=1)
    load = np.diag(coactivation_counts(torch.from_numpy(grouped), E))
    null = null_routing(load, N, k, rng)
    assert (np.sort(null, axis=1)[:, 0] != np.sort(null, axis=1)[:, 1]).all(), "null picks distinct experts"
    assert np.allclose(np.diag(coactivation_counts(torch.from_numpy(null), E)) / N, load / N, atol=0.03)
    mi_grouped = pair_mutual_information(coactivation_counts(torch.from_numpy(grouped), E))
    mi_null = pair_mutual_information(coactivation_counts(torch.from_numpy(null), E))
    assert mi_grouped > 1.5 and mi_null < 0.3
    # grouped pairs fit on one device once a placement keeps each pair together
    ct_grouped = best_random_placement_ct(grouped, E, 4, rng)
    ct_null = best_random_placement_ct(null, E, 4, rng)
    assert 1.0 <= ct_grouped < ct_null <= 2.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrain")
    data_dir = write_standin_data(root / "data")
    cfg = small_config()
    outputs = {name: root / "run1" / name for name in ("model", "log.csv", "structure.json")}
    pretrain(cfg, data_dir, outputs["model"], outputs["log.csv"], outputs["structure.json"])
    return cfg, data_dir, outputs


def test_pretrain_learns_and_writes_outputs(run):
    cfg, data_dir, outputs = run
    log = pd.read_csv(outputs["log.csv"])
    assert list(log.columns) == ["step", "train_loss", "aux_loss", "lr", "heldout_ppl", "elapsed_s"]
    assert log["step"].tolist() == list(range(1, 41))
    assert log["train_loss"].iloc[-5:].mean() < log["train_loss"].iloc[:5].mean() - 1.0
    measured = log.dropna(subset=["heldout_ppl"])["step"].tolist()
    assert measured == [8, 16, 24, 32, 40]
    assert (log["aux_loss"] > 0).all() and log["elapsed_s"].is_monotonic_increasing
    meta = json.loads(Path(str(outputs["log.csv"]) + ".meta.json").read_text())
    assert meta["config_hash"] == cfg.hash() and meta["seed"] == cfg.seed

    structure = json.loads(outputs["structure.json"].read_text())
    assert [row["layer"] for row in structure["layers"]] == [0, 1]
    assert structure["provenance"]["config_hash"] == cfg.hash()
    assert structure["heldout_ppl"] < structure["unigram_ppl"], "the model must beat the unigram baseline"
    assert structure["heldout_ppl"] == pytest.approx(log["heldout_ppl"].iloc[-1])
    for row in structure["layers"]:
        assert row["excess_pair_mi_bits"] == pytest.approx(row["pair_mi_bits"] - row["null_pair_mi_bits"])
        assert 1.0 <= row["ct_best_random_placement"] <= 2.0
    assert set(structure["mean"]) >= {"excess_pair_mi_bits", "ct_best_random_placement"}
    for when in ("before_training", "after_training"):          # from scratch: a reference map, no groups inherited
        assert structure["inheritance"][when]["basis"] == "reference"
        assert 0 < structure["inheritance"][when]["main_group_share_random"] < 1

    model, tokenizer = load_checkpoint(outputs["model"])
    layers = moe_layers(model)
    assert [l.num_experts for l in layers] == [8, 8] and model.config.router_aux_loss_coef == 0.01
    assert model.config.pad_token_id is None, "pad == eos must not freeze the <|endoftext|> embedding"
    heldout = corpus_windows(data_dir / "corpus" / "heldout.jsonl", tokenizer, EVAL_TOKENS, 32, cfg.seed)
    nll, count = heldout_nll(model, heldout)
    assert math.exp(nll / count) == pytest.approx(structure["heldout_ppl"], rel=1e-5)


def test_pretrain_is_reproducible_and_replaces_outputs(run, tmp_path):
    cfg, data_dir, outputs = run
    again = {name: tmp_path / name for name in ("model", "log.csv", "structure.json")}
    again["model"].mkdir()
    (again["model"] / "stale.txt").write_text("old")
    pretrain(cfg, data_dir, again["model"], again["log.csv"], again["structure.json"])
    first, second = pd.read_csv(outputs["log.csv"]), pd.read_csv(again["log.csv"])
    assert first["train_loss"].tolist() == second["train_loss"].tolist()
    assert not (again["model"] / "stale.txt").exists()
    assert not list(tmp_path.glob(".model.tmp*"))


def test_pretrain_rejects_bad_settings(tmp_path):
    cfg = small_config()
    with pytest.raises(ValueError, match="model.source"):
        pretrain(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, source="checkpoint")),
                 tmp_path, tmp_path / "m", tmp_path / "l.csv", tmp_path / "s.json")
    with pytest.raises(ValueError, match="pretrain.seq_len"):
        pretrain(dataclasses.replace(cfg, pretrain=dataclasses.replace(cfg.pretrain, seq_len=1000)),
                 tmp_path, tmp_path / "m", tmp_path / "l.csv", tmp_path / "s.json")
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        pretrain(cfg, tmp_path, tmp_path / "m", tmp_path / "l.csv", tmp_path / "s.json")


def test_data_parallel_pretraining_matches_one_process(tmp_path):
    """Two gloo ranks, each with half of every batch and averaged gradients, train the same model
    as one process on the whole batch (without the load-balancing loss, which is not linear in
    the tokens); only rank 0 writes."""
    from occult.harness.ranks import run_ranks

    data_dir = write_standin_data(tmp_path / "data")
    base = small_config(steps=6)
    cfg = dataclasses.replace(base, pretrain=dataclasses.replace(base.pretrain, router_aux_loss=0.0))
    paths = {name: {k: tmp_path / name / k for k in ("model", "log.csv", "structure.json")} for name in ("one", "dp")}

    pretrain(cfg, data_dir, *paths["one"].values())

    def rank_main(rank, world):
        pretrain(cfg, data_dir, *paths["dp"].values())
        return rank

    assert run_ranks(rank_main, 2, timeout_s=120.0) == [0, 1]
    one_log, dp_log = (pd.read_csv(paths[n]["log.csv"]) for n in ("one", "dp"))
    np.testing.assert_allclose(dp_log["train_loss"], one_log["train_loss"], rtol=1e-4)
    assert json.loads((paths["dp"]["model"] / "occult_pretrain.json").read_text())["train"]["data_parallel_ranks"] == 2
    one_model, _ = load_checkpoint(paths["one"]["model"])
    dp_model, _ = load_checkpoint(paths["dp"]["model"])
    for (name, a), b in zip(one_model.state_dict().items(), dp_model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    assert not list((tmp_path / "dp").glob("*.resume"))


def test_data_parallel_pretraining_needs_a_batch_that_splits(tmp_path):
    from occult.harness.ranks import run_ranks

    data_dir = write_standin_data(tmp_path / "data")
    base = small_config(steps=2)
    cfg = dataclasses.replace(base, pretrain=dataclasses.replace(base.pretrain, batch_size=7))

    def rank_main(rank, world):
        with pytest.raises(ValueError, match="pretrain.batch_size: 7 rows do not split over 2"):
            pretrain(cfg, data_dir, tmp_path / "m", tmp_path / "l.csv", tmp_path / "s.json")
        return rank

    assert run_ranks(rank_main, 2, timeout_s=60.0) == [0, 1]


def _with_pretrain(cfg, **changes):
    from occult.config import load_config, merge

    return load_config(merge(cfg.raw, {"pretrain": changes}))


def test_pretrain_stops_at_its_target_perplexity_and_resumes_to_the_same_stop(run, tmp_path):
    """`target_heldout_ppl`: the first measurement at or below it ends training (steps is the budget);
    a run paused before it resumes and stops at the same step with the same weights."""
    from occult.stages.pretrain import PretrainPaused, resume_dir_of

    cfg, data_dir, outputs = run
    measured = pd.read_csv(outputs["log.csv"]).dropna(subset=["heldout_ppl"]).set_index("step")["heldout_ppl"]
    target = float(measured.loc[16]) * 1.0001           # the full run reaches it at step 16 (eval every 8)
    early = _with_pretrain(cfg, target_heldout_ppl=target, eval_every=8)
    paths = [tmp_path / "straight" / n for n in ("model", "log.csv", "structure.json")]
    pretrain(early, data_dir, *paths)
    log = pd.read_csv(paths[1])
    assert log["step"].tolist() == list(range(1, 17))
    # the same weights as the full run's first 16 steps: the schedule still spans the 40-step budget
    np.testing.assert_array_equal(log["train_loss"], pd.read_csv(outputs["log.csv"])["train_loss"].iloc[:16])
    train = json.loads(paths[2].read_text())["train"]
    assert (train["steps"], train["step_budget"], train["reached_target"]) == (16, 40, True)
    assert json.loads(paths[2].read_text())["heldout_ppl"] <= target

    paused = [tmp_path / "paused" / n for n in ("model", "log.csv", "structure.json")]
    with pytest.raises(PretrainPaused):
        pretrain(early, data_dir, *paused, time_limit_s=0.0)
    pretrain(early, data_dir, *paused)
    assert not resume_dir_of(paused[0]).exists()
    np.testing.assert_array_equal(pd.read_csv(paused[1])["train_loss"], log["train_loss"])

    unreachable = _with_pretrain(cfg, steps=8, target_heldout_ppl=1.0001, eval_every=4)
    pretrain(unreachable, data_dir, *(tmp_path / "budget" / n for n in ("model", "log.csv", "structure.json")))
    train = json.loads((tmp_path / "budget" / "structure.json").read_text())["train"]
    assert (train["steps"], train["reached_target"]) == (8, False)


def test_pretrain_seed_makes_another_base_model_measured_on_the_same_tokens(run, tmp_path):
    cfg, data_dir, outputs = run
    same = _with_pretrain(cfg, seed=cfg.seed, steps=4)
    other = _with_pretrain(cfg, seed=cfg.seed + 1, steps=4)
    default = _with_pretrain(cfg, steps=4)
    logs = {}
    for name, c in (("default", default), ("same", same), ("other", other)):
        pretrain(c, data_dir, tmp_path / name / "model", tmp_path / name / "log.csv", tmp_path / name / "s.json")
        logs[name] = pd.read_csv(tmp_path / name / "log.csv")["train_loss"].tolist()
    assert logs["same"] == logs["default"] and logs["other"] != logs["default"]
    structure = json.loads((tmp_path / "other" / "s.json").read_text())
    assert structure["train"]["base_seed"] == cfg.seed + 1 and structure["heldout_tokens"] == json.loads(
        (tmp_path / "default" / "s.json").read_text())["heldout_tokens"]
