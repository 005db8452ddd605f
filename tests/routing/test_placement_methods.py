"""Placement methods beyond the paper: balance, untouched inputs, and the behaviour each promises."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from occult.routing.placement import contiguous, expected_ct, greedy_occult, max_device_load_over_mean, swap_search
from occult.routing.placement_methods import (
    SYNTHETIC_SHAPES,
    coactivation_matrix,
    device_load,
    eplb_load_only,
    expected_node_ct,
    expert_load,
    hierarchical,
    load_aware_swap,
    metis_partition,
    pair_greedy,
    rebalance,
    repair_load,
    synthetic_preset,
    synthetic_trace,
)


def assert_balanced(device_of_expert: np.ndarray, num_experts: int, num_devices: int) -> None:
    assert device_of_expert.shape == (num_experts,)
    assert np.issubdtype(device_of_expert.dtype, np.integer)
    assert device_of_expert.min() >= 0 and device_of_expert.max() < num_devices
    assert (np.bincount(device_of_expert, minlength=num_devices) == num_experts // num_devices).all()


def read_only(array: np.ndarray) -> np.ndarray:
    array = np.array(array)
    array.setflags(write=False)
    return array


def planted_trace(num_experts: int, group_size: int, top_k: int, num_tokens: int, seed: int,
                  noise: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Tokens choose k experts of one hidden group (size E/D-sized blocks); `noise` swaps in strays."""
    rng = np.random.default_rng(seed)
    groups_GS = rng.permutation(num_experts).reshape(-1, group_size)
    group_N = rng.integers(len(groups_GS), size=num_tokens)
    ids_NK = np.stack([rng.choice(groups_GS[g], top_k, replace=False) for g in group_N])
    strays = rng.random(num_tokens) < noise
    for t in np.flatnonzero(strays):
        outside = np.setdiff1d(np.arange(num_experts), ids_NK[t])
        ids_NK[t, 0] = rng.choice(outside)
    return ids_NK, groups_GS


def found_groups(device_of_expert: np.ndarray, num_devices: int) -> set[frozenset[int]]:
    return {frozenset(np.flatnonzero(device_of_expert == d).tolist()) for d in range(num_devices)}


# ---------------------------------------------------------------------------------------------
# every method: balanced, inputs untouched, deterministic

@pytest.mark.parametrize("preset,num_devices", [("olmoe", 4), ("olmoe", 16), ("qwen_moe", 6), ("deepseek_moe", 8)])
def test_every_method_is_balanced_and_leaves_inputs_alone(preset, num_devices):
    num_experts, _ = SYNTHETIC_SHAPES[preset]
    calib_LNK, _ = synthetic_preset(preset, 1500, 1, seed=3)
    ids_NK = read_only(calib_LNK[0])
    coact_EE = read_only(coactivation_matrix(ids_NK, num_experts))
    load_E = read_only(expert_load(ids_NK, num_experts))
    init = read_only(greedy_occult(coact_EE, num_devices))
    snapshots = [a.copy() for a in (ids_NK, coact_EE, load_E, init)]
    gpus = 2 if num_devices % 2 == 0 else 1
    results = {
        "pair_greedy": lambda: pair_greedy(coact_EE, num_devices),
        "load_aware": lambda: load_aware_swap(ids_NK, num_devices, init, eps=0.1, rounds=3, seed=0, kicks=1),
        "hierarchical": lambda: hierarchical(ids_NK, num_devices // gpus, gpus, num_experts, rounds=3, seed=0,
                                             kicks=1).device_of_expert,
        "eplb": lambda: eplb_load_only(load_E, num_devices),
        "metis": lambda: metis_partition(coact_EE, num_devices, seed=0),
    }
    for name, run in results.items():
        if name == "metis":
            pytest.importorskip("pymetis")
        first = run()
        assert_balanced(first, num_experts, num_devices)
        assert np.array_equal(run(), first), f"{name} is not deterministic"
    for before, after in zip(snapshots, (ids_NK, coact_EE, load_E, init)):
        assert np.array_equal(before, after)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="square"):
        pair_greedy(np.zeros((4, 5)), 2)
    with pytest.raises(ValueError, match="evenly"):
        pair_greedy(np.zeros((6, 6)), 4)
    with pytest.raises(ValueError, match="load_E"):
        eplb_load_only(np.array([1.0, -2.0]), 2)
    with pytest.raises(ValueError, match="eps"):
        load_aware_swap(np.array([[0, 1]]), 2, contiguous(4, 2), eps=-0.1, rounds=1, seed=0)
    with pytest.raises(ValueError, match="preset"):
        synthetic_preset("mixtral", 10, 1, 0)


