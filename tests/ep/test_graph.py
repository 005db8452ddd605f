"""`GraphedForward`: refuses what it cannot capture; on a GPU, replays equal the eager calls."""

from __future__ import annotations

import pytest
import torch

from occult.ep.graph import GraphedForward


def test_cpu_inputs_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="CUDA"):
        GraphedForward(lambda x: x * 2, torch.ones(3))


@pytest.mark.gpu
def test_replay_equals_eager_static_ep_layer_and_checks_shapes():
    from occult.ep.layer import ep_moe
    from occult.ep.plan import contiguous_placement
    from occult.kernels.reference import moe_dense_ref

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, top_k, hidden, ffn, tokens = 8, 2, 64, 32, 48
    w_gate_up = torch.randn(experts, 2 * ffn, hidden, device="cuda", generator=gen).bfloat16() / 8
    w_down = torch.randn(experts, hidden, ffn, device="cuda", generator=gen).bfloat16() / 6
    placement = contiguous_placement(experts, 1)

    def layer(x, ids, weights):
        return ep_moe(x, ids, weights, placement, w_gate_up, w_down, backend="triton", static_capacity=tokens)

    def inputs():
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices
        return x, ids, torch.rand(tokens, top_k, device="cuda", generator=gen)

    graphed = GraphedForward(layer, *inputs())
    for _ in range(3):
        x, ids, weights = inputs()
        with torch.no_grad():
            want = moe_dense_ref(x, ids, weights, w_gate_up, w_down).float()
        got = graphed(x, ids, weights).float()
        assert ((got - want).norm() / want.norm()).item() <= 1e-2
    with pytest.raises(ValueError, match="captured"):
        graphed(torch.zeros(tokens + 1, hidden, device="cuda", dtype=torch.bfloat16), ids, weights)
