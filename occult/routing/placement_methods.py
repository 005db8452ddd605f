"""Placement methods beyond the paper, and synthetic routing traces to study them on.

Every method returns a balanced `device_of_expert` [E] (each device holds exactly E/D experts),
never modifies its inputs and is deterministic given its seed (see `occult.routing.placement` for the
metrics and the paper's Algorithm 1).

- `pair_greedy`: max-edge agglomeration (the official code's idea, with its defects avoided):
  merge the two clusters joined by the heaviest collaboration while the merge fits on a device;
  when no positive edge can be merged, pack the clusters first-fit decreasing.
- `load_aware_swap`: the swap search on E[C_T] restricted to placements whose busiest device
  carries at most (1+eps)·mean token-expert assignments (repairing the start first).
- `hierarchical`: node → GPU placement: minimise inter-node C_T first, then C_T inside each node.
- `metis_partition`: a balanced k-way partition of the co-activation graph by METIS (`pymetis`).
- `eplb_load_only`: longest-processing-time packing by expert load only, in the manner of
  DeepSeek's EPLB without replication (the production baseline that ignores collaboration).
- `synthetic_trace` / `synthetic_preset`: clustered, Zipf-loaded routing traces of the OLMoE,
  Qwen-MoE and DeepSeek-MoE shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from occult.routing.placement import (
    _as_ids,
    _check_distinct_rows,
    _experts_per_device,
    _score,
    _single_threaded_blas,
    _SwapState,
    _validated_placement,
    expected_ct,
    greedy_occult,
    swap_search,
)

SYNTHETIC_SHAPES: dict[str, tuple[int, int]] = {
    "olmoe": (64, 8),          # OLMoE-1B-7B: 64 experts, top-8
    "qwen_moe": (60, 4),       # Qwen1.5-MoE-A2.7B: 60 routed experts, top-4
    "deepseek_moe": (64, 6),   # DeepSeek-MoE-16B: 64 routed experts, top-6
}


# ----------------------------------------------------------------------------------------------
# Pair-greedy agglomeration


def pair_greedy(coact_EE: np.ndarray, num_devices: int) -> np.ndarray:
    """Max-edge agglomeration into clusters of at most E/D experts, then first-fit decreasing.

    Clusters start as single experts. Each step merges the two clusters joined by the heaviest
    total collaboration (symmetrised, diagonal ignored) among pairs whose merged size fits on one
    device; ties go to the lowest cluster indices. When no such pair has positive collaboration
    left (an all-zero matrix included) the merging stops: every step removes a cluster, so it
    always terminates. Clusters are then packed, largest first (ties: lowest expert), each into
    the first device with room; a cluster that fits nowhere is split over the devices with the
    most room, its most attached experts first. Devices are numbered in packing order.
    """
    collab_EE = _symmetric_collaboration(coact_EE)
    num_experts = len(collab_EE)
    capacity = _experts_per_device(num_experts, num_devices)
    weight_CC = collab_EE.copy()
    members = [[e] for e in range(num_experts)]
    alive_C = np.ones(num_experts, dtype=bool)
    size_C = np.ones(num_experts, dtype=np.int64)
    upper_CC = np.triu(np.ones((num_experts, num_experts), dtype=bool), k=1)
    while True:
        fits_CC = (size_C[:, None] + size_C[None, :] <= capacity) & alive_C[:, None] & alive_C[None, :]
        candidates_CC = np.where(fits_CC & upper_CC & (weight_CC > 0), weight_CC, -np.inf)
        flat = int(np.argmax(candidates_CC))              # row-major: the lowest indices on ties
        if not np.isfinite(candidates_CC.flat[flat]):
            break
        i, j = divmod(flat, num_experts)
        weight_CC[i, :] += weight_CC[j, :]
        weight_CC[:, i] += weight_CC[:, j]
        weight_CC[i, i] = 0.0
        weight_CC[j, :] = 0.0
        weight_CC[:, j] = 0.0
        members[i] += members[j]
        members[j] = []
        size_C[i] += size_C[j]
        size_C[j] = 0
        alive_C[j] = False
    clusters = sorted((sorted(members[c]) for c in np.flatnonzero(alive_C)), key=lambda m: (-len(m), m[0]))
    return _pack_first_fit(clusters, collab_EE, num_devices, capacity)


def _pack_first_fit(clusters: list[list[int]], collab_EE: np.ndarray, num_devices: int,
                    capacity: int) -> np.ndarray:
    device_of_expert = np.full(len(collab_EE), -1, dtype=np.int64)
    free_D = np.full(num_devices, capacity, dtype=np.int64)
    for cluster in clusters:
        fitting = np.flatnonzero(free_D >= len(cluster))
        if len(fitting):
            device_of_expert[cluster] = fitting[0]
            free_D[fitting[0]] -= len(cluster)
            continue
        attachment = collab_EE[np.ix_(cluster, cluster)].sum(axis=1)
        remaining = [cluster[i] for i in np.argsort(-attachment, kind="stable")]
        while remaining:
            device = int(np.argmax(free_D))                # most room; lowest index on ties
            take, remaining = remaining[:free_D[device]], remaining[free_D[device]:]
            device_of_expert[take] = device
            free_D[device] -= len(take)
    return device_of_expert


# ----------------------------------------------------------------------------------------------
# Local search with a feasibility rule (load-aware, and inside nodes)


class _GroupedSearch:
    """Swap descent on the sum of several traces' (C_T, −pairs) objectives over one placement.

    Each group is a `_SwapState`; a swap is priced as the sum of the groups' exact deltas.
    `allowed(state, a)` returns the [E] mask of partners b that keep the placement feasible.
    """

    def __init__(self, traces: list[np.ndarray], device_of_expert: np.ndarray, num_devices: int,
                 allowed: Callable[[np.ndarray, int], np.ndarray]):
        self.traces = [t for t in traces if len(t) and t.shape[1] >= 2]
        self.num_devices = num_devices
        self.allowed = allowed
        self.states = [_SwapState(t, device_of_expert, num_devices) for t in self.traces]
        self.device_of_expert = device_of_expert.copy()
        self.tie_scale = 1 + sum(2 * t.shape[1] * len(t) for t in self.traces)

    def score(self, device_of_expert: np.ndarray) -> tuple[int, int]:
        parts = [_score(t, device_of_expert, self.num_devices) for t in self.traces]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def reset(self, device_of_expert: np.ndarray) -> None:
        self.device_of_expert = device_of_expert.copy()
        for state in self.states:
            state.reset(device_of_expert)

    def swap(self, a: int, b: int) -> None:
        for state in self.states:
            state.swap(a, b)
        dev = self.device_of_expert
        dev[a], dev[b] = dev[b], dev[a]

    def descend(self, rounds: int, rng: np.random.Generator) -> np.ndarray:
        num_experts = len(self.device_of_expert)
        for _ in range(rounds):
            moved = False
            for a in rng.permutation(num_experts):
                key_E = np.zeros(num_experts, dtype=np.int64)
                for state in self.states:
                    delta_ct_E, delta_pairs_E = state.deltas(a)
                    key_E += delta_ct_E * self.tie_scale - delta_pairs_E
                forbidden_E = (self.device_of_expert == self.device_of_expert[a]) | ~self.allowed(self.device_of_expert, a)
                key_E[forbidden_E] = np.iinfo(np.int64).max
                b = int(np.argmin(key_E))
                if key_E[b] < 0:
                    self.swap(a, b)
                    moved = True
            if not moved:
                break
        return self.device_of_expert.copy()

    def search(self, rounds: int, kicks: int, kick_swaps: int, rng: np.random.Generator) -> np.ndarray:
        """Descent, then `kicks` perturb-and-descend restarts kept when no worse (as `swap_search`)."""
        if not self.states or rounds == 0:
            return self.device_of_expert.copy()
        best = self.descend(rounds, rng)
        best_score = self.score(best)
        num_experts = len(best)
        for _ in range(kicks):
            candidate = best.copy()
            for _ in range(kick_swaps):
                a = int(rng.integers(num_experts))
                partners = np.flatnonzero((candidate != candidate[a]) & self.allowed(candidate, a))
                if len(partners):
                    b = int(partners[rng.integers(len(partners))])
                    candidate[a], candidate[b] = candidate[b], candidate[a]
            self.reset(candidate)
            candidate = self.descend(rounds, rng)
            candidate_score = self.score(candidate)
            if candidate_score <= best_score:
                best, best_score = candidate, candidate_score
        return best


# ----------------------------------------------------------------------------------------------
# Load-aware swap search


def expert_load(ids_NK: np.ndarray, num_experts: int) -> np.ndarray:
    """Token-expert assignments per expert [E] (int64)."""
    return np.bincount(_as_ids(ids_NK, num_experts).ravel(), minlength=num_experts).astype(np.int64)


def device_load(load_E: np.ndarray, device_of_expert: np.ndarray, num_devices: int) -> np.ndarray:
    """Sum of expert loads per device [D]."""
    return np.bincount(device_of_expert, weights=load_E, minlength=num_devices)


def load_aware_swap(ids_NK: np.ndarray, num_devices: int, init: np.ndarray, eps: float, rounds: int,
                    seed: int, kicks: int = 8, kick_swaps: int = 3) -> np.ndarray:
    """Swap search on E[C_T] that keeps the busiest device's load ≤ (1+eps)·mean.

    Load is token-expert assignments on the trace. If `init` breaks the bound it is first
    repaired: repeatedly, the swap between the busiest device and another one that lowers the
    larger of their two loads the most (both below the old maximum; the sorted load vector then
    falls, so this ends), until the bound holds or no swap helps. The search then accepts only
    swaps keeping every device ≤ max(bound, repaired maximum), so a bound out of reach is never
    made worse. The result's E[C_T] on the trace is never above the repaired start's.
    """
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    ids_NK = _as_ids(ids_NK, len(init))
    _check_distinct_rows(ids_NK)
    num_experts = len(init)
    start = _validated_placement(np.asarray(init, dtype=np.int64), num_experts, num_devices, "init")
    load_E = expert_load(ids_NK, num_experts)
    bound = (1.0 + eps) * load_E.sum() / num_devices
    start = repair_load(load_E, start, num_devices, bound)
    ceiling = max(bound, float(device_load(load_E, start, num_devices).max())) + 1e-9
    if rounds < 0 or kicks < 0 or kick_swaps < 1:
        raise ValueError(f"rounds={rounds}, kicks={kicks} must be >= 0 and kick_swaps={kick_swaps} >= 1")
    if num_devices < 2 or len(ids_NK) == 0:
        return start

    def allowed(device_of_expert: np.ndarray, a: int) -> np.ndarray:
        load_D = device_load(load_E, device_of_expert, num_devices)
        p = device_of_expert[a]
        shift_E = load_E[a] - load_E                    # what leaves p (a) minus what arrives (b)
        return (load_D[p] - shift_E <= ceiling) & (load_D[device_of_expert] + shift_E <= ceiling)

    with _single_threaded_blas():
        search = _GroupedSearch([ids_NK], start, num_devices, allowed)
        return search.search(rounds, kicks, kick_swaps, np.random.default_rng(seed))


def repair_load(load_E: np.ndarray, device_of_expert: np.ndarray, num_devices: int, bound: float) -> np.ndarray:
    """Swaps that lower the busiest device's load until it is ≤ `bound` or no swap helps."""
    device_of_expert = device_of_expert.copy()
    load_E = np.asarray(load_E, dtype=np.float64)
    for _ in range(len(load_E) ** 2):
        load_D = device_load(load_E, device_of_expert, num_devices)
        p = int(np.argmax(load_D))
        if load_D[p] <= bound + 1e-9:
            break
        on_p = np.flatnonzero(device_of_expert == p)
        off_p = np.flatnonzero(device_of_expert != p)
        shift_AB = load_E[on_p][:, None] - load_E[off_p][None, :]
        worse_AB = np.maximum(load_D[p] - shift_AB, load_D[device_of_expert[off_p]][None, :] + shift_AB)
        i, j = np.unravel_index(int(np.argmin(worse_AB)), worse_AB.shape)
        if worse_AB[i, j] >= load_D[p] - 1e-9:
            break
        a, b = on_p[i], off_p[j]
        device_of_expert[a], device_of_expert[b] = device_of_expert[b], device_of_expert[a]
    return device_of_expert


