"""Config validation: each bad value gives one ConfigError naming the offending field."""

import json
import os

import pytest
import yaml

from occult.config import ConfigError, load_config, merge, parse_variant

DEFAULT = yaml.safe_load(open("config/config.yaml"))


def bad(override: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(merge(DEFAULT, override))
    assert field in str(err.value), str(err.value)


def test_default_loads_and_hashes_stably():
    a, b = load_config("config/config.yaml"), load_config(DEFAULT)
    assert a.hash() == b.hash() and a.num_experts == 16 and a.top_k == 4
    assert load_config(merge(DEFAULT, {"seed": 1})).hash() != a.hash()


@pytest.mark.parametrize("preset", ["tiny", "mini"])
def test_presets_load(preset):
    cfg = load_config(merge(DEFAULT, yaml.safe_load(open(f"config/presets/{preset}.yaml"))))
    assert cfg.run == preset


def test_shipped_presets_are_the_repository_files(tmp_path, monkeypatch):
    """`load_config("mini")`: the package's copy of config/ (occult/resources), default + preset."""
    from occult.config import preset_config, preset_names, resource

    assert resource("schema.yaml").read_text() == open("config/schema.yaml").read()
    assert preset_names() == sorted(p[:-5] for p in os.listdir("config/presets") if p.endswith(".yaml"))
    mini = merge(DEFAULT, yaml.safe_load(open("config/presets/mini.yaml")))
    assert preset_config("mini") == mini and load_config("mini").hash() == load_config(mini).hash()
    assert load_config("tiny").hash() == load_config(DEFAULT).hash()
    with pytest.raises(ConfigError, match="config file nope does not exist .*shipped preset: mini, "):
        load_config("nope")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mini").write_text(yaml.safe_dump(merge(DEFAULT, {"seed": 5})))
    assert load_config("mini").seed == 5            # a file of that name wins over the preset


def test_unknown_key_is_named():
    bad({"model": {"hiden_size": 3}}, "model.hiden_size")
    bad({"colour": 1}, "colour")


def test_type_error_is_named():
    bad({"pretrain": {"lr": "fast"}}, "pretrain.lr")


def test_simulate_holds_model_settings_and_no_measured_files():
    """The measured runs come from the results tree (simulator.yaml); file lists in the config are
    unknown keys, and the measured constants are optional overrides."""
    cfg = load_config(DEFAULT).simulate
    assert cfg.dense_tflops is None and cfg.kernel_stream_gbps is None and cfg.hbm_gbps == 4300
    assert set(DEFAULT["simulate"]["prediction_check"]) == {"predictions"}
    for key in ("measured", "calibration", "history", "folders", "shared_ab", "alltoall_csv", "gemm_csv"):
        bad({"simulate": {key: []}}, f"simulate.{key}: unknown key")
    bad({"simulate": {"prediction_check": {"measured": []}}}, "simulate.prediction_check.measured: unknown key")
    bad({"simulate": {"dense_tflops": 0}}, "simulate.dense_tflops")
    assert load_config(merge(DEFAULT, {"simulate": {"dense_tflops": 700}})).simulate.dense_tflops == 700


def test_experts_not_divisible_by_devices():
    bad({"placement": {"devices": [2, 3]}}, "placement.devices")
    bad({"bench": {"devices": 3}}, "bench.devices")


def test_pruning_needs_enough_experts_per_device_set():
    # E=16, k=4, D=8: two experts per device, so N_d=1 leaves 2 < k experts
    bad({"finetune": {"devices": 8}}, "finetune.variants: prune1")
    bad({"bench": {"devices": 8, "cases": ["prune1"]}}, "bench.cases: prune1")


def test_missing_checkpoint_is_named(tmp_path):
    bad({"model": {"source": "checkpoint", "checkpoint": str(tmp_path / "nope")}}, "model.checkpoint")
    bad({"model": {"source": "checkpoint"}}, "model.checkpoint")


def test_checkpoint_shape_read_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 64, "num_experts_per_tok": 8}))
    cfg = load_config(merge(DEFAULT, {"model": {"source": "checkpoint", "checkpoint": str(tmp_path)}}))
    assert (cfg.num_experts, cfg.top_k) == (64, 8)
    (tmp_path / "config.json").write_text("{")
    bad({"model": {"source": "checkpoint", "checkpoint": str(tmp_path)}}, "model.checkpoint")


def test_variant_names():
    assert parse_variant("prune2-sim").max_devices == 2
    assert parse_variant("sft").max_devices is None
    with pytest.raises(ConfigError, match="finetune.variants"):
        parse_variant("prune-x")


def test_base_model_and_grid_keys_are_checked():
    bad({"model": {"upcycle_init": "copies"}}, "model.upcycle_init")
    bad({"model": {"upcycle_init": "drop"}}, "model.upcycle_init")           # the default model is trained from scratch
    bad({"model": {"drop_ratio": 1.5}}, "model.drop_ratio")
    bad({"pretrain": {"seed": -1}}, "pretrain.seed")
    bad({"pretrain": {"target_heldout_ppl": 0.5}}, "pretrain.target_heldout_ppl")
    bad({"pretrain": {"steps": 0, "target_heldout_ppl": 5.0}}, "pretrain.target_heldout_ppl")
    bad({"pretrain": {"eval_every": 0}}, "pretrain.eval_every")
    bad({"finetune": {"quality_arms": "some"}}, "finetune.quality_arms")
    bad({"finetune": {"base_seeds": [0, 1]}}, "finetune.base_seeds")         # without the quality grid
    bad({"finetune": {"quality_grid": True, "base_seeds": [1, 1]}}, "finetune.base_seeds")
    cfg = load_config(merge(DEFAULT, {"pretrain": {"seed": 3, "target_heldout_ppl": 9.5, "eval_every": 7},
                                      "finetune": {"quality_grid": True, "quality_arms": "core", "base_seeds": [0, 2]}}))
    assert cfg.pretrain.base_seed(cfg.seed) == 3 and cfg.finetune.base_seeds == (0, 2)
    assert load_config(DEFAULT).pretrain.base_seed(5) == 5


def test_the_drop_preset_is_the_upcycle_preset_with_another_initialisation():
    """Same data, model sizes, profiling, placement, fine-tuning recipe and seed; only the
    initialisation, the pre-training length (a perplexity target within a budget) and the grid differ."""
    vg = yaml.safe_load(open("config/presets/upcycle.yaml"))
    drop = yaml.safe_load(open("config/presets/upcycle-drop.yaml"))
    for section in ("data", "profile", "placement", "evaluate", "bench"):
        assert drop[section] == vg[section], section
    assert drop.get("seed") == vg.get("seed")
    changed = {"upcycle_init", "drop_ratio", "router_noise"}
    assert {k: v for k, v in drop["model"].items() if k not in changed} == \
           {k: v for k, v in vg["model"].items() if k not in changed}
    assert drop["model"]["upcycle_init"] == "drop" and vg["model"].get("upcycle_init", "virtual_groups") == "virtual_groups"
    kept = {"batch_size", "seq_len", "lr", "warmup_steps", "router_aux_loss"}
    assert {k: drop["pretrain"][k] for k in kept} == {k: vg["pretrain"][k] for k in kept}
    assert drop["pretrain"]["steps"] >= vg["pretrain"]["steps"] and drop["pretrain"]["target_heldout_ppl"] > 1
    recipe = {"devices", "variants", "steps", "batch_size", "seq_len", "lr"}
    assert {k: drop["finetune"][k] for k in recipe} == {k: vg["finetune"][k] for k in recipe}
    assert len(drop["finetune"]["base_seeds"]) >= 2
