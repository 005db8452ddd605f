"""Every GPU experiment is a Snakemake target: each dry-runs on a CPU machine with the gpu profile,
declares the GPUs it takes, starts through the GPU allocator (occult.harness.gpu_slots), launches one
torchrun rank per GPU where it runs D ranks, asks SLURM for its GPUs, and stays out of `rule all`."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.workflow.test_profiles import HAS_SLURM_PLUGIN, PROFILES, REPO, directive, rule_blocks, snakemake
from tests.workflow.test_workflow import dry_run

WRAPPER = "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
# D ranks ask for D GPUs themselves: Snakemake lowers a job's gpus to the profile's limit
RANKS_WRAPPER = "python -m occult.harness.gpu_slots --gpus {wildcards.devices} -- torchrun --nproc_per_node={wildcards.devices} "
# rule -> (a target it makes, the GPUs it takes, whether it starts one torchrun rank per GPU)
GPU_TARGETS = {
    "bench_ep_runtime": ("results/box/ep_v1/ep_prefill_trace_D2.csv", 2, True),
    "bench_ep_compute": ("results/box/ep_v1/ep_train_uniform_D4_compute_graph.csv", 4, True),
    "measure_matmul_peak": ("results/box/ep_v1/peak.csv", 1, False),
    "profile_ep_layer": ("results/box/ep_v1/profile_T64_D2", 2, True),
    "bench_kernels": ("results/box/kernels_v1/kernels.csv", 1, False),
    "tune_kernels": ("results/box/tune_v1/tune.csv", 1, False),
    "bench_alltoall": ("results/box/comm_v1_D8/alltoall.csv", 8, True),
    "test_gpu_kernels": ("results/box/gpu_tests_v1/junit.xml", 1, False),
    "probe_host": ("results/box/host_probe_v1/host_probe.csv", 1, False),
    "compare_train_host": ("results/box/host_probe_v1/train_host_ab.csv", 1, False),
    "compare_shared_host": ("results/box/host_probe_v1/shared_host_ab.csv", 1, False),
    "bench_train_step": ("results/tiny/model/trainbench.csv", 1, False),
}
# the latency sweeps (workflow/rules/gpu.smk), dry-run with the others
ALL_TARGETS = {**GPU_TARGETS, "run_gpu_sweep": ("results/box/sweeps_v1/sweep_train_D2_uniform.csv", 2, True)}
GPU_RULE_FILES = sorted((REPO / "workflow" / "rules").glob("gpu_*.smk"))


def jobs(log: str) -> dict[str, list[str]]:
    """rule -> the text of each of its jobs in a dry run's output (`snakemake -n -p`)."""
    found: dict[str, list[str]] = {}
    for block in re.split(r"\n(?=rule \w+:\n)", log):
        match = re.match(r"rule (\w+):\n", block)
        if match:
            found.setdefault(match.group(1), []).append(block)
    return found


def shell_text(rule: str) -> str:
    """A rule's shell command, its string pieces joined."""
    return "".join(re.findall(r'"([^"]*)"', directive(rule_blocks()[rule], "shell")))


def gpu_rules_in_files() -> set[str]:
    names = set()
    for path in GPU_RULE_FILES:
        names |= set(re.findall(r"^\s*rule (\w+):", path.read_text(), re.MULTILINE))
    return names


def test_every_rule_of_the_gpu_files_is_a_listed_target():
    assert gpu_rules_in_files() - {"sample_routing"} == set(GPU_TARGETS)


@pytest.mark.parametrize("rule", sorted(GPU_TARGETS))
def test_gpu_rule_declares_its_gpus_and_starts_through_the_allocator(rule):
    assert re.search(r"\bgpus\s*=", directive(rule_blocks()[rule], "resources")), f"{rule}: no gpus in resources"
    shell = shell_text(rule)
    assert (RANKS_WRAPPER if GPU_TARGETS[rule][2] else WRAPPER) in shell, \
        f"{rule}: shell does not start through occult.harness.gpu_slots"