# ----------------------------------------------------------------------------------------------
# Hierarchical node → GPU placement


@dataclass(frozen=True)
class HierarchicalPlacement:
    """A GPU placement with GPUs grouped into nodes: GPU g lives on node g // gpus_per_node."""

    device_of_expert: np.ndarray    # [E] GPU of each expert, in [0, nodes * gpus_per_node)
    gpus_per_node: int

    @property
    def node_of_expert(self) -> np.ndarray:
        return self.device_of_expert // self.gpus_per_node

    def expected_inter_node_ct(self, ids_NK: np.ndarray) -> float:
        """E[number of distinct nodes per token]: the inter-node traffic per token."""
        return expected_node_ct(ids_NK, self.device_of_expert, self.gpus_per_node)

    def expected_ct(self, ids_NK: np.ndarray) -> float:
        """E[number of distinct GPUs per token]."""
        return expected_ct(ids_NK, self.device_of_expert)


def expected_node_ct(ids_NK: np.ndarray, device_of_expert: np.ndarray, gpus_per_node: int) -> float:
    """E[C_T] counted in nodes: GPU g belongs to node g // gpus_per_node."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node} must be >= 1")
    return expected_ct(ids_NK, np.asarray(device_of_expert) // gpus_per_node)


def hierarchical(ids_NK: np.ndarray, nodes: int, gpus_per_node: int, num_experts: int | None = None,
                 rounds: int = 20, seed: int = 0, kicks: int = 8) -> HierarchicalPlacement:
    """Node-level placement minimising inter-node C_T, then a GPU placement inside each node.

    Level 1: the paper's greedy on the trace's co-activation over `nodes` parts, refined by
    `swap_search` on node-level C_T. Level 2, node by node: each token's experts on that node
    form a sub-trace (grouped by how many it has there; tokens with one contribute a constant);
    the greedy on the node's co-activation, refined by a swap search on the sum of the groups'
    C_T, places them on the node's GPUs. Node-level C_T is fixed before GPU-level C_T is
    touched, so inter-node traffic is minimised first. `num_experts` defaults to the largest
    id + 1.
    """
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"nodes={nodes} and gpus_per_node={gpus_per_node} must be >= 1")
    if num_experts is None:
        num_experts = int(np.max(ids_NK)) + 1 if np.size(ids_NK) else 0
    ids_NK = _as_ids(ids_NK, num_experts)
    _check_distinct_rows(ids_NK)
    _experts_per_device(num_experts, nodes * gpus_per_node)
    coact_EE = coactivation_matrix(ids_NK, num_experts)
    if nodes > 1:
        node_of_expert = swap_search(ids_NK, nodes, greedy_occult(coact_EE, nodes), rounds, seed, kicks=kicks)
    else:
        node_of_expert = np.zeros(num_experts, dtype=np.int64)
    device_of_expert = np.empty(num_experts, dtype=np.int64)
    rng = np.random.default_rng(seed)
    for node in range(nodes):
        experts = np.flatnonzero(node_of_expert == node)
        local_of_expert = np.full(num_experts, -1, dtype=np.int64)
        local_of_expert[experts] = np.arange(len(experts))
        start = greedy_occult(coact_EE[np.ix_(experts, experts)], gpus_per_node)
        groups = _node_groups(local_of_expert[ids_NK])
        with _single_threaded_blas():
            search = _GroupedSearch(groups, start, gpus_per_node, lambda dev, a: np.ones(len(dev), dtype=bool))
            local_gpu = search.search(rounds, kicks, 3, rng)
        device_of_expert[experts] = node * gpus_per_node + local_gpu
    return HierarchicalPlacement(device_of_expert, gpus_per_node)


def _node_groups(local_NK: np.ndarray) -> list[np.ndarray]:
    """Each token's experts on one node (local ids; −1 elsewhere), grouped by their number (≥ 2)."""
    present_N = (local_NK >= 0).sum(axis=1)
    groups = []
    for count in range(2, local_NK.shape[1] + 1):
        rows = local_NK[present_N == count]
        if len(rows):
            groups.append(np.sort(rows, axis=1)[:, -count:])    # −1s sort first
    return groups


