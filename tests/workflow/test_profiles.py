"""Workflow profiles and rule declarations: the SLURM profile dry-runs on CPU and asks for GPUs the
way the plugin accepts; the local multi-GPU profile launches sweeps with one torchrun rank per GPU;
every rule declares log, benchmark, threads and resources (mem_mb, runtime)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "workflow" / "profiles"
SNAKEMAKE = shutil.which("snakemake") or str(Path(sys.executable).parent / "snakemake")
GPU_RULES = ["profile_coactivation"]   # the CPU-pipeline stages that move their model to CUDA
HAS_SLURM_PLUGIN = importlib.util.find_spec("snakemake_executor_plugin_slurm") is not None
RULE_RE = re.compile(r"^(?P<indent>[ \t]*)rule (?P<name>\w+):\s*$", re.MULTILINE)


def rule_blocks() -> dict[str, str]:
    """rule name -> its text, from every .smk file (conditional rules included)."""
    blocks = {}
    for smk in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        text = smk.read_text()
        for match in RULE_RE.finditer(text):
            indent = len(match.group("indent"))
            lines = []
            for line in text[match.end():].splitlines()[1:]:
                if line.strip() and len(line) - len(line.lstrip()) <= indent:
                    break
                lines.append(line)
            blocks[match.group("name")] = "\n".join(lines)
    return blocks


def directive(block: str, name: str) -> str:
    """The text of one directive of a rule block (until the next directive at the same indent)."""
    match = re.search(rf"^(?P<indent>[ \t]+){name}:(?P<body>.*(?:\n(?:(?P=indent)[ \t]+.*|\s*))*)", block,
                      re.MULTILINE)
    return match.group("body") if match else ""


def snakemake(workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(REPO / "config" / "config.yaml"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_rule_parser_sees_every_stage():
    assert {"build_data", "pretrain_model", "import_checkpoint", "profile_coactivation", "place_experts",
            "finetune_variant", "eval_variant", "bench_layer", "make_report", "run_gpu_sweep",
            "plot_gpu_sweeps"} <= set(rule_blocks())


@pytest.mark.parametrize("rule", sorted(rule_blocks()))
def test_every_rule_declares_log_benchmark_threads_resources(rule):
    block = rule_blocks()[rule]
    for name in ["log", "benchmark", "threads", "resources"]:
        assert directive(block, name).strip(), f"rule {rule}: no {name}:"
    resources = directive(block, "resources")
    for name in ["mem_mb", "runtime"]:
        assert re.search(rf"\b{name}\s*=", resources), f"rule {rule}: resources without {name}"
    assert f"logs/{rule}/" in directive(block, "log"), f"rule {rule}: log not under logs/{rule}/"
    assert f"benchmarks/{rule}/" in directive(block, "benchmark"), \
        f"rule {rule}: benchmark not under benchmarks/{rule}/"


def test_gpu_sweep_rule_asks_for_as_many_gpus_as_ranks():
    block = rule_blocks()["run_gpu_sweep"]
    assert re.search(r"\bgpus\s*=", directive(block, "resources"))
    assert "--nproc_per_node={wildcards.devices}" in block


def load_profile(name: str) -> dict:
    path = PROFILES / name / "config.yaml"
    assert path.is_file(), f"{path} is missing"
    return yaml.safe_load(path.read_text())


def test_profiles_name_only_real_rules():
    rules = set(rule_blocks())
    for name in ["default", "slurm", "gpu"]:
        unknown = set(load_profile(name).get("set-resources", {})) - rules
        assert not unknown, f"profile {name}: set-resources for unknown rules {unknown}"


def test_gpu_profile_limits_and_asks_for_gpus():
    profile = load_profile("gpu")
    limits = dict(item.split("=") for item in profile["resources"])
    assert int(limits["gpus"]) >= 1
    assert profile["default-resources"]["gpus"] == 0
    for rule in GPU_RULES:
        assert profile["set-resources"][rule]["gpus"] >= 1, rule


def test_gpu_profile_dry_run_launches_torchrun_with_one_rank_per_gpu(tmp_path):
    target = "results/box/sweeps_v0/sweep_prefill_D2.csv"
    out = snakemake(tmp_path, "-n", "--workflow-profile", str(PROFILES / "gpu"), "--", target)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "torchrun --nproc_per_node=2 " in log
    assert re.search(r"resources: .*\bgpus=2\b", log), log[-3000:]


def test_slurm_profile_asks_for_gpus_through_plugin_resources():
    profile = load_profile("slurm")
    assert profile["executor"] == "slurm"
    for rule, resources in profile.get("set-resources", {}).items():
        assert not re.search(r"--(gres|gpus)[=\s]", str(resources.get("slurm_extra", ""))), \
            f"{rule}: the slurm plugin refuses --gres/--gpus in slurm_extra; use the gpu resource"
    for rule in GPU_RULES:
        assert int(profile["set-resources"][rule]["gpu"]) >= 1, rule
    assert profile["set-resources"]["run_gpu_sweep"]["gpu"] == "int(wildcards.devices)"


@pytest.mark.skipif(not HAS_SLURM_PLUGIN, reason="snakemake-executor-plugin-slurm is not installed "
                    "(pip install -e '.[slurm]')")
def test_slurm_profile_dry_run_on_default_config(tmp_path):
    out = snakemake(tmp_path, "-n", "--workflow-profile", str(PROFILES / "slurm"))
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    for rule in ["build_data", "pretrain_model", "profile_coactivation", "finetune_variant", "eval_variant",
                 "make_report"]:
        assert rule in log, rule
    assert re.search(r"resources: .*\bgpu=1\b", log), "no GPU job in the SLURM dry run"

    sweep = snakemake(tmp_path, "-n", "--workflow-profile", str(PROFILES / "slurm"), "--",
                      "results/cluster/sweeps_v0/sweep_train_D4.csv")
    log = sweep.stdout + sweep.stderr
    assert sweep.returncode == 0, log[-3000:]
    assert re.search(r"resources: .*\bgpu=4\b", log) and "--nproc_per_node=4" in log


@pytest.mark.skipif(not HAS_SLURM_PLUGIN, reason="snakemake-executor-plugin-slurm is not installed")
def test_slurm_gpu_request_passes_the_plugins_checks():
    from snakemake_executor_plugin_slurm.utils import set_gres_string
    from snakemake_executor_plugin_slurm.validation import validate_slurm_extra

    class Resources(dict):
        __getattr__ = dict.get

    class Job:
        def __init__(self, resources: dict):
            self.resources = Resources(resources)

    profile = load_profile("slurm")
    for rule in GPU_RULES:
        job = Job({**profile["default-resources"], **profile["set-resources"][rule]})
        validate_slurm_extra(job)
        assert set_gres_string(job).strip() == f"--gpus={job.resources['gpu']}", rule


def test_slurm_profile_gives_gpus_to_every_rule_that_declares_them():
    """A rule whose resources name `gpus` gets a GPU partition and `gpu` count under SLURM; without
    one, the cluster would start it on a node with no GPU."""
    slurm = load_profile("slurm")["set-resources"]
    declaring = [name for name, block in rule_blocks().items()
                 if re.search(r"\bgpus\s*=", directive(block, "resources") or "")]
    assert "run_gpu_sweep" in declaring
    missing = [name for name in declaring if "gpu" not in slurm.get(name, {})]
    assert not missing, f"slurm profile: no gpu entry for {missing}"
