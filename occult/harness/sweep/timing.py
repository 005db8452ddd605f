"""How the sweep times a step: host probes, steps from a drained GPU or blocks back to back (max over
ranks), the training step, the interleaved A/B loop, host profiles and per-phase medians."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from occult.harness.baselines import Method
from occult.harness.sweep.settings import STREAM_BLOCKS


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


HOST_PROBE_ITERS = 4000     # ≈ 0.2 ms of pure Python on an H200 machine's host CPU


def host_probe_us(iters: int = HOST_PROBE_ITERS) -> float:
    """Microseconds of a fixed pure-Python loop (no torch, no GPU): the host CPU's single-thread speed
    now. On H200 virtual machines it moved 1.0 -> 2.1 ms per 20k iterations within seconds, and an eager
    layer call's host time moved with it (`occult.harness.host_probe`,
    `results/nvidia-h200/host_probe_v1`); the simulator scales host terms by it (docs/simulator.md)."""
    begin = time.perf_counter()
    total = 0
    for i in range(iters):
        total += i * i % 7
    return 1e6 * (time.perf_counter() - begin)


HOST_LAUNCHES = 20
_LAUNCH_SCRATCH: dict[torch.device, torch.Tensor] = {}


def host_launch_us(device: torch.device, launches: int = HOST_LAUNCHES) -> float:
    """Microseconds to issue `launches` in-place adds on a one-element tensor of `device` (the ops
    are drained after the clock stops): the dispatcher and driver launch path at this moment."""
    scratch = _LAUNCH_SCRATCH.setdefault(device, torch.zeros(1, device=device))
    begin = time.perf_counter()
    for _ in range(launches):
        scratch.add_(1.0)
    elapsed = time.perf_counter() - begin
    synchronize(device)
    return 1e6 * elapsed


def _run_blocks(step: Callable[[int], None], blocks: Sequence[range], device: torch.device,
                world: int) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """Per block: the GPU drained and the ranks met, the host probed (`host_probe_us`,
    `host_launch_us`), then its steps issued back to back; returns each block's milliseconds per
    step (CUDA events; `perf_counter` on the CPU), host milliseconds per step (from the first call
    until the last returns: a sync inside a step counts, GPU work still queued at the end does not)
    and the probes' microseconds."""
    times: list[float] = []
    hosts: list[float] = []
    probes: list[tuple[float, float]] = []
    for block in blocks:
        synchronize(device)
        if world > 1:
            dist.barrier()
        probes.append((host_probe_us(), host_launch_us(device)))
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        begin = time.perf_counter()
        for i in block:
            step(i)
        host = 1e3 * (time.perf_counter() - begin)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = host
        times.append(elapsed / len(block))
        hosts.append(host / len(block))
    return times, hosts, probes


def _max_over_ranks(times: list[float], hosts: list[float], probes: list[tuple[float, float]], device: torch.device,
                    world: int, host_times: list[float] | None,
                    host_probes: list[tuple[float, float]] | None) -> list[float]:
    python_us, launch_us = zip(*probes) if probes else ((), ())
    values = torch.tensor([times, hosts, list(python_us), list(launch_us)], dtype=torch.float64,
                          device=device if device.type == "cuda" else "cpu")
    if world > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    if host_times is not None:
        host_times.extend(values[1].tolist())
    if host_probes is not None:
        host_probes.extend(zip(values[2].tolist(), values[3].tolist()))
    return values[0].tolist()


def time_steps(step: Callable[[int], None], steps: int, warmup: int, device: torch.device,
               world: int, host_times: list[float] | None = None,
               host_probes: list[tuple[float, float]] | None = None) -> list[float]:
    """Milliseconds of each timed step (after `warmup`), the GPU drained before every step, max over
    ranks. If `host_times` is given, it receives each timed step's host milliseconds (max over ranks);
    `host_probes`, the host probes' microseconds (Python loop, launches) before each timed step."""
    _run_blocks(step, [range(i, i + 1) for i in range(warmup)], device, world)
    times, hosts, probes = _run_blocks(step, [range(i, i + 1) for i in range(warmup, warmup + steps)], device, world)
    return _max_over_ranks(times, hosts, probes, device, world, host_times, host_probes)


