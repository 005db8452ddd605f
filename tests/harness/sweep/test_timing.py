"""Sweep timing: quantiles, stream blocks, the host probes and the interleaved A/B loop."""

from __future__ import annotations

import time

import pytest
import torch

from occult.harness.sweep import settings, timing


def test_quantile_interpolates():
    assert timing.quantile([4.0, 1.0, 3.0, 2.0, 5.0], 0.5) == 3.0
    assert timing.quantile([1.0, 2.0], 0.1) == pytest.approx(1.1)
    assert timing.quantile([7.0], 0.9) == 7.0


def test_stream_timing_issues_blocks_of_steps_back_to_back():
    """`time_stream`: the warm-up steps, then `STREAM_BLOCKS` blocks of `steps` steps in order, one
    time per block (ms per step), host time per step beside it."""
    calls: list[int] = []

    def step(i: int) -> None:
        calls.append(i)
        time.sleep(0.002)

    hosts: list[float] = []
    probes: list[tuple[float, float]] = []
    times = timing.time_stream(step, 4, 2, torch.device("cpu"), 1, hosts, probes)
    assert calls == list(range(2 + settings.STREAM_BLOCKS * 4))
    assert len(times) == len(hosts) == len(probes) == settings.STREAM_BLOCKS
    assert all(p > 0 and q > 0 for p, q in probes)
    assert all(2.0 <= t < 50.0 for t in times)          # one step, not a block: 2 ms of sleep each


def test_host_probe_scales_with_its_work():
    """`host_probe_us` times a fixed pure-Python loop: more iterations take longer (the probe is not a
    constant), and its time is microseconds, not seconds."""
    small = min(timing.host_probe_us(2000) for _ in range(5))
    large = min(timing.host_probe_us(40000) for _ in range(5))
    assert 0 < small < large
    assert large > 5 * small
    few = min(timing.host_launch_us(torch.device("cpu"), 5) for _ in range(5))
    many = min(timing.host_launch_us(torch.device("cpu"), 500) for _ in range(5))
    assert 0 < few < many


def test_interleaved_ab_alternates_the_order_and_writes_one_row_per_step(monkeypatch, tmp_path):
    """`interleaved_ab` (the host-speed-controlled A/B of occult.harness.host_ab): every step
    warmed up, then timed once per round, in reversed order every other round, one CSV row per step."""
    class Event:
        def __init__(self, **_kwargs):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, _other):
            return 0.25

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_args: None)
    monkeypatch.setattr(timing, "host_launch_us", lambda _device: 3.0)
    calls: list[str] = []
    steps = {("olmoe", 1, arm): (lambda arm=arm: calls.append(arm)) for arm in ("a", "b", "c")}
    out = tmp_path / "ab.csv"
    timing.interleaved_ab(steps, rounds=2, warmup=2, device=torch.device("cpu"), out_csv=out,
                                key_columns=("shape", "batch", "arm"))
    assert calls == ["a", "a", "b", "b", "c", "c", "a", "b", "c", "c", "b", "a"]
    import pandas as pd

    table = pd.read_csv(out)
    assert list(table.columns) == ["round", "shape", "batch", "arm", "host_us", "step_us", "host_launch_us"]
    assert table.arm.tolist() == ["a", "b", "c", "c", "b", "a"] and (table.step_us == 250.0).all()
    assert not (tmp_path / "ab.tmp").exists()