def coactivation_matrix(ids_NK: np.ndarray, num_experts: int) -> np.ndarray:
    """[E, E] int64 tokens selecting both experts (diagonal: the load), from a trace."""
    ids_NK = _as_ids(ids_NK, num_experts)
    hot_NE = np.zeros((len(ids_NK), num_experts), dtype=np.float64)
    np.put_along_axis(hot_NE, ids_NK, 1.0, axis=1)
    return np.rint(hot_NE.T @ hot_NE).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# METIS


def metis_partition(coact_EE: np.ndarray, num_devices: int, seed: int) -> np.ndarray:
    """Balanced partition of the co-activation graph by METIS (PyPI `pymetis`).

    Edge weights are the symmetrised off-diagonal counts (scaled to integers up to 10^6 when
    they are not integers); experts weigh one each. METIS may leave a part a few experts over
    E/D: the least attached expert of an over-full part (least collaboration with its partners)
    then moves to the under-full part it collaborates with most, until every part holds E/D.
    Raises ImportError naming `pymetis` when it is not installed.
    """
    try:
        import pymetis
    except ImportError:
        raise ImportError("metis_partition needs the PyPI package 'pymetis' (pip install pymetis)") from None
    collab_EE = _symmetric_collaboration(coact_EE)
    num_experts = len(collab_EE)
    capacity = _experts_per_device(num_experts, num_devices)
    if num_devices == 1 or capacity == 1:
        return np.arange(num_experts, dtype=np.int64) // capacity
    if np.allclose(collab_EE, np.rint(collab_EE)):
        weight_EE = np.rint(collab_EE).astype(np.int64)
    else:
        weight_EE = np.rint(collab_EE * (1e6 / collab_EE.max())).astype(np.int64)
    rows, cols = np.nonzero(weight_EE > 0)                 # row-major: CSR order
    starts = np.searchsorted(rows, np.arange(num_experts + 1)).tolist()
    options = pymetis.Options(seed=int(seed), ufactor=1)
    if hasattr(pymetis, "CSRAdjacency"):
        graph = {"adjacency": pymetis.CSRAdjacency(starts, cols.tolist())}
    else:
        graph = {"xadj": starts, "adjncy": cols.tolist()}
    _, parts = pymetis.part_graph(num_devices, **graph, eweights=weight_EE[rows, cols].tolist(), options=options)
    return rebalance(collab_EE, np.asarray(parts, dtype=np.int64), num_devices)