# ---------------------------------------------------------------------------------------------
# pair-greedy

@pytest.mark.parametrize("num_experts,num_devices", [(8, 4), (16, 2), (60, 6), (64, 64)])
def test_pair_greedy_terminates_on_all_zero_matrix(num_experts, num_devices):
    got = pair_greedy(read_only(np.zeros((num_experts, num_experts), dtype=np.int64)), num_devices)
    assert_balanced(got, num_experts, num_devices)


@pytest.mark.parametrize("num_experts,num_devices,seed", [(16, 4, 0), (64, 8, 1), (60, 4, 2), (32, 2, 3)])
def test_pair_greedy_recovers_planted_blocks(num_experts, num_devices, seed):
    group_size = num_experts // num_devices
    ids_NK, groups_GS = planted_trace(num_experts, group_size, min(4, group_size), 3000, seed, noise=0.05)
    got = pair_greedy(coactivation_matrix(ids_NK, num_experts), num_devices)
    assert found_groups(got, num_devices) == {frozenset(g.tolist()) for g in groups_GS}
    assert expected_ct(ids_NK, got) < expected_ct(ids_NK, contiguous(num_experts, num_devices))


def test_pair_greedy_splits_clusters_that_cannot_be_packed():
    # blocks of 3, 3, 2, 2, 2 with capacity 4 on 3 devices: first-fit decreasing cannot place them whole
    blocks = [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9], [10, 11]]
    coact_EE = np.zeros((12, 12))
    for block in blocks:
        coact_EE[np.ix_(block, block)] = 10.0
    got = pair_greedy(read_only(coact_EE), 3)
    assert_balanced(got, 12, 3)
    assert sum(len(set(got[b].tolist())) == 1 for b in blocks) >= 4


# ---------------------------------------------------------------------------------------------
# load-aware

@pytest.mark.parametrize("num_devices,eps", [(4, 0.1), (8, 0.2), (4, 0.02)])
def test_load_aware_respects_bound_and_never_worsens_repaired_start(num_devices, eps):
    ids_NK = synthetic_trace((64, 6), 3000, seed=5, skew=1.0)           # Zipf-skewed load
    load_E = expert_load(ids_NK, 64)
    init = greedy_occult(coactivation_matrix(ids_NK, 64), num_devices)     # collaboration-only: unbalanced
    bound = (1 + eps) * load_E.sum() / num_devices
    assert device_load(load_E, init, num_devices).max() > bound
    repaired = repair_load(load_E, init, num_devices, bound)
    got = load_aware_swap(ids_NK, num_devices, init, eps=eps, rounds=10, seed=0, kicks=3)
    assert_balanced(got, 64, num_devices)
    assert device_load(load_E, got, num_devices).max() <= bound + 1e-9
    assert max_device_load_over_mean(ids_NK, got, num_devices) <= 1 + eps + 1e-9
    assert device_load(load_E, repaired, num_devices).max() <= bound + 1e-9
    assert expected_ct(ids_NK, got) <= expected_ct(ids_NK, repaired)


def test_load_aware_does_not_worsen_an_unreachable_bound():
    ids_NK = np.array([[0, 1]] * 50 + [[2, 3]] * 2)           # experts 0 and 1 carry most of the load
    init = np.array([0, 1, 0, 1])
    got = load_aware_swap(ids_NK, 2, init, eps=0.0, rounds=5, seed=0)
    assert_balanced(got, 4, 2)
    assert device_load(expert_load(ids_NK, 4), got, 2).max() <= device_load(expert_load(ids_NK, 4), init, 2).max()


# ---------------------------------------------------------------------------------------------
# hierarchical

