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

Host synchronisation: `build_plan` makes exactly one (`.tolist()` of the per-device row and
pair counts, which the all-to-all needs as split sizes). `build_pairs` makes none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("dedup", "per_expert")
META_BYTES_PER_PAIR = 8  # int32 code + fp32 gate


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


@dataclass(frozen=True)
class DispatchPlan:
    """Everything the source rank needs to send its tokens and combine what comes back.

    S = rows sent (all destinations), P = T*k pairs sent, J = D (dedup) or k (per_expert).
    """

    mode: str
    num_devices: int
    send_token_S: torch.Tensor       # int64 [S] token of each sent row, grouped by destination
    pair_code_P: torch.Tensor        # int32 [P] 2 * local expert + starts_row, send order
    pair_slot_P: torch.Tensor        # int64 [P] index t*k + j of the pair's gate in weights_TK
    brim0_TJ: torch.Tensor           # int64 [T, J] row of token t's j-th partial, or -1
    devices_per_token_T: torch.Tensor  # int64 [T] C_T
    rows_per_device: list[int]       # host: rows sent to each device (all-to-all split sizes)
    pairs_per_device: list[int]      # host: pairs sent to each device

    @property
    def num_rows(self) -> int:
        return sum(self.rows_per_device)


def build_plan(
    ids_TK: torch.Tensor,
    device_of_expert_E: torch.Tensor,
    num_devices: int,
    local_id_of_expert_E: torch.Tensor,
    mode: str = "dedup",
) -> DispatchPlan:
    """Plan the dispatch of T tokens routed to `ids_TK` (global expert ids) on the tensors' device."""
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
    _, pair_slot_P = torch.sort(dev_flat, stable=True)
    dev_P = dev_flat[pair_slot_P]
    token_P = pair_slot_P // top_k
    num_pairs = pair_slot_P.numel()

    hit_TD = torch.zeros(num_tokens, num_devices, dtype=torch.bool, device=device)
    hit_TD.scatter_(1, dev_flat.view(num_tokens, top_k), True)
    devices_per_token_T = hit_TD.sum(1)

    # A pair starts a new row unless (dedup) it shares token and device with the previous pair.
    starts_P = torch.ones(num_pairs, dtype=torch.bool, device=device)
    if mode == "dedup" and num_pairs > 1:
        starts_P[1:] = (token_P[1:] != token_P[:-1]) | (dev_P[1:] != dev_P[:-1])
    row_P = torch.cumsum(starts_P.long(), 0) - 1

    rows_D = torch.zeros(num_devices, dtype=torch.long, device=device).index_add_(0, dev_P, starts_P.long())
    pairs_D = torch.zeros(num_devices, dtype=torch.long, device=device).index_add_(
        0, dev_P, torch.ones_like(dev_P)
    )
    # The one host sync: split sizes of the all-to-all (and the size of the send buffer).
    rows_per_device, pairs_per_device = torch.stack([rows_D, pairs_D]).tolist()
    num_rows = sum(rows_per_device)

    # Every pair of a row names the same token: duplicate writes store equal values.
    send_token_S = torch.zeros(num_rows, dtype=torch.long, device=device).index_put_((row_P,), token_P)
    if mode == "dedup":
        brim0_TJ = torch.full((num_tokens, num_devices), -1, dtype=torch.long, device=device)
        brim0_TJ.index_put_((token_P, dev_P), row_P)
    else:
        brim0_TJ = torch.empty(num_tokens * top_k, dtype=torch.long, device=device)
        brim0_TJ[pair_slot_P] = row_P
        brim0_TJ = brim0_TJ.view(num_tokens, top_k)
    pair_code_P = (2 * local_id[ids_flat[pair_slot_P]] + starts_P.long()).to(torch.int32)
    return DispatchPlan(
        mode=mode,
        num_devices=num_devices,
        send_token_S=send_token_S,
        pair_code_P=pair_code_P,
        pair_slot_P=pair_slot_P,
        brim0_TJ=brim0_TJ,
        devices_per_token_T=devices_per_token_T,
        rows_per_device=rows_per_device,
        pairs_per_device=pairs_per_device,
    )


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
    expert_M, order_M = torch.sort(expert_P, stable=True)
    counts_E = torch.zeros(experts_per_rank, dtype=torch.long, device=code.device).index_add_(
        0, expert_M, torch.ones_like(expert_M)
    )
    expert_offsets = torch.cat([counts_E.new_zeros(1), torch.cumsum(counts_E, 0)])
    return row_P[order_M], recv_gate_P[order_M], expert_offsets
