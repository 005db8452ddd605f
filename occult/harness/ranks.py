"""Run a function on D CPU ranks (gloo) for tests and benchmarks, and never hang.

`run_ranks(fn, world_size, *args)` forks `world_size` processes (OMP_NUM_THREADS=1 is set
before the fork: forking after OpenMP started threads can hang the child), joins them into one
gloo process group through a `file://` rendezvous in a fresh temporary directory (no ports), calls
`fn(rank, world_size, *args, **kwargs)` in each, and returns the per-rank results in rank order.

Failure handling: a rank that raises reports its traceback and exits; a rank that dies reports
nothing. Either way the parent notices within a poll interval, kills the other ranks (they are
likely blocked in a collective) and raises `RankFailure` naming the rank. Collectives also carry
`timeout_s` (gloo raises after it), and the parent enforces a wall-clock deadline on the whole
run, killing every rank when it passes.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

POLL_S = 0.1
FAILURE_GRACE_S = 2.0
KILL_GRACE_S = 2.0
RENDEZVOUS_ATTEMPTS = 2


class RankFailure(RuntimeError):
    """A rank raised, died or ran past the deadline; the message names it."""


def _rank_main(
    rank: int,
    world_size: int,
    init_file: str,
    timeout_s: float,
    results: Any,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> None:
    torch.set_num_threads(1)
    phase = "init-error"                # the rendezvous failed: nothing of fn has run here
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        phase = "error"
        try:
            value = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        # Results travel as plain pickled bytes: torch's shared-memory reductions would tie the
        # tensors to this process, which exits right after.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, phase, traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)


def _failure_message(rank: int, payload: str, results, world_size: int, processes: list,
                     finished: dict, in_fn: set[int]) -> str:
    """All errors reported within a short grace period, root causes first; the ranks whose error
    came from `fn` (not from the rendezvous) are added to `in_fn`.

    When one rank raises or dies, its peers soon fail too with transport errors ("Connection
    reset by peer"); whichever reaches the parent first, the message leads with the original
    error, and a rank that exited without any report is named with its exit code.
    """
    errors = {rank: payload}
    reported = set(finished) | {rank}
    grace = time.monotonic() + FAILURE_GRACE_S
    while time.monotonic() < grace and len(reported) < world_size:
        try:
            other, status, text = results.get(timeout=POLL_S)
        except queue.Empty:
            continue
        reported.add(other)
        if status in ("error", "init-error"):
            errors[other] = text
        if status == "error":
            in_fn.add(other)
    for other, proc in enumerate(processes):
        proc.join(0.05)
        if other not in reported and proc.exitcode not in (None, 0):
            errors[other] = f"died (exit code {proc.exitcode}) without a report\n"

    def is_consequence(text: str) -> bool:
        return any(marker in text for marker in ("gloo/transport", "Connection reset", "Connection closed"))

    def line(r: int) -> str:
        text = errors[r]
        return f"rank {r} of {world_size} {text}" if text.startswith("died") else \
            f"rank {r} of {world_size} failed:\n{text}"

    order = sorted(errors, key=lambda r: (is_consequence(errors[r]), r))
    parts = [line(r) for r in order]
    return "\n".join(parts)


def _stop(processes: list) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + KILL_GRACE_S
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(KILL_GRACE_S)


class _RendezvousFailure(RankFailure):
    """A rank's gloo rendezvous failed before any rank's `fn` reported an error of its own."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    deadline_s: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks; return the results.

    `timeout_s` bounds each collective; `deadline_s` (default: `timeout_s` plus 30 s) bounds each
    attempt. `fn` is inherited through fork, so closures work; its return value must pickle.
    A failed rendezvous (gloo's full-mesh connect on a loaded host, seen in CI beside other gloo
    jobs) is retried from fresh processes up to RENDEZVOUS_ATTEMPTS times in all, unless a rank's
    `fn` had already failed; an error raised by `fn` itself is never retried.
    """
    if world_size < 1:
        raise ValueError(f"world_size: must be at least 1, got {world_size}")
    deadline_s = timeout_s + 30.0 if deadline_s is None else deadline_s
    os.environ["OMP_NUM_THREADS"] = "1"
    attempt = 1
    while True:
        try:
            return _run_ranks_once(fn, world_size, args, kwargs, timeout_s, deadline_s)
        except _RendezvousFailure as failure:
            if attempt >= RENDEZVOUS_ATTEMPTS:
                raise RankFailure(f"the gloo rendezvous failed {attempt} times; the last time:\n{failure}") from None
            attempt += 1


def _run_ranks_once(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout_s: float,
                    deadline_s: float) -> list[Any]:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    tmp_dir = Path(tempfile.mkdtemp(prefix="occult-gloo-"))
    init_file = str(tmp_dir / "rendezvous")
    processes = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, init_file, timeout_s, results, fn, args, kwargs),
            name=f"occult-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    values: dict[int, Any] = {}
    try:
        for proc in processes:
            proc.start()
        deadline = time.monotonic() + deadline_s
        while len(values) < world_size:
            try:
                rank, status, payload = results.get(timeout=POLL_S)
            except queue.Empty:
                for rank, proc in enumerate(processes):
                    if rank not in values and not proc.is_alive():
                        # It may have reported just before exiting: look once more.
                        try:
                            rank, status, payload = results.get(timeout=POLL_S)
                        except queue.Empty:
                            raise RankFailure(
                                f"rank {rank} of {world_size} died (exit code {proc.exitcode}) without a result"
                            ) from None
                        break
                else:
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(values))
                        raise RankFailure(
                            f"ranks {missing} of {world_size} did not finish within {deadline_s:.0f} s"
                        )
                    continue
            if status in ("error", "init-error"):
                in_fn = {rank} if status == "error" else set()
                message = _failure_message(rank, payload, results, world_size, processes, values, in_fn)
                raise (RankFailure if in_fn else _RendezvousFailure)(message)
            values[rank] = pickle.loads(payload)
        for proc in processes:
            proc.join(KILL_GRACE_S)
    finally:
        _stop(processes)
        results.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return [values[rank] for rank in range(world_size)]


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun (it sets WORLD_SIZE and RANK)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _release_before_teardown(device: str) -> None:
    """Free objects in reference cycles (CUDA graphs that captured collectives among them) and let
    queued GPU work finish, so that destroying the process group does not wait on either."""
    gc.collect()
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


def run_in_group(
    fn: Callable[[], Any],
    device: str,
    world: int,
    timeout_s: float,
    deadline_s: float = 24 * 3600.0,
    error: type[Exception] = ValueError,
) -> None:
    """Call `fn()` on every rank of an EP group of `world` ranks, however the command was started:
    under torchrun (NCCL on GPUs, gloo on the CPU), as `world` forked gloo ranks on the CPU
    (`run_ranks`), or on one GPU (a one-rank NCCL group). Mismatches raise `error`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if launched_by_torchrun():
        if world != int(os.environ["WORLD_SIZE"]):
            raise error(f"--D {world} differs from torchrun's WORLD_SIZE {os.environ['WORLD_SIZE']}")
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl", timeout=timeout,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
        else:
            dist.init_process_group("gloo", timeout=timeout)
        try:
            fn()
        finally:
            _release_before_teardown(device)
            dist.destroy_process_group()
    elif device == "cpu":
        run_ranks(lambda rank, world_size: fn(), world, timeout_s=timeout_s, deadline_s=deadline_s)
    else:
        if world != 1:
            raise error(f"--D {world} on GPUs needs torchrun --nproc_per_node={world}")
        with tempfile.TemporaryDirectory(prefix="occult-group-") as tmp:
            torch.cuda.set_device(0)
            dist.init_process_group("nccl", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1,
                                    timeout=timeout, device_id=torch.device("cuda", 0))
            try:
                fn()
            finally:
                _release_before_teardown(device)
                dist.destroy_process_group()
