"""Expert placement: metrics and bounds, the paper's greedy, the swap search, the stage and its files."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from occult.config import load_config
from occult.routing.placement import (
    PlacementFileError,
    collaboration_count,
    contiguous,
    ct_bounds,
    device_counts,
    expected_ct,
    greedy_occult,
    intra_device_pair_fraction,
    load_placement,
    load_placement_layers,
    max_device_load_over_mean,
    swap_search,
    trace_metrics,
)
from occult.stages.place import place, run_placement

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# helpers

def random_trace(num_experts: int, k: int, num_tokens: int, seed: int, clusters: int = 6) -> np.ndarray:
    """Tokens drawn from a few skewed expert preferences: collaboration structure to find."""
    rng = np.random.default_rng(seed)
    prefs = rng.dirichlet(np.full(num_experts, 0.4), size=clusters)
    cluster_N = rng.integers(clusters, size=num_tokens)
    return np.stack([rng.choice(num_experts, k, replace=False, p=prefs[c]) for c in cluster_N])


def coactivation(ids_NK: np.ndarray, num_experts: int) -> np.ndarray:
    coact_EE = np.zeros((num_experts, num_experts), dtype=np.int64)
    for i, j in itertools.product(range(ids_NK.shape[1]), repeat=2):
        np.add.at(coact_EE, (ids_NK[:, i], ids_NK[:, j]), 1)
    return coact_EE


def random_placement(num_experts: int, num_devices: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(contiguous(num_experts, num_devices))


def assert_balanced(device_of_expert: np.ndarray, num_experts: int, num_devices: int) -> None:
    assert device_of_expert.shape == (num_experts,)
    assert np.issubdtype(device_of_expert.dtype, np.integer)
    assert (np.bincount(device_of_expert, minlength=num_devices) == num_experts // num_devices).all()
    assert device_of_expert.min() >= 0 and device_of_expert.max() < num_devices


def planted_groups(num_experts: int, num_devices: int, num_tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Experts in hidden groups of E/D that always fire together (k = E/D): optimum E[C_T] = 1."""
    rng = np.random.default_rng(seed)
    groups_DG = rng.permutation(num_experts).reshape(num_devices, -1)
    ids_NK = groups_DG[rng.integers(num_devices, size=num_tokens)]
    return rng.permuted(ids_NK, axis=1), groups_DG


