"""The quality grid over base models (workflow/rules/quality_grid.smk): one target pre-trains, profiles
and places every base model of finetune.base_seeds, fine-tunes and scores the grid's arms on each,
and pools the claims; each model stage gets one GPU through the allocator; a job cut off or failed
part-way keeps its finished arms, and the same target then continues from them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.workflow.test_gpu_targets import jobs
from tests.workflow.test_profiles import PROFILES, REPO, SNAKEMAKE

GRID = {"finetune": {"quality_grid": True, "quality_arms": "core", "base_seeds": [0, 1]}}
TARGET = "results/micro/bases/verdicts_pooled.csv"


def run(workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    grid = workdir / "grid.yaml"
    grid.write_text(yaml.safe_dump(GRID))
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--configfile",
           str(REPO / "config" / "config.yaml"), str(REPO / "tests" / "data" / "micro.yaml"), str(grid), *extra]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env)


def finished(out: subprocess.CompletedProcess) -> set[str]:
    """The rules of the jobs a (real) Snakemake run finished."""
    return set(re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", out.stdout + out.stderr))


def test_the_grid_target_gives_every_base_models_gpu_stages_one_gpu(tmp_path):
    out = run(tmp_path, "-n", "-p", "--workflow-profile", str(PROFILES / "gpu"), "--", TARGET)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    found = jobs(log)
    for rule in ("pretrain_base_model", "profile_base_model", "finetune_quality_arms", "evaluate_quality_arms"):
        assert len(found[rule]) == 2, rule                            # one job per base model
        for job in found[rule]:
            assert re.search(r"resources: .*\bgpus=1\b", job) and "gpu_slots --gpus 1 -- " in job, job
    for seed in (0, 1):
        assert any(f"--config work/micro/bases/s{seed}/config.yaml" in job for job in found["pretrain_base_model"])
    assert len(found["sample_base_routing"]) == 4 and len(found["routing_inheritance"]) == 2
    # each base model's configuration: the run's, with its own pretrain.seed
    raw = yaml.safe_load((tmp_path / "work" / "micro" / "bases" / "s1" / "config.yaml").read_text())
    assert raw["pretrain"]["seed"] == 1 and raw["finetune"]["base_seeds"] == [] and raw["run"] == "micro"
    bad = run(tmp_path, "-n", "--config", "finetune={'base_seeds': [0, 1], 'quality_grid': False}", "--", TARGET)
    assert bad.returncode != 0 and "finetune.base_seeds" in bad.stdout + bad.stderr


@pytest.mark.slow
def test_the_grid_runs_over_two_base_models_and_resumes_from_finished_arms(tmp_path):
    out = run(tmp_path, "--cores", "2", "--", TARGET)
    assert out.returncode == 0, out.stderr[-4000:]
    results, work = tmp_path / "results" / "micro" / "bases", tmp_path / "work" / "micro" / "bases"
    arms = ["raw", "sft-moe", "prune1-router-D4-keep-moe", "prune1-sim-D4-keep-moe", "prune2-router-D4-keep-moe",
            "prune2-sim-D4-keep-moe", "prune2-sim-D4-renormalise-moe", "prune1-sim-D4-renormalise-moe"]
    for seed in (0, 1):
        base = results / f"s{seed}"
        assert sorted(p.stem for p in (base / "evaluate").glob("*.json")) == sorted(arms)
        assert json.loads((base / "evaluated.json").read_text())["arms"] == arms
        assert (base / "tables" / "accuracy.csv").is_file() and (base / "model" / "config.json").is_file()
        inheritance = pd.read_csv(base / "placement" / "inheritance.csv")
        assert set(inheritance["basis"]) == {"reference"}                  # trained from scratch: no initial groups
        assert json.loads((base / "model" / "occult_pretrain.json").read_text())["train"]["base_seed"] == seed
    logs = [pd.read_csv(results / f"s{s}" / "model" / "pretrain_log.csv")["train_loss"].tolist() for s in (0, 1)]
    assert logs[0] != logs[1]                                              # two different base models
    pooled = pd.read_csv(tmp_path / TARGET)
    assert list(pooled.columns) == ["model_family", "claim", "estimate_pp", "stderr_pp", "between_base_sd_pp",
                                    "base_models", "verdict", "inheritance_index", "inheritance_basis",
                                    "inheritance_base_models", "base_heldout_ppl"]
    assert set(pooled["model_family"]) == {"scratch"} and (pooled["base_models"] == 2).all()
    final_ppl = [pd.read_csv(results / f"s{s}" / "model" / "pretrain_log.csv")["heldout_ppl"].dropna().iloc[-1]
                 for s in (0, 1)]
    assert pooled["base_heldout_ppl"].to_numpy() == pytest.approx(sum(final_ppl) / 2, rel=1e-5)    # 6 digits written
    assert (pooled["inheritance_base_models"] == 2).all() and set(pooled["inheritance_basis"]) == {"reference"}

    def cut_off(seed: int) -> None:
        """What a job cut off while scoring base model `seed` leaves: no record, nothing after it."""
        for path in (results / f"s{seed}" / "evaluated.json", tmp_path / TARGET,
                     *(results / f"s{seed}" / "tables").glob("*")):
            path.unlink()

    # cut off part-way through scoring base model 1: two arms' scores are missing
    scores = results / "s1" / "evaluate"
    cut_off(1)
    for arm in arms[-2:]:
        (scores / f"{arm}.json").unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in scores.glob("*.json")}
    again = run(tmp_path, "--cores", "2", "--", TARGET)
    assert again.returncode == 0, again.stderr[-4000:]
    ran = finished(again)
    assert "evaluate_quality_arms" in ran and "pretrain_base_model" not in ran and "finetune_quality_arms" not in ran
    assert {p.name: p.stat().st_mtime_ns for p in scores.glob("*.json") if p.name in kept} == kept
    assert sorted(p.stem for p in scores.glob("*.json")) == sorted(arms)

    # a job that fails part-way (one arm's checkpoint unreadable) keeps what it finished; once that arm is
    # fine-tuned again, only it is trained and scored
    arm_dir = work / "s0" / "finetune" / arms[-1]
    (arm_dir / "model.safetensors").unlink()
    cut_off(0)
    (results / "s0" / "evaluate" / f"{arms[-1]}.json").unlink()
    (results / "s0" / "evaluate" / f"{arms[-2]}.json").unlink()
    failed = run(tmp_path, "--cores", "2", "--", TARGET)
    assert failed.returncode != 0
    assert (results / "s0" / "evaluate" / f"{arms[-2]}.json").is_file()        # scored before the failure, kept
    others = {p.name: p.stat().st_mtime_ns for p in (work / "s0" / "finetune").iterdir() if p.name != arms[-1]}
    import shutil

    shutil.rmtree(arm_dir)
    (work / "s0" / "finetuned.json").unlink()
    fixed = run(tmp_path, "--cores", "2", "--", TARGET)
    assert fixed.returncode == 0, fixed.stderr[-4000:]
    assert {"finetune_quality_arms", "evaluate_quality_arms", "quality_base_grid"} <= finished(fixed)
    assert {p.name: p.stat().st_mtime_ns for p in (work / "s0" / "finetune").iterdir() if p.name != arms[-1]} == others
    assert sorted(p.stem for p in (results / "s0" / "evaluate").glob("*.json")) == sorted(arms)
