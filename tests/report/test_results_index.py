"""The results index: schema and tree checks on small hand-made trees, and the committed index files
against the committed tree and the simulator's inputs (the runs' simulator.yaml files)."""

from __future__ import annotations

import csv
import re
import subprocess
from pathlib import Path

import pytest

from occult.report.results_index import (
    COLUMNS, ResultsIndexError, current_runs, load_index, runs_in_tree, unindexed_runs,
)
from occult.sim.inputs import discover

REPO = Path(__file__).resolve().parents[2]
NOT_MACHINES = {"tiny", "preregistered", "paper"}   # results/ folders that are not per-machine run folders


def row(run: str, kind: str = "sweeps", status: str = "current", superseded_by: str = "", in_tree: str = "yes",
        used_by: str = "") -> dict:
    return {"run": run, "kind": kind, "commit": "abc1234", "target": f"snakemake results/m/{run}/x.csv",
            "status": status, "superseded_by": superseded_by, "in_tree": in_tree, "used_by": used_by, "note": "n"}


def write_machine(root: Path, machine: str, rows: list[dict], columns=COLUMNS) -> Path:
    machine_dir = root / machine
    machine_dir.mkdir(parents=True, exist_ok=True)
    for r in rows:
        if r["in_tree"] == "yes":
            (machine_dir / r["run"]).mkdir(exist_ok=True)
    path = machine_dir / "index.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    write_machine(tmp_path, "gpu-a", [
        row("sweeps_v1", status="superseded", superseded_by="sweeps_v3", in_tree="no"),
        row("sweeps_v2", status="superseded", superseded_by="sweeps_v3", used_by="simulator;claims"),
        row("sweeps_v3"),
        row("kernels_v1", kind="kernels", status="invalid", in_tree="no"),
        row("kernels_v2", kind="kernels"),
        row("kernels_v3", kind="kernels", status="partial"),
    ])
    write_machine(tmp_path, "gpu-b", [row("sweeps_v1", status="superseded", superseded_by="gpu-a/sweeps_v3")])
    return tmp_path


def test_load_index_adds_the_machine_and_keeps_every_row(tree):
    index = load_index(tree)
    assert list(index.columns) == ["machine", *COLUMNS]
    assert len(index) == 7
    assert sorted(set(index["machine"])) == ["gpu-a", "gpu-b"]
    assert index.loc[(index["machine"] == "gpu-a") & (index["run"] == "sweeps_v2"), "used_by"].item() == "simulator;claims"


def test_current_and_in_tree_helpers_filter_by_status_tree_and_kind(tree):
    assert sorted(current_runs(results_dir=tree)["run"]) == ["kernels_v2", "sweeps_v3"]
    assert list(current_runs("kernels", results_dir=tree)["run"]) == ["kernels_v2"]
    in_tree = runs_in_tree("sweeps", results_dir=tree)
    assert sorted(zip(in_tree["machine"], in_tree["run"])) == [
        ("gpu-a", "sweeps_v2"), ("gpu-a", "sweeps_v3"), ("gpu-b", "sweeps_v1")]


def test_missing_column_names_the_file_and_the_column(tmp_path):
    path = write_machine(tmp_path, "gpu-a", [row("sweeps_v1")], columns=[c for c in COLUMNS if c != "used_by"])
    with pytest.raises(ResultsIndexError, match=rf"{path}: missing column 'used_by'"):
        load_index(tmp_path)


@pytest.mark.parametrize("bad, field", [
    (row("sweeps_v1", status="stale"), "status"),
    (row("sweeps_v1", status="superseded"), "superseded_by"),
    (row("sweeps_v1", superseded_by="sweeps_v0"), "superseded_by"),
    (row("sweeps_v1", status="partial", superseded_by="sweeps_v0"), "superseded_by"),
    (row("sweeps_v1", used_by="notes"), "used_by"),
    (row("sweeps_v1", in_tree="maybe"), "in_tree"),
    ({**row("sweeps_v1"), "commit": ""}, "commit"),
])
def test_a_bad_value_names_the_file_the_run_and_the_field(tmp_path, bad, field):
    path = write_machine(tmp_path, "gpu-a", [bad])
    with pytest.raises(ResultsIndexError, match=rf"{path}, line 2 \(run 'sweeps_v1'\): field '{field}'"):
        load_index(tmp_path)


