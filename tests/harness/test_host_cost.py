"""The host-cost tools of `occult.harness.host_cost`, and a group of one skipping the all-to-alls."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from occult.harness.ranks import run_ranks
from occult.harness.host_cost import HOST_PARTS, host_breakdown
from occult.ep.layer import ep_moe
from occult.kernels.reference import moe_dense_ref


def test_a_group_of_one_exchanges_nothing():
    def body(rank, world):
        calls = []
        real = dist.all_to_all_single
        dist.all_to_all_single = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(6, 8, generator=gen, requires_grad=True)
            ids = torch.rand(6, 4, generator=gen).topk(2, dim=1).indices
            weights = torch.rand(6, 2, generator=gen, requires_grad=True)
            w_gu, w_dn = torch.randn(4, 10, 8, generator=gen), torch.randn(4, 8, 5, generator=gen)
            y = ep_moe(x, ids, weights, torch.zeros(4, dtype=torch.long), w_gu, w_dn, group=dist.group.WORLD)
            y.sum().backward()
            ref = moe_dense_ref(x.detach(), ids, weights.detach(), w_gu, w_dn)
            return len(calls), float((y - ref).abs().max()), x.grad is not None and weights.grad is not None
        finally:
            dist.all_to_all_single = real

    calls, err, grads = run_ranks(body, 1, timeout_s=60)[0]
    assert calls == 0 and err < 1e-5 and grads


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_host_breakdown_needs_a_gpu():
    with pytest.raises(RuntimeError, match="host_breakdown: needs a GPU"):
        host_breakdown(8, repeats=1)


def _breakdown_in_a_fresh_process() -> dict[str, float]:
    # Its own interpreter, as the tool is meant to run: after other GPU tests in one pytest process,
    # a second copy of the kernels (tests/kernels/test_package.py) could bypass the launcher
    # wrappers, which host_breakdown reports as an error rather than as 0 µs.
    code = ("import json; from occult.harness.host_cost import host_breakdown; "
            "print(json.dumps(host_breakdown(64, repeats=5, warmup=2, hidden=256, ffn=128)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_host_breakdown_parts_add_up_within_the_total():
    out = _breakdown_in_a_fresh_process()
    skipped = {"plan_count", "plan_pack", "dispatch_rows", "combine"}      # one device: nothing travels
    assert all(out[part] > 0 for part in HOST_PARTS if part not in skipped)
    assert all(out[part] == 0 for part in skipped)
    assert 0 < out["swiglu_launcher"] < out["swiglu"] and 0 < out["down_launcher"] < out["down_reduce"]
    # every launch of a warm forward is direct (kernels/launch.py): none through Triton's Python
    assert out["rest"] > 0 and out["triton_launch"] == 0
    assert 0 < out["direct_lookup"] <= sum(out[p] for p in HOST_PARTS)


def test_a_static_capacity_below_the_tokens_is_refused_on_one_device_and_in_the_plan():
    from occult.ep.plan import static_plan

    x, ids = torch.randn(5, 8), torch.tensor([[0, 1]] * 5)
    w_gu, w_dn = torch.randn(2, 6, 8), torch.randn(2, 8, 3)
    with pytest.raises(ValueError, match="static_capacity: 4 rows per device < 5 tokens"):
        ep_moe(x, ids, torch.rand(5, 2), torch.zeros(2, dtype=torch.long), w_gu, w_dn, static_capacity=4)
    with pytest.raises(ValueError, match="static_capacity: 4 rows per device < 5 tokens"):
        static_plan(ids, torch.tensor([0, 1]), 2, torch.tensor([0, 0]), 4, 2)
    assert ep_moe(x, ids, torch.rand(5, 2), torch.zeros(2, dtype=torch.long), w_gu, w_dn, static_capacity=5).shape == (5, 8)