def lexicographic_score(ids_NK, device_of_expert, num_devices):
    cnt_ND = device_counts(ids_NK, device_of_expert, num_devices)
    return int((cnt_ND > 0).sum()), -int((cnt_ND * (cnt_ND - 1) // 2).sum())


def reference_greedy(coact_EE: np.ndarray, num_devices: int) -> list[int]:
    """Algorithm 1, one expert at a time in plain Python."""
    num_experts = len(coact_EE)
    size = num_experts // num_devices
    c = [[0.0 if i == j else (float(coact_EE[i][j]) + float(coact_EE[j][i])) / 2 for j in range(num_experts)]
         for i in range(num_experts)]
    device_of = [-1] * num_experts
    for d in range(num_devices):
        unplaced = [e for e in range(num_experts) if device_of[e] < 0]
        placed = [e for e in range(num_experts) if device_of[e] >= 0]
        if d == 0:
            pairs = [(i, j) for i in range(num_experts) for j in range(i + 1, num_experts)]
            members = list(max(pairs, key=lambda ij: (c[ij[0]][ij[1]], -ij[0], -ij[1])))
        else:
            members = [min(unplaced, key=lambda e: (sum(c[e][p] for p in placed) / len(placed), e))]
        for e in members:
            device_of[e] = d
        while len(members) < size:
            unplaced = [e for e in range(num_experts) if device_of[e] < 0]
            best = max(unplaced, key=lambda e: (sum(c[e][m] for m in members) / len(members), -e))
            device_of[best] = d
            members.append(best)
    return device_of


# ---------------------------------------------------------------------------------------------
# metrics and bounds

@pytest.mark.parametrize("num_experts,k,num_devices,want", [
    (64, 8, 4, (1, 4)), (64, 8, 8, (1, 8)), (64, 8, 16, (2, 8)), (64, 8, 32, (4, 8)), (64, 8, 64, (8, 8)),
    (16, 4, 2, (1, 2)), (16, 4, 8, (2, 4)), (60, 4, 4, (1, 4)), (64, 6, 16, (2, 6)),
])
def test_ct_bounds_hold_and_are_attained(num_experts, k, num_devices, want):
    lo, hi = ct_bounds(num_experts, k, num_devices)
    assert (lo, hi) == want
    device_of_expert = random_placement(num_experts, num_devices, seed=1)
    rng = np.random.default_rng(0)
    ids_NK = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(500)])
    counts_N = collaboration_count(ids_NK, device_of_expert)
    assert counts_N.min() >= lo and counts_N.max() <= hi
    by_device = np.argsort(device_of_expert, kind="stable")          # experts grouped device by device
    packed = by_device[:k]
    per_device = num_experts // num_devices
    spread = by_device[(np.arange(k) * per_device) % num_experts + np.arange(k) // num_devices]
    assert collaboration_count(packed[None], device_of_expert)[0] == lo
    assert collaboration_count(spread[None], device_of_expert)[0] == hi


def test_collaboration_count_matches_sets():
    device_of_expert = random_placement(16, 4, seed=3)
    ids_NK = random_trace(16, 4, 300, seed=3)
    want = [len({int(device_of_expert[e]) for e in row}) for row in ids_NK]
    assert collaboration_count(ids_NK, device_of_expert).tolist() == want
    assert expected_ct(ids_NK, device_of_expert) == pytest.approx(np.mean(want))


def test_load_and_pair_metrics():
    device_of_expert = np.array([0, 0, 1, 1])
    ids_NK = np.array([[0, 1], [0, 2], [1, 3], [0, 1]])
    assert intra_device_pair_fraction(ids_NK, device_of_expert, 2) == pytest.approx(0.5)
    assert max_device_load_over_mean(ids_NK, device_of_expert, 2) == pytest.approx(6 / 4)
    with pytest.raises(ValueError, match="ids_NK"):
        collaboration_count(np.array([[0, 4]]), device_of_expert)


@pytest.mark.parametrize("experts,devices,top_k,seed", [(16, 4, 4, 0), (64, 8, 8, 1), (8, 2, 1, 2), (12, 3, 5, 3)])
def test_trace_metrics_equal_the_three_functions(experts, devices, top_k, seed):
    device_of_expert = random_placement(experts, devices, seed=seed)
    ids_NK = random_trace(experts, top_k, 500, seed=seed)
    got = trace_metrics(ids_NK, device_of_expert, devices)
    assert got["expected_ct"] == pytest.approx(expected_ct(ids_NK, device_of_expert), abs=1e-12)
    assert got["max_device_load_over_mean"] == pytest.approx(
        max_device_load_over_mean(ids_NK, device_of_expert, devices), abs=1e-12)
    assert got["intra_device_pair_fraction"] == pytest.approx(
        intra_device_pair_fraction(ids_NK, device_of_expert, devices), abs=1e-12)
    with pytest.raises(ValueError, match="no tokens"):
        trace_metrics(ids_NK[:0], device_of_expert, devices)


# ---------------------------------------------------------------------------------------------
# placements

@pytest.mark.parametrize("num_experts,num_devices", [(16, 2), (16, 4), (16, 8), (64, 8), (60, 4), (8, 8)])
def test_contiguous_and_greedy_are_balanced_and_within_bounds(num_experts, num_devices):
    k = min(4, num_experts)
    ids_NK = random_trace(num_experts, k, 400, seed=num_experts)
    coact_EE = coactivation(ids_NK, num_experts)
    lo, hi = ct_bounds(num_experts, k, num_devices)
    for device_of_expert in (contiguous(num_experts, num_devices), greedy_occult(coact_EE, num_devices)):
        assert_balanced(device_of_expert, num_experts, num_devices)
        assert lo <= expected_ct(ids_NK, device_of_expert) <= hi
    assert contiguous(num_experts, num_devices).tolist() == sorted(contiguous(num_experts, num_devices).tolist())


def test_greedy_does_not_modify_its_input_and_matches_reference():
    for seed, (num_experts, num_devices) in enumerate([(16, 4), (12, 3), (16, 2), (24, 8)]):
        ids_NK = random_trace(num_experts, 3, 300, seed=seed)
        coact_EE = coactivation(ids_NK, num_experts)
        coact_EE = coact_EE * (1 + 3 * np.triu(np.ones_like(coact_EE)))   # not symmetric: greedy symmetrises
        before = coact_EE.copy()
        coact_EE.setflags(write=False)
        got = greedy_occult(coact_EE, num_devices)
        assert np.array_equal(coact_EE, before)
        assert got.tolist() == reference_greedy(before, num_devices)
        assert np.array_equal(greedy_occult(before, num_devices), got)      # deterministic


@pytest.mark.parametrize("num_experts,num_devices", [(16, 4), (64, 8), (32, 2)])
def test_greedy_recovers_planted_blocks(num_experts, num_devices):
    rng = np.random.default_rng(num_experts)
    groups_DG = rng.permutation(num_experts).reshape(num_devices, -1)
    block_of = np.empty(num_experts, dtype=np.int64)
    for g, members in enumerate(groups_DG):
        block_of[members] = g
    coact_EE = rng.integers(0, 20, size=(num_experts, num_experts))
    coact_EE = coact_EE + coact_EE.T
    coact_EE[block_of[:, None] == block_of[None, :]] += 200
    device_of_expert = greedy_occult(coact_EE, num_devices)
    found = {frozenset(np.flatnonzero(device_of_expert == d).tolist()) for d in range(num_devices)}
    assert found == {frozenset(g.tolist()) for g in groups_DG}


def test_swap_search_never_worse_than_init_and_balanced():
    for seed, (num_experts, k, num_devices) in enumerate([(16, 4, 4), (16, 4, 2), (32, 6, 8), (64, 8, 8)]):
        ids_NK = random_trace(num_experts, k, 1500, seed=seed)
        for init in (contiguous(num_experts, num_devices), random_placement(num_experts, num_devices, seed),
                     greedy_occult(coactivation(ids_NK, num_experts), num_devices)):
            got = swap_search(ids_NK, num_devices, init, rounds=10, seed=seed, kicks=4)
            assert_balanced(got, num_experts, num_devices)
            assert expected_ct(ids_NK, got) <= expected_ct(ids_NK, init)
            assert lexicographic_score(ids_NK, got, num_devices) <= lexicographic_score(ids_NK, init, num_devices)
        assert np.array_equal(swap_search(ids_NK, num_devices, init, 10, seed, kicks=4), got)   # seeded


@pytest.mark.parametrize("num_experts,num_devices,seed", [(16, 4, 0), (16, 4, 1), (16, 4, 2), (32, 8, 0), (32, 8, 1)])
def test_swap_search_finds_planted_optimum(num_experts, num_devices, seed):
    ids_NK, _ = planted_groups(num_experts, num_devices, 1000, seed)
    assert expected_ct(ids_NK, contiguous(num_experts, num_devices)) > 1.5
    got = swap_search(ids_NK, num_devices, contiguous(num_experts, num_devices), rounds=20, seed=seed)
    assert expected_ct(ids_NK, got) == 1.0


def test_swap_deltas_are_exact_after_swaps():
    """The incremental tables price every swap exactly, also after a chain of applied swaps."""
    from occult.routing.placement import _score, _SwapState

    num_experts, num_devices = 16, 4
    ids_NK = random_trace(num_experts, 5, 400, seed=4)
    state = _SwapState(ids_NK, random_placement(num_experts, num_devices, seed=4), num_devices)
    rng = np.random.default_rng(0)
    for _ in range(6):
        base_ct, base_neg_pairs = _score(ids_NK, state.device_of_expert, num_devices)
        for a in range(num_experts):
            delta_ct_E, delta_pairs_E = state.deltas(a)
            for b in np.flatnonzero(state.device_of_expert != state.device_of_expert[a]):
                trial = state.device_of_expert.copy()
                trial[a], trial[b] = trial[b], trial[a]
                ct, neg_pairs = _score(ids_NK, trial, num_devices)
                assert (delta_ct_E[b], delta_pairs_E[b]) == (ct - base_ct, base_neg_pairs - neg_pairs), (a, b)
        a = int(rng.integers(num_experts))
        b = int(rng.choice(np.flatnonzero(state.device_of_expert != state.device_of_expert[a])))
        state.swap(a, b)


def test_swap_descent_ends_in_a_local_optimum():
    """With kicks=0 the search stops when no single swap improves (C_T, -pairs): checked by brute
    force, which also checks the incremental swap deltas."""
    num_experts, num_devices = 16, 4
    ids_NK = random_trace(num_experts, 4, 600, seed=5)
    got = swap_search(ids_NK, num_devices, contiguous(num_experts, num_devices), rounds=100, seed=0, kicks=0)
    base = lexicographic_score(ids_NK, got, num_devices)
    for a, b in itertools.combinations(range(num_experts), 2):
        if got[a] != got[b]:
            trial = got.copy()
            trial[a], trial[b] = trial[b], trial[a]
            assert lexicographic_score(ids_NK, trial, num_devices) >= base, (a, b)


def test_place_dispatch():
    ids_NK = random_trace(16, 4, 500, seed=9)
    coact_EE = coactivation(ids_NK, 16)
    assert np.array_equal(place("contiguous", coact_EE, ids_NK, 4, 5, 0), contiguous(16, 4))
    assert np.array_equal(place("greedy", coact_EE, ids_NK, 4, 5, 0), greedy_occult(coact_EE, 4))
    swap = place("swap", coact_EE, ids_NK, 4, 5, 0)
    assert expected_ct(ids_NK, swap) <= expected_ct(ids_NK, greedy_occult(coact_EE, 4))
    from occult.shapes import MoEShape
    from occult.routing.latency import LayerCost, default_starts, validation_runs
    from occult.sim.cost_model_json import builtin_cost_model

    layer = LayerCost(builtin_cost_model()[0], MoEShape("m", 16, 4, 1024, 512))
    fastest = place("latency", coact_EE, ids_NK, 4, 5, 0, layer)
    others = default_starts(ids_NK, 16, 4, swap_rounds=5, seed=0)
    valid_NK = ids_NK[np.concatenate(validation_runs(len(ids_NK)))]   # runs too short: priced pooled
    best_start = min(others.values(), key=lambda p: layer.predict(ids_NK, p, 4).key())
    assert layer.predict(valid_NK, fastest, 4).key() <= layer.predict(valid_NK, best_start, 4).key()
    with pytest.raises(ValueError, match="LayerCost"):
        place("latency", coact_EE, ids_NK, 4, 5, 0)
    with pytest.raises(ValueError, match="annealing"):
        place("annealing", coact_EE, ids_NK, 4, 5, 0)
    with pytest.raises(ValueError, match="evenly"):
        contiguous(16, 3)


@pytest.mark.slow
def test_swap_search_speed_at_olmoe_scale():
    ids_NK = random_trace(64, 8, 50_000, seed=0, clusters=16)
    init = greedy_occult(coactivation(ids_NK, 64), 8)
    start = time.perf_counter()
    got = swap_search(ids_NK, 8, init, rounds=20, seed=0)
    elapsed = time.perf_counter() - start
    print(f"swap_search E=64 k=8 N=50000 D=8: {elapsed:.1f} s, E[C_T] {expected_ct(ids_NK, init):.3f} -> "
          f"{expected_ct(ids_NK, got):.3f}")
    assert expected_ct(ids_NK, got) < expected_ct(ids_NK, init)
    assert elapsed < 60


# ---------------------------------------------------------------------------------------------
# stage and files

def write_profile(profile_dir: Path, num_experts: int = 16, k: int = 4, layers=(0, 1, 2), tokens: int = 800) -> None:
    profile_dir.mkdir(parents=True, exist_ok=True)
    calib = np.stack([random_trace(num_experts, k, tokens, seed=10 + i) for i in range(len(layers))])
    heldout = np.stack([random_trace(num_experts, k, tokens, seed=10 + i)[::-1] for i in range(len(layers))])
    coact = np.stack([coactivation(c, num_experts) for c in calib])
    load = np.stack([np.bincount(c.ravel(), minlength=num_experts) for c in calib])
    np.savez(profile_dir / "profile.npz", coactivation=coact, load=load, layers=np.array(layers))
    np.savez(profile_dir / "routing_calibration.npz", ids=calib.astype(np.int16), layers=np.array(layers))
    np.savez(profile_dir / "routing_heldout.npz", ids=heldout.astype(np.int16), layers=np.array(layers))


@pytest.fixture
def cfg():
    return load_config(REPO / "config" / "config.yaml",
                       overrides={"placement": {"devices": [2, 4], "swap_rounds": 5}, "finetune": {"devices": 4},
                                  "bench": {"devices": 2}})


def test_run_placement_writes_placements_and_table(tmp_path, cfg):
    write_profile(tmp_path / "profile")
    run_placement(cfg, tmp_path / "profile", tmp_path / "placement", tmp_path / "placement" / "expected_ct.csv")
    assert cfg.placement.methods == ("contiguous", "greedy", "swap", "latency")
    for d in (2, 4):
        for method in cfg.placement.methods:
            path = tmp_path / "placement" / f"D{d}_{method}.json"
            doc = json.loads(path.read_text())
            assert doc["provenance"]["config_hash"] == cfg.hash() and doc["provenance"]["seed"] == cfg.seed
            layers, table_LE = load_placement_layers(path, num_experts=16, num_devices=d)
            assert layers == [0, 1, 2] and table_LE.shape == (3, 16)
            assert np.array_equal(load_placement(path), table_LE)
    table = pd.read_csv(tmp_path / "placement" / "expected_ct.csv")
    assert list(table.columns) == ["D", "method", "layer", "expected_ct_heldout", "expected_ct_calibration",
                                   "lower_bound", "upper_bound", "max_device_load_over_mean",
                                   "intra_device_pair_fraction"]
    assert len(table) == 2 * 4 * (3 + 1)
    assert (table["lower_bound"] <= table["expected_ct_heldout"]).all()
    assert (table["expected_ct_heldout"] <= table["upper_bound"]).all()
    means = table[table["layer"] == "mean"].set_index(["D", "method"])
    for d in (2, 4):
        assert means.loc[(d, "swap"), "expected_ct_calibration"] <= means.loc[(d, "greedy"), "expected_ct_calibration"]
        assert means.loc[(d, "greedy"), "expected_ct_calibration"] < means.loc[(d, "contiguous"), "expected_ct_calibration"]
    meta = json.loads((tmp_path / "placement" / "expected_ct.csv.meta.json").read_text())
    assert meta["config_hash"] == cfg.hash()


def test_run_placement_names_bad_profile_files(tmp_path, cfg):
    profile_dir = tmp_path / "profile"
    write_profile(profile_dir)
    (profile_dir / "routing_heldout.npz").unlink()
    with pytest.raises(PlacementFileError, match="routing_heldout.npz.*does not exist"):
        run_placement(cfg, profile_dir, tmp_path / "out", tmp_path / "out.csv")
    write_profile(profile_dir)
    data = (profile_dir / "profile.npz").read_bytes()
    (profile_dir / "profile.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(PlacementFileError, match="profile.npz"):
        run_placement(cfg, profile_dir, tmp_path / "out", tmp_path / "out.csv")
    write_profile(profile_dir, layers=(0, 1))
    np.savez(profile_dir / "routing_calibration.npz", ids=np.zeros((2, 10), dtype=np.int16), layers=np.array([0, 1]))
    with pytest.raises(PlacementFileError, match="routing_calibration.npz.*shape"):
        run_placement(cfg, profile_dir, tmp_path / "out", tmp_path / "out.csv")
    write_profile(profile_dir, num_experts=8)
    with pytest.raises(PlacementFileError, match="profile.npz.*E=8"):
        run_placement(cfg, profile_dir, tmp_path / "out", tmp_path / "out.csv")
    assert not (tmp_path / "out.csv").exists()


def test_load_placement_rejects_bad_files(tmp_path):
    good = {"devices": 2, "num_experts": 4, "layers": [0, 1], "device_of_expert": [[0, 0, 1, 1], [1, 0, 1, 0]]}
    path = tmp_path / "D2_greedy.json"
    path.write_text(json.dumps(good))
    assert load_placement(path).tolist() == good["device_of_expert"]
    cases = {
        "shape": {**good, "device_of_expert": [[0, 0, 1, 1]]},                    # one row for two layers
        "expected 6": {**good, "num_experts": 6},
        "not balanced": {**good, "device_of_expert": [[0, 0, 0, 1], [1, 0, 1, 0]]},
        "lie in": {**good, "device_of_expert": [[0, 0, 2, 2], [1, 0, 1, 0]]},
        "integer table": {**good, "device_of_expert": [[0, 0, 1], [1, 0, 1, 0]]},
        "needs keys": {"devices": 2},
    }
    for message, doc in cases.items():
        path.write_text(json.dumps(doc))
        with pytest.raises(PlacementFileError, match=f"D2_greedy.json.*{message}"):
            load_placement(path)
    path.write_text(json.dumps(good))
    with pytest.raises(PlacementFileError, match="D2_greedy.json.*expected 8"):
        load_placement(path, num_experts=8)
    with pytest.raises(PlacementFileError, match="D2_greedy.json.*expected D=4"):
        load_placement(path, num_devices=4)
    path.write_text("{not json")
    with pytest.raises(PlacementFileError, match="D2_greedy.json.*JSON"):
        load_placement(path)
    with pytest.raises(PlacementFileError, match="missing.json.*does not exist"):
        load_placement(tmp_path / "missing.json")
