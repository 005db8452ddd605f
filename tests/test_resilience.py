"""Resilience: a killed run is finished by the next one without redoing finished jobs; outputs are
atomic; a dead rank never hangs the others; truncated or wrong-shaped inputs (profile, placement,
checkpoint) give one error naming the file; the same seed gives identical tables and arrays."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from occult.cli import main
from occult.harness.ranks import RankFailure, run_ranks
from occult.provenance import atomic_path, write_json
from tests.models.test_moe import EOT, tiny_model_cfg, write_standin_data

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
SNAKEMAKE = shutil.which("snakemake") or str(VENV_BIN / "snakemake")
PROGRESS_BAR = re.compile(r"\d+%\|")
PROVENANCE_FIELDS = {"commit", "config_hash", "seed", "versions", "hardware"}


def error_lines(stderr: str) -> list[str]:
    """stderr without logging lines (`<date> occult INFO ...`) and progress bars."""
    return [line for line in stderr.splitlines()
            if line.strip() and " occult INFO " not in line and not PROGRESS_BAR.search(line)]


# ---------------------------------------------------------------------------------------------
# (a) a run killed mid-DAG is finished by the next one


def snakemake_cmd(workdir: Path, override: Path, *extra: str) -> list[str]:
    return [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--cores", "2",
            "--configfile", str(REPO / "config" / "config.yaml"), str(REPO / "tests" / "data" / "micro.yaml"),
            str(override), *extra, "--", "results/micro/placement/expected_ct.csv"]


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"snakemake exited ({proc.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_run_is_finished_without_redoing_finished_jobs(tmp_path, sig):
    work = tmp_path / "run"
    override = tmp_path / "fast.yaml"
    override.write_text(yaml.safe_dump({"pretrain": {"steps": 10}}))
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(snakemake_cmd(work, override), stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            wait_for(work / "logs" / "pretrain_model" / "micro.log", proc, timeout_s=90)
            time.sleep(1.0)       # pretrain_model is running (it takes > 5 s)
            os.killpg(proc.pid, sig)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode != 0

    data = work / "work" / "micro" / "data"
    finished = [data / "manifest.json", data / "corpus" / "train.jsonl", data / "corpus" / "heldout.jsonl",
                data / "tokenizer" / "tokenizer.json", data / "instructions.jsonl"]
    mtimes = {p: p.stat().st_mtime_ns for p in finished}
    assert not (work / "work" / "micro" / "model" / "base").exists(), "a killed job left a partial checkpoint"

    if sig == signal.SIGKILL:
        # Snakemake had no chance to release its lock: it says so and names --unlock.
        locked = subprocess.run(snakemake_cmd(work, override, "--rerun-incomplete"), capture_output=True,
                                text=True, env=env, timeout=120)
        assert locked.returncode != 0 and "--unlock" in locked.stderr
        unlock = subprocess.run(snakemake_cmd(work, override, "--unlock"), capture_output=True, text=True,
                                env=env, timeout=120)
        assert unlock.returncode == 0, unlock.stderr[-2000:]

    rerun = subprocess.run(snakemake_cmd(work, override, "--rerun-incomplete"), capture_output=True,
                           text=True, env=env, timeout=300)
    log = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, log[-4000:]
    assert "rule pretrain_model:" in log and "rule place_experts:" in log
    assert "rule build_data:" not in log, "the finished data stage ran again"
    assert {p: p.stat().st_mtime_ns for p in finished} == mtimes
    assert (work / "results" / "micro" / "placement" / "expected_ct.csv").stat().st_size > 0

    again = subprocess.run(snakemake_cmd(work, override, "-n"), capture_output=True, text=True, env=env,
                           timeout=120)
    assert "Nothing to be done" in again.stdout + again.stderr


# ---------------------------------------------------------------------------------------------
# (b) atomic outputs


def _die_inside_atomic_path(target: str, as_dir: bool) -> None:
    with atomic_path(target) as tmp:
        if as_dir:
            tmp.mkdir()
            (tmp / "weights.bin").write_bytes(b"\0" * 4096)
        else:
            tmp.write_bytes(b"half a file")
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("as_dir", [False, True], ids=["file", "dir"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "replace"])
def test_killed_writer_leaves_no_partial_target(tmp_path, as_dir, existing):
    target = tmp_path / ("model" if as_dir else "table.csv")
    if existing:
        if as_dir:
            target.mkdir()
            (target / "old.txt").write_text("old")
        else:
            target.write_text("old")
    proc = multiprocessing.get_context("fork").Process(target=_die_inside_atomic_path, args=(str(target), as_dir))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    if not existing:
        assert not target.exists()
    elif as_dir:
        assert sorted(p.name for p in target.iterdir()) == ["old.txt"]
    else:
        assert target.read_text() == "old"


def test_failed_writer_cleans_up_and_a_later_write_succeeds(tmp_path):
    target = tmp_path / "out.json"
    write_json(target, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("partial")
            raise RuntimeError("boom")
    assert json.loads(target.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"], "temporary file left behind"
    write_json(target, {"v": 2})
    assert json.loads(target.read_text()) == {"v": 2}


# ---------------------------------------------------------------------------------------------
# (c) a dead rank


def _rank_dies_mid_run(rank: int, world: int, dead_rank: int) -> float:
    import torch.distributed as dist

    x = torch.ones(8)
    dist.all_reduce(x)                 # one collective that succeeds
    if rank == dead_rank:
        os._exit(1)
    for _ in range(1000):              # the survivors block here on the dead peer
        dist.all_reduce(x)
    return float(x.sum())


@pytest.mark.parametrize("dead_rank", [0, 1])
def test_dead_rank_fails_the_run_within_bounded_time(dead_rank):
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(_rank_dies_mid_run, 2, dead_rank, timeout_s=60.0)
    elapsed = time.monotonic() - start
    assert elapsed < 30.0, f"took {elapsed:.1f} s"
    assert "rank" in str(failure.value)


def test_dead_rank_is_named():
    with pytest.raises(RankFailure) as failure:
        run_ranks(_rank_dies_mid_run, 2, 1, timeout_s=60.0)
    assert "rank 1 of 2 died" in str(failure.value)


# ---------------------------------------------------------------------------------------------
# stage inputs for (d) and (e): a tiny checkpoint, its profile and placements, through the CLI


@dataclasses.dataclass(frozen=True)
class Stages:
    config: Path
    data: Path
    model: Path
    profile: Path
    placements: Path


def write_small_config(path: Path) -> Path:
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    raw["model"] = dataclasses.asdict(tiny_model_cfg())
    raw["profile"] = {**raw["profile"], "calibration_tokens": 600, "heldout_tokens": 300, "seq_len": 48}
    raw["placement"] = {**raw["placement"], "devices": [2, 4], "methods": ["contiguous", "greedy", "swap"],
                        "swap_rounds": 3}
    raw["finetune"] = {**raw["finetune"], "devices": 4, "variants": ["raw", "sft", "prune1-router"], "steps": 1,
                       "batch_size": 2, "seq_len": 48}
    raw["bench"] = {**raw["bench"], "devices": 2, "tokens_per_rank": [16], "repeats": 1, "warmup": 0,
                    "cases": ["trivial", "placed", "prune1"]}
    path.write_text(yaml.safe_dump(raw))
    return path


def cli(*argv: str) -> int:
    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def stages(tmp_path_factory) -> Stages:
    from transformers import AutoTokenizer

    from occult.models.moe import build_tiny_olmoe

    root = tmp_path_factory.mktemp("resilience")
    data = write_standin_data(root / "data")
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    eot = tokenizer.convert_tokens_to_ids(EOT)
    model = build_tiny_olmoe(tiny_model_cfg(), len(tokenizer), pad_token_id=eot, bos_token_id=eot,
                             eos_token_id=eot, seed=0)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    s = Stages(write_small_config(root / "config.yaml"), data, root / "model", root / "profile", root / "placement")
    assert cli("profile", "--config", s.config, "--model", s.model, "--data", s.data, "--out", s.profile) == 0
    assert cli("place", "--config", s.config, "--profile", s.profile, "--out", s.placements,
               "--table", s.placements / "expected_ct.csv") == 0
    return s


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def assert_one_error_naming(capsys, code: int, stage: str, path: Path) -> None:
    lines = error_lines(capsys.readouterr().err)
    assert code == 1, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"occult {stage}: error:") and str(path) in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------
# (d) truncated or wrong-shaped inputs name the file


@pytest.mark.parametrize("damage", ["truncated", "wrong_shape", "missing_array"])
def test_bad_profile_npz_is_named_by_place(stages, tmp_path, capsys, damage):
    profile = tmp_path / "profile"
    shutil.copytree(stages.profile, profile)
    npz = profile / "profile.npz"
    if damage == "truncated":
        truncate(npz)
    else:
        with np.load(npz) as f:
            arrays = dict(f)
        if damage == "wrong_shape":
            arrays["coactivation"] = arrays["coactivation"][:, :, :-1]
        else:
            del arrays["coactivation"]
        np.savez(npz, **arrays)
    code = cli("place", "--config", stages.config, "--profile", profile, "--out", tmp_path / "pl",
               "--table", tmp_path / "pl" / "t.csv")
    assert_one_error_naming(capsys, code, "place", npz)
    assert not (tmp_path / "pl" / "t.csv").exists()


def bench_on_truncated_trace(stages: Stages, tmp_path: Path) -> tuple[int, Path]:
    profile = tmp_path / "profile"
    shutil.copytree(stages.profile, profile)
    truncate(profile / "routing_heldout.npz")
    code = cli("bench", "--config", stages.config, "--profile", profile, "--placements", stages.placements,
               "--out", tmp_path / "b.csv")
    return code, profile / "routing_heldout.npz"


def test_truncated_routing_trace_gives_one_line_in_bench(stages, tmp_path, capsys):
    code, _ = bench_on_truncated_trace(stages, tmp_path)
    lines = error_lines(capsys.readouterr().err)
    assert code == 1 and len(lines) == 1 and lines[0].startswith("occult bench: error:"), lines


def test_truncated_routing_trace_is_named_by_bench(stages, tmp_path, capsys):
    code, trace = bench_on_truncated_trace(stages, tmp_path)
    assert_one_error_naming(capsys, code, "bench", trace)


def damage_placement(path: Path, damage: str) -> None:
    if damage == "truncated":
        truncate(path)
        return
    doc = json.loads(path.read_text())
    doc["device_of_expert"] = [row[:-1] for row in doc["device_of_expert"]]
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("damage", ["truncated", "wrong_shape"])
@pytest.mark.parametrize("stage, name", [("bench", "D2_greedy.json"), ("finetune", "D4_greedy.json")])
def test_bad_placement_json_is_named(stages, tmp_path, capsys, damage, stage, name):
    placements = tmp_path / "placement"
    shutil.copytree(stages.placements, placements)
    damage_placement(placements / name, damage)
    if stage == "bench":
        code = cli("bench", "--config", stages.config, "--profile", stages.profile, "--placements", placements,
                   "--out", tmp_path / "b.csv")
    else:
        code = cli("finetune", "--config", stages.config, "--variant", "prune1-router", "--model", stages.model,
                   "--data", stages.data, "--profile", stages.profile, "--placements", placements,
                   "--out", tmp_path / "ft", "--log", tmp_path / "ft.csv")
    assert_one_error_naming(capsys, code, stage, placements / name)


@pytest.mark.parametrize("damage", ["truncated_weights", "no_config", "wrong_shape"])
def test_bad_checkpoint_is_named_by_profile(stages, tmp_path, capsys, damage):
    model = tmp_path / "model"
    shutil.copytree(stages.model, model)
    if damage == "truncated_weights":
        truncate(model / "model.safetensors")
    elif damage == "no_config":
        (model / "config.json").unlink()
    else:
        hf = json.loads((model / "config.json").read_text())
        hf["num_experts"] *= 2                   # weights no longer fit the declared shape
        (model / "config.json").write_text(json.dumps(hf))
    code = cli("profile", "--config", stages.config, "--model", model, "--data", stages.data,
               "--out", tmp_path / "profile")
    assert_one_error_naming(capsys, code, "profile", model)
    assert not (tmp_path / "profile" / "profile.npz").exists()


# ---------------------------------------------------------------------------------------------
# (e) the same seed gives identical tables; results carry provenance


def test_same_seed_gives_identical_profile_and_placements(stages, tmp_path):
    assert cli("profile", "--config", stages.config, "--model", stages.model, "--data", stages.data,
               "--out", tmp_path / "profile") == 0
    for name in ["profile.npz", "routing_calibration.npz", "routing_heldout.npz"]:
        with np.load(stages.profile / name) as first, np.load(tmp_path / "profile" / name) as second:
            assert first.files == second.files
            for key in first.files:
                np.testing.assert_array_equal(first[key], second[key], err_msg=f"{name}:{key}")

    assert cli("place", "--config", stages.config, "--profile", tmp_path / "profile", "--out", tmp_path / "pl",
               "--table", tmp_path / "pl" / "expected_ct.csv") == 0
    assert (tmp_path / "pl" / "expected_ct.csv").read_bytes() == (stages.placements / "expected_ct.csv").read_bytes()
    for path in sorted(stages.placements.glob("D*_*.json")):
        first, second = json.loads(path.read_text()), json.loads((tmp_path / "pl" / path.name).read_text())
        assert first["device_of_expert"] == second["device_of_expert"], path.name


def test_results_carry_provenance(stages):
    documents = {
        "profile.json": json.loads((stages.profile / "profile.json").read_text())["provenance"],
        "D4_swap.json": json.loads((stages.placements / "D4_swap.json").read_text())["provenance"],
        "expected_ct.csv.meta.json": json.loads((stages.placements / "expected_ct.csv.meta.json").read_text()),
    }
    seed = yaml.safe_load(stages.config.read_text())["seed"]
    for name, meta in documents.items():
        assert PROVENANCE_FIELDS <= meta.keys(), f"{name}: missing {PROVENANCE_FIELDS - meta.keys()}"
        assert meta["seed"] == seed and len(meta["config_hash"]) == 12, name
        assert meta["commit"], name
        assert meta["versions"]["torch"] in {torch.__version__, torch.__version__.split("+")[0]}, name
        assert meta["hardware"]["cpu_count"] == os.cpu_count(), name
        assert meta["hardware"]["cpu_isa"] == torch.backends.cpu.get_cpu_capability(), name


def test_gpu_interconnect_is_read_from_nvidia_smi_topology():
    from occult.provenance import gpu_interconnect

    topology = ("\tGPU0\tGPU1\tGPU2\tCPU Affinity\n"
                "GPU0\t X \tNV18\tSYS\t0-31\n"
                "GPU1\tNV18\t X \tSYS\t0-31\n")
    assert gpu_interconnect(3, topology) == "NV18/SYS"
    assert gpu_interconnect(2, topology) == "NV18"
    assert gpu_interconnect(1, topology) == "single GPU"
    assert gpu_interconnect(2, None).startswith("unknown")


def test_commit_is_dirty_for_code_changes_not_for_regenerated_results(tmp_path, monkeypatch):
    import subprocess

    from occult.provenance import git_commit

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    monkeypatch.delenv("OCCULT_COMMIT", raising=False)
    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "table.csv").write_text("a\n1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    clean = git_commit(tmp_path)
    assert len(clean) == 12 and not clean.endswith("-dirty")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("old\n")
    (tmp_path / "README.md").write_text("old\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "docs")
    clean = git_commit(tmp_path)
    (tmp_path / "results" / "table.csv").write_text("a\n2\n")          # the pipeline rewrote an output
    (tmp_path / "docs" / "notes.md").write_text("new\n")               # documentation changed
    (tmp_path / "README.md").write_text("new\n")
    assert git_commit(tmp_path) == clean
    (tmp_path / "code.py").write_text("x = 2\n")                      # the code changed
    assert git_commit(tmp_path) == clean + "-dirty"
    monkeypatch.setenv("OCCULT_COMMIT", "0e62a9e0b16e")     # set by a device script: wins over git
    assert git_commit(tmp_path) == "0e62a9e0b16e"
