"""The layout every grouped GEMM shares: pairs sorted by expert, `expert_offsets` [E+1] bounding
each expert's pairs (see `reference.py`). Its argument checks, the tile schedule over it (on the
device: each program finds its expert and first pair without a host sync) and the store of
per-pair rows. Used by `grouped_swiglu`, `grouped_swiglu_backward` and `grouped_down_reduce`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from .combine import cdiv, interpreting


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------


def check_grouped_args(op: str, pair_row_M: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor,
                       weight_name: str, device: torch.device) -> None:
    """Shape/dtype/device checks shared by the grouped ops; raises ValueError naming the field."""
    if pair_row_M.dim() != 1 or pair_row_M.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: pair_row_M must be a 1-D int tensor, got {tuple(pair_row_M.shape)} {pair_row_M.dtype}")
    if expert_offsets.dim() != 1 or expert_offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{op}: expert_offsets must be a 1-D int tensor, got {tuple(expert_offsets.shape)} {expert_offsets.dtype}"
        )
    if weight.dim() != 3:
        raise ValueError(f"{op}: {weight_name} must be 3-D, got shape {tuple(weight.shape)}")
    if expert_offsets.shape[0] != weight.shape[0] + 1:
        raise ValueError(
            f"{op}: expert_offsets has {expert_offsets.shape[0]} entries, expected E+1 = {weight.shape[0] + 1} "
            f"for {weight_name} of {weight.shape[0]} experts"
        )
    for name, tensor in (("pair_row_M", pair_row_M), ("expert_offsets", expert_offsets), (weight_name, weight)):
        if tensor.device != device:
            raise ValueError(f"{op}: {name} is on {tensor.device}, expected {device}")


def check_swiglu_args(x_RD: torch.Tensor, pair_row_M: torch.Tensor, expert_offsets: torch.Tensor,
                      w_gate_up_E2FD: torch.Tensor) -> None:
    """The checks of `grouped_swiglu`'s forward and backward launchers: x 2-D fp32/fp16/bf16,
    W [E, 2F, D] in x's dtype, then `check_grouped_args`."""
    op = "grouped_swiglu"
    if x_RD.dim() != 2 or x_RD.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{op}: x_RD must be a 2-D fp32/fp16/bf16 tensor, got {tuple(x_RD.shape)} {x_RD.dtype}")
    check_grouped_args(op, pair_row_M, expert_offsets, w_gate_up_E2FD, "w_gate_up_E2FD", x_RD.device)
    if w_gate_up_E2FD.shape[1] % 2 != 0 or w_gate_up_E2FD.shape[2] != x_RD.shape[1]:
        raise ValueError(
            f"{op}: w_gate_up_E2FD must be [E, 2F, D={x_RD.shape[1]}], got {tuple(w_gate_up_E2FD.shape)}"
        )
    if w_gate_up_E2FD.dtype != x_RD.dtype:
        raise ValueError(f"{op}: w_gate_up_E2FD is {w_gate_up_E2FD.dtype} but x_RD is {x_RD.dtype}")


# ----------------------------------------------------------------------------------------------
# Tile schedule (device side)
# ----------------------------------------------------------------------------------------------


@triton.jit
def expert_tile_table(offsets_ptr, num_experts, BLOCK_M: tl.constexpr, EXPERTS_P2: tl.constexpr):
    """Per expert lane: (first pair, end pair, first M-tile, end M-tile) in the tile order (experts
    in order, ceil(count / BLOCK_M) tiles each); lanes past num_experts own nothing. The number of
    M-tiles is `tl.max` of the last."""
    e_idx = tl.arange(0, EXPERTS_P2)
    is_expert = e_idx < num_experts
    lo = tl.load(offsets_ptr + e_idx, mask=is_expert, other=0)
    hi = tl.load(offsets_ptr + e_idx + 1, mask=is_expert, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, axis=0)
    return lo, hi, tiles_end - tiles, tiles_end


@triton.jit
def locate_tile(pid_m, lo, hi, tiles_start, tiles_end, BLOCK_M: tl.constexpr, EXPERTS_P2: tl.constexpr):
    """(expert, first pair, end pair) of M-tile `pid_m` from `expert_tile_table`; expert ≥ the
    number of experts means past the last tile."""
    expert = tl.sum((tiles_end <= pid_m).to(tl.int32), axis=0)
    mine = tl.arange(0, EXPERTS_P2) == expert
    start = tl.sum(tl.where(mine, lo + (pid_m - tiles_start) * BLOCK_M, 0), axis=0)
    end = tl.sum(tl.where(mine, hi, 0), axis=0)
    return expert, start, end


@triton.jit
def persistent_schedule(offsets_ptr, num_experts, BLOCK_M: tl.constexpr, EXPERTS_P2: tl.constexpr):
    """The tile table of a persistent program (`expert_tile_table`) and its exact number of M-tiles."""
    lo, hi, tiles_start, tiles_end = expert_tile_table(offsets_ptr, num_experts, BLOCK_M, EXPERTS_P2)
    return lo, hi, tiles_start, tiles_end, tl.max(tiles_end, axis=0).to(tl.int32)


@triton.jit
def tile_at(tile, lo, hi, tiles_start, tiles_end, num_pid_m, num_pid_n, GROUP_SIZE: tl.constexpr,
            BLOCK_M: tl.constexpr, EXPERTS_P2: tl.constexpr):
    """(expert, first pair, end pair, N-tile) of flat output tile `tile` in the swizzled order."""
    pid_m, pid_n = swizzle_tiles(tile, num_pid_m, num_pid_n, GROUP_SIZE)
    expert, start, end = locate_tile(pid_m, lo, hi, tiles_start, tiles_end, BLOCK_M, EXPERTS_P2)
    return expert, start, end, pid_n


@triton.jit
def expert_tile(pid_m, offsets_ptr, num_experts, BLOCK_M: tl.constexpr, EXPERTS_P2: tl.constexpr):
    """(expert, first pair, end pair) of M-tile `pid_m`; expert ≥ num_experts means idle."""
    lo, hi, tiles_start, tiles_end = expert_tile_table(offsets_ptr, num_experts, BLOCK_M, EXPERTS_P2)
    return locate_tile(pid_m, lo, hi, tiles_start, tiles_end, BLOCK_M, EXPERTS_P2)


@triton.jit
def swizzle_tiles(pid, num_pid_m, num_pid_n, GROUP_SIZE: tl.constexpr):
    """Map a flat program id to (pid_m, pid_n), walking GROUP_SIZE M-tiles per N column."""
    per_group = GROUP_SIZE * num_pid_n
    first_m = (pid // per_group) * GROUP_SIZE
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_SIZE)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


def m_tile_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of Σ_e ceil(count_e / block_m), known without reading the counts."""
    return cdiv(num_pairs, block_m) + num_experts


def gemm_programs(tile_bound: int, meta: Mapping[str, int], device: torch.device) -> int:
    """Programs to launch over at most `tile_bound` output tiles: one per tile, or with a
    `PERSISTENT` config one per SM (3 in the interpreter, so that its programs loop over tiles)."""
    if not meta.get("PERSISTENT"):
        return tile_bound
    return max(1, min(tile_bound, _multiprocessors(device)))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if interpreting() or device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def store_pair_rows(acc, out_ptr, row_ptr, start, end, pid_n, N, stride_om, stride_on,
                    SCATTER_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile of per-pair rows into the pairs' rows of `out` (or, one pair per row, the rows themselves)."""
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SCATTER_ROWS:
        out_m = tl.load(row_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        out_m = offs_m.to(tl.int64)
    tl.store(out_ptr + out_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & (offs_n < N)[None, :])
