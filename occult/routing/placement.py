"""Expert placement: balanced expert → device maps that keep collaborating experts together.

A placement of one layer is `device_of_expert` [E], values in [0, D), each device holding exactly
E/D experts. A token routed to top-k experts is sent once per distinct device of its experts:
its collaboration count C_T. Placement never changes routing, only where expert weights live,
so any placement is exact; the best ones minimise E[C_T] over tokens.

Methods:
- `contiguous`: expert e on device e // (E/D) (what plain EP does).
- `greedy`: the paper's Algorithm 1 on the pairwise co-activation matrix.
- `swap`: local search from `greedy` that lowers the k-way objective E[C_T] on a calibration
  routing trace directly; judged on a held-out trace.
- `latency`: the placement of lowest predicted layer time (`occult.routing.latency`), by the
  calibrated cost model of the scale simulator.

`run_placement` is the pipeline stage: profile → `D{D}_{method}.json` per (D, method) and one long
table of E[C_T], its bounds, device load balance and the share of intra-device pairs.
"""

from __future__ import annotations

import contextlib
import math
import zipfile
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np

METHODS = ("contiguous", "greedy", "swap", "latency")


class PlacementFileError(ValueError):
    """A profile, routing trace or placement file is missing or malformed; the message names it."""


# ----------------------------------------------------------------------------------------------
# Metrics


def ct_bounds(num_experts: int, top_k: int, num_devices: int) -> tuple[int, int]:
    """Bounds on one token's C_T for any balanced placement: ⌈k / (E/D)⌉ ≤ C_T ≤ min(k, D)."""
    per_device = _experts_per_device(num_experts, num_devices)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
    return math.ceil(top_k / per_device), min(top_k, num_devices)


def collaboration_count(ids_NK: np.ndarray, device_of_expert: np.ndarray) -> np.ndarray:
    """C_T per token: the number of distinct devices among its experts ([N] int64)."""
    ids_NK = _as_ids(ids_NK, len(device_of_expert))
    if ids_NK.shape[1] == 0:
        return np.zeros(len(ids_NK), dtype=np.int64)
    dev_NK = np.sort(np.asarray(device_of_expert)[ids_NK], axis=1)
    return 1 + np.count_nonzero(np.diff(dev_NK, axis=1), axis=1).astype(np.int64)


def expected_ct(ids_NK: np.ndarray, device_of_expert: np.ndarray) -> float:
    """E[C_T]: mean collaboration count over tokens."""
    counts_N = collaboration_count(ids_NK, device_of_expert)
    if len(counts_N) == 0:
        raise ValueError("expected_ct: the routing trace has no tokens")
    return float(counts_N.mean())


def device_counts(ids_NK: np.ndarray, device_of_expert: np.ndarray, num_devices: int) -> np.ndarray:
    """[N, D] number of each token's experts on each device."""
    ids_NK = _as_ids(ids_NK, len(device_of_expert))
    num_tokens = len(ids_NK)
    flat = (np.arange(num_tokens)[:, None] * num_devices + np.asarray(device_of_expert)[ids_NK]).ravel()
    return np.bincount(flat, minlength=num_tokens * num_devices).reshape(num_tokens, num_devices)


def max_device_load_over_mean(ids_NK: np.ndarray, device_of_expert: np.ndarray, num_devices: int) -> float:
    """Load imbalance: the busiest device's (token, expert) assignments over the mean per device."""
    return _load_over_mean(device_counts(ids_NK, device_of_expert, num_devices))


def intra_device_pair_fraction(ids_NK: np.ndarray, device_of_expert: np.ndarray, num_devices: int) -> float:
    """Share of co-activated expert pairs (two experts of one token) that sit on one device."""
    top_k = np.asarray(ids_NK).shape[1]
    return _intra_pair_share(device_counts(ids_NK, device_of_expert, num_devices), top_k) if top_k >= 2 else 1.0


