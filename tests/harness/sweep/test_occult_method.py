"""Occult as a sweep method: every option and trace routing on two CPU ranks, and (GPU) the
CUDA-graph replay of the expert compute."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import torch

from occult.shapes import SHAPES
from occult.harness.sweep import occult_method, settings
from occult.provenance import REPO_ROOT
from tests.harness.sweep.test_inputs import write_trace


def test_occult_options_and_trace_routing_run_on_two_ranks(tmp_path):
    write_trace(tmp_path / "routing_heldout.npz", 4, 1, 40, seed=1)
    write_trace(tmp_path / "routing_calibration.npz", 4, 1, 40, seed=2)
    out = tmp_path / "trace.csv"
    methods = ["occult", "occult-pe", "occult-static", "occult-trivial", "occult-compute", "occult-nd1"]
    cmd = [sys.executable, "-m", "occult.harness.sweep", "--device", "cpu", "--dtype", "float32", "--D", "2",
           "--kind", "prefill", "--shapes", "tiny", "--sizes", "12", "--repeats", "2", "--warmup", "3",
           "--routings", "trace", "--trace", str(tmp_path / "routing_heldout.npz"), "--out", str(out),
           "--methods", *methods]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frame = pd.read_csv(out).set_index("method")
    assert (frame["status"] == "ok").all(), frame["status"]
    assert set(frame["routing"]) == {"trace"}
    checked = frame.drop(index="occult-compute")
    assert (checked["max_rel_err"] < settings.REL_TOLERANCE["float32"]).all()
    assert pd.isna(frame.loc["occult-compute", "max_rel_err"])          # no output to check
    # The static plan sends T rows to the other device whatever the routing; exact dedup sends
    # at most that many, per_expert at least as many rows as dedup.
    assert frame.loc["occult-static", "bytes_sent"] >= frame.loc["occult", "bytes_sent"]
    assert frame.loc["occult-pe", "bytes_sent"] >= frame.loc["occult", "bytes_sent"]
    assert (frame["pairs_received_max"] > 0).all()
    assert frame.loc["occult-nd1", "mean_devices_per_token"] == 1


@pytest.mark.gpu
def test_compute_graph_replays_the_eager_compute_forward_and_backward():
    """`occult-compute-graph` (the simulator's host-free kernel rows) gives the eager
    `occult-compute` outputs and row gradients on fresh inputs, every input set its own graph."""
    from occult.harness.baselines import ExpertWeights

    device, shape = torch.device("cuda"), SHAPES["tiny"]
    weights = ExpertWeights.random(shape, seed=3, device=device, dtype=torch.bfloat16)
    placement = torch.zeros(shape.num_experts, dtype=torch.long)
    methods = {}
    for name in ("occult-compute", "occult-compute-graph"):
        methods[name] = occult_method.build_method(name, placement, "triton")
        methods[name].setup(shape, None, torch.bfloat16, device, weights)
        for p in methods[name].expert_parameters():
            p.requires_grad_(True)
    gen = torch.Generator(device=device).manual_seed(4)
    for train in (False, True):
        for _ in range(2):                 # two input sets: two graphs side by side
            tokens = 64
            x = torch.randn(tokens, shape.hidden, device=device, generator=gen).bfloat16()
            ids = torch.rand(tokens, shape.num_experts, device=device, generator=gen).topk(shape.top_k, 1).indices
            gate = torch.rand(tokens, shape.top_k, device=device, generator=gen)
            got = {}
            for name, method in methods.items():
                with torch.set_grad_enabled(train):
                    for _ in range(3):      # capture, then replays
                        y = method.forward(x, ids, gate)
                        if train:
                            received = method._received[(x.data_ptr(), tuple(x.shape), ids.data_ptr())]
                            received.x_RD.grad = None
                            y.float().square().sum().backward()
                got[name] = (y.detach().clone(), received.x_RD.grad.clone() if train else None)
            eager, graphed = got["occult-compute"], got["occult-compute-graph"]
            torch.testing.assert_close(graphed[0], eager[0], atol=0, rtol=0)
            if train:
                assert graphed[1].abs().sum() > 0
                torch.testing.assert_close(graphed[1], eager[1], atol=0, rtol=0)
