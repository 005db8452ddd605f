"""Sweep inputs: the same inputs for every method, trace routing widened to a shape, and the
balanced placement's load bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from occult.provenance import derive_seed
from occult.shapes import get_shape
from occult import method_names
from occult.shapes import SHAPES
from occult.harness.sweep import inputs, settings


def test_inputs_are_the_same_for_every_method_and_fresh_per_set():
    shape = SHAPES["tiny"]
    router = inputs.SyntheticRouter.make(shape, seed=0)
    placement = torch.arange(shape.num_experts) % 2

    def make(seed):
        return inputs.make_inputs(shape, router, 32, seed, torch.device("cpu"), torch.float32, [None, 1],
                                 placement, with_grad_output=False)

    a, b, c = make(11), make(11), make(12)
    assert torch.equal(a.x_TD, b.x_TD) and torch.equal(a.routes[None][0], b.routes[None][0])
    assert not torch.equal(a.x_TD, c.x_TD)
    ids, weights = a.routes[None]
    assert ids.shape == (32, shape.top_k) and torch.all(weights[:, :-1] >= weights[:, 1:])
    pruned_ids, _ = a.routes[1]
    assert torch.all(placement[pruned_ids] == placement[pruned_ids[:, :1]])   # one device per token
    assert derive_seed("x", 1) == derive_seed("x", 1) != derive_seed("x", 2)


def write_trace(path: Path, experts: int, top_k: int, tokens: int, seed: int) -> None:
    """A routing npz in occult.routing.profiling's layout: ids [L, N, k] of distinct experts per token."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((2, tokens, experts)), axis=-1)[..., :top_k].astype("int16")
    np.savez(path, ids=ids, layers=np.arange(2))


def test_trace_router_keeps_the_trace_and_rejects_shapes_it_cannot_widen(tmp_path):
    write_trace(tmp_path / "routing_heldout.npz", 4, 1, 30, seed=3)
    router = inputs.TraceRouter.load(tmp_path / "routing_heldout.npz", SHAPES["tiny"], seed=0)  # E=8, k=2
    assert router.ids_NK.shape == (60, 2) and int(router.ids_NK.max()) < 8
    # Both sub-experts of a token come from the trace's one expert of that token.
    assert torch.equal(router.ids_NK[:, 0] // 2, router.ids_NK[:, 1] // 2)
    assert (router.ids_NK[:, 0] != router.ids_NK[:, 1]).all()
    gen = torch.Generator().manual_seed(0)
    logits = router.logits(torch.zeros(5, 32), gen)
    top = logits.topk(2, dim=1).indices.sort(dim=1).values
    window = [row for row in router.ids_NK.sort(dim=1).values.tolist()]
    assert all(row in window for row in top.tolist())
    write_trace(tmp_path / "wide.npz", 16, 4, 10, seed=4)
    with pytest.raises(settings.SweepError, match="wide.npz"):
        inputs.TraceRouter.load(tmp_path / "wide.npz", SHAPES["tiny"], seed=0)


@pytest.mark.parametrize("shape_name, world", [("olmoe", 2), ("qwen", 4), ("deepseek", 4)])
def test_balanced_placement_bounds_the_busiest_device_where_greedy_does_not(shape_name, world):
    """The sweep's skewed router makes greedy_occult put 1.7-2.8x the mean pairs on one device
    (sweeps_v5: 221k of 262k pairs on one GPU of two); -balanced keeps it <= 1.1x on fresh tokens,
    with every device holding E/D experts and fewer devices per token than the contiguous layout."""
    from occult.ep.plan import contiguous_placement

    shape = get_shape(shape_name)
    router = inputs.SyntheticRouter.make(shape, 0)
    greedy = inputs.occult_placement(shape, router, world, 0)
    balanced = inputs.occult_placement(shape, router, world, 0, balanced=True)
    contiguous = contiguous_placement(shape.num_experts, world)
    assert torch.bincount(balanced, minlength=world).tolist() == [shape.num_experts // world] * world
    batch = inputs.make_inputs(shape, router, 4096, 123, torch.device("cpu"), torch.float32, [None], None, False)
    ids = batch.routes[None][0]

    def imbalance_and_spread(placement):
        device_TK = placement[ids]
        load = torch.bincount(device_TK.flatten(), minlength=world).float()
        spread = torch.zeros(len(ids), world).scatter_(1, device_TK, 1.0).sum(1).mean()
        return (load.max() / load.mean()).item(), spread.item()

    greedy_load, greedy_spread = imbalance_and_spread(greedy)
    balanced_load, balanced_spread = imbalance_and_spread(balanced)
    _, contiguous_spread = imbalance_and_spread(contiguous)
    assert greedy_load > 1.5 and balanced_load <= 1 + method_names.BALANCE_EPS + 0.05
    assert greedy_spread <= balanced_spread < contiguous_spread


@pytest.mark.parametrize("shape_name, world", [("olmoe", 2), ("deepseek", 4)])
def test_latency_placement_is_predicted_no_slower_than_greedy_or_balanced(shape_name, world):
    """-latency: the sweep's placement of lowest predicted layer time on its calibration batch, balanced
    (E/D experts per device) and, on that batch, predicted no slower than -balanced or greedy_occult."""
    from occult.routing.latency import LayerCost
    from occult.sim.cost_model_json import builtin_cost_model

    shape = get_shape(shape_name)
    router = inputs.SyntheticRouter.make(shape, 0)
    latency = inputs.occult_placement(shape, router, world, 0, latency=True)
    assert torch.bincount(latency, minlength=world).tolist() == [shape.num_experts // world] * world
    gen = torch.Generator().manual_seed(derive_seed(0, "calibration", shape.name))
    ids = router.calibration_ids(inputs.CALIBRATION_TOKENS, shape.top_k, gen).numpy()
    layer = LayerCost(builtin_cost_model()[0], shape)
    mine = layer.predict(ids, latency.numpy(), world).predicted_ms
    for other in (inputs.occult_placement(shape, router, world, 0),
                  inputs.occult_placement(shape, router, world, 0, balanced=True)):
        assert mine <= layer.predict(ids, other.numpy(), world).predicted_ms * (1 + 1e-12)


def test_trace_router_places_on_the_calibration_trace_beside_the_timed_one(tmp_path):
    """routing_heldout_sample.npz times, routing_calibration_sample.npz beside it places (the names
    profiling's sample files have); without a calibration file the timed trace places too."""
    write_trace(tmp_path / "routing_heldout_sample.npz", 4, 1, 30, seed=5)
    write_trace(tmp_path / "routing_calibration_sample.npz", 4, 1, 50, seed=6)
    router = inputs.TraceRouter.load(tmp_path / "routing_heldout_sample.npz", SHAPES["tiny"], seed=0)
    assert router.ids_NK.shape == (60, 2) and router.calibration_NK.shape == (100, 2)
    (tmp_path / "alone").mkdir()
    write_trace(tmp_path / "alone" / "routing_heldout.npz", 4, 1, 30, seed=5)
    alone = inputs.TraceRouter.load(tmp_path / "alone" / "routing_heldout.npz", SHAPES["tiny"], seed=0)
    assert torch.equal(alone.calibration_NK, alone.ids_NK)