def trace_metrics(ids_NK: np.ndarray, device_of_expert: np.ndarray, num_devices: int) -> dict[str, float]:
    """`expected_ct`, `max_device_load_over_mean` and `intra_device_pair_fraction` of one trace,
    from one pass over it (`device_counts`); equal to the three functions."""
    cnt_ND = device_counts(ids_NK, device_of_expert, num_devices)
    if len(cnt_ND) == 0:
        raise ValueError("trace_metrics: the routing trace has no tokens")
    top_k = np.asarray(ids_NK).shape[1]
    return {
        "expected_ct": float(np.count_nonzero(cnt_ND, axis=1).mean()),
        "max_device_load_over_mean": _load_over_mean(cnt_ND),
        "intra_device_pair_fraction": _intra_pair_share(cnt_ND, top_k) if top_k >= 2 else 1.0,
    }


def _load_over_mean(cnt_ND: np.ndarray) -> float:
    load_D = cnt_ND.sum(axis=0)
    return float(load_D.max() / load_D.mean())


def _intra_pair_share(cnt_ND: np.ndarray, top_k: int) -> float:
    """Pairs of a token's k >= 2 experts that sit on one device, over all such pairs."""
    return float((cnt_ND * (cnt_ND - 1) // 2).sum() / (len(cnt_ND) * top_k * (top_k - 1) // 2))


# ----------------------------------------------------------------------------------------------
# Placements


def contiguous(num_experts: int, num_devices: int) -> np.ndarray:
    """Expert e on device e // (E/D)."""
    per_device = _experts_per_device(num_experts, num_devices)
    return np.arange(num_experts, dtype=np.int64) // per_device


def greedy_occult(coact_EE: np.ndarray, num_devices: int) -> np.ndarray:
    """The paper's Algorithm 1: greedy balanced grouping by pairwise collaboration.

    Devices are filled one after another. Device 0 starts from the most-collaborating pair; each
    later device starts from the unplaced expert whose mean collaboration with all experts placed
    so far is lowest. A device is then filled, up to E/D experts, by repeatedly adding the unplaced
    expert of highest mean collaboration with the experts already on it. The diagonal (an expert's
    own load) is ignored and the matrix is symmetrised; ties go to the lowest expert index. The
    input is not modified.
    """
    coact_EE = np.asarray(coact_EE)
    if coact_EE.ndim != 2 or coact_EE.shape[0] != coact_EE.shape[1]:
        raise ValueError(f"coact_EE must be a square matrix, got shape {coact_EE.shape}")
    num_experts = coact_EE.shape[0]
    per_device = _experts_per_device(num_experts, num_devices)
    collab_EE = coact_EE.astype(np.float64)           # a copy: the input stays untouched
    collab_EE = (collab_EE + collab_EE.T) / 2
    np.fill_diagonal(collab_EE, 0.0)

    device_of_expert = np.full(num_experts, -1, dtype=np.int64)
    for device in range(num_devices):
        unplaced = np.flatnonzero(device_of_expert < 0)
        placed = np.flatnonzero(device_of_expert >= 0)
        if device == 0 and per_device >= 2:
            upper = np.triu(np.ones((num_experts, num_experts), dtype=bool), k=1)
            flat = int(np.argmax(np.where(upper, collab_EE, -np.inf)))     # row-major: lowest index
            members = list(divmod(flat, num_experts))
        elif device == 0:
            members = [0]
        else:
            mean_to_placed = collab_EE[np.ix_(unplaced, placed)].mean(axis=1)
            members = [int(unplaced[np.argmin(mean_to_placed)])]
        device_of_expert[members] = device
        while len(members) < per_device:
            unplaced = np.flatnonzero(device_of_expert < 0)
            mean_to_device = collab_EE[np.ix_(unplaced, members)].mean(axis=1)
            best = int(unplaced[np.argmax(mean_to_device)])
            device_of_expert[best] = device
            members.append(best)
    return device_of_expert


def swap_search(ids_NK: np.ndarray, num_devices: int, init: np.ndarray, rounds: int, seed: int,
                kicks: int = 16, kick_swaps: int = 3) -> np.ndarray:
    """Swap local search that minimises E[C_T] on a routing trace (k-way, not pairwise).

    Descent: each pass visits every expert a (in a seeded random order), evaluates swapping it with
    every expert b on another device, and applies the best swap if it improves the objective; at
    most `rounds` passes, stopping after a pass without a move. The objective is lexicographic:
    first the total C_T, then, between placements of equal C_T, the number of intra-device expert
    pairs (more is better), which lets the descent walk across the plateaus of the step-valued C_T.

    Single swaps still stall in "rings" (groups split 2+2 over devices that each hold halves of two
    groups: every single swap raises C_T). So after the first descent the search is iterated
    `kicks` times: apply `kick_swaps` random swaps to the best placement, descend again, and keep
    the result when it is no worse. The returned placement is never worse than `init`
    (kicks=0 gives the plain descent). Balance is kept by construction; everything is seeded.
    """
    ids_NK = _as_ids(ids_NK, len(init))
    _check_distinct_rows(ids_NK)
    num_experts = len(init)
    best = _validated_placement(np.asarray(init, dtype=np.int64), num_experts, num_devices, "init")
    if rounds < 0 or kicks < 0 or kick_swaps < 1:
        raise ValueError(f"rounds={rounds}, kicks={kicks} must be >= 0 and kick_swaps={kick_swaps} >= 1")
    num_tokens, top_k = ids_NK.shape
    if num_tokens == 0 or top_k < 2 or num_devices < 2 or rounds == 0:
        return best
    rng = np.random.default_rng(seed)
    with _single_threaded_blas():
        state = _SwapState(ids_NK, best, num_devices)
        best = state.descend(rounds, rng)
        best_score = _score(ids_NK, best, num_devices)
        for _ in range(kicks):
            state.reset(kicked(best, kick_swaps, rng))
            candidate = state.descend(rounds, rng)
            candidate_score = _score(ids_NK, candidate, num_devices)
            if candidate_score <= best_score:
                best, best_score = candidate, candidate_score
    return best



def kicked(device_of_expert: np.ndarray, swaps: int, rng: np.random.Generator) -> np.ndarray:
    """A copy of a placement with `swaps` random swaps of two experts on different devices (the
    perturbation of the perturb-and-descend searches); balance is kept."""
    candidate = device_of_expert.copy()
    for _ in range(swaps):
        a = int(rng.integers(len(candidate)))
        others = np.flatnonzero(candidate != candidate[a])
        b = int(others[rng.integers(len(others))])
        candidate[a], candidate[b] = candidate[b], candidate[a]
    return candidate

def _score(ids_NK: np.ndarray, device_of_expert: np.ndarray, num_devices: int) -> tuple[int, int]:
    """Lexicographic objective of the swap search: (total C_T, −intra-device pairs)."""
    cnt_ND = device_counts(ids_NK, device_of_expert, num_devices)
    return int((cnt_ND > 0).sum()), -int((cnt_ND * (cnt_ND - 1) // 2).sum())


class _SwapState:
    """A placement with the tables that price every swap exactly. With cnt[t, d] the number of
    token t's experts on device d, a on device p, b on device q (tokens holding both a and b do
    not change):

        ΔC_T    = Z[a, q] − S[a] + Z[b, p] − S[b] + Σ_{t ∋ a,b} ([cnt[t,p] = 1] + [cnt[t,q] = 1])
        Δpairs  = W[a, q] − W[a, p] + |T_a| + W[b, p] − W[b, q] + |T_b| − 2·|T_a ∩ T_b|
        Z[e, d] = #{t ∋ e : cnt[t, d] = 0},  S[e] = #{t ∋ e : cnt[t, dev e] = 1},  W[e, d] = Σ_{t ∋ e} cnt[t, d]

    A swap updates cnt, Z, S, W from the tokens it touches only.
    """

    CHUNK = 65536

    def __init__(self, ids_NK: np.ndarray, device_of_expert: np.ndarray, num_devices: int):
        self.ids_NK = ids_NK
        self.num_devices = num_devices
        self.num_experts = len(device_of_expert)
        num_tokens, top_k = ids_NK.shape
        expert_flat = ids_NK.ravel()
        token_flat = np.repeat(np.arange(num_tokens), top_k)
        order = np.argsort(expert_flat, kind="stable")
        bounds = np.searchsorted(expert_flat[order], np.arange(self.num_experts + 1))
        self.tokens_of_expert = [token_flat[order[bounds[e]:bounds[e + 1]]] for e in range(self.num_experts)]
        self.size_E = np.diff(bounds).astype(np.int64)
        self.ids_of_expert = [ids_NK[tokens] for tokens in self.tokens_of_expert]     # static: cached
        self.tie_scale = 2 * top_k * num_tokens + 1          # > any |Δpairs|: one integer key per swap
        self.reset(device_of_expert)

    def reset(self, device_of_expert: np.ndarray) -> None:
        """Start over from another placement (the per-expert token index is kept)."""
        num_tokens = len(self.ids_NK)
        self.device_of_expert = device_of_expert.copy()
        self.cnt_ND = device_counts(self.ids_NK, self.device_of_expert, self.num_devices)
        parts = [self._tables(np.arange(start, min(start + self.CHUNK, num_tokens)))
                 for start in range(0, num_tokens, self.CHUNK)]
        self.zeros_ED, self.alone_E, self.mass_ED = (sum(tables) for tables in zip(*parts))

    def _tables(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Contributions of `tokens` to Z [E, D], S [E] and W [E, D]."""
        ids_tK = self.ids_NK[tokens]
        cnt_tD = self.cnt_ND[tokens]
        incidence_tE = np.zeros((len(tokens), self.num_experts))
        np.put_along_axis(incidence_tE, ids_tK, 1.0, axis=1)
        # exact: float64 sums of small integers; one product gives Z and W together
        both_E2D = np.rint(incidence_tE.T @ np.concatenate([cnt_tD == 0, cnt_tD], axis=1)).astype(np.int64)
        alone_tK = np.take_along_axis(cnt_tD, self.device_of_expert[ids_tK], axis=1) == 1
        alone_E = np.bincount(ids_tK.ravel(), weights=alone_tK.ravel(), minlength=self.num_experts).astype(np.int64)
        return both_E2D[:, :self.num_devices], alone_E, both_E2D[:, self.num_devices:]

    def deltas(self, a: int) -> tuple[np.ndarray, np.ndarray]:
        """(ΔC_T [E], Δpairs [E]) of swapping a with each expert b (meaningless where dev b = dev a)."""
        dev_E = self.device_of_expert
        p = dev_E[a]
        tokens_a = self.tokens_of_expert[a]
        ids_aK = self.ids_of_expert[a]
        one_aD = self.cnt_ND[tokens_a] == 1
        rows_aK = np.arange(len(tokens_a))[:, None]
        shared_weight_aK = one_aD[:, [p]].astype(np.int64) + one_aD[rows_aK, dev_E[ids_aK]]
        shared_ct_E = np.bincount(ids_aK.ravel(), weights=shared_weight_aK.ravel(), minlength=self.num_experts)
        shared_tokens_E = np.bincount(ids_aK.ravel(), minlength=self.num_experts)
        gain_ED = self.zeros_ED - self.alone_E[:, None]
        own_mass_E = self.mass_ED[np.arange(self.num_experts), dev_E]
        delta_ct_E = gain_ED[a, dev_E] + gain_ED[:, p] + shared_ct_E.astype(np.int64)
        delta_pairs_E = (self.mass_ED[a, dev_E] - self.mass_ED[a, p] + self.size_E[a]
                         + self.mass_ED[:, p] - own_mass_E + self.size_E - 2 * shared_tokens_E)
        return delta_ct_E, delta_pairs_E

    def swap(self, a: int, b: int) -> None:
        p, q = self.device_of_expert[a], self.device_of_expert[b]
        tokens_a, tokens_b = self.tokens_of_expert[a], self.tokens_of_expert[b]
        touched = np.union1d(tokens_a, tokens_b)
        old = self._tables(touched)
        self.cnt_ND[tokens_a, p] -= 1
        self.cnt_ND[tokens_a, q] += 1
        self.cnt_ND[tokens_b, q] -= 1
        self.cnt_ND[tokens_b, p] += 1
        self.device_of_expert[a], self.device_of_expert[b] = q, p
        new = self._tables(touched)
        self.zeros_ED += new[0] - old[0]
        self.alone_E += new[1] - old[1]
        self.mass_ED += new[2] - old[2]

    def descend(self, rounds: int, rng: np.random.Generator) -> np.ndarray:
        """Best swap per expert while it improves (C_T, −pairs); at most `rounds` passes."""
        for _ in range(rounds):
            moved = False
            for a in rng.permutation(self.num_experts):
                delta_ct_E, delta_pairs_E = self.deltas(a)
                key_E = delta_ct_E * self.tie_scale - delta_pairs_E
                key_E[self.device_of_expert == self.device_of_expert[a]] = np.iinfo(np.int64).max
                b = int(np.argmin(key_E))
                if key_E[b] < 0:
                    self.swap(a, b)
                    moved = True
            if not moved:
                break
        return self.device_of_expert.copy()


# ----------------------------------------------------------------------------------------------
# Files


def load_profile_coactivation(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """`coactivation` [L, E, E] and `layers` [L] of a profile, checked against `load` [L, E]."""
    arrays = _load_npz(path, ("coactivation", "load", "layers"))
    coact, load, layers = arrays["coactivation"], arrays["load"], arrays["layers"]
    if coact.ndim != 3 or coact.shape[1] != coact.shape[2] or coact.shape[1] == 0:
        raise PlacementFileError(f"{path}: 'coactivation' must have shape [L, E, E], got {coact.shape}")
    num_layers, num_experts = coact.shape[:2]
    if layers.shape != (num_layers,):
        raise PlacementFileError(f"{path}: 'layers' must have shape [{num_layers}], got {layers.shape}")
    if load.shape != (num_layers, num_experts):
        raise PlacementFileError(f"{path}: 'load' must have shape [{num_layers}, {num_experts}], got {load.shape}")
    if not np.issubdtype(coact.dtype, np.number) or not np.all(np.isfinite(coact)) or (coact < 0).any():
        raise PlacementFileError(f"{path}: 'coactivation' must hold finite non-negative counts")
    return coact, layers.astype(np.int64)


def load_routing(path: Path, layers: np.ndarray, num_experts: int) -> np.ndarray:
    """Routing trace `ids` [L, N, k] (int64), checked against the profile's layers and E."""
    arrays = _load_npz(path, ("ids", "layers"))
    ids, trace_layers = arrays["ids"], arrays["layers"]
    if ids.ndim != 3 or ids.shape[0] != len(layers) or ids.shape[1] == 0 or ids.shape[2] == 0:
        raise PlacementFileError(f"{path}: 'ids' must have shape [L={len(layers)}, N>0, k>0], got {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise PlacementFileError(f"{path}: 'ids' must be integers, got {ids.dtype}")
    if not np.array_equal(trace_layers.astype(np.int64), layers):
        raise PlacementFileError(f"{path}: 'layers' {trace_layers.tolist()} differ from the profile's {layers.tolist()}")
    if ids.min() < 0 or ids.max() >= num_experts:
        raise PlacementFileError(f"{path}: expert ids must lie in [0, {num_experts})")
    return ids.astype(np.int64)


def load_placement_layers(path: Path, num_experts: int | None = None,
                          num_devices: int | None = None) -> tuple[list[int], np.ndarray]:
    """(layers, device_of_expert [L, E]) of a placement JSON, validated; errors name the file."""
    import json

    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlacementFileError(f"{path}: placement file does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PlacementFileError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(doc, dict) or not {"devices", "layers", "device_of_expert"} <= doc.keys():
        raise PlacementFileError(f"{path}: needs keys 'devices', 'layers' and 'device_of_expert'")
    devices = doc["devices"]
    if not isinstance(devices, int) or devices < 1:
        raise PlacementFileError(f"{path}: 'devices' must be a positive integer, got {devices!r}")
    if num_devices is not None and devices != num_devices:
        raise PlacementFileError(f"{path}: placement is for D={devices}, expected D={num_devices}")
    try:
        table = np.asarray(doc["device_of_expert"], dtype=np.int64)
        layers = [int(layer) for layer in doc["layers"]]
    except (TypeError, ValueError):
        raise PlacementFileError(f"{path}: 'device_of_expert' must be an [L, E] integer table") from None
    expected_e = num_experts if num_experts is not None else doc.get("num_experts")
    if table.ndim != 2 or table.shape[0] != len(layers) or table.shape[1] == 0:
        raise PlacementFileError(
            f"{path}: 'device_of_expert' must have shape [L={len(layers)}, E], got {table.shape}")
    if expected_e is not None and table.shape[1] != expected_e:
        raise PlacementFileError(f"{path}: placement has E={table.shape[1]} experts, expected {expected_e}")
    for layer, row in zip(layers, table):
        try:
            _validated_placement(row, table.shape[1], devices, "device_of_expert")
        except ValueError as err:
            raise PlacementFileError(f"{path}: layer {layer}: {err}") from None
    return layers, table


def load_placement(path: Path, num_experts: int | None = None, num_devices: int | None = None) -> np.ndarray:
    """device_of_expert [L, E] of a placement JSON, validated (balanced, in range, right E)."""
    return load_placement_layers(path, num_experts, num_devices)[1]


# ----------------------------------------------------------------------------------------------
# Helpers


def _load_npz(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The named arrays of an .npz file; a missing, truncated or incomplete file names itself."""
    path = Path(path)
    if not path.is_file():
        raise PlacementFileError(f"{path}: file does not exist")
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in keys if key not in archive.files]
            if missing:
                raise PlacementFileError(f"{path}: missing array(s) {', '.join(missing)} (has {', '.join(archive.files)})")
            return {key: archive[key] for key in keys}
    except PlacementFileError:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as err:
        raise PlacementFileError(f"{path}: not a readable .npz file ({type(err).__name__}: {err})") from None


@contextlib.contextmanager
def _single_threaded_blas() -> Iterator[None]:
    """The search's matrix products are small; BLAS threads only contend (with other jobs too)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _experts_per_device(num_experts: int, num_devices: int) -> int:
    if num_devices < 1 or num_experts < 1 or num_experts % num_devices:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {num_devices} devices")
    return num_experts // num_devices


def _as_ids(ids_NK: np.ndarray, num_experts: int) -> np.ndarray:
    ids_NK = np.asarray(ids_NK)
    if ids_NK.ndim != 2 or not np.issubdtype(ids_NK.dtype, np.integer):
        raise ValueError(f"ids_NK must be a 2-D integer array, got {ids_NK.dtype} {ids_NK.shape}")
    if ids_NK.size and (ids_NK.min() < 0 or ids_NK.max() >= num_experts):
        raise ValueError(f"ids_NK: expert ids must lie in [0, {num_experts})")
    return ids_NK.astype(np.int64, copy=False)


def _check_distinct_rows(ids_NK: np.ndarray) -> None:
    sorted_NK = np.sort(ids_NK, axis=1)
    if (np.diff(sorted_NK, axis=1) == 0).any():
        raise ValueError("ids_NK: a token lists the same expert twice")


def _validated_placement(device_of_expert: np.ndarray, num_experts: int, num_devices: int, name: str) -> np.ndarray:
    per_device = _experts_per_device(num_experts, num_devices)
    if device_of_expert.shape != (num_experts,):
        raise ValueError(f"{name}: expected {num_experts} experts, got shape {device_of_expert.shape}")
    if device_of_expert.min() < 0 or device_of_expert.max() >= num_devices:
        raise ValueError(f"{name}: devices must lie in [0, {num_devices})")
    per_device_D = np.bincount(device_of_expert, minlength=num_devices)
    if (per_device_D != per_device).any():
        raise ValueError(f"{name}: not balanced, experts per device {per_device_D.tolist()} (want {per_device} each)")
    return device_of_expert.copy()
