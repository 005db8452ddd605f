"""tools/remote/run_target.sh on a CPU: a detached Snakemake run started, polled to its end (well or
with an error), and archived; a machine where nothing was started says so."""

from __future__ import annotations

import os
import subprocess
import tarfile

from tests.workflow.test_profiles import REPO

DRIVER = REPO / "tools" / "remote" / "run_target.sh"


def driver(state, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUN_TARGET_STATE": str(state)}
    env.pop("RUN_TARGET_DIR", None)
    return subprocess.run(["bash", str(DRIVER), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_nothing_started_here_is_exit_4(tmp_path):
    polled = driver(tmp_path / "state", "poll", "5")
    assert polled.returncode == 4 and "no run was started here" in polled.stdout


def test_a_started_target_is_polled_to_its_end_and_archived(tmp_path):
    state = tmp_path / "state"
    started = driver(state, "start", "-n", "results/box/ep_v1/peak.csv")
    assert started.returncode == 0 and "started in" in started.stdout, started.stderr
    polled = driver(state, "poll", "240")
    assert polled.returncode == 0, polled.stdout[-2000:]
    assert "measure_matmul_peak" in polled.stdout and "finished, exit 0" in polled.stdout
    archive = tmp_path / "out.tgz"
    packed = driver(state, "archive", str(archive))
    assert packed.returncode == 0, packed.stderr
    with tarfile.open(archive) as tar:
        assert any(name.endswith("state/log") for name in tar.getnames())


def test_a_failed_run_is_exit_1_with_its_error(tmp_path):
    state = tmp_path / "state"
    assert driver(state, "start", "-n", "results/box/no_such_kind_v1/x.csv").returncode == 0
    polled = driver(state, "poll", "240")
    assert polled.returncode == 1 and "finished, exit 1" in polled.stdout
    assert "MissingRuleException" in polled.stdout or "No rule to produce" in polled.stdout
