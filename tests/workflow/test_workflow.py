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


def test_prediction_check_joins_the_dag_once_its_measured_files_are_named(tmp_path):
    sweep = tmp_path / "sweep_prefill_D4.csv"
    sweep.write_text("kind,shape,method,D,tokens_per_gpu,median_ms,status\nprefill,olmoe,occult,4,1024,1.0,ok\n")
    check = ("simulate={'prediction_check': {'predictions': 'results/preregistered/predictions_D4_D8_90f63fd.csv', "
             f"'measured': ['{sweep}']}}}}")
    named = dry_run("--forceall", "--config", check)
    assert named.returncode == 0, named.stderr[-2000:]
    assert "check_predictions" in named.stdout
    assert "check_predictions" not in dry_run("--forceall").stdout     # default: nothing measured yet
