"""Dispatch plans: which token rows go to which device (BRIM_0), and how an expert rank groups
the (row, local expert) pairs it received by expert (BRIM_1).

Placement. `device_of_expert_E[e]` is the device (rank in the EP group) holding expert e.
Each device numbers its experts 0..E_d-1 in increasing global id (`local_expert_ids`), and its
local weight tensors are stacked in that order (`experts_of_device`).

Modes (J = columns of BRIM_0):
  * `per_expert` (Tutel, MegaBlocks, Megatron): one row per (token, selected expert); J = k.
  * `dedup` (Occult): one row per (token, destination device), carrying all of the token's
    experts on that device; J = D. Rows per token = C_T, the number of distinct devices.

Wire format. The hidden rows `x_SD` go in send order: grouped by destination device, then by
token. Beside them travels a *pair stream*, one entry per (token, selected expert), in the same
order (device, token, k-slot): `code = 2 * local_expert + starts_row` (int32) and the gate
weight (fp32). `starts_row` marks the first pair of each row, so the receiver recovers the row of
every pair with a cumulative sum. Metadata is therefore 8 bytes per (token, expert) in both modes,
and dedup never sends more bytes than per_expert (equal when k = 1).

Packed rows (what `occult.ep.layer` actually sends, v2). Each sent row carries its pairs'
metadata in a fixed tail of `slots` entries (slots = k in dedup mode, 1 in per_expert mode): the
local expert id (int32, −1 = empty slot) and the gate (fp32), so hidden rows and metadata travel
in ONE all-to-all. `DispatchPlan.pair_row_P`/`pair_rank_P` give each pair's (row, slot), and
`build_pairs_from_slots` rebuilds BRIM_1 on the expert rank from the received [R, slots] codes,
together with the [R, slots] table of each row's pair positions in expert order (the reduction
table of the down projection: no sort by row is needed).

Static shapes (`static_plan`, dedup only). A rank sends each of its T tokens at most once to
each device, so a buffer of C ≥ T rows per destination is an exact upper bound: row d·C + t of
the send buffer is token t's row for device d (its metadata slots all −1 when t needs nothing
there, or t ≥ T). No sort, no split sizes on the host, no sync: the all-to-alls have equal
splits, and the layer can be captured in a CUDA graph. The wire carries C·(D−1) remote rows
whatever the routing (exact dispatch: E[C_T]·T·(D−1)/D on average), so it pays at small D or
where launches, not bytes, dominate. The expert rank sees R = D·C rows with `slots` pairs each;
`build_pairs_from_slots(code_RK, None, E_r)` groups them by expert without knowing how many are
filled (the empty slots sort last, past `expert_offsets[-1]`).

Host synchronisation: `count_plan` and `finish_plan` make none; `build_plan` = both plus exactly
one `.tolist()` of the per-device row and pair counts (the all-to-all split sizes). The layer
instead exchanges the counts on the device first and reads send and receive counts in one sync.
`build_pairs` and `build_pairs_from_slots` make none. The layer's exact dedup path uses
`count_dedup_plan` + `finish_dedup_plan` instead: the same rows, counts and packed bytes without
sorting the pairs (a [T, D] hit matrix and its cumulative sum number the rows; a [T, k, k]
comparison gives each pair's slot), in about 30 launches instead of about 40 plus two radix sorts;
its pair fields are in (token, slot) order. Per-device counts of `count_plan` come from binary searches
over the device-sorted pairs (no `index_add_`: its atomics on D bins serialise), and sort keys are
narrowed to int16 where they fit (fewer radix passes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from occult.kernels.wire_format import DispatchPlan

MODES = ("dedup", "per_expert")


def check_placement(device_of_expert_E: torch.Tensor, num_devices: int) -> torch.Tensor:
    """Validate a placement (1-D integers in [0, num_devices)) and return it as int64."""
    if not isinstance(device_of_expert_E, torch.Tensor):
        device_of_expert_E = torch.as_tensor(device_of_expert_E)
    if device_of_expert_E.dim() != 1 or device_of_expert_E.is_floating_point():
        raise ValueError(
            f"device_of_expert_E: expected a 1-D integer tensor, got {device_of_expert_E.dtype} "
            f"of shape {tuple(device_of_expert_E.shape)}"
        )
    if num_devices < 1:
        raise ValueError(f"num_devices: must be at least 1, got {num_devices}")
    placement = device_of_expert_E.long()
    if placement.numel() and (placement.min() < 0 or placement.max() >= num_devices):
        raise ValueError(
            f"device_of_expert_E: values must lie in [0, {num_devices}), got "
            f"[{int(placement.min())}, {int(placement.max())}]"
        )
    return placement


def contiguous_placement(num_experts: int, num_devices: int) -> torch.Tensor:
    """The trivial placement: experts 0..E/D-1 on device 0, the next E/D on device 1, ..."""
    return torch.arange(num_experts) * num_devices // num_experts


def local_expert_ids(device_of_expert_E: torch.Tensor, num_devices: int) -> torch.Tensor:
    """[E] each expert's index among the experts of its device, in increasing global id."""
    placement = device_of_expert_E.long()
    one_hot_ED = torch.nn.functional.one_hot(placement, num_devices)
    return (one_hot_ED.cumsum(0) - 1).gather(1, placement[:, None]).squeeze(1)


