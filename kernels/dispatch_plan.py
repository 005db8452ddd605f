"""The exact dedup dispatch plan and the packed send buffer in two Triton launches.

Plain-torch reference: `occult.ep.plan.count_dedup_plan` + `finish_dedup_plan` and
`occult.ep.layer._pack_rows` (≈40 small launches). Same outputs, byte for byte:

  count (before the layer's one host sync)   `dedup_plan_count`
      per block of BLOCK_T tokens: rows [D] (tokens with a pair on device d), pairs [D], the most
      pairs of one (token, device); then a cumulative sum over blocks and counts_D3 [D, 3]
      (rows, pairs, most) — the tensor the layer exchanges and reads back.
  plan + pack (after it)                     `dedup_plan_pack`
      row of (t, d) = first row of device d (an exclusive cumsum of the row totals) + rows of d
      in earlier blocks + earlier tokens of the block with a row for d (an in-block cumsum).
      Writes BRIM_0 [T, D], the token of each sent row, C_T, the pair fields of the plan in
      (token, slot) order (row, slot in the row, 2·local expert + starts_row, t·k + j), and the
      packed rows: hidden vector | `slots` int32 local expert ids (−1 = empty) | `slots` fp32
      gates | zeros up to the 64-byte row end. The program grid is (token block, hidden chunk);
      the chunk-0 programs also write the plan and the metadata.

No atomics and no sort: every output element is written by exactly one program, so the result is
deterministic. Integer ids and placements of any int dtype; x of any float dtype and strides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from occult.kernels.wire_format import DispatchPlan, packed_row_layout

from .combine import cdiv, interpreting, next_pow2
from .launch import launch

MAX_PAIR_TILE = 8192          # BLOCK_T · K_P2 · max(D_P2, K_P2) elements of the 3-D compares


@triton.jit
def _pair_devices(ids_ptr, place_ptr, offs_t, mask_t, K, stride_it, stride_ik, K_P2: tl.constexpr):
    """(ids [BT, KP] int64, dev [BT, KP] int64 with −1 where masked, mask [BT, KP])."""
    offs_k = tl.arange(0, K_P2)
    mask = mask_t[:, None] & (offs_k < K)[None, :]
    ids = tl.load(ids_ptr + offs_t[:, None] * stride_it + offs_k[None, :] * stride_ik, mask=mask, other=0).to(tl.int64)
    dev = tl.load(place_ptr + ids, mask=mask, other=-1).to(tl.int64)
    return ids, dev, mask


@triton.jit
def _plan_count_kernel(
    ids_ptr, place_ptr, rows_ptr, pairs_ptr, most_ptr,
    T, K, D, stride_it, stride_ik,
    BLOCK_T: tl.constexpr, K_P2: tl.constexpr, D_P2: tl.constexpr,
):
    block = tl.program_id(0)
    offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    _, dev, _ = _pair_devices(ids_ptr, place_ptr, offs_t, offs_t < T, K, stride_it, stride_ik, K_P2)
    offs_d = tl.arange(0, D_P2)
    pairs_td = tl.sum((dev[:, :, None] == offs_d[None, None, :]).to(tl.int64), axis=1)     # [BT, DP]
    rows_d = tl.sum((pairs_td > 0).to(tl.int64), axis=0)
    mask_d = offs_d < D
    tl.store(rows_ptr + offs_d * tl.num_programs(0) + block, rows_d, mask=mask_d)      # [D, blocks]
    tl.store(pairs_ptr + block * D + offs_d, tl.sum(pairs_td, axis=0), mask=mask_d)
    tl.store(most_ptr + block, tl.max(tl.max(pairs_td, axis=1), axis=0))


@triton.jit
def _plan_pack_kernel(
    ids_ptr, place_ptr, local_ptr, gate_ptr, x_ptr, cum_ptr,
    brim_ptr, token_ptr, ct_ptr, prow_ptr, prank_ptr, pcode_ptr, pslot_ptr,
    xbuf_ptr, mbuf_ptr, gbuf_ptr,
    T, K, D, H, num_blocks, slots, meta_word0, row_words, row_elems,
    stride_it, stride_ik, stride_gt, stride_gk, stride_xt, stride_xh, stride_bt, stride_bd,
    BLOCK_T: tl.constexpr, K_P2: tl.constexpr, D_P2: tl.constexpr, BLOCK_H: tl.constexpr,
):
    block = tl.program_id(0)
    chunk = tl.program_id(1)
    offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    ids, dev, mask_tk = _pair_devices(ids_ptr, place_ptr, offs_t, mask_t, K, stride_it, stride_ik, K_P2)
    offs_d = tl.arange(0, D_P2)
    mask_d = offs_d < D
    onehot = dev[:, :, None] == offs_d[None, None, :]                                      # [BT, KP, DP]
    hit = (tl.sum(onehot.to(tl.int64), axis=1) > 0).to(tl.int64)                          # [BT, DP]
    # Row of (t, d): device d's first row + its rows in earlier blocks + earlier tokens here (one 1-D
    # scan per device: triton 3.6 miscompiles a 2-D scan of this layout).
    totals = tl.load(cum_ptr + offs_d * num_blocks + (num_blocks - 1), mask=mask_d, other=0)
    after_first = (offs_d * 0 + block) > 0                                               # [DP]
    earlier = tl.load(cum_ptr + offs_d * num_blocks + (block - 1), mask=mask_d & after_first, other=0)
    base_d = tl.cumsum(totals, axis=0) - totals + earlier                                 # [DP]
    sent = (hit > 0) & mask_t[:, None] & mask_d[None, :]
    offs_h = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_h[None, :] * stride_xh,
                mask=mask_t[:, None] & mask_h[None, :], other=0.0)
    row_td = tl.zeros((BLOCK_T, D_P2), dtype=tl.int64)
    for d in range(D):
        column = offs_d[None, :] == d
        hit_d = tl.sum(tl.where(column, hit, 0), axis=1).to(tl.int32)                     # [BT]
        first = tl.sum(tl.where(offs_d == d, base_d, 0), axis=0)
        row = first + (tl.cumsum(hit_d, axis=0) - hit_d).to(tl.int64)                    # [BT]
        row_td = tl.where(column, row[:, None], row_td)
        # this chunk of the hidden vectors of the tokens with a row for d
        to_d = (hit_d > 0) & mask_t
        tl.store(xbuf_ptr + row[:, None] * row_elems + offs_h[None, :], x, mask=to_d[:, None] & mask_h[None, :])
        if chunk == 0:
            tl.store(token_ptr + row, offs_t.to(tl.int64), mask=to_d)

    if chunk == 0:
        tl.store(brim_ptr + offs_t[:, None] * stride_bt + offs_d[None, :] * stride_bd,
                 tl.where(sent, row_td, -1), mask=mask_t[:, None] & mask_d[None, :])
        tl.store(ct_ptr + offs_t, tl.sum(tl.where(sent, 1, 0), axis=1).to(tl.int64), mask=mask_t)
        # Pairs in (token, slot) order: slot in the row = the token's earlier pairs on that device.
        offs_k = tl.arange(0, K_P2)
        earlier_k = offs_k[None, None, :] < offs_k[None, :, None]                          # [1, KP, KP]
        same = (dev[:, :, None] == dev[:, None, :]) & earlier_k & mask_tk[:, None, :]
        rank = tl.sum(same.to(tl.int64), axis=2)                                           # [BT, KP]
        pair_row = tl.sum(tl.where(onehot, row_td[:, None, :], 0), axis=2)                 # [BT, KP]
        local = tl.load(local_ptr + ids, mask=mask_tk, other=0).to(tl.int64)
        gate = tl.load(gate_ptr + offs_t[:, None] * stride_gt + offs_k[None, :] * stride_gk,
                       mask=mask_tk, other=0.0).to(tl.float32)
        flat = offs_t.to(tl.int64)[:, None] * K + offs_k[None, :]
        tl.store(prow_ptr + flat, pair_row, mask=mask_tk)
        tl.store(prank_ptr + flat, rank, mask=mask_tk)
        tl.store(pcode_ptr + flat, (2 * local + (rank == 0).to(tl.int64)).to(tl.int32), mask=mask_tk)
        tl.store(pslot_ptr + flat, flat, mask=mask_tk)
        # Metadata of each sent row: slot s holds the pair whose rank is s (−1 / 0.0 when none).
        meta_row = row_td * row_words + meta_word0
        for s in range(slots):
            is_s = onehot & (rank == s)[:, :, None] & mask_tk[:, :, None]
            has = tl.sum(is_s.to(tl.int32), axis=1) > 0
            code = tl.sum(tl.where(is_s, local[:, :, None], 0), axis=1)
            gate_s = tl.sum(tl.where(is_s, gate[:, :, None], 0.0), axis=1)
            tl.store(mbuf_ptr + meta_row + s, tl.where(has, code, -1).to(tl.int32), mask=sent)
            tl.store(gbuf_ptr + meta_row + slots + s, gate_s, mask=sent)
        for word in range(meta_word0 + 2 * slots, row_words):                             # alignment padding
            tl.store(mbuf_ptr + row_td * row_words + word, tl.zeros_like(row_td).to(tl.int32), mask=sent)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _pow2(value: int) -> int:
    return max(2, next_pow2(max(value, 1)))


def block_tokens(top_k: int, num_devices: int) -> int:
    """Tokens per program: the [T, k, max(D, k)] compares stay within MAX_PAIR_TILE elements."""
    per_token = _pow2(top_k) * max(_pow2(num_devices), _pow2(top_k))
    return max(16, min(128, next_pow2(max(MAX_PAIR_TILE // per_token, 1))))


@dataclass(frozen=True)
class FusedCounts:
    """What `dedup_plan_count` leaves for `dedup_plan_pack` (same role as `DedupCounts`)."""

    counts_D3: torch.Tensor          # int64 [D, 3] rows, pairs, most pairs of a row (every row)
    cum_rows_DB: torch.Tensor        # int64 [D, blocks] rows per device through each token block
    block_t: int


def _check(ids_TK: torch.Tensor, device_of_expert_E: torch.Tensor, num_devices: int) -> None:
    if ids_TK.dim() != 2 or ids_TK.is_floating_point():
        raise ValueError(f"dedup_plan: ids_TK must be an integer [T, k] tensor, got {ids_TK.dtype} {tuple(ids_TK.shape)}")
    if device_of_expert_E.device != ids_TK.device:
        raise ValueError(f"dedup_plan: device_of_expert_E is on {device_of_expert_E.device}, ids_TK on {ids_TK.device}")
    if num_devices < 1:
        raise ValueError(f"dedup_plan: num_devices must be ≥ 1, got {num_devices}")


def dedup_plan_count(ids_TK: torch.Tensor, device_of_expert_E: torch.Tensor, num_devices: int) -> FusedCounts:
    """Per-device rows and pairs of the exact dedup plan, on the device, no sync (one kernel + 4 ops)."""
    _check(ids_TK, device_of_expert_E, num_devices)
    num_tokens, top_k = ids_TK.shape
    device = ids_TK.device
    block_t = block_tokens(top_k, num_devices)
    num_blocks = cdiv(num_tokens, block_t)
    if num_blocks == 0:
        zeros = torch.zeros(num_devices, 3, dtype=torch.long, device=device)
        return FusedCounts(zeros, torch.zeros(num_devices, 0, dtype=torch.long, device=device), block_t)
    rows = torch.empty(num_devices, num_blocks, dtype=torch.long, device=device)    # device-major
    pairs = torch.empty(num_blocks, num_devices, dtype=torch.long, device=device)   # block-major: summed
    most = torch.empty(num_blocks, dtype=torch.long, device=device)
    launch(_plan_count_kernel, (num_blocks,),
           (ids_TK, device_of_expert_E, rows, pairs, most, num_tokens, top_k, num_devices, *ids_TK.stride()),
           dict(BLOCK_T=block_t, K_P2=_pow2(top_k), D_P2=_pow2(num_devices)))
    cum_rows = rows.cumsum(1)       # innermost scan (torch's outer-dim scan is one thread per column)
    counts = torch.stack([cum_rows[:, -1], pairs.sum(0), most.max().expand(num_devices)], dim=1)
    return FusedCounts(counts, cum_rows, block_t)


def dedup_plan_pack(
    counts: FusedCounts,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    x_TD: torch.Tensor,
    device_of_expert_E: torch.Tensor,
    local_id_of_expert_E: torch.Tensor,
    rows_per_device: list[int],
    pairs_per_device: list[int],
    slots: int,
) -> tuple[DispatchPlan, torch.Tensor]:
    """(the plan, the packed send buffer uint8 [S, row bytes]) in one kernel, given the split sizes
    read on the host and the metadata slots per row every rank agreed on (≥ the most pairs of any
    row). The plan's pair fields are in (token, slot) order."""
    _check(ids_TK, device_of_expert_E, counts.counts_D3.shape[0])
    num_tokens, top_k = ids_TK.shape
    num_devices = counts.counts_D3.shape[0]
    num_rows = sum(rows_per_device)
    hidden = x_TD.shape[1]
    device = x_TD.device
    slots = max(slots, 1)
    hidden_bytes, row_bytes = packed_row_layout(hidden, x_TD.dtype.itemsize, slots)
    buffer = torch.empty(num_rows, row_bytes, dtype=torch.uint8, device=device)
    long = dict(dtype=torch.long, device=device)
    plan = DispatchPlan(
        mode="dedup",
        num_devices=num_devices,
        send_token_S=torch.empty(num_rows, **long),
        pair_code_P=torch.empty(num_tokens * top_k, dtype=torch.int32, device=device),
        pair_slot_P=torch.empty(num_tokens * top_k, **long),
        brim0_TJ=torch.empty(num_tokens, num_devices, **long),
        devices_per_token_T=torch.empty(num_tokens, **long),
        rows_per_device=rows_per_device,
        pairs_per_device=pairs_per_device,
        pair_row_P=torch.empty(num_tokens * top_k, **long),
        pair_rank_P=torch.empty(num_tokens * top_k, **long),
        slots=slots,
        pairs_in_token_order=True,
    )
    num_blocks = counts.cum_rows_DB.shape[1]
    if num_tokens == 0:
        return plan, buffer
    # 128 hidden columns × up to 128 tokens in 8 warps: 64 x elements a thread, no spill
    block_h = 32 if interpreting() else 128
    chunks = max(cdiv(hidden, block_h), 1)
    launch(_plan_pack_kernel, (num_blocks, chunks), (
        ids_TK, device_of_expert_E, local_id_of_expert_E, weights_TK, x_TD, counts.cum_rows_DB,
        plan.brim0_TJ, plan.send_token_S, plan.devices_per_token_T, plan.pair_row_P, plan.pair_rank_P,
        plan.pair_code_P, plan.pair_slot_P,
        buffer.view(x_TD.dtype), buffer.view(torch.int32), buffer.view(torch.float32),
        num_tokens, top_k, num_devices, hidden, num_blocks, slots, hidden_bytes // 4, row_bytes // 4,
        row_bytes // x_TD.element_size(),
        *ids_TK.stride(), *weights_TK.stride(), *x_TD.stride(), *plan.brim0_TJ.stride(),
    ), dict(BLOCK_T=counts.block_t, K_P2=_pow2(top_k), D_P2=_pow2(num_devices), BLOCK_H=block_h, num_warps=8))
    return plan, buffer


