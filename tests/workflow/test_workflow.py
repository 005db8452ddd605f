"""The Snakemake DAG builds on the default config, and a bad config stops it with one clear error."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = shutil.which("snakemake") or str(Path(sys.executable).parent / "snakemake")


def dry_run(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([SNAKEMAKE, "-n", "--cores", "1", *extra], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_default_dag_has_every_stage():
    out = dry_run("--forceall")
    assert out.returncode == 0, out.stderr[-2000:]
    for rule in ["build_data", "pretrain_model", "profile_coactivation", "place_experts",
                 "finetune_variant", "eval_variant", "bench_layer", "make_report"]:
        assert rule in out.stdout, rule


@pytest.mark.parametrize("override, field", [
    ("placement={'devices': [3], 'methods': ['greedy'], 'swap_rounds': 1}", "placement.devices"),
    ("model={'source': 'checkpoint', 'checkpoint': '/nonexistent/olmoe'}", "model.checkpoint"),
])
def test_bad_config_stops_before_any_job(override, field):
    out = dry_run("--config", override)
    assert out.returncode != 0
    assert field in out.stderr + out.stdout


def test_every_shell_script_parses_as_bash():
    scripts = sorted([*(REPO / "workflow" / "scripts").glob("*.sh"), *(REPO / "tools").rglob("*.sh")])
    assert len(scripts) >= 3
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"


def test_prediction_check_joins_the_dag_once_a_run_names_its_sweeps(tmp_path):
    """A results tree (here a working directory's) whose simulator.yaml names sweeps under
    prediction_check adds rule check_predictions; the committed tree names none yet."""
    run = tmp_path / "results" / "gpu-a" / "d4_v1"
    run.mkdir(parents=True)
    (run / "sweep_prefill_D4.csv").write_text("kind,shape,method,D,tokens_per_gpu,median_ms,status\n"
                                              "prefill,olmoe,occult,4,1024,1.0,ok\n")
    (run / "simulator.yaml").write_text("prediction_check: [sweep_prefill_D4.csv]\n")
    (run.parent / "index.csv").write_text("run,kind,commit,target,status,superseded_by,in_tree,used_by,note\n"
                                          "d4_v1,sweeps,abc1234,snakemake x,current,,yes,simulator,D=4 sweeps\n")
    named = dry_run("--forceall", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                    "--configfile", str(REPO / "config" / "config.yaml"))
    assert named.returncode == 0, named.stderr[-2000:]
    assert "check_predictions" in named.stdout
    assert "check_predictions" not in dry_run("--forceall").stdout     # default: nothing measured yet


def test_a_bad_simulator_yaml_stops_before_any_job(tmp_path):
    run = tmp_path / "results" / "gpu-a" / "d4_v1"
    run.mkdir(parents=True)
    (run / "simulator.yaml").write_text("prediction_check: [absent.csv]\n")
    (run.parent / "index.csv").write_text("run,kind,commit,target,status,superseded_by,in_tree,used_by,note\n"
                                          "d4_v1,sweeps,abc1234,snakemake x,current,,yes,simulator,D=4 sweeps\n")
    out = dry_run("--forceall", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                  "--configfile", str(REPO / "config" / "config.yaml"))
    assert out.returncode != 0
    assert "d4_v1/simulator.yaml: prediction_check[0]" in out.stderr + out.stdout