def experts_of_device(device_of_expert_E: torch.Tensor, device: int) -> torch.Tensor:
    """Global ids of the experts on `device`, in local order (slice the full weights with it)."""
    return torch.nonzero(device_of_expert_E.long() == device).flatten()


def narrow_key(key: torch.Tensor, bound: int) -> torch.Tensor:
    """`key` (values in [0, bound]) as int16 when it fits: a radix sort then makes 2 passes, not 8."""
    return key.to(torch.int16) if bound < 2**15 else key


@dataclass(frozen=True)
class PlanCounts:
    """The device half of a plan (no host sync): pairs in send order and per-device counts.

    P = T*k pairs sent, in (device, token, slot) order.
    """

    mode: str
    num_devices: int
    num_tokens: int
    top_k: int
    pair_slot_P: torch.Tensor        # int64 [P] index t*k + j of the pair's gate in weights_TK
    token_P: torch.Tensor            # int64 [P]
    dev_P: torch.Tensor              # int64 [P] destination device
    starts_P: torch.Tensor           # bool [P] first pair of its row
    row_P: torch.Tensor              # int64 [P] row of the pair in the send buffer
    rank_P: torch.Tensor             # int64 [P] slot of the pair within its row
    code_P: torch.Tensor             # int64 [P] local expert id at the destination
    counts_D3: torch.Tensor          # int64 [D, 3] rows and pairs sent to each device, and (same in
                                     # every row) the most pairs any sent row carries
    devices_per_token_T: torch.Tensor  # int64 [T] C_T


