"""Where a training step's time goes: torch.profiler over a few steps of a loop, summarised as JSON.

`StepTrace(out_json, skip=10, steps=5)` is called once per loop iteration (`trace.step()` at the start
of each step, `trace.close()` after the loop). It waits `skip` steps (compilation, allocator growth,
autotuning), profiles the next `steps`, and writes:

- `wall_ms_per_step`: host wall time of the profiled steps (the device synchronised at both ends);
- `device_busy_ms_per_step`: the summed self time of every device kernel and copy, per step;
- `host_bound_share`: 1 - busy/wall, the share of the step the device sat idle (the launch and
  Python overhead a CUDA graph or fewer, larger kernels would recover);
- the top kernels by device time and the top host operators by self host time (with the device
  time of the kernels each launched), with call counts per step.

With `out_json=None` it does nothing, so loops call it unconditionally. On a CPU the device columns
are zero; the summary is still written (the tests use that).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

from occult.provenance import write_json

TOP_OPS = 25


def _self_device_us(event) -> float:
    """Self device time of a profiler average in microseconds (the attribute is named per torch version)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


class StepTrace:
    """Profile steps [skip, skip + steps) of a loop and write their summary to `out_json`."""

    def __init__(self, out_json: Path | None, *, skip: int = 10, steps: int = 5, total: int | None = None,
                 meta: dict[str, Any] | None = None):
        """`total`: the loop's length, if known; a short loop skips fewer steps so that its trace still runs."""
        if skip < 0 or steps < 1:
            raise ValueError(f"StepTrace: skip must be >= 0 and steps >= 1, got skip={skip}, steps={steps}")
        if total is not None:
            skip = min(skip, max(0, total - steps))
        self.out_json = Path(out_json) if out_json is not None else None
        self.skip, self.steps, self.meta = skip, steps, meta or {}
        self.calls = 0
        self.profiler: torch.profiler.profile | None = None
        self.started_at = 0.0
        self.cuda = torch.cuda.is_available()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step(self) -> None:
        """Call at the start of every step."""
        if self.out_json is None:
            return
        if self.calls == self.skip:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._sync()
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            self.started_at = time.perf_counter()
        elif self.calls == self.skip + self.steps:
            self._finish()
        self.calls += 1

    def close(self) -> None:
        """Call after the loop: finishes a trace the loop ended inside of (its steps are what ran)."""
        if self.profiler is not None:
            self._finish()

    def _finish(self) -> None:
        self._sync()
        wall_s = time.perf_counter() - self.started_at
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        steps = max(1, min(self.steps, self.calls - self.skip))
        averages = profiler.key_averages()
        # kineto gives kernels and copies their own events (device type CUDA); host operators carry
        # the device time of the kernels they launched too, so only the former are summed
        # (record_function ranges also get a device-side copy, e.g. "Optimizer.step#AdamW.step", spanning
        # kernels counted already: left out)
        kernels = [e for e in averages if e.device_type != DeviceType.CPU and "#" not in e.key]
        host_ops = [e for e in averages if e.device_type == DeviceType.CPU]
        device_us = sum(_self_device_us(e) for e in kernels)

        def rows(events, key) -> list[dict[str, Any]]:
            ranked = sorted(events, key=key, reverse=True)[:TOP_OPS]
            return [{"op": e.key, "calls_per_step": e.count / steps,
                     "self_device_ms_per_step": _self_device_us(e) / 1e3 / steps,
                     "self_host_ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in ranked]

        wall_ms = wall_s * 1e3 / steps
        busy_ms = device_us / 1e3 / steps
        write_json(self.out_json, {
            **self.meta,
            "profiled_steps": steps,
            "skipped_steps": self.skip,
            "device": torch.cuda.get_device_name() if self.cuda else "cpu",
            "wall_ms_per_step": wall_ms,
            "device_busy_ms_per_step": busy_ms,
            "host_bound_share": max(0.0, 1.0 - busy_ms / wall_ms) if self.cuda else None,
            "kernels_by_device_time": rows(kernels, _self_device_us),
            "host_ops_by_host_time": rows(host_ops, lambda e: e.self_cpu_time_total),
        })
