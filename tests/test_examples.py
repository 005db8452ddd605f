"""The library example runs as documented and shows what it claims."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "communicate_less.py"


def load_example():
    spec = importlib.util.spec_from_file_location("communicate_less", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_communicate_less_example(capsys):
    report = load_example().main(["--tokens", "256"])
    assert set(report) == {"contiguous", "occult"}
    for name, row in report.items():
        assert row["max_abs_logit_err"] < 1e-5, name                  # the sharded model is the model
        assert abs(row["measured_ct"] - row["expected_ct_heldout"]) < 1e-9, name   # EPStats = the placement's E[C_T]
        assert 1.0 <= row["measured_ct"] <= 2.0 and row["remote_bytes_per_token"] > 0
    assert "E[C_T] held-out" in capsys.readouterr().out