def count_plan(
    ids_TK: torch.Tensor,
    device_of_expert_E: torch.Tensor,
    num_devices: int,
    local_id_of_expert_E: torch.Tensor,
    mode: str = "dedup",
) -> PlanCounts:
    """The device half of `build_plan`: send order, row numbering and per-device counts."""
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {MODES}")
    if ids_TK.dim() != 2:
        raise ValueError(f"ids_TK: expected [T, k], got shape {tuple(ids_TK.shape)}")
    device = ids_TK.device
    placement = device_of_expert_E.to(device=device, dtype=torch.long)
    local_id = local_id_of_expert_E.to(device=device, dtype=torch.long)
    num_tokens, top_k = ids_TK.shape
    ids_flat = ids_TK.reshape(-1).long()
    dev_flat = placement[ids_flat]                                   # [P] in (t, j) order

    # Pairs in send order (device, token, slot): a stable sort by device keeps (t, j) order.
    dev_sorted, pair_slot_P = torch.sort(narrow_key(dev_flat, num_devices), stable=True)
    dev_P = dev_flat[pair_slot_P]
    token_P = pair_slot_P // max(top_k, 1)
    num_pairs = pair_slot_P.numel()

    hit_TD = torch.zeros(num_tokens, num_devices, dtype=torch.bool, device=device)
    hit_TD.scatter_(1, dev_flat.view(num_tokens, top_k), True)
    devices_per_token_T = hit_TD.sum(1)

    # A pair starts a new row unless (dedup) it shares token and device with the previous pair.
    starts_P = torch.ones(num_pairs, dtype=torch.bool, device=device)
    if mode == "dedup" and num_pairs > 1:
        starts_P[1:] = (token_P[1:] != token_P[:-1]) | (dev_P[1:] != dev_P[:-1])
    rows_through_P = torch.cumsum(starts_P.long(), 0)
    row_P = rows_through_P - 1
    # Slot of a pair within its row: distance to the row's first pair.
    index_P = torch.arange(num_pairs, device=device)
    if mode == "dedup" and num_pairs:
        # First pair of each row by a scatter-add where only the row's start contributes (exact in
        # integers, so deterministic; CUDA's cummax is a slow generic scan).
        first_R = torch.zeros_like(index_P).scatter_add_(0, row_P, torch.where(starts_P, index_P, 0))
        rank_P = index_P - first_R[row_P]
    else:
        rank_P = torch.zeros_like(index_P)
    most_pairs = (rank_P.max() + 1) if num_pairs else rank_P.new_zeros(())

    # Per-device counts by binary search over the device-sorted pairs (no atomics, no sync).
    bounds_D1 = torch.searchsorted(
        dev_sorted, torch.arange(num_devices + 1, device=device, dtype=dev_sorted.dtype)
    )
    rows_through_D1 = torch.cat([rows_through_P.new_zeros(1), rows_through_P])[bounds_D1]
    counts_D3 = torch.stack(
        [rows_through_D1.diff(), bounds_D1.diff(), most_pairs.expand(num_devices)], dim=1
    )
    return PlanCounts(
        mode=mode,
        num_devices=num_devices,
        num_tokens=num_tokens,
        top_k=top_k,
        pair_slot_P=pair_slot_P,
        token_P=token_P,
        dev_P=dev_P,
        starts_P=starts_P,
        row_P=row_P,
        rank_P=rank_P,
        code_P=local_id[ids_flat[pair_slot_P]],
        counts_D3=counts_D3,
        devices_per_token_T=devices_per_token_T,
    )


def finish_plan(
    counts: PlanCounts, rows_per_device: list[int], pairs_per_device: list[int], slots: int
) -> DispatchPlan:
    """The host half of `build_plan`, given the counts read back from `counts.counts_D3` and the
    metadata slots per packed row (≥ the most pairs of any row; all ranks must agree on it)."""
    device = counts.row_P.device
    num_rows = sum(rows_per_device)
    num_tokens, top_k = counts.num_tokens, counts.top_k
    token_P, dev_P, row_P, starts_P = counts.token_P, counts.dev_P, counts.row_P, counts.starts_P
    # Every pair of a row names the same token: duplicate writes store equal values.
    send_token_S = torch.zeros(num_rows, dtype=torch.long, device=device).scatter_(0, row_P, token_P)
    if counts.mode == "dedup":
        brim0_TJ = torch.full((num_tokens, counts.num_devices), -1, dtype=torch.long, device=device)
        brim0_TJ.index_put_((token_P, dev_P), row_P)
    else:
        brim0_TJ = torch.empty(num_tokens * top_k, dtype=torch.long, device=device)
        brim0_TJ[counts.pair_slot_P] = row_P
        brim0_TJ = brim0_TJ.view(num_tokens, top_k)
    pair_code_P = (2 * counts.code_P + starts_P.long()).to(torch.int32)
    return DispatchPlan(
        mode=counts.mode,
        num_devices=counts.num_devices,
        send_token_S=send_token_S,
        pair_code_P=pair_code_P,
        pair_slot_P=counts.pair_slot_P,
        brim0_TJ=brim0_TJ,
        devices_per_token_T=counts.devices_per_token_T,
        rows_per_device=rows_per_device,
        pairs_per_device=pairs_per_device,
        pair_row_P=row_P,
        pair_rank_P=counts.rank_P,
        slots=max(slots, 1),
    )


