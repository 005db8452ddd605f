"""Latency placement: the incremental state prices swaps exactly as the simulator does, the search is
never slower than the best start on the whole trace nor on its validation stretches, D = 1 changes nothing, and replicas follow their routing rule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from occult.shapes import MoEShape, get_shape
from occult.routing.latency import (
    LayerCost,
    _LatencyState,
    default_starts,
    latency_search,
    stretch_key,
    validation_runs,
)
from occult.routing.placement import contiguous, expected_ct
from occult.routing.placement_methods import synthetic_trace
from occult.routing.replicas import (
    ReplicatedPlacement,
    add_replicas,
    predict_replicated,
    replica_search,
    route_to_copies,
)
from occult.sim.cost_model import CostModel, HostTerms, LinkModel, LogLogCurve, OtherGpuTerms, builtin_alltoall_curve
from occult.sim.cost_model_json import builtin_cost_model


def toy_cost(gpus_per_node: int = 8) -> CostModel:
    """A small calibrated-looking model: every term the latency objective reads is non-zero."""
    link = LinkModel({2: builtin_alltoall_curve()}, gpus_per_node, 5e7, 0.015)
    kernels = LogLogCurve(np.array([0.1, 10.0, 1000.0]), np.array([50.0, 300.0, 600.0]), extend="flat")
    return CostModel(link, kernels, 2.5, {}, 755.0, hbm_bytes_per_ms=4.3e9, kernel_floor_ms=0.02,
                     kernel_stream_bytes_per_ms=2e9, other_gpu=OtherGpuTerms(0.05, 3.0, 2.0, 5),
                     host={("occult", "fwd", 1): HostTerms(0.3, 0.2, 3, "fit"),
                           ("occult", "train", 1): HostTerms(0.5, 0.4, 3, "fit")})


OLMOE = get_shape("olmoe")


@pytest.mark.parametrize("pass_, num_devices, gpus_per_node", [
    ("fwd", 4, 8), ("fwd", 8, 2), ("train", 8, 4), ("train", 16, 4), ("fwd", 64, 8)])
def test_incremental_state_prices_swaps_as_the_simulator(pass_, num_devices, gpus_per_node):
    """After each random swap: the candidate's price, the state's value and the simulator's own
    `traffic` + `gpu_components` agree; the tables equal a state built afresh."""
    ids = synthetic_trace((64, 8), 1500, seed=1)
    layer = LayerCost(toy_cost(gpus_per_node), OLMOE, 8192, pass_)
    dev = np.random.default_rng(0).permutation(contiguous(64, num_devices))
    state = _LatencyState(ids, dev, num_devices, layer)
    rng = np.random.default_rng(1)
    for _ in range(12):
        a = int(rng.integers(64))
        others = np.flatnonzero(state.dev != state.dev[a])
        b = int(others[rng.integers(len(others))])
        slots = state.slots
        priced = state.candidates(a)
        state.swap(a, b)
        gpu, _ = state.value()
        reference = layer.predict(ids, state.dev, num_devices)
        assert gpu == pytest.approx(reference.gpu_ms, rel=1e-9)
        if state.slots == slots:
            assert priced["gpu"][b] == pytest.approx(gpu, rel=1e-9)
        assert state.facts() == pytest.approx((reference.expected_ct, reference.max_load_over_mean), rel=1e-12)
        assert priced["expected_ct"][b] == pytest.approx(reference.expected_ct, rel=1e-12)
    fresh = _LatencyState(ids, state.dev, num_devices, layer)
    for table in ("zeros_ESD", "alone_ES", "rows_SD", "load_D", "active_D", "slot_hist"):
        assert np.array_equal(getattr(fresh, table), getattr(state, table)), table


@pytest.mark.parametrize("shape, num_devices", [("olmoe", 2), ("olmoe", 8), ("deepseek", 4), ("qwen", 4)])
def test_result_is_the_search_only_where_it_beats_the_best_start_on_the_validation_stretches(shape, num_devices):
    """With the shipped model, on the sweep-like skewed traces: the search starts from the start of
    lowest time on the fit part; it returns its own result where that has a lower mean time over
    the validation stretches (four runs of consecutive tokens, not fitted, each priced as a batch of
    its own) than the start of lowest time on the whole trace, else that start; balanced."""
    layer_shape = get_shape(shape)
    ids = synthetic_trace((layer_shape.num_experts, layer_shape.top_k), 4800, seed=3, skew=1.0)
    layer = LayerCost(builtin_cost_model()[0], layer_shape)
    starts = default_starts(ids, layer_shape.num_experts, num_devices, swap_rounds=3, kicks=1)
    result = latency_search(ids, num_devices, layer, starts, rounds=3, seed=0, kicks=1)
    runs = validation_runs(len(ids))
    assert [len(run) for run in runs] == [300] * 4 and [int(run[0]) for run in runs] == [900, 2100, 3300, 4500]
    assert all(np.array_equal(run, np.arange(run[0], run[0] + 300)) for run in runs)     # consecutive tokens
    held = np.concatenate(runs)
    fit = np.delete(ids, held, axis=0)
    on_fit = {name: layer.predict(fit, p, num_devices).key() for name, p in starts.items()}
    assert result.start_method == min(on_fit, key=on_fit.get)
    assert set(result.validation) == {*starts, "search"}

    def mean_over_runs(placed):
        return np.mean([layer.predict(ids[run], placed, num_devices).key()[0] for run in runs])

    whole = {name: layer.predict(ids, p, num_devices).key() for name, p in starts.items()}
    best_start = min(whole, key=whole.get)
    assert result.validation[result.chosen] == pytest.approx(mean_over_runs(result.device_of_expert), rel=1e-12)
    assert result.validation[best_start] == pytest.approx(mean_over_runs(starts[best_start]), rel=1e-12)
    if result.chosen == "search":
        assert result.validation["search"] < result.validation[best_start]
        assert result.final.key() <= whole[best_start]
    else:
        assert result.chosen == best_start and np.array_equal(result.device_of_expert, starts[best_start])
    assert layer.predict(ids, result.device_of_expert, num_devices) == result.final
    assert np.bincount(result.device_of_expert).tolist() == [layer_shape.num_experts // num_devices] * num_devices
    path = result.path
    assert len(path["expected_ct"]) == len(path["predicted_ms"]) > 0 and path["accepted"].sum() == min(result.swaps, 400)


@pytest.mark.parametrize("skew, seed, num_devices", [(1.0, 3, 2), (1.0, 0, 4), (0.5, 1, 8), (0.0, 2, 2)])
def test_the_result_is_never_slower_than_the_best_start_on_the_whole_trace(skew, seed, num_devices):
    """The search's result must also beat the best start on the trace it was given, not only on the
    validation stretches: on the first case here the descent wins the stretches and is 0.2% slower
    on the whole trace, so the best start is returned."""
    ids = synthetic_trace((64, 8), 1600, seed=seed, skew=skew)
    layer = LayerCost(builtin_cost_model()[0], OLMOE)
    starts = default_starts(ids, 64, num_devices, swap_rounds=3, kicks=1)
    result = latency_search(ids, num_devices, layer, starts, rounds=3, seed=0, kicks=1)
    whole = {name: layer.predict(ids, p, num_devices).key() for name, p in starts.items()}
    best_start = min(whole, key=whole.get)
    assert result.final.key() <= whole[best_start]
    assert layer.predict(ids, result.device_of_expert, num_devices).key() == result.final.key()
    if (skew, seed, num_devices) == (1.0, 3, 2):
        assert result.validation["search"] < result.validation[best_start] and result.chosen == best_start


def test_without_validation_the_search_never_loses_to_its_best_start():
    """validate=False fits and chooses on the whole trace: never slower there than any start."""
    ids = synthetic_trace((64, 8), 1500, seed=3, skew=1.0)
    layer = LayerCost(builtin_cost_model()[0], OLMOE)
    starts = default_starts(ids, 64, 4, swap_rounds=3, kicks=1)
    result = latency_search(ids, 4, layer, starts, rounds=3, seed=0, kicks=1, validate=False)
    best = min(result.starts.values(), key=lambda p: p.key())
    assert result.start == best and result.final.key() <= best.key() and result.gain >= 1.0
    assert result.final.predicted_ms < best.predicted_ms      # the skewed trace leaves room to gain


def test_one_device_changes_nothing():
    ids = synthetic_trace((64, 8), 800, seed=5)
    layer = LayerCost(builtin_cost_model()[0], OLMOE)
    starts = default_starts(ids, 64, 1, swap_rounds=2, kicks=0)
    result = latency_search(ids, 1, layer, starts, rounds=5)
    assert (result.device_of_expert == 0).all() and result.swaps == 0
    times = {p.predicted_ms for p in result.starts.values()} | {result.final.predicted_ms}
    assert len(times) == 1 and result.final.expected_ct == 1.0 and result.final.comm_ms == 0.0


def test_across_nodes_the_search_prices_the_network():
    """16 devices in nodes of 4: the predicted time counts the slower inter-node link, and the search
    lowers the tokens' node crossings below contiguous's."""
    ids = synthetic_trace((64, 8), 1500, seed=7)
    cost = builtin_cost_model()[0]
    four = LayerCost(dataclasses.replace(cost, link=dataclasses.replace(cost.link, gpus_per_node=4)), OLMOE)
    sixteen = LayerCost(dataclasses.replace(cost, link=dataclasses.replace(cost.link, gpus_per_node=16)), OLMOE)
    flat = contiguous(64, 16)
    assert four.predict(ids, flat, 16).comm_ms > sixteen.predict(ids, flat, 16).comm_ms
    result = latency_search(ids, 16, four, {"contiguous": flat}, rounds=2, kicks=0)
    assert result.final.predicted_ms < result.start.predicted_ms
    assert expected_ct(ids, result.device_of_expert // 4) < expected_ct(ids, flat // 4)


def test_layer_cost_refuses_what_it_does_not_price():
    cost = builtin_cost_model()[0]
    with pytest.raises(ValueError, match="eager exact Occult"):
        LayerCost(cost, OLMOE, method="occult-nd2")
    with pytest.raises(ValueError, match="pass_"):
        LayerCost(cost, OLMOE, pass_="decode")
    with pytest.raises(ValueError, match="uncalibrated"):
        LayerCost(dataclasses.replace(cost, kernel_tflops=None), OLMOE)
    ids = synthetic_trace((64, 8), 200, seed=0)
    with pytest.raises(ValueError, match="no start"):
        latency_search(ids, 4, LayerCost(cost, OLMOE), {})
    with pytest.raises(ValueError, match="'search' names"):
        latency_search(ids, 4, LayerCost(cost, OLMOE), {"search": contiguous(64, 4)})


# ---------------------------------------------------------------------------------------------
# replicas

def test_tokens_use_a_copy_on_a_device_they_visit_else_alternate():
    """Experts 0..3 on devices 0, 0, 1, 1; expert 0 has a copy on device 1."""
    placement = ReplicatedPlacement(np.array([0, 0, 1, 1]), np.array([0]), np.array([1]), 2, 1)
    ids = np.array([[0, 2],       # visits device 1: the copy (id 4)
                    [0, 1],       # visits device 0: the primary
                    [0, 3],       # device 1: the copy
                    [3, 0],       # device 1 again, expert 0 second in the row
                    [0, 0 + 1]])  # device 0
    slots = route_to_copies(ids, placement)
    assert slots.tolist() == [[4, 2], [0, 1], [4, 3], [3, 4], [0, 1]]
    alone = route_to_copies(np.array([[0], [0], [0], [0]]), placement)     # no other expert: alternate
    assert alone.ravel().tolist() == [0, 4, 0, 4]
    assert placement.virtual_placement.tolist() == [0, 0, 1, 1, 1]


def test_replicas_are_placed_within_their_slots_and_never_predicted_slower():
    ids = synthetic_trace((64, 8), 1500, seed=2, skew=1.2)
    layer = LayerCost(builtin_cost_model()[0], OLMOE)
    primary = contiguous(64, 4)
    for slots in (1, 2):
        placed = add_replicas(ids, primary, 4, slots)
        assert len(placed.copy_expert) == 4 * slots
        loads = np.bincount(ids.ravel(), minlength=64)
        assert set(placed.copy_expert) == set(np.argsort(-loads, kind="stable")[:4 * slots])
        assert (placed.copies_per_device() <= slots).all()
        assert (placed.device_of_expert[placed.copy_expert] != placed.copy_device).all()
        found, prediction = replica_search(ids, placed, layer, rounds=1)
        bare = predict_replicated(ids, add_replicas(ids, primary, 4, 0), layer)
        assert prediction.key() <= bare.key()
        assert prediction == predict_replicated(ids, found, layer)
    assert len(add_replicas(ids, contiguous(64, 64), 64, 2).copy_expert) == 64     # at most one copy each


@pytest.mark.parametrize("copy_expert, copy_device, why", [
    ([0], [0], "its expert's own device"),
    ([0, 0], [1, 1], "more than one copy"),
    ([0, 1], [1, 1], "more than slots_per_device"),
    ([9], [1], "out of range"),
])
def test_replicated_placement_rejects_bad_copies(copy_expert, copy_device, why):
    with pytest.raises(ValueError, match=why):
        ReplicatedPlacement(np.array([0, 0, 1, 1]), np.array(copy_expert), np.array(copy_device), 2, 1)


def test_shape_of_the_trace_prices_the_layer():
    small = MoEShape("small", 64, 8, 512, 256)
    ids = synthetic_trace((64, 8), 600, seed=1)
    cost = builtin_cost_model()[0]
    assert (LayerCost(cost, small).predict(ids, contiguous(64, 4), 4).predicted_ms
            < LayerCost(cost, OLMOE).predict(ids, contiguous(64, 4), 4).predicted_ms)


def test_validation_keeps_the_search_from_fitting_noise():
    """Uniform routing has no structure to exploit: what the descent gains on 400 calibration tokens is
    their sampling noise, and unvalidated it is slower than the best start on 6,000 unseen tokens;
    chosen on the validation part, the result is as fast there as the best start."""
    layer = LayerCost(builtin_cost_model()[0], OLMOE)
    ids = synthetic_trace((64, 8), 6400, seed=0, skew=0.0)
    calib, unseen = ids[:400], ids[400:]
    starts = default_starts(calib, 64, 8, swap_rounds=3, kicks=1)
    best_start = min(layer.predict(unseen, p, 8).predicted_ms for p in starts.values())
    fitted = latency_search(calib, 8, layer, starts, rounds=5, seed=0, kicks=2, validate=False)
    checked = latency_search(calib, 8, layer, starts, rounds=5, seed=0, kicks=2)
    assert fitted.final.predicted_ms < min(p.predicted_ms for p in fitted.starts.values())
    assert layer.predict(unseen, fitted.device_of_expert, 8).predicted_ms > best_start * 1.02
    assert layer.predict(unseen, checked.device_of_expert, 8).predicted_ms <= best_start * 1.001


def test_validation_prices_each_stretch_as_its_own_batch():
    """A trace whose first half routes to experts 0-7 and second half to 8-15: splitting those two
    sets over the two devices balances the pooled trace as well as mixing them does, but each
    stretch of it loads one device only; the stretches see that. Runs too short to price a batch
    are pooled: then the two tie. The starts themselves are compared on the whole trace (a batch
    drawn from both halves), so the one faster there is returned, the stretches notwithstanding."""
    rng = np.random.default_rng(0)
    first = np.argsort(rng.random((2048, 8)), axis=1)[:, :2]
    ids = np.concatenate([first, first + 8])
    layer = LayerCost(builtin_cost_model()[0], MoEShape("halves", 16, 2, 2048, 1024))
    by_half = np.repeat([0, 1], 8)
    mixed = np.tile(np.repeat([0, 1], 4), 2)
    pooled = {name: layer.predict(ids, p, 2) for name, p in (("by_half", by_half), ("mixed", mixed))}
    assert pooled["by_half"].max_load_over_mean == pytest.approx(1.0, abs=0.01)
    stretches = [ids[run] for run in validation_runs(len(ids))]
    assert stretch_key(layer, stretches, by_half, 2)[0] > stretch_key(layer, stretches, mixed, 2)[0] * 1.2
    result = latency_search(ids, 2, layer, {"mixed": mixed, "by_half": by_half}, rounds=0, kicks=0)
    assert result.validation["by_half"] > result.validation["mixed"] * 1.2
    faster_pooled = min(pooled, key=lambda name: pooled[name].key())
    assert result.chosen == faster_pooled and result.final == pooled[faster_pooled]
    short = latency_search(ids[::8], 2, layer, {"by_half": by_half, "mixed": mixed}, rounds=0, kicks=0)
    assert short.validation["by_half"] <= short.validation["mixed"]       # pooled: no half loads one device
