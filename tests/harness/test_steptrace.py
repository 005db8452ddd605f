"""occult.harness.steptrace on CPU: the profiled window, the summary's fields, a loop that ends inside the window."""

import json

import pytest
import torch

from occult.harness.steptrace import StepTrace


def _loop(trace: StepTrace, steps: int) -> None:
    w = torch.randn(64, 64, requires_grad=True)
    for _ in range(steps):
        trace.step()
        (torch.randn(32, 64) @ w).square().sum().backward()
    trace.close()


def test_profiles_the_window_after_the_skipped_steps(tmp_path):
    out = tmp_path / "trace.json"
    _loop(StepTrace(out, skip=3, steps=4, meta={"loop": "test"}), steps=20)
    summary = json.loads(out.read_text())
    assert summary["loop"] == "test" and summary["profiled_steps"] == 4 and summary["skipped_steps"] == 3
    assert summary["wall_ms_per_step"] > 0
    assert summary["device"] == "cpu" and summary["device_busy_ms_per_step"] == 0 and summary["kernels_by_device_time"] == []
    ops = {row["op"]: row for row in summary["host_ops_by_host_time"]}
    assert "aten::mm" in ops and ops["aten::mm"]["calls_per_step"] == pytest.approx(2.0)   # forward + grad of w


def test_a_short_loop_is_traced_and_a_loop_ending_inside_the_window_is_summarised(tmp_path):
    short = tmp_path / "short.json"
    _loop(StepTrace(short, skip=10, steps=5, total=6), steps=6)          # skip shrinks to 1
    assert json.loads(short.read_text())["skipped_steps"] == 1
    cut = tmp_path / "cut.json"
    _loop(StepTrace(cut, skip=2, steps=5), steps=4)                       # 2 of the 5 steps ran
    assert json.loads(cut.read_text())["profiled_steps"] == 2
    never = tmp_path / "never.json"
    _loop(StepTrace(never, skip=10, steps=5), steps=4)                    # the window never opened
    assert not never.exists()
    _loop(StepTrace(None), steps=30)                                      # disabled: a no-op


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="skip"):
        StepTrace(None, skip=-1)
