"""The wire format of a dispatch: packed rows, and the plan that says which rows go where.

Each sent row is one token's hidden vector (padded to 4 bytes) followed by a tail of `slots`
metadata entries, one per (token, local expert) pair the row carries: the local expert id (int32,
-1 = empty slot) and the gate weight (fp32), 8 bytes a pair. Rows start `ROW_ALIGN_BYTES`-aligned
so the kernels' row loads stay 16-byte vectors. `slots` is k in dedup mode (a row carries all of a
token's experts on one device) and 1 in per_expert mode. The return trip carries the hidden vector
only. The EP runtime (`occult.ep`), the dispatch kernels and the scale simulator all size rows
with `packed_row_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

META_BYTES_PER_PAIR = 8  # int32 code + fp32 gate
ROW_ALIGN_BYTES = 64     # packed rows start 64-byte aligned: the kernels' row loads stay 16-byte vectors


def packed_row_layout(hidden: int, elem_bytes: int, slots: int) -> tuple[int, int]:
    """(bytes of the hidden part, padded to 4; bytes of a packed row, padded to ROW_ALIGN_BYTES)."""
    hidden_bytes = -(-hidden * elem_bytes // 4) * 4
    row_bytes = hidden_bytes + META_BYTES_PER_PAIR * slots
    return hidden_bytes, -(-row_bytes // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES


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
    pair_row_P: torch.Tensor | None = None   # int64 [P] row of each pair in the send buffer
    pair_rank_P: torch.Tensor | None = None  # int64 [P] the pair's slot within its row (< slots)
    slots: int = 1                   # metadata slots per packed row (max pairs per row)
    capacity: int | None = None      # static plans: rows per destination (row d*C + t = token t)
    pairs_in_token_order: bool = False  # pair_slot_P is arange(T*k): pair p is (t, j) = divmod(p, k)

    @property
    def num_rows(self) -> int:
        return sum(self.rows_per_device)