def rebalance(collab_EE: np.ndarray, device_of_expert: np.ndarray, num_devices: int) -> np.ndarray:
    """Move least-attached experts out of over-full devices until each holds exactly E/D."""
    device_of_expert = np.asarray(device_of_expert, dtype=np.int64).copy()
    capacity = _experts_per_device(len(device_of_expert), num_devices)
    while True:
        count_D = np.bincount(device_of_expert, minlength=num_devices)
        if (count_D == capacity).all():
            return device_of_expert
        source = int(np.argmax(count_D))
        members = np.flatnonzero(device_of_expert == source)
        attachment = collab_EE[np.ix_(members, members)].sum(axis=1)
        mover = int(members[np.argmin(attachment)])
        pull_D = np.bincount(device_of_expert, weights=collab_EE[mover], minlength=num_devices)
        pull_D[count_D >= capacity] = -np.inf
        device_of_expert[mover] = int(np.argmax(pull_D))


# ----------------------------------------------------------------------------------------------
# EPLB-style load-only placement


def eplb_load_only(load_E: np.ndarray, num_devices: int) -> np.ndarray:
    """Longest-processing-time packing: heaviest expert first onto the lightest device with room.

    Ties go to the lower expert / device index; each device receives exactly E/D experts.
    Collaboration is ignored: this is the load-only production baseline (no replication).
    """
    load_E = np.asarray(load_E, dtype=np.float64)
    if load_E.ndim != 1 or not np.all(np.isfinite(load_E)) or (load_E < 0).any():
        raise ValueError(f"load_E must be a 1-D array of finite non-negative loads, got shape {load_E.shape}")
    capacity = _experts_per_device(len(load_E), num_devices)
    device_of_expert = np.empty(len(load_E), dtype=np.int64)
    total_D = np.zeros(num_devices)
    count_D = np.zeros(num_devices, dtype=np.int64)
    for e in np.argsort(-load_E, kind="stable"):
        device = int(np.argmin(np.where(count_D < capacity, total_D, np.inf)))
        device_of_expert[e] = device
        total_D[device] += load_E[e]
        count_D[device] += 1
    return device_of_expert


