"""Give a command GPUs of its own: take N free GPUs, set CUDA_VISIBLE_DEVICES, exec the command.

    python -m occult.harness.gpu_slots --gpus 2 -- torchrun --nproc_per_node=2 -m occult.harness.sweep ...

Snakemake counts GPUs (`resources: gpus=N` against the profile's limit) but does not say which
ones a job may use; every GPU rule's shell starts with this command, so that concurrent jobs on one
machine get distinct devices. Each GPU of the pool has a lock file in the slot folder
(`--slots-dir`, default `$OCCULT_GPU_SLOTS` or `.snakemake/gpu_slots`, one subfolder per host);
a job holds an exclusive `flock` on each of its GPUs' files. The locks are inherited by the
command (this process execs it), so they last exactly as long as the command and its children:
a job that ends, crashes or is killed with SIGKILL frees its GPUs, and the next job reuses them.
A job whose GPUs are not free waits until they are (so even a profile limit above the machine's
count never puts two jobs on one GPU).

The pool is the inherited CUDA_VISIBLE_DEVICES where set (start Snakemake with
`CUDA_VISIBLE_DEVICES=2,3` to keep it to those), else `--gpu-count`/`$OCCULT_GPU_COUNT`, else
the lines of `nvidia-smi -L`. `--gpus 0` runs the command unchanged. Under SLURM
(`SLURM_JOB_ID` set) a job whose allocation shows exactly the GPUs asked for runs unchanged:
the scheduler has pinned them (gres) and lock files on a shared file system would tie unrelated
nodes together.

Jobs holding GPUs also get their own torchrun rendezvous port (`PET_MASTER_PORT`, unless set):
29510 + the position of the job's first GPU in the pool, so two jobs on one machine never share one.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_SLOTS_DIR = ".snakemake/gpu_slots"
ENV_SLOTS_DIR = "OCCULT_GPU_SLOTS"
ENV_GPU_COUNT = "OCCULT_GPU_COUNT"
BASE_PORT = 29510


class SlotError(RuntimeError):
    """The request cannot be met (bad count, no GPUs, more GPUs asked for than the pool holds)."""


def visible_pool(env: dict[str, str], gpu_count: int | None) -> list[str]:
    """GPU ids this job may choose from, in order."""
    inherited = env.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None:          # set, even empty: the GPUs this process was given
        return [item.strip() for item in inherited.split(",") if item.strip()]
    count = gpu_count
    if count is None and env.get(ENV_GPU_COUNT, "").strip():
        text = env[ENV_GPU_COUNT].strip()
        if not text.isdigit():
            raise SlotError(f"{ENV_GPU_COUNT}={text!r}: expected a whole number of GPUs")
        count = int(text)
    if count is None:
        count = nvidia_smi_count()
    return [str(i) for i in range(count)]


def nvidia_smi_count() -> int:
    """GPUs listed by `nvidia-smi -L` (0 where there is no nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SlotError(f"nvidia-smi -L failed (exit {out.returncode}): {out.stderr.strip()[:200]}")
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive flock on `path`, or None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _slot(slots_dir: Path, gpu: str) -> Path:
    return slots_dir / f"gpu{gpu.replace('/', '_')}.lock"


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def acquire(pool: list[str], count: int, slots_dir: Path, wait_s: float | None,
            poll_s: float = 0.2, note=None) -> tuple[list[str], list[int]]:
    """Lock `count` free GPUs of `pool` (lowest ids first): (ids, open descriptors holding the locks).

    All-or-nothing under a short-lived allocator lock, so two jobs never each hold part of what the
    other needs. Waits while too few are free (at most `wait_s`, None: no limit)."""
    slots_dir.mkdir(parents=True, exist_ok=True)
    deadline = None if wait_s is None else time.monotonic() + wait_s
    next_note = time.monotonic()
    while True:
        guard = os.open(slots_dir / "allocator.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            taken: list[tuple[str, int]] = []
            for gpu in pool:
                fd = _try_lock(_slot(slots_dir, gpu))
                if fd is not None:
                    taken.append((gpu, fd))
                    if len(taken) == count:
                        break
            if len(taken) == count:
                return [gpu for gpu, _ in taken], [fd for _, fd in taken]
            for _, fd in taken:
                os.close(fd)
        finally:
            os.close(guard)
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            busy = {gpu: _holder(_slot(slots_dir, gpu)) for gpu in pool}
            raise SlotError(f"{count} of GPUs {','.join(pool)} not free within {wait_s:g} s; holders: {busy}")
        if note is not None and now >= next_note:
            note(f"waiting for {count} free GPU(s) of {','.join(pool)} (slots in {slots_dir})")
            next_note = now + 60.0
        time.sleep(poll_s)


def _record(fds: list[int], command: list[str]) -> None:
    """Write who holds each lock into its file (read back in the waiting message)."""
    line = f"pid {os.getpid()}: {' '.join(command)[:200]}\n".encode()
    for fd in fds:
        os.ftruncate(fd, 0)
        os.pwrite(fd, line, 0)


def plan(gpus: int, env: dict[str, str], gpu_count: int | None) -> list[str] | None:
    """The pool to allocate from, or None where the command runs unchanged (no GPUs asked for, or
    a SLURM allocation of exactly the GPUs asked for)."""
    if gpus < 0:
        raise SlotError(f"--gpus {gpus}: expected 0 or more")
    if gpus == 0:
        return None
    pool = visible_pool(env, gpu_count)
    if env.get("SLURM_JOB_ID") and env.get("CUDA_VISIBLE_DEVICES", "").strip() and len(pool) == gpus:
        return None
    if not pool:
        where = ("CUDA_VISIBLE_DEVICES is empty" if "CUDA_VISIBLE_DEVICES" in env
                 else f"nvidia-smi lists none; set {ENV_GPU_COUNT} or --gpu-count to declare them")
        raise SlotError(f"--gpus {gpus}: no GPU found ({where})")
    if gpus > len(pool):
        raise SlotError(f"--gpus {gpus}: only {len(pool)} GPU(s) here ({','.join(pool)})")
    return pool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.gpu_slots", description=__doc__.split("\n")[0],
                                     usage="%(prog)s --gpus N [options] -- COMMAND [ARGS ...]")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs the command gets (0: run it unchanged)")
    parser.add_argument("--gpu-count", type=int, default=None,
                        help=f"GPUs of this machine (default: ${ENV_GPU_COUNT}, else nvidia-smi -L)")
    parser.add_argument("--slots-dir", type=Path, default=None,
                        help=f"lock folder (default: ${ENV_SLOTS_DIR}, else {DEFAULT_SLOTS_DIR}), one subfolder per host")
    parser.add_argument("--wait-s", type=float, default=None, help="give up after waiting this long (default: wait)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if args.gpu_count is not None and args.gpu_count < 0:
        parser.error(f"--gpu-count {args.gpu_count}: expected 0 or more")
    env = dict(os.environ)

    def note(message: str) -> None:
        print(f"gpu_slots: {message}", file=sys.stderr, flush=True)

    try:
        pool = plan(args.gpus, env, args.gpu_count)
        if pool is not None:
            base = args.slots_dir or Path(env.get(ENV_SLOTS_DIR) or DEFAULT_SLOTS_DIR)
            ids, fds = acquire(pool, args.gpus, base / socket.gethostname(), args.wait_s, note=note)
            _record(fds, command)
            for fd in fds:
                os.set_inheritable(fd, True)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
            env.setdefault("PET_MASTER_PORT", str(BASE_PORT + pool.index(ids[0])))
            note(f"GPU(s) {env['CUDA_VISIBLE_DEVICES']} for: {' '.join(command)[:160]}")
    except SlotError as err:
        print(f"gpu_slots: error: {err}", file=sys.stderr)
        return 2
    try:
        os.execvpe(command[0], command, env)
    except OSError as err:
        print(f"gpu_slots: error: cannot run {command[0]!r}: {err}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