@dataclass(frozen=True)
class DedupCounts:
    """The device half of the layer's exact dedup plan (`count_dedup_plan`; no sort, no sync).

    Pairs stay in (token, slot) order: pair p = t*k + j. Row numbers follow the send order
    (destination device, then token), as in `build_plan`.
    """

    dev_TK: torch.Tensor             # int64 [T, k] destination device of each pair
    code_TK: torch.Tensor            # int64 [T, k] local expert id at the destination
    rank_TK: torch.Tensor            # int64 [T, k] slot of the pair within its (token, device) row
    hit_TD: torch.Tensor             # bool [T, D] token t sends a row to device d
    counts_D3: torch.Tensor          # int64 [D, 3] as `PlanCounts.counts_D3`
    devices_per_token_T: torch.Tensor  # int64 [T] C_T


@functools.lru_cache(maxsize=32)
def _earlier_slots(top_k: int, device: torch.device) -> torch.Tensor:
    """bool [k, k]: entry (j, j') is True when slot j' comes before slot j (built once per k, device)."""
    return torch.ones(top_k, top_k, dtype=torch.bool, device=device).tril(-1)


def count_dedup_plan(
    ids_TK: torch.Tensor,
    device_of_expert_E: torch.Tensor,
    num_devices: int,
    local_id_of_expert_E: torch.Tensor,
) -> DedupCounts:
    """The dedup plan's device half in ≈12 elementwise/scan ops (`count_plan` sorts the T·k pairs
    by device instead: ≈35 ops, two of them radix sorts). Same rows and counts as `count_plan`."""
    if ids_TK.dim() != 2:
        raise ValueError(f"ids_TK: expected [T, k], got shape {tuple(ids_TK.shape)}")
    device = ids_TK.device
    num_tokens, top_k = ids_TK.shape
    ids = ids_TK.long()
    dev_TK = device_of_expert_E.to(device=device, dtype=torch.long)[ids]
    pairs_TD = torch.zeros(num_tokens, num_devices, dtype=torch.long, device=device)
    pairs_TD.scatter_add_(1, dev_TK, torch.ones_like(dev_TK))        # integer adds: exact
    hit_TD = pairs_TD > 0
    # Slot of pair (t, j) in its row: the token's earlier pairs on the same device.
    rank_TK = ((dev_TK[:, :, None] == dev_TK[:, None, :]) & _earlier_slots(top_k, device)).sum(2)
    most_pairs = pairs_TD.max() if pairs_TD.numel() else pairs_TD.new_zeros(())
    counts_D3 = torch.stack([hit_TD.sum(0), pairs_TD.sum(0), most_pairs.expand(num_devices)], dim=1)
    return DedupCounts(
        dev_TK=dev_TK,
        code_TK=local_id_of_expert_E.to(device=device, dtype=torch.long)[ids],
        rank_TK=rank_TK,
        hit_TD=hit_TD,
        counts_D3=counts_D3,
        devices_per_token_T=hit_TD.sum(1),
    )


