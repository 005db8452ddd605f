"""The whole DAG on a micro config, in a fresh directory: every stage runs and connects; a second
run does nothing; deleting one result reruns exactly its job and the report."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.slow
def test_quality_grid_runs_through_the_dag(tmp_path):
    """finetune.quality_grid: the DAG fine-tunes and scores every arm of quality_arms (the D=4 grid,
    the gate ablation, full fine-tuning) in two jobs and summarises them as a committed GPU run is;
    the routing sample kept beside a GPU run's results comes from the same profile; the arms
    split over two evaluation processes (--shard, one per GPU) are scored once each."""
    import json

    import yaml

    from occult.config import load_config, merge
    from occult.routing.variants import quality_arms

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"finetune": {"quality_grid": True}}))
    targets = ["results/micro/quality/tables/accuracy.csv", "results/micro/profile/routing_heldout_sample.npz"]
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path), "--cores", "2", "--configfile",
           str(REPO / "config" / "config.yaml"), str(REPO / "tests" / "data" / "micro.yaml"), str(grid), "--", *targets]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    raw = merge(merge(*(yaml.safe_load(p.read_text()) for p in (REPO / "config" / "config.yaml",
                                                                  REPO / "tests" / "data" / "micro.yaml"))),
                {"finetune": {"quality_grid": True}})
    arms = [a.name for a in quality_arms(load_config(raw))]
    assert {"prune1-sim-D4-renormalise-moe", "sft-all", "prune2-sim-D4-keep-all"} <= set(arms)
    quality = tmp_path / "results" / "micro" / "quality"
    assert sorted(p.stem for p in (quality / "evaluate").glob("*.json")) == sorted(arms)
    assert sorted(p.name for p in (quality / "finetune").glob("*_log.csv")) == sorted(f"{a}_log.csv" for a in arms if a != "raw")
    verdicts = json.loads((quality / "tables" / "verdicts.json").read_text())["verdicts"]
    assert {v["claim"] for v in verdicts} >= {"pruning within 1 device hurts",
                                               "gate weights renormalised after pruning against kept as they are"}
    assert (tmp_path / "figures" / "micro" / "quality" / "accuracy.png").stat().st_size > 1000
    from occult.routing.profiling import load_routing

    sample = load_routing(tmp_path / "results" / "micro" / "profile" / "routing_heldout_sample.npz")
    assert sample.ids.shape[1] == load_routing(tmp_path / "work" / "micro" / "profile" / "routing_heldout.npz").ids.shape[1]

    work, scored = tmp_path / "work" / "micro", tmp_path / "sharded"
    for shard in ("0/2", "1/2"):
        run = subprocess.run([sys.executable, "-m", "occult.stages.evaluate", "--config", str(work / "config.yaml"),
                              "--model", str(work / "model" / "base"), "--arms", str(work / "quality" / "finetune"),
                              "--data", str(work / "data"), "--profile", str(work / "profile"),
                              "--placements", str(tmp_path / "results" / "micro" / "placement"), "--out", str(scored),
                              "--shard", shard], capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        assert len(list(scored.glob("*.json"))) == (len(arms) + 1) // 2 if shard == "0/2" else len(arms)
    assert sorted(p.stem for p in scored.glob("*.json")) == sorted(arms)
