"""The GPU entry points of the harness on a CPU: telemetry around a command (with a stand-in
nvidia-smi), and a clear refusal where a GPU is needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FAKE_SMI = """#!/bin/sh
case "$*" in
  *-lms=*) echo "timestamp, index, clocks.sm [MHz]"; echo "$*" ; while :; do echo "2026/01/01 00:00:00.000, 0, 1980 MHz"; sleep 0.05; done ;;
  *) echo "clocks_event_reasons.active" ;;
esac
"""


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env=env or dict(os.environ))


@pytest.fixture
def fake_smi_env(tmp_path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "2,3"}


def test_telemetry_samples_the_jobs_gpus_while_the_command_runs(tmp_path, fake_smi_env):
    out = tmp_path / "t" / "telemetry.csv"
    done = run("-m", "occult.harness.telemetry", "--out", str(out), "--", "sh", "-c", "sleep 0.4", env=fake_smi_env)
    assert done.returncode == 0, done.stderr
    lines = out.read_text().splitlines()
    assert "--id=2,3" in lines[1] and "clocks_event_reasons.active" in lines[1]
    assert len(lines) >= 4 and lines[-1].startswith("2026/01/01")


def test_telemetry_passes_on_a_failure_and_writes_nothing(tmp_path, fake_smi_env):
    out = tmp_path / "telemetry.csv"
    failed = run("-m", "occult.harness.telemetry", "--out", str(out), "--", "sh", "-c", "exit 3", env=fake_smi_env)
    assert failed.returncode == 3 and not out.exists()
    assert not list(tmp_path.glob(".telemetry.csv.tmp*"))


@pytest.mark.parametrize("argv", [
    ["-m", "occult.harness.matmul_peak", "--out", "{tmp}/peak.csv"],
    ["-m", "occult.harness.host_probe", "--seconds", "1", "--out", "{tmp}/probe.csv"],
    ["-m", "occult.harness.host_ab", "train", "--out", "{tmp}/ab.csv"],
    ["-m", "occult.harness.host_ab", "shared", "--out", "{tmp}/ab.csv"],
])
def test_gpu_entry_points_refuse_a_machine_without_cuda(tmp_path, argv):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = run(*[a.format(tmp=tmp_path) for a in argv], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr
    assert not list(Path(tmp_path).iterdir())