def finish_dedup_plan(
    counts: DedupCounts, rows_per_device: list[int], pairs_per_device: list[int], slots: int
) -> DispatchPlan:
    """The host half of the layer's dedup plan, given the counts read back (no further sync).

    Row of (t, d) = first row of device d + number of earlier tokens with a row for d. The plan's
    pair fields are in (token, slot) order (`pair_slot_P` = arange), not in send order: consumers
    index rows and slots through `pair_row_P` / `pair_rank_P`.
    """
    hit_TD = counts.hit_TD
    num_tokens, num_devices = hit_TD.shape
    device = hit_TD.device
    num_rows = sum(rows_per_device)
    rows_D = counts.counts_D3[:, 0]
    # the running count of hits per device, scanned token-innermost (a [T, D] scan along T is
    # torch's outer-dimension kernel: one thread per device column)
    before_TD = hit_TD.t().contiguous().cumsum(1).t() + (rows_D.cumsum(0) - rows_D - 1)   # row index where hit
    brim0_TD = torch.where(hit_TD, before_TD, -1)
    # Each row's token: scatter t into its rows; rows of (t, d) without a hit go to a spare slot.
    token_TD = torch.arange(num_tokens, device=device)[:, None].expand(num_tokens, num_devices)
    send_token_S = torch.empty(num_rows + 1, dtype=torch.long, device=device).scatter_(
        0, torch.where(hit_TD, before_TD, num_rows).reshape(-1), token_TD.reshape(-1)
    )[:num_rows]
    rank_TK = counts.rank_TK
    return DispatchPlan(
        mode="dedup",
        num_devices=num_devices,
        send_token_S=send_token_S,
        pair_code_P=(2 * counts.code_TK + (rank_TK == 0)).to(torch.int32).reshape(-1),
        pair_slot_P=torch.arange(rank_TK.numel(), device=device),
        brim0_TJ=brim0_TD,
        devices_per_token_T=counts.devices_per_token_T,
        rows_per_device=rows_per_device,
        pairs_per_device=pairs_per_device,
        pair_row_P=brim0_TD.gather(1, counts.dev_TK).reshape(-1),
        pair_rank_P=rank_TK.reshape(-1),
        slots=max(slots, 1),
        pairs_in_token_order=True,
    )


def static_slots(device_of_expert_E: torch.Tensor, num_devices: int, top_k: int) -> int:
    """Metadata slots of a static plan: the most of a token's k experts one device can hold."""
    placement = device_of_expert_E.detach().cpu().long()
    most_here = int(torch.bincount(placement, minlength=num_devices).max()) if placement.numel() else 0
    return max(min(top_k, most_here), 1)


def check_static_capacity(capacity: int, num_tokens: int) -> None:
    """A static-shape call needs room for every token of this rank on each device."""
    if capacity < num_tokens:
        raise ValueError(f"static_capacity: {capacity} rows per device < {num_tokens} tokens on this rank")


def static_plan(
    ids_TK: torch.Tensor,
    device_of_expert_E: torch.Tensor,
    num_devices: int,
    local_id_of_expert_E: torch.Tensor,
    capacity: int,
    slots: int,
) -> DispatchPlan:
    """The static-shape dedup plan (module docstring): row d*capacity + t carries token t's pairs
    on device d; no sort and no host sync. `slots` ≥ the most experts of one token on one device
    (`static_slots`); every rank of the group must use the same `capacity` and `slots`."""
    if ids_TK.dim() != 2:
        raise ValueError(f"ids_TK: expected [T, k], got shape {tuple(ids_TK.shape)}")
    num_tokens, top_k = ids_TK.shape
    check_static_capacity(capacity, num_tokens)
    device = ids_TK.device
    placement = device_of_expert_E.to(device=device, dtype=torch.long)
    local_id = local_id_of_expert_E.to(device=device, dtype=torch.long)
    ids_flat = ids_TK.reshape(-1).long()
    dev_TK = placement[ids_flat].view(num_tokens, top_k)
    one_hot_TKD = torch.nn.functional.one_hot(dev_TK, num_devices)
    # Slot of each pair within its (token, device) row: earlier pairs of the token on that device.
    rank_TK = (one_hot_TKD.cumsum(1) - 1).gather(2, dev_TK[..., None]).squeeze(2)
    hit_TD = one_hot_TKD.amax(1) > 0 if top_k else torch.zeros(num_tokens, num_devices, dtype=torch.bool, device=device)
    token_T = torch.arange(num_tokens, device=device)
    row_TD = torch.arange(num_devices, device=device)[None, :] * capacity + token_T[:, None]
    return DispatchPlan(
        mode="dedup",
        num_devices=num_devices,
        send_token_S=token_T,
        pair_code_P=(2 * local_id[ids_flat]).to(torch.int32),
        pair_slot_P=torch.arange(ids_flat.numel(), device=device),
        brim0_TJ=torch.where(hit_TD, row_TD, -1),
        devices_per_token_T=hit_TD.sum(1),
        rows_per_device=[capacity] * num_devices,
        pairs_per_device=[],
        pair_row_P=(dev_TK * capacity + token_T[:, None]).reshape(-1),
        pair_rank_P=rank_TK.reshape(-1),
        slots=max(slots, 1),
        capacity=capacity,
        pairs_in_token_order=True,
    )