def time_stream(step: Callable[[int], None], steps: int, warmup: int, device: torch.device,
                world: int, host_times: list[float] | None = None,
                host_probes: list[tuple[float, float]] | None = None) -> list[float]:
    """Milliseconds per step of `STREAM_BLOCKS` blocks of `steps` steps issued back to back (the GPU
    drained, and ranks met, only before each block; max over ranks): the steady rate of consecutive
    layer calls. `host_times` receives each block's host milliseconds per step, `host_probes` the
    host probes' microseconds before each block."""
    for i in range(warmup):
        step(i)
    blocks = [range(warmup + b * steps, warmup + (b + 1) * steps) for b in range(STREAM_BLOCKS)]
    times, hosts, probes = _run_blocks(step, blocks, device, world)
    return _max_over_ranks(times, hosts, probes, device, world, host_times, host_probes)


def interleaved_ab(steps: dict[tuple, Callable[[], None]], rounds: int, warmup: int, device: torch.device,
                   out_csv: Path, key_columns: Sequence[str], progress_every: int = 50) -> None:
    """Time several variants with the host's speed held fixed (one GPU, one process): warm each step up,
    then per round (the order reversed every other round, so that no variant is always first) time
    every step as `time_steps` does (the GPU drained, CUDA events around it, its own host time), after
    one launch probe (`host_launch_us`) per round. Writes `out_csv` (columns round, *key_columns,
    host_us, step_us, host_launch_us; one row per step) atomically."""
    import csv
    import time

    for step in steps.values():
        for _ in range(warmup):
            step()
    torch.cuda.synchronize(device)
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows, began = [], time.monotonic()
    for round_ in range(rounds):
        launch_us = host_launch_us(device)
        for key in (list(steps) if round_ % 2 == 0 else list(reversed(steps))):
            torch.cuda.synchronize(device)
            start_event.record()
            t0 = time.perf_counter()
            steps[key]()
            host_us = 1e6 * (time.perf_counter() - t0)
            end_event.record()
            end_event.synchronize()
            rows.append((round_, *key, round(host_us, 1), round(1e3 * start_event.elapsed_time(end_event), 1),
                         round(launch_us, 1)))
        if round_ % progress_every == 0:
            print(f"round {round_}/{rounds} ({time.monotonic() - began:.0f} s)", flush=True)
    tmp = out_csv.with_suffix(".tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["round", *key_columns, "host_us", "step_us", "host_launch_us"])
        writer.writerows(rows)
    tmp.replace(out_csv)


def train_step(method: Method, x_TD: torch.Tensor, ids_TK: torch.Tensor, gate_TK: torch.Tensor,
               shared: torch.nn.Module | None, dy_TD: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """One training step as the sweep times it: gradients cleared, the layer (plus the shared expert)
    forward on fresh leaves, backward from `dy_TD` (`-compute` returns the received rows' outputs
    [R, d]: any upstream gradient will do there)."""
    for p in params:
        p.grad = None
    x = x_TD.detach().requires_grad_()
    gate = gate_TK.detach().requires_grad_()
    y = method.forward(x, ids_TK, gate)
    if shared is not None:
        y = y + shared(x)
    y.backward(dy_TD if y.shape == dy_TD.shape else torch.ones_like(y))


def profile_host(step: Callable[[int], None], steps: int, device: torch.device, world: int, rank: int,
                 out_txt: Path, top: int = 40) -> None:
    """Run `steps` more steps under cProfile (the GPU drained before each, as in `time_steps`) and
    write rank 0's Python-side profile to `out_txt`: the `top` functions by own time, then by
    cumulative time. cProfile slows Python code, so the shares are what it is for, not the times."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    for i in range(steps):
        synchronize(device)
        if world > 1:
            dist.barrier()
        profiler.enable()
        step(i)
        profiler.disable()
    synchronize(device)
    if rank != 0:
        return
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"# {steps} steps, rank 0; host seconds per step = totals / {steps}\n")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    out_txt.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_txt.with_suffix(".tmp")
    tmp.write_text(text.getvalue())
    tmp.replace(out_txt)


def phase_medians(events: list[tuple[torch.cuda.Event, ...]], device: torch.device, world: int) -> dict[str, float]:
    """Median ms of dispatch (plan, counts, sync, pack, all-to-all, BRIM_1), expert kernels and
    return + combine over the timed steps, each the max over ranks of the rank's median."""
    torch.cuda.synchronize(device)
    spans = [[a.elapsed_time(b) for a, b in zip(ev[:-1], ev[1:])] for ev in events]
    medians = torch.tensor([statistics.median(col) for col in zip(*spans)], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(("dispatch_ms", "experts_ms", "combine_ms"), medians.tolist()))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