# ----------------------------------------------------------------------------------------------
# Synthetic routing traces


def synthetic_trace(shape: tuple[int, int], num_tokens: int, seed: int, clusters: int = 8,
                    skew: float = 0.6, cohesion: float = 2.5, draw: int = 0) -> np.ndarray:
    """A routing trace [N, k] with clustered co-activation and Zipf-like expert load.

    The structure depends on `seed` only: experts get Zipf popularity p_e ∝ rank^−skew (ranks in
    a random order) and a random cluster out of `clusters` (nearly equal sizes, not contiguous
    in expert index). Each token picks a home cluster with probability proportional to its
    popularity, then its k distinct experts by Gumbel top-k on log p_e + cohesion·[e in home].
    `draw` selects an independent sample of tokens from the same structure (e.g. 0 for the
    calibration trace, 1 for the held-out one).
    """
    num_experts, top_k = shape
    if not 1 <= top_k <= num_experts or not 1 <= clusters <= num_experts or num_tokens < 1:
        raise ValueError(f"synthetic_trace: need 1 <= k={top_k} <= E={num_experts}, "
                         f"1 <= clusters={clusters} <= E and num_tokens={num_tokens} >= 1")
    if skew < 0 or cohesion < 0:
        raise ValueError(f"synthetic_trace: skew={skew} and cohesion={cohesion} must be >= 0")
    structure = np.random.default_rng([seed, 0])
    rank_E = structure.permutation(num_experts) + 1
    popularity_E = rank_E.astype(np.float64) ** -skew
    popularity_E /= popularity_E.sum()
    cluster_of_expert = structure.permutation(np.arange(num_experts) % clusters)
    cluster_mass_C = np.bincount(cluster_of_expert, weights=popularity_E, minlength=clusters)
    tokens = np.random.default_rng([seed, 1, draw])
    home_N = tokens.choice(clusters, size=num_tokens, p=cluster_mass_C / cluster_mass_C.sum())
    logits_NE = np.log(popularity_E)[None, :] + cohesion * (cluster_of_expert[None, :] == home_N[:, None])
    logits_NE += tokens.gumbel(size=(num_tokens, num_experts))
    ids_NK = np.argpartition(-logits_NE, top_k - 1, axis=1)[:, :top_k]
    return np.sort(ids_NK, axis=1).astype(np.int64)