def test_every_rule_the_gpu_profile_gives_a_gpu_starts_through_the_allocator():
    profile = yaml.safe_load((PROFILES / "gpu" / "config.yaml").read_text())
    for rule, resources in profile["set-resources"].items():
        if resources.get("gpus"):
            assert WRAPPER in shell_text(rule), rule


def test_each_gpu_target_dry_runs_with_its_gpus_and_one_rank_per_gpu(tmp_path):
    targets = [target for target, _, _ in ALL_TARGETS.values()]
    out = snakemake(tmp_path, "-n", "-p", "--workflow-profile", str(PROFILES / "gpu"), "--resources", "gpus=8",
                    "--", *targets)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    found = jobs(log)
    for rule, (target, gpus, ranks) in ALL_TARGETS.items():
        assert rule in found, f"{rule}: no job for {target}"
        (job,) = found[rule]
        assert re.search(rf"resources: .*\bgpus={gpus}\b", job), job
        assert f"occult.harness.gpu_slots --gpus {gpus} -- " in job, job
        assert (f"--nproc_per_node={gpus} " in job) == ranks, job
    assert "--trace " in found["bench_ep_runtime"][0]


def test_ranks_beyond_the_profiles_limit_ask_the_allocator_for_all_their_gpus(tmp_path):
    """With the profile's 2 GPUs, Snakemake lowers a D=4 job's gpus to 2; the job still asks for 4, so
    on a 2-GPU machine it stops with the allocator's error instead of running 4 ranks on 2 GPUs."""
    out = snakemake(tmp_path, "-n", "-p", "--workflow-profile", str(PROFILES / "gpu"), "--",
                    "results/box/comm_v1_D4/alltoall.csv")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    (job,) = jobs(log)["bench_alltoall"]
    assert "gpu_slots --gpus 4 -- torchrun --nproc_per_node=4 " in job


def test_the_quality_target_gives_each_model_stage_one_gpu(tmp_path):
    out = snakemake(tmp_path, "-n", "-p", "--workflow-profile", str(PROFILES / "gpu"), "--configfile",
                    str(REPO / "config" / "config.yaml"), str(REPO / "config" / "presets" / "mini.yaml"), "--",
                    "results/mini/quality/tables/accuracy.csv", "results/mini/model/trainbench.csv",
                    "results/mini/profile/routing_heldout_sample.npz")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    found = jobs(log)
    for rule in ("pretrain_model", "profile_coactivation", "finetune_quality_arms", "evaluate_quality_arms",
                 "bench_train_step"):
        (job,) = found[rule]
        assert re.search(r"resources: .*\bgpus=1\b", job) and "gpu_slots --gpus 1 -- " in job, job
    for rule in ("build_data", "place_experts", "sample_routing", "summarise_quality_arms"):
        assert re.search(r"resources: .*\bgpus=0\b", found[rule][0]), rule


def test_no_gpu_rule_runs_in_the_default_dag():
    """The committed GPU results the default DAG redraws are never measured again by it."""
    out = dry_run()
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert not (gpu_rules_in_files() | {"run_gpu_sweep"}) & set(jobs(log))


@pytest.mark.skipif(not HAS_SLURM_PLUGIN, reason="snakemake-executor-plugin-slurm is not installed")
def test_slurm_profile_asks_for_each_gpu_targets_gpus(tmp_path):
    targets = [target for target, _, _ in ALL_TARGETS.values()]
    out = snakemake(tmp_path, "-n", "--workflow-profile", str(PROFILES / "slurm"), "--", *targets)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    found = jobs(log)
    for rule, (_, gpus, _) in ALL_TARGETS.items():
        (job,) = found[rule]
        assert re.search(rf"resources: .*\bgpu={gpus}\b", job) and "slurm_partition=gpu" in job, job
