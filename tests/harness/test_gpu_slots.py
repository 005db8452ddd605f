"""The GPU allocator of the GPU rules (occult.harness.gpu_slots), on a CPU with a declared GPU count:
concurrent jobs get distinct GPUs, never more jobs than GPUs, released and crashed jobs' GPUs are
reused, SLURM allocations pass through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# One fake job: records "<start_ns> <end_ns> <CUDA_VISIBLE_DEVICES> <PET_MASTER_PORT>" after holding its GPUs a while.
JOB = ('s=$(date +%s%N); sleep "$HOLD"; '
       'echo "$s $(date +%s%N) ${CUDA_VISIBLE_DEVICES-unset} ${PET_MASTER_PORT-unset}" > "$RECORD"')


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "OCCULT_GPU_COUNT", "PET_MASTER_PORT")}
    return {**env, **extra}


def start(tmp_path: Path, name: str, gpus: int, *options: str, hold: float = 0.4, env=None,
          command: tuple[str, ...] = ("sh", "-c", JOB)) -> subprocess.Popen:
    env = {**(env if env is not None else clean_env()), "HOLD": str(hold), "RECORD": str(tmp_path / f"{name}.rec")}
    return subprocess.Popen([sys.executable, "-m", "occult.harness.gpu_slots", "--gpus", str(gpus),
                             "--slots-dir", str(tmp_path / "slots"), *options, "--", *command],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def record(tmp_path: Path, name: str) -> tuple[int, int, str, str]:
    begin, end, visible, port = (tmp_path / f"{name}.rec").read_text().split()
    return int(begin), int(end), visible, port


def finish(job: subprocess.Popen, timeout: float = 60) -> str:
    out, err = job.communicate(timeout=timeout)
    assert job.returncode == 0, err
    return err


def test_concurrent_jobs_get_distinct_gpus_never_more_than_the_count_and_reuse_them(tmp_path):
    jobs = [start(tmp_path, f"job{i}", 1, "--gpu-count", "2") for i in range(6)]
    for job in jobs:
        finish(job)
    records = [record(tmp_path, f"job{i}") for i in range(6)]
    assert {visible for _, _, visible, _ in records} == {"0", "1"}            # 6 jobs on 2 GPUs: both reused
    for i, (b1, e1, v1, p1) in enumerate(records):
        same_gpu = [r for j, r in enumerate(records) if j != i and r[2] == v1 and r[0] < e1 and b1 < r[1]]
        assert not same_gpu, f"job{i} shared GPU {v1} with {same_gpu}"
        assert p1 == str(29510 + int(v1))                                  # one rendezvous port per GPU
    running = max(sum(b <= t < e for b, e, _, _ in records) for t, _, _, _ in records)
    assert running <= 2                                                    # never more jobs at once than GPUs


def test_a_multi_gpu_job_sees_its_gpus_and_a_one_gpu_job_the_rest(tmp_path):
    wide = start(tmp_path, "wide", 2, "--gpu-count", "3", hold=1.0)
    time.sleep(0.3)
    narrow = start(tmp_path, "narrow", 1, "--gpu-count", "3", hold=0.1)
    finish(wide), finish(narrow)
    _, wide_end, wide_gpus, _ = record(tmp_path, "wide")
    narrow_begin, _, narrow_gpu, _ = record(tmp_path, "narrow")
    assert wide_gpus == "0,1" and narrow_gpu == "2"
    assert narrow_begin < wide_end                                          # beside it, not after it


def test_a_killed_job_frees_its_gpu(tmp_path):
    holder = start(tmp_path, "holder", 1, "--gpu-count", "1", hold=60)
    time.sleep(0.5)
    blocked = start(tmp_path, "blocked", 1, "--gpu-count", "1", "--wait-s", "0.5")
    _, err = blocked.communicate(timeout=30)
    assert blocked.returncode == 2 and "not free within" in err and f"pid {holder.pid}" in err
    os.killpg(holder.pid, signal.SIGKILL)              # the job and its children, as a crash would
    holder.wait(timeout=10)
    after = start(tmp_path, "after", 1, "--gpu-count", "1", "--wait-s", "10", hold=0)
    finish(after)
    assert record(tmp_path, "after")[2] == "0"


def test_the_pool_is_the_inherited_cuda_visible_devices(tmp_path):
    env = clean_env(CUDA_VISIBLE_DEVICES="5,7")
    first = start(tmp_path, "first", 1, env=env, hold=0.8)
    time.sleep(0.3)
    second = start(tmp_path, "second", 1, env=env, hold=0)
    finish(first), finish(second)
    assert (record(tmp_path, "first")[2], record(tmp_path, "second")[2]) == ("5", "7")


def test_zero_gpus_and_slurm_allocations_run_the_command_unchanged(tmp_path):
    finish(start(tmp_path, "cpu", 0, hold=0))
    assert record(tmp_path, "cpu")[2:] == ("unset", "unset")
    finish(start(tmp_path, "slurm", 2, hold=0, env=clean_env(SLURM_JOB_ID="42", CUDA_VISIBLE_DEVICES="0,1")))
    assert record(tmp_path, "slurm")[2:] == ("0,1", "unset")
    assert not (tmp_path / "slots").exists()                                 # no lock taken


@pytest.mark.parametrize("options, env, message", [
    (("--gpus", "3", "--gpu-count", "2"), {}, "only 2 GPU(s)"),
    (("--gpus", "1"), {"CUDA_VISIBLE_DEVICES": ""}, "CUDA_VISIBLE_DEVICES is empty"),
    (("--gpus", "1"), {"OCCULT_GPU_COUNT": "two"}, "OCCULT_GPU_COUNT='two'"),
    (("--gpus", "-1"), {}, "--gpus -1"),
])
def test_a_request_that_cannot_be_met_fails_with_one_line(tmp_path, options, env, message):
    out = subprocess.run([sys.executable, "-m", "occult.harness.gpu_slots", *options, "--slots-dir", str(tmp_path),
                          "--", "true"], env=clean_env(**env), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_missing_command_is_named(tmp_path):
    out = subprocess.run([sys.executable, "-m", "occult.harness.gpu_slots", "--gpus", "1", "--gpu-count", "1",
                          "--slots-dir", str(tmp_path), "--", "no-such-command-here"],
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 127 and "no-such-command-here" in out.stderr