def synthetic_preset(name: str, num_tokens: int, num_layers: int, seed: int,
                     **knobs: float) -> tuple[np.ndarray, np.ndarray]:
    """(calibration [L, N, k], held-out [L, N, k]) traces of a named shape: olmoe, qwen_moe, deepseek_moe.

    Layer l uses structure seed (seed, l): layers differ, and both splits share each layer's structure.
    """
    if name not in SYNTHETIC_SHAPES:
        raise ValueError(f"synthetic preset {name!r} is not one of {', '.join(SYNTHETIC_SHAPES)}")
    shape = SYNTHETIC_SHAPES[name]
    layer_seeds = [int(s) for s in np.random.default_rng(seed).integers(2**31, size=num_layers)]
    calib = np.stack([synthetic_trace(shape, num_tokens, s, draw=0, **knobs) for s in layer_seeds])
    heldout = np.stack([synthetic_trace(shape, num_tokens, s, draw=1, **knobs) for s in layer_seeds])
    return calib, heldout


# ----------------------------------------------------------------------------------------------
# Helpers


def _symmetric_collaboration(coact_EE: np.ndarray) -> np.ndarray:
    """A float64 copy, symmetrised, diagonal zeroed; the input is left untouched."""
    coact_EE = np.asarray(coact_EE)
    if coact_EE.ndim != 2 or coact_EE.shape[0] != coact_EE.shape[1] or coact_EE.shape[0] == 0:
        raise ValueError(f"coact_EE must be a non-empty square matrix, got shape {coact_EE.shape}")
    collab_EE = coact_EE.astype(np.float64)
    if not np.all(np.isfinite(collab_EE)) or (collab_EE < 0).any():
        raise ValueError("coact_EE must hold finite non-negative collaboration counts")
    collab_EE = (collab_EE + collab_EE.T) / 2
    np.fill_diagonal(collab_EE, 0.0)
    return collab_EE
