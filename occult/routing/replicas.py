"""Replicas: spare expert slots that hold a second copy of the hottest experts.

With R spare slots per device, the R·D hottest experts (by calibration load; at most E) get one
more copy each, on another device. Copies are placed collaboration-aware: hottest expert first,
onto the device with a free slot (not its own) whose experts it is co-activated with most (ties:
the less loaded device, then the lower index); `replica_search` then moves copies between devices
where that lowers the predicted layer time.

Which copy a token uses (`route_to_copies`), deterministic and computable on each source device:
a token's experts without a copy fix the devices it already visits; then its replicated experts, in
increasing expert id, each use the first of its copies (primary first, then the copy) on a device
the token already visits, and otherwise copy number (token index mod copies): the tokens that visit
none of an expert's devices are split evenly over its copies. A chosen device joins the token's
visited devices, so two replicated experts of one token meet where they can.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from occult.routing.placement import _as_ids, _experts_per_device, _validated_placement


@dataclass(frozen=True)
class ReplicatedPlacement:
    """Primaries `device_of_expert` [E] (E/D per device) plus copies: `copy_expert` [C] on
    `copy_device` [C], at most `slots_per_device` copies per device."""

    device_of_expert: np.ndarray
    copy_expert: np.ndarray
    copy_device: np.ndarray
    num_devices: int
    slots_per_device: int

    def __post_init__(self) -> None:
        num_experts = len(self.device_of_expert)
        _validated_placement(np.asarray(self.device_of_expert, dtype=np.int64), num_experts, self.num_devices,
                             "device_of_expert")
        experts, devices = np.asarray(self.copy_expert), np.asarray(self.copy_device)
        if experts.shape != devices.shape or experts.ndim != 1:
            raise ValueError("copies: copy_expert and copy_device must be 1-D arrays of one length")
        if len(experts) and (experts.min() < 0 or experts.max() >= num_experts
                             or devices.min() < 0 or devices.max() >= self.num_devices):
            raise ValueError("copies: expert or device out of range")
        if len(np.unique(experts)) != len(experts):
            raise ValueError("copies: an expert has more than one copy")
        if (self.device_of_expert[experts] == devices).any():
            raise ValueError("copies: a copy sits on its expert's own device")
        if len(devices) and np.bincount(devices, minlength=self.num_devices).max() > self.slots_per_device:
            raise ValueError(f"copies: a device holds more than slots_per_device={self.slots_per_device} copies")

    @property
    def virtual_placement(self) -> np.ndarray:
        """Device of every slot id: experts 0..E−1, then copy c as id E + c."""
        return np.concatenate([self.device_of_expert, self.copy_device]).astype(np.int64)

    def copies_per_device(self) -> np.ndarray:
        return np.bincount(self.copy_device, minlength=self.num_devices)


def route_to_copies(ids_NK: np.ndarray, placement: ReplicatedPlacement) -> np.ndarray:
    """Each (token, expert) pair's slot id (expert e, or E + c for copy c), by the module's rule."""
    num_experts = len(placement.device_of_expert)
    ids_NK = _as_ids(ids_NK, num_experts)
    slots_NK = ids_NK.copy()
    if not len(placement.copy_expert):
        return slots_NK
    num_devices = placement.num_devices
    copy_of_expert = np.full(num_experts, -1, dtype=np.int64)
    copy_of_expert[placement.copy_expert] = np.arange(len(placement.copy_expert))
    replicated_NK = copy_of_expert[ids_NK] >= 0
    visited_ND = np.zeros((len(ids_NK), num_devices), dtype=bool)
    rows, cols = np.nonzero(~replicated_NK)
    visited_ND[rows, placement.device_of_expert[ids_NK[rows, cols]]] = True
    for expert in np.sort(placement.copy_expert):
        rows, cols = np.nonzero(ids_NK == expert)
        if not len(rows):
            continue
        copy = copy_of_expert[expert]
        primary, second = placement.device_of_expert[expert], placement.copy_device[copy]
        on_primary, on_second = visited_ND[rows, primary], visited_ND[rows, second]
        use_second = np.where(on_primary, False, np.where(on_second, True, rows % 2 == 1))
        slots_NK[rows[use_second], cols[use_second]] = num_experts + copy
        visited_ND[rows, np.where(use_second, second, primary)] = True
    return slots_NK


def add_replicas(ids_NK: np.ndarray, device_of_expert: np.ndarray, num_devices: int, slots_per_device: int
                 ) -> ReplicatedPlacement:
    """One copy of each of the min(R·D, E) hottest experts, placed collaboration-aware (module docstring)."""
    from occult.routing.placement_methods import coactivation_matrix

    device_of_expert = np.asarray(device_of_expert, dtype=np.int64)
    num_experts = len(device_of_expert)
    _experts_per_device(num_experts, num_devices)
    if slots_per_device < 0:
        raise ValueError(f"slots_per_device: must be >= 0, got {slots_per_device}")
    empty = np.zeros(0, dtype=np.int64)
    if slots_per_device == 0 or num_devices == 1:
        return ReplicatedPlacement(device_of_expert, empty, empty, num_devices, slots_per_device)
    ids_NK = _as_ids(ids_NK, num_experts)
    coact_EE = coactivation_matrix(ids_NK, num_experts).astype(np.float64)
    load_E = np.diag(coact_EE).copy()
    np.fill_diagonal(coact_EE, 0.0)
    hot = np.argsort(-load_E, kind="stable")[:min(slots_per_device * num_devices, num_experts)]
    free_D = np.full(num_devices, slots_per_device, dtype=np.int64)
    load_D = np.bincount(device_of_expert, weights=load_E, minlength=num_devices)
    members = [list(np.flatnonzero(device_of_expert == d)) for d in range(num_devices)]
    copy_expert, copy_device = [], []
    for expert in hot:
        allowed = (free_D > 0) & (np.arange(num_devices) != device_of_expert[expert])
        if not allowed.any():       # only its own device has room: a placed copy moves there for it
            own = device_of_expert[expert]
            movable = [i for i, (e, d) in enumerate(zip(copy_expert, copy_device))
                       if device_of_expert[e] != own and d != own]
            if not movable:
                continue
            i = movable[0]
            allowed = np.arange(num_devices) == copy_device[i]
            members[copy_device[i]].remove(copy_expert[i])
            members[own].append(copy_expert[i])
            copy_device[i] = int(own)
            free_D[own] -= 1
            free_D[allowed] += 1
        pull_D = np.array([coact_EE[expert, members[d]].sum() for d in range(num_devices)])
        order = np.lexsort((np.arange(num_devices), load_D, -pull_D))
        device = int(next(d for d in order if allowed[d]))
        copy_expert.append(int(expert))
        copy_device.append(device)
        free_D[device] -= 1
        members[device].append(int(expert))
        load_D[device] += load_E[expert] / 2          # about half its tokens move to the copy
        load_D[device_of_expert[expert]] -= load_E[expert] / 2
    return ReplicatedPlacement(device_of_expert, np.array(copy_expert, dtype=np.int64),
                               np.array(copy_device, dtype=np.int64), num_devices, slots_per_device)


def replica_search(ids_NK: np.ndarray, placement: ReplicatedPlacement, layer, rounds: int = 2
                   ) -> tuple[ReplicatedPlacement, object]:
    """Copy moves that lower `layer`'s predicted time (`occult.routing.latency.LayerCost`): each copy in
    turn to every other device that is not its expert's, into the place of a copy there (the two
    exchange devices) or, where that device has a free slot, alone; or dropped (a copy costs its
    weight reads). A move is made when it lowers the time; at most `rounds` passes. The result is
    never predicted slower than the primaries without copies (those are returned then). Returns
    (placement, its prediction)."""
    best = placement
    best_pred = predict_replicated(ids_NK, best, layer)
    for _ in range(rounds):
        moved = False
        c = 0
        while c < len(best.copy_expert):
            for candidate in _copy_moves(best, c):
                pred = predict_replicated(ids_NK, candidate, layer)
                if pred.key() < best_pred.key():
                    best, best_pred, moved = candidate, pred, True
            c += 1
        if not moved:
            break
    bare = _with_copies(best, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    bare_pred = predict_replicated(ids_NK, bare, layer)
    return (bare, bare_pred) if bare_pred.key() < best_pred.key() else (best, best_pred)


def _copy_moves(placement: ReplicatedPlacement, c: int):
    """Placements without copy c, and with copy c on another allowed device (swapping with one copy
    there when full)."""
    expert = placement.copy_expert[c]
    keep = np.arange(len(placement.copy_expert)) != c
    yield _with_copies(placement, placement.copy_expert[keep], placement.copy_device[keep])
    for device in range(placement.num_devices):
        if device in (placement.device_of_expert[expert], placement.copy_device[c]):
            continue
        here = np.flatnonzero(placement.copy_device == device)
        if len(here) < placement.slots_per_device:
            devices = placement.copy_device.copy()
            devices[c] = device
            yield _with_devices(placement, devices)
            continue
        for other in here:
            if placement.device_of_expert[placement.copy_expert[other]] == placement.copy_device[c]:
                continue
            devices = placement.copy_device.copy()
            devices[c], devices[other] = device, placement.copy_device[c]
            yield _with_devices(placement, devices)


def predict_replicated(ids_NK: np.ndarray, placement: ReplicatedPlacement, layer):
    """`layer.predict` of the trace routed to copies by `route_to_copies`."""
    return layer.predict(route_to_copies(ids_NK, placement), placement.virtual_placement, placement.num_devices)


def _with_devices(placement: ReplicatedPlacement, copy_device: np.ndarray) -> ReplicatedPlacement:
    return ReplicatedPlacement(placement.device_of_expert, placement.copy_expert, copy_device, placement.num_devices,
                               placement.slots_per_device)


def _with_copies(placement: ReplicatedPlacement, copy_expert: np.ndarray, copy_device: np.ndarray
                 ) -> ReplicatedPlacement:
    return ReplicatedPlacement(placement.device_of_expert, copy_expert, copy_device, placement.num_devices,
                               placement.slots_per_device)