# ----------------------------------------------------------------------------------------------
# The expert side: BRIM_1 (pairs grouped by local expert) by a counting sort, no sort kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _slot_keys(code_ptr, num_slots, slots, num_experts, stride_cr, stride_cs, BLOCK_P: tl.constexpr):
    """This program's flat slots p = r·slots + s, their mask and bucket (the local expert, or
    num_experts when the slot is empty)."""
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < num_slots
    code = tl.load(code_ptr + (offs_p // slots) * stride_cr + (offs_p % slots) * stride_cs, mask=mask_p, other=-1)
    return offs_p, mask_p, tl.where(code >= 0, code, num_experts).to(tl.int64)


@triton.jit
def _group_count_kernel(
    code_ptr, counts_ptr, num_slots, slots, num_experts, stride_cr, stride_cs,
    BLOCK_P: tl.constexpr, BUCKETS_P2: tl.constexpr,
):
    offs_p, mask_p, key = _slot_keys(code_ptr, num_slots, slots, num_experts, stride_cr, stride_cs, BLOCK_P)
    block = tl.program_id(0)
    buckets = tl.arange(0, BUCKETS_P2)
    hits = (key[:, None] == buckets[None, :]) & mask_p[:, None]
    # bucket-major [buckets, blocks]: the host's running sum over blocks is then an innermost scan
    tl.store(counts_ptr + buckets * tl.num_programs(0) + block, tl.sum(hits.to(tl.int64), axis=0),
             mask=buckets <= num_experts)


@triton.jit
def _group_place_kernel(
    code_ptr, cum_ptr, start_ptr, flat_ptr, row_ptr, pos_ptr,
    num_slots, slots, num_experts, num_kept, stride_cr, stride_cs,
    BLOCK_P: tl.constexpr, BUCKETS_P2: tl.constexpr,
):
    offs_p, mask_p, key = _slot_keys(code_ptr, num_slots, slots, num_experts, stride_cr, stride_cs, BLOCK_P)
    block = tl.program_id(0)
    # Position = the bucket's start + its slots in earlier blocks + earlier slots of this block in it
    # (stable: flat order kept within a bucket). A [BLOCK_P, BLOCK_P] compare, no scan over slots.
    # The buckets' starts come from the last column of the running sums (every program scans the
    # few buckets itself; program 0 writes them out as the expert offsets).
    buckets = tl.arange(0, BUCKETS_P2)
    in_bucket = buckets <= num_experts
    blocks = tl.num_programs(0)
    totals = tl.load(cum_ptr + buckets * blocks + (blocks - 1), mask=in_bucket, other=0)
    start = tl.cumsum(totals, axis=0) - totals
    if block == 0:
        tl.store(start_ptr + buckets, start, mask=in_bucket)
    after_first = (buckets * 0 + block) > 0
    before = start + tl.load(cum_ptr + buckets * blocks + (block - 1), mask=in_bucket & after_first, other=0)
    base = tl.sum(tl.where(key[:, None] == buckets[None, :], before[None, :], 0), axis=1)
    lanes = tl.arange(0, BLOCK_P)
    same_before = (key[:, None] == key[None, :]) & (lanes[None, :] < lanes[:, None]) & mask_p[None, :]
    pos = base + tl.sum(same_before.to(tl.int64), axis=1)
    keep = mask_p & (pos < num_kept)
    flat = offs_p.to(tl.int64)
    tl.store(flat_ptr + pos, flat, mask=keep)
    tl.store(row_ptr + pos, flat // slots, mask=keep)
    tl.store(pos_ptr + flat, tl.where(key < num_experts, pos, -1), mask=mask_p)


def group_pairs_by_expert(
    code_RK: torch.Tensor, num_pairs: int | None, experts_per_rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """BRIM_1 from the received rows' slot codes: (pair_flat_M, pair_row_M, expert_offsets,
    pair_pos_RK), the outputs of `occult.ep.plan.build_pairs_from_slots` (its plain-torch
    reference), by a counting sort in two launches and one torch scan instead of a sort."""
    if code_RK.dim() != 2 or code_RK.is_floating_point():
        raise ValueError(f"group_pairs_by_expert: code_RK must be an integer [R, K] tensor, got "
                         f"{code_RK.dtype} {tuple(code_RK.shape)}")
    device = code_RK.device
    num_rows, slots = code_RK.shape
    num_slots = num_rows * slots
    kept = num_slots if num_pairs is None else num_pairs
    long = dict(dtype=torch.long, device=device)
    pair_flat_M = torch.empty(kept, **long)
    pair_row_M = torch.empty(kept, **long)
    pair_pos_RK = torch.empty(num_rows, slots, **long)
    block_p = 16 if interpreting() else 64
    num_blocks = cdiv(num_slots, block_p)
    if num_blocks == 0:
        return pair_flat_M, pair_row_M, torch.zeros(experts_per_rank + 1, **long), pair_pos_RK
    buckets_p2 = _pow2(experts_per_rank + 1)
    counts = torch.empty(experts_per_rank + 1, num_blocks, **long)     # [bucket, block]
    launch(_group_count_kernel, (num_blocks,), (code_RK, counts, num_slots, slots, experts_per_rank, *code_RK.stride()),
           dict(BLOCK_P=block_p, BUCKETS_P2=buckets_p2))
    # Scan along the innermost dimension: torch's outer-dimension scan runs one thread per column
    # over all blocks, ~0.4 ms for [4096 blocks, 33 buckets] on an H200 (ep_v6 profile).
    cum = counts.cumsum(1)
    start = torch.empty(experts_per_rank + 1, **long)          # first position of each bucket (kernel)
    launch(_group_place_kernel, (num_blocks,),
           (code_RK, cum, start, pair_flat_M, pair_row_M, pair_pos_RK, num_slots, slots, experts_per_rank, kept,
            *code_RK.stride()), dict(BLOCK_P=block_p, BUCKETS_P2=buckets_p2))
    return pair_flat_M, pair_row_M, start, pair_pos_RK