@pytest.mark.parametrize("nodes,gpus,seed", [(2, 4, 0), (4, 2, 1), (4, 4, 2)])
def test_hierarchical_beats_contiguous_between_nodes(nodes, gpus, seed):
    num_experts = 64
    ids_NK, _ = planted_trace(num_experts, num_experts // nodes, 6, 2000, seed, noise=0.1)
    got = hierarchical(read_only(ids_NK), nodes, gpus, num_experts, rounds=10, seed=seed, kicks=2)
    num_devices = nodes * gpus
    assert_balanced(got.device_of_expert, num_experts, num_devices)
    base = contiguous(num_experts, num_devices)
    assert got.expected_inter_node_ct(ids_NK) <= expected_node_ct(ids_NK, base, gpus)
    assert got.expected_inter_node_ct(ids_NK) < 1.2                       # planted node groups found
    assert got.expected_ct(ids_NK) <= expected_ct(ids_NK, base)
    assert np.array_equal(got.node_of_expert, got.device_of_expert // gpus)


def test_hierarchical_node_level_is_the_swap_search():
    ids_NK = synthetic_trace((32, 4), 1500, seed=2)
    got = hierarchical(ids_NK, 2, 2, 32, rounds=5, seed=0, kicks=2)
    node_only = swap_search(ids_NK, 2, greedy_occult(coactivation_matrix(ids_NK, 32), 2), 5, 0, kicks=2)
    assert expected_node_ct(ids_NK, got.device_of_expert, 2) == pytest.approx(expected_ct(ids_NK, node_only))


# ---------------------------------------------------------------------------------------------
# METIS and EPLB

def test_metis_recovers_planted_blocks_or_names_the_package():
    ids_NK, groups_GS = planted_trace(32, 8, 4, 2000, seed=4, noise=0.02)
    coact_EE = coactivation_matrix(ids_NK, 32)
    try:
        import pymetis  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pymetis"):
            metis_partition(coact_EE, 4, seed=0)
        return
    got = metis_partition(read_only(coact_EE), 4, seed=0)
    assert found_groups(got, 4) == {frozenset(g.tolist()) for g in groups_GS}


def test_rebalance_moves_least_attached_experts():
    collab_EE = np.zeros((6, 6))
    collab_EE[0, 1] = collab_EE[1, 0] = 5.0        # 0, 1 belong together; 2 hangs loosely on 0
    collab_EE[0, 2] = collab_EE[2, 0] = 1.0
    collab_EE[2, 3] = collab_EE[3, 2] = 3.0
    got = rebalance(read_only(collab_EE), np.array([0, 0, 0, 1, 2, 2]), 3)
    assert_balanced(got, 6, 3)
    assert got[0] == got[1] and got[2] == got[3]


def test_eplb_balances_zipf_load_better_than_contiguous():
    for (num_experts, num_devices), skew in itertools.product([(64, 8), (60, 6), (64, 16)], (0.5, 1.0)):
        load_E = read_only(1e4 / np.arange(1, num_experts + 1) ** skew)
        got = eplb_load_only(load_E, num_devices)
        assert_balanced(got, num_experts, num_devices)
        per_device = device_load(load_E, got, num_devices)
        contiguous_load = device_load(load_E, contiguous(num_experts, num_devices), num_devices)
        assert per_device.max() < contiguous_load.max()
        # no device exceeds the mean by more than the heaviest expert (the busiest's last addition)
        assert per_device.max() <= per_device.mean() + load_E.max() + 1e-9
        if skew == 0.5 and num_devices <= 8:          # no single expert outweighs a device
            assert per_device.max() / per_device.mean() < 1.15      # contiguous: > 1.5


# ---------------------------------------------------------------------------------------------
# synthetic traces

def test_synthetic_trace_shapes_structure_and_seeding():
    for name, (num_experts, top_k) in SYNTHETIC_SHAPES.items():
        calib_LNK, heldout_LNK = synthetic_preset(name, 800, 2, seed=0)
        assert calib_LNK.shape == heldout_LNK.shape == (2, 800, top_k)
        assert calib_LNK.min() >= 0 and calib_LNK.max() < num_experts
        assert (np.diff(np.sort(calib_LNK, axis=2), axis=2) > 0).all()            # distinct experts
        assert not np.array_equal(calib_LNK, heldout_LNK)
        assert np.array_equal(synthetic_preset(name, 800, 2, seed=0)[0], calib_LNK)
    ids_NK = synthetic_trace((64, 8), 4000, seed=1, skew=1.0)
    load_E = expert_load(ids_NK, 64)
    assert load_E.max() > 3 * load_E.mean() / 2                                  # skewed load
    coact_EE = coactivation_matrix(ids_NK, 64)
    placed = greedy_occult(coact_EE, 4)
    assert expected_ct(ids_NK, placed) < expected_ct(ids_NK, contiguous(64, 4)) - 0.3   # structure to find
