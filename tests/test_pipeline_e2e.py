"""The whole DAG on a micro config, in a fresh directory: every stage runs and connects; a second
run does nothing; deleting one result reruns exactly its job and the report."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = shutil.which("snakemake") or str(Path(sys.executable).parent / "snakemake")


def snakemake(workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--cores", "2",
           "--configfile", str(REPO / "config" / "config.yaml"), str(REPO / "tests" / "data" / "micro.yaml"),
           *extra]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.slow
def test_micro_pipeline_end_to_end(tmp_path):
    out = snakemake(tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    results, figures = tmp_path / "results" / "micro", tmp_path / "figures" / "micro"
    for name in ["ct_ablation.csv", "accuracy.csv", "placement_summary.csv"]:
        assert (results / "tables" / name).stat().st_size > 0, name
    for name in ["ct_ablation.png", "latency_vs_ct.png", "accuracy.png", "coactivation_heatmaps.png",
                 "expected_ct_vs_devices.png"]:
        assert (figures / name).stat().st_size > 1000, name
    accuracy = (results / "tables" / "accuracy.csv").read_text()
    for variant in ["raw", "sft", "prune1-router", "prune2-sim", "chance"]:
        assert variant in accuracy

    again = snakemake(tmp_path, "-n")
    assert "Nothing to be done" in again.stdout, again.stdout[-2000:]

    (results / "bench" / "ep_cpu.csv").unlink()
    dry = snakemake(tmp_path, "-n")
    table = dry.stdout.split("Job stats:")[1].split("total")[0].splitlines()[3:]
    jobs = {line.split()[0] for line in table if line.strip()}
    assert jobs == {"bench_layer", "make_report", "all"}, dry.stdout[-2000:]
