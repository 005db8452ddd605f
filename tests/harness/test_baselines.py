"""The baselines of occult.harness.baselines against moe_dense_ref, on gloo ranks (CPU, fp32).

Each method gets the same global weights and routing; every rank checks its own tokens' output
and the gradients w.r.t. x and the gate weights; expert-weight gradients are checked where the
method keeps the plain sum over ranks (naive EP: each expert lives on one rank).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from occult.harness.baselines import (ExpertWeights, contiguous_experts, make_method)
from occult.shapes import SHAPES, MoEShape
from occult.harness.baselines.tutel import GivenRoutingGate
from occult.harness.ranks import run_ranks
from occult.kernels.reference import moe_dense_ref

# (shape, tokens per rank, routing): non-power-of-two sizes, a rank without tokens, a hot expert.
CASES = [
    (MoEShape("t8k2", 8, 2, 32, 16), (13, 7), "random"),
    (MoEShape("t6k3", 6, 3, 24, 8), (9, 0), "random"),
    (MoEShape("t4k1", 4, 1, 16, 8), (11, 5), "hot"),
]
ATOL = 1e-5


def routing(shape: MoEShape, tokens: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, shape.hidden, generator=gen)
    probs = torch.softmax(torch.randn(tokens, shape.num_experts, generator=gen), dim=1)
    if kind == "hot":
        probs[:, 0] += 10.0     # every token picks expert 0 first
    weights, ids = probs.topk(shape.top_k, dim=1)
    return x, ids, weights / weights.sum(1, keepdim=True) * 0.9


def check_rank(rank: int, world: int, name: str, shape: MoEShape, tokens: tuple[int, ...], kind: str) -> dict:
    weights = ExpertWeights.random(shape, seed=7)
    x, ids, gate = routing(shape, tokens[rank], kind, seed=100 + rank)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(200 + rank))
    method = make_method(name)
    method.setup(shape, None, torch.float32, torch.device("cpu"), weights)

    x_in, gate_in = x.clone().requires_grad_(), gate.clone().requires_grad_()
    y = method.forward(x_in, ids, gate_in)
    (y * dy).sum().backward()

    x_ref, gate_ref = x.clone().requires_grad_(), gate.clone().requires_grad_()
    wgu_ref = weights.w_gate_up_E2FD.clone().requires_grad_()
    wd_ref = weights.w_down_EDF.clone().requires_grad_()
    y_ref = moe_dense_ref(x_ref, ids, gate_ref, wgu_ref, wd_ref)
    (y_ref * dy).sum().backward()
    grads_ref = torch.cat([wgu_ref.grad.flatten(), wd_ref.grad.flatten()])
    if world > 1:
        torch.distributed.all_reduce(grads_ref)
    out = {
        "y": (y.detach() - y_ref.detach()).abs().max().item() if len(x) else 0.0,
        "x_grad": (x_in.grad - x_ref.grad).abs().max().item() if len(x) else 0.0,
        "gate_grad": (gate_in.grad - gate_ref.grad).abs().max().item() if len(x) else 0.0,
        "bytes_sent": method.bytes_sent(ids),
    }
    if name == "naive":
        block = contiguous_experts(shape.num_experts, world, rank)
        e, f2, d = weights.w_gate_up_E2FD.shape
        full_gu = grads_ref[: e * f2 * d].view(e, f2, d)
        full_d = grads_ref[e * f2 * d :].view(weights.w_down_EDF.shape)
        local_gu, local_d = method.expert_parameters()
        out["expert_grad"] = max((local_gu.grad - full_gu[block]).abs().max().item(),
                                 (local_d.grad - full_d[block]).abs().max().item())
    method.teardown()
    return out


@pytest.mark.parametrize("name,world", [("naive", 1), ("naive", 2), ("fsdp", 2), ("hf", 1)])
@pytest.mark.parametrize("shape,tokens,kind", CASES, ids=[c[0].name for c in CASES])
def test_method_matches_dense_reference(name, world, shape, tokens, kind):
    if name == "hf":
        import transformers.models.olmoe.modeling_olmoe  # noqa: F401 - imported once, before the fork
    results = run_ranks(check_rank, world, name, shape, tokens[:world], kind, timeout_s=60)
    for rank, result in enumerate(results):
        for key in ("y", "x_grad", "gate_grad", "expert_grad"):
            if key in result:
                assert result[key] < ATOL, f"{name} rank {rank}: {key} differs by {result[key]:.3g}"
        assert result["bytes_sent"] is not None and result["bytes_sent"] >= 0
    if world == 1:
        assert results[0]["bytes_sent"] == 0


def test_naive_bytes_count_remote_rows_both_ways():
    shape = MoEShape("t4k1", 4, 1, 16, 8)

    def body(rank: int, world: int) -> int:
        method = make_method("naive")
        method.setup(shape, None, torch.float32, torch.device("cpu"), ExpertWeights.random(shape, seed=1))
        # Rank 0 sends 3 tokens to expert 2 (rank 1) and 1 to expert 0 (itself); rank 1 sends none.
        ids = torch.tensor([[2], [2], [2], [0]]) if rank == 0 else torch.zeros(0, 1, dtype=torch.long)
        return method.bytes_sent(ids)

    row = 16 * 4
    assert run_ranks(body, 2, timeout_s=30) == [3 * row, 3 * row]


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "deepseek_v2"])
def test_hf_uses_the_transformers_experts_module_of_each_family(family):
    from occult.harness.baselines.hf import experts_class

    shape = MoEShape("fam", 4, 2, 16, 8, hf_family=family)
    weights = ExpertWeights.random(shape, seed=3)
    method = make_method("hf")
    method.setup(shape, None, torch.float32, torch.device("cpu"), weights)
    assert isinstance(method.module, experts_class(family))
    assert type(method.module).__module__.startswith("transformers.")
    x, ids, gate = routing(shape, 6, "random", seed=5)
    want = moe_dense_ref(x, ids, gate, weights.w_gate_up_E2FD, weights.w_down_EDF)
    torch.testing.assert_close(method.forward(x, ids, gate), want, atol=ATOL, rtol=0)
    assert method.supports(shape, 2) is not None and method.supports(shape, 1) is None


def test_given_routing_gate_reproduces_ids_and_normalised_weights():
    shape = SHAPES["tiny"]
    x, ids, gate = routing(shape, 10, "random", seed=9)
    gate = gate * torch.linspace(0.2, 1.0, 10)[:, None]          # rows that do not sum to one
    gate[3, 1] = 0.0                                              # a zero weight still routes
    router = GivenRoutingGate(model_dim=shape.hidden, num_global_experts=shape.num_experts, k=shape.top_k)
    router.route(ids, gate)
    scores = torch.softmax(router(x), dim=1)
    top_scores, top_ids = scores.topk(shape.top_k, dim=1)
    assert torch.equal(torch.sort(top_ids, 1).values, torch.sort(ids, 1).values)
    torch.testing.assert_close(top_scores * gate.sum(1, keepdim=True), gate.sort(1, descending=True).values)
    with pytest.raises(ValueError, match="routing has 10 tokens"):
        router(x[:4])


@pytest.mark.skipif(importlib.util.find_spec("tutel") is None, reason="tutel is not installed here")
@pytest.mark.parametrize("world", [1, 2])
def test_tutel_matches_dense_reference(world):
    shape, tokens, kind = CASES[0]
    for rank, result in enumerate(run_ranks(check_rank, world, "tutel", shape, tokens[:world], kind, timeout_s=60)):
        assert max(result["y"], result["x_grad"], result["gate_grad"]) < ATOL, f"tutel rank {rank}: {result}"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed here")
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("shape,tokens,kind", CASES, ids=[c[0].name for c in CASES])
def test_deepspeed_matches_dense_reference(world, shape, tokens, kind):
    """DeepSpeed's own top-1, top-2 and top-k gating paths (k = 1, 2, 3), a rank without tokens and a
    hot expert: forward and the gradients of x and the gate weights equal the dense reference.
    DeepSpeed's dropless top-1 caps the capacity at the rank's own token count, so ranks with
    different counts size their all-to-alls differently and gloo aborts: the top-1 case runs with
    equal counts (the sweeps always have them)."""
    if shape.top_k == 1:
        tokens = (tokens[0],) * len(tokens)
    for rank, result in enumerate(run_ranks(check_rank, world, "deepspeed", shape, tokens[:world], kind,
                                            timeout_s=120)):
        assert max(result["y"], result["x_grad"], result["gate_grad"]) < ATOL, f"deepspeed rank {rank}: {result}"
        assert result["bytes_sent"] is not None and (result["bytes_sent"] > 0) == (world > 1)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed here")
def test_deepspeed_gate_needs_a_routing_of_the_right_size():
    shape = SHAPES["tiny"]
    method = make_method("deepspeed")
    method.setup(shape, None, torch.float32, torch.device("cpu"), ExpertWeights.random(shape, 0))
    x, ids, gate = routing(shape, 6, "random", seed=1)
    with pytest.raises(ValueError, match="routing has 5 tokens, input 6"):
        method.forward(x, ids[:5], gate[:5])
    with pytest.raises(RuntimeError, match="route"):
        method.layer(x)


@pytest.mark.parametrize("name", ["megablocks", "tutel", "deepspeed"])
def test_missing_libraries_are_reported_not_replaced(name):
    method = make_method(name)
    ok, reason = method.available()
    if ok:
        pytest.skip(f"{name} is installed here")
    assert reason, "an unavailable method must say why"


def test_megablocks_is_unavailable_without_cuda():
    ok, reason = make_method("megablocks").available()
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert not ok and reason


def test_bad_names_and_weights_are_rejected():
    with pytest.raises(ValueError, match="method: 'nope'"):
        make_method("nope")
    with pytest.raises(ValueError, match="w_down_EDF"):
        ExpertWeights(torch.zeros(2, 8, 4), torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match="top_k 9 exceeds"):
        MoEShape("bad", 8, 9, 4, 4)
    with pytest.raises(ValueError, match="not divisible"):
        contiguous_experts(6, 4, 0)


def test_tutel_dispatch_index_range_is_checked_once_per_routing(monkeypatch):
    """Tutel's dispatch kernels index [E x capacity, hidden] with 32-bit ints: a routing whose padded
    buffer reaches 2^31 elements is refused with the numbers (not left to a CUDA illegal memory
    access), a smaller one passes; the check runs once per routing tensor, not per timed step."""
    from occult.harness.baselines import given_routing

    ids = torch.tensor([[0, 1], [0, 2], [0, 3]])
    assert given_routing.padded_buffer_elements(ids, 4, 8) == (3, 4 * 3 * 8)
    given_routing.check_tutel_index_range(ids, 4, 2**27, None, 1, "tutel")          # 3 * 2^29 < 2^31
    with pytest.raises(ValueError, match=r"tutel: .* 4 x 3 x 268435456 = 3221225472 elements >= 2\^31"):
        given_routing.check_tutel_index_range(ids, 4, 2**28, None, 1, "tutel")

    class Identity(given_routing.GivenRoutingMethod):
        name, uses_tutel_dispatch, num_experts, group, world = "fake", True, 4, None, 1

        def __init__(self, hidden):
            self.hidden, self.layer = hidden, lambda x: x
            self.gate = type("Gate", (), {"route": lambda self, ids, weights: None})()

    calls = []
    real = given_routing.check_tutel_index_range
    monkeypatch.setattr(given_routing, "check_tutel_index_range", lambda *a: (calls.append(a), real(*a)))
    x, weights = torch.randn(3, 5), torch.full((3, 2), 0.5)
    method = Identity(8)
    for _ in range(3):
        torch.testing.assert_close(method.forward(x, ids, weights), x)
    method.forward(x, ids.clone(), weights)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="2\\^31"):
        Identity(2**28).forward(x, ids, weights)