def build_plan(
    ids_TK: torch.Tensor,
    device_of_expert_E: torch.Tensor,
    num_devices: int,
    local_id_of_expert_E: torch.Tensor,
    mode: str = "dedup",
) -> DispatchPlan:
    """Plan the dispatch of T tokens routed to `ids_TK` (global expert ids) on the tensors' device."""
    counts = count_plan(ids_TK, device_of_expert_E, num_devices, local_id_of_expert_E, mode)
    # The one host sync: split sizes of the all-to-all (and the size of the send buffer).
    rows_per_device, pairs_per_device, most_pairs = counts.counts_D3.t().tolist()
    return finish_plan(counts, rows_per_device, pairs_per_device, max(most_pairs, default=1))


def build_pairs(
    recv_code_P: torch.Tensor,
    recv_gate_P: torch.Tensor,
    experts_per_rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BRIM_1 on the expert rank: (pair_row_M, pair_gate_M, expert_offsets) from the pair stream.

    The received pairs are in row order; a stable sort by local expert groups them by expert and
    keeps each expert's pairs in row order. `pair_gate_M` stays differentiable w.r.t. `recv_gate_P`.
    """
    if recv_code_P.dim() != 1 or recv_gate_P.shape != recv_code_P.shape:
        raise ValueError(
            f"recv_code_P/recv_gate_P: expected two 1-D tensors of one length, got "
            f"{tuple(recv_code_P.shape)} and {tuple(recv_gate_P.shape)}"
        )
    code = recv_code_P.long()
    row_P = torch.cumsum(code & 1, 0) - 1
    expert_P = code >> 1
    expert_M, order_M = torch.sort(narrow_key(expert_P, experts_per_rank), stable=True)
    expert_offsets = torch.searchsorted(
        expert_M, torch.arange(experts_per_rank + 1, device=code.device, dtype=expert_M.dtype)
    )
    return row_P[order_M], recv_gate_P[order_M], expert_offsets


def build_pairs_from_slots(
    code_RK: torch.Tensor,
    num_pairs: int | None,
    experts_per_rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """BRIM_1 from packed rows: (pair_flat_M, pair_row_M, expert_offsets, pair_pos_RK).

    `code_RK` int [R, K]: the local expert of each row's slots (−1 = empty), `num_pairs` = the
    number of filled slots (known on the host from the split sizes), or None (static shapes: every
    slot becomes a pair, the empty ones last, past `expert_offsets[-1]`). Pairs are grouped by expert
    (stable: row-major within an expert). `pair_flat_M` = r*K + slot of each pair (gather the
    gates with it), `pair_pos_RK` = each slot's position in expert order (−1 = empty): the table
    that reduces the pairs of every row without sorting by row. No host sync.
    """
    if code_RK.dim() != 2:
        raise ValueError(f"code_RK: expected [R, K], got shape {tuple(code_RK.shape)}")
    device = code_RK.device
    num_rows, slots = code_RK.shape
    code_flat = code_RK.reshape(-1).long()
    key = torch.where(code_flat >= 0, code_flat, experts_per_rank)      # empty slots sort last
    key_sorted, order = torch.sort(narrow_key(key, experts_per_rank), stable=True)
    padded = num_pairs is None
    num_pairs = order.numel() if padded else num_pairs
    pair_flat_M = order[:num_pairs]
    expert_offsets = torch.searchsorted(
        key_sorted[:num_pairs], torch.arange(experts_per_rank + 1, device=device, dtype=key_sorted.dtype)
    )
    pair_pos_RK = torch.full((num_rows * slots,), -1, dtype=torch.long, device=device)
    pair_pos_RK[pair_flat_M] = torch.arange(num_pairs, device=device)
    if padded:
        pair_pos_RK = torch.where(code_flat >= 0, pair_pos_RK, -1)
    return pair_flat_M, pair_flat_M // max(slots, 1), expert_offsets, pair_pos_RK.view(num_rows, slots)