@pytest.mark.parametrize("target", ["sweeps_v9", "gpu-b/sweeps_v3", "gpu-c/sweeps_v1"])
def test_superseded_by_must_name_an_indexed_run(tree, target):
    write_machine(tree, "gpu-b", [row("sweeps_v1", status="superseded", superseded_by=target)])
    with pytest.raises(ResultsIndexError, match=rf"run 'sweeps_v1'\): field 'superseded_by' names '{target}'"):
        load_index(tree)


def test_in_tree_must_match_the_folder(tree):
    (tree / "gpu-a" / "sweeps_v1").mkdir()                        # indexed as removed, but present
    with pytest.raises(ResultsIndexError, match=r"field 'in_tree' is no but .*gpu-a/sweeps_v1 exists"):
        load_index(tree)
    (tree / "gpu-a" / "sweeps_v1").rmdir()
    (tree / "gpu-a" / "sweeps_v3").rmdir()                        # indexed as present, but gone
    with pytest.raises(ResultsIndexError, match=r"field 'in_tree' is yes but .*gpu-a/sweeps_v3 does not exist"):
        load_index(tree)


def test_duplicate_rows_and_unindexed_folders_are_found(tree):
    (tree / "gpu-a" / "ep_v1").mkdir()
    assert unindexed_runs(tree) == ["gpu-a/ep_v1"]
    write_machine(tree, "gpu-b", [row("sweeps_v1"), row("sweeps_v1")])
    with pytest.raises(ResultsIndexError, match=r"run 'sweeps_v1' has more than one row"):
        load_index(tree)


def tracked_machines() -> list[Path]:
    files = subprocess.run(["git", "ls-files", "results"], cwd=REPO, capture_output=True, text=True, check=True)
    names = {Path(f).parts[1] for f in files.stdout.split() if len(Path(f).parts) > 2}
    return [REPO / "results" / n for n in sorted(names - NOT_MACHINES)]


def test_the_committed_index_matches_the_committed_tree():
    machines = tracked_machines()
    assert machines, "no machine folders under results/"
    for machine in machines:
        assert (machine / "index.csv").is_file(), f"{machine}: no index.csv"
    index = load_index(REPO / "results")                         # every row valid against the tree
    assert unindexed_runs(REPO / "results") == []
    for machine in machines:
        assert not index[index["machine"] == machine.name].empty
    kept = index[index["in_tree"] == "yes"]
    stays_without_reason = kept[(kept["status"] != "current") & (kept["used_by"] == "")]
    assert stays_without_reason.empty, stays_without_reason[["machine", "run"]].to_string()


def test_every_file_the_simulator_reads_is_in_an_indexed_run_that_says_so():
    """The simulator reads exactly the in-tree runs whose index rows list `simulator` (each through its
    simulator.yaml), and only files inside those runs."""
    inputs = discover(REPO / "results")
    index = load_index(REPO / "results")
    marked = index[(index["in_tree"] == "yes") & index["used_by"].str.split(";").map(lambda u: "simulator" in u)]
    runs = {Path(spec).parent.relative_to(REPO / "results").parts for spec in inputs.specs}
    assert runs == set(zip(marked["machine"], marked["run"]))
    for name in inputs.files():
        assert Path(name).parent.relative_to(REPO / "results").parts[:2] in runs, name


def test_every_run_the_paper_claims_read_is_in_the_tree_and_says_so():
    spec = REPO / "results" / "paper" / "claims_spec.yaml"
    assert spec.is_file(), spec
    named = set(re.findall(r"results/([\w.-]+)/([\w.-]+)", spec.read_text()))
    index = load_index(REPO / "results").set_index(["machine", "run"])
    runs = [(m, r) for m, r in named if m not in NOT_MACHINES]
    assert runs, f"{spec}: names no run"
    for machine, run in runs:
        entry = index.loc[(machine, run)]
        assert entry["in_tree"] == "yes", f"{machine}/{run}"
        assert "claims" in entry["used_by"].split(";"), f"{machine}/{run}: used_by lacks claims"
