"""Grouped down GEMM with the gate scaling fused in its epilogue, reduced into rows, in Triton.

Math (e = expert of pair m; fp32 accumulation):
  forward   y[r]   = Σ_{m : row[m] = r} gate[m] · (h[m] @ Wd[e]^T)
  backward  a[m]   = dy[row[m]] @ Wd[e]                 (one gathered GEMM gives both of:)
            dh[m]  = gate[m] · a[m]
            dgate[m] = ⟨a[m], h[m]⟩ = ⟨dy[row[m]], h[m] @ Wd[e]^T⟩   (expert-side gate gradient)
            dWd[e] = Σ_{m ∈ e} gate[m] · dy[row[m]]^T h[m]

Layout (see `reference.py`): `h_MF` [M, F] in expert order; `pair_row_M` int [M];
`pair_gate_M` [M] (any float dtype, e.g. fp32 gates with bf16 activations; dgate comes back in
the gate's dtype); `expert_offsets` int [E+1]; `w_down_EDF` [E, D, F]; `y_RD` [R, D] in h's dtype.

Design:
* Same tile schedule as `grouped_swiglu` (`grouped_layout.py`: device-side cumsum over per-expert
  tile counts, a fixed bound cdiv(M, BLOCK_M) + E of M-tiles, idle programs exit, swizzled program
  order); configs and operand paths from `gemm_configs.py`.
* Forward: the GEMM epilogue multiplies by gate[m] and writes each pair's row to an [M, D]
  buffer (`partial_dtype`: h's dtype for 16-bit activations — each pair's contribution rounded
  once, exactly as per-expert dispatch rounds each expert's returned row — fp32 otherwise); a
  segmented sum over the row→pairs CSR (`combine.segment_sum_rows`, or the row table) then adds
  the pairs of each row in fp32 in a fixed order and writes y in h's dtype. This deterministic two-step
  was chosen over fp32 atomics into an [R, D] buffer: results are bitwise reproducible run to run,
  re-running a kernel (the autotuner does) cannot double-count, no [R, D] fp32 buffer + cast pass
  is needed, and the interpreter has no bf16 atomics. Its price is M·D·2·(2 or 4) bytes of extra
  traffic (write + read of the pair rows), see docs/kernels.md.
* Backward dh/dgate: one gathered GEMM dy[row] @ Wd[e] per (M-tile, F-tile); the epilogue writes
  dh = gate·a and the partial dot ⟨a, h⟩ of its F block to a [F-tiles, M] fp32 buffer that is
  summed afterwards (deterministic; no atomics). dy is gathered inside the kernel.
* Backward dWd: one program per (expert, D block, F block) looping over the expert's pairs,
  gathering dy rows and scaling them by the gate in the prologue; an empty expert writes zeros.

Autotuned on a GPU (key: D, F); under TRITON_INTERPRET=1 one 16-wide config, chosen at launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .combine import (cdiv, check_row_table, direct_call_ok, eager_function, eager_function_ok, gather_sum_rows,
                      interpreting, next_pow2, row_csr, segment_sum_rows)
from .gemm_configs import (GROUP_M, SINGLE_ACC_CONFIGS, dot_precision, fixed_gemm_meta, gathered_operand_wanted,
                           kernel_name, launch_gemm, partial_dtype, use_tma)
from .grouped_layout import (check_grouped_args, expert_tile, gemm_programs, m_tile_bound, persistent_schedule,
                             store_pair_rows, swizzle_tiles, tile_at)
from .launch import launch


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _down_fwd_tile(
    h_ptr, w_ptr, h_desc, w_desc, expert, start, end, pid_n, D, F,
    stride_hm, stride_hf, stride_we, stride_wd, stride_wf,
    TMA: tl.constexpr, PRECISION: tl.constexpr, WARP_SPEC_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The accumulator [BLOCK_M, BLOCK_N] of one output tile (fp32)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        w_row = expert * D + pid_n * BLOCK_N
        for k0 in tl.range(0, F, BLOCK_K, warp_specialize=WARP_SPEC_K):
            acc = tl.dot(h_desc.load([start.to(tl.int32), k0]), w_desc.load([w_row, k0]).T, acc,
                         input_precision=PRECISION)
    else:
        offs_m = start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_k[None, :] * stride_hf
        b_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wd + offs_k[:, None] * stride_wf
        for k0 in range(0, F, BLOCK_K):
            mask_k = offs_k < F - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None] & (offs_n < D)[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_hf
            b_ptrs += BLOCK_K * stride_wf
    return acc


@triton.jit
def _down_fwd_store(
    acc, yp_ptr, gate_ptr, row_ptr, start, end, pid_n, D, stride_gm, stride_ym, stride_yd,
    SCATTER_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """gate · acc into the pairs' rows (or, one pair per row, the rows themselves)."""
    offs_m = start + tl.arange(0, BLOCK_M)
    gate = tl.load(gate_ptr + offs_m.to(tl.int64) * stride_gm, mask=offs_m < end, other=0.0).to(tl.float32)
    store_pair_rows(acc * gate[:, None], yp_ptr, row_ptr, start, end, pid_n, D, stride_ym, stride_yd, SCATTER_ROWS,
                    BLOCK_M, BLOCK_N)


@triton.jit
def _down_fwd_kernel(
    h_ptr, gate_ptr, offsets_ptr, w_ptr, yp_ptr, row_ptr,
    M, D, F, num_experts,
    stride_hm, stride_hf, stride_gm, stride_we, stride_wd, stride_wf, stride_ym, stride_yd,
    SCATTER_ROWS: tl.constexpr, TMA: tl.constexpr,
    PRECISION: tl.constexpr, GROUP_SIZE: tl.constexpr, EXPERTS_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WARP_SPEC: tl.constexpr = 0,
    PERSISTENT: tl.constexpr = False,
):
    # One output tile per program (a grid of the tile bound; idle programs do nothing), or
    # PERSISTENT: one program per SM walks tiles pid, pid + programs, ... in a loop whose tile and
    # K levels are flattened into one pipelined loop (the next tile's loads are issued while this
    # tile's epilogue runs). WARP_SPEC 1: producer/consumer warps on the K loop, 2: on the
    # flattened loop.
    num_pid_n = tl.cdiv(D, BLOCK_N)
    if TMA:
        # h [M, F] and Wd viewed as [E*D, F]: rows past the expert's pairs (or its D rows) belong
        # to the next expert and land in masked-out outputs; reads past the tensors are zeros.
        h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, F], strides=[stride_hm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_experts * D, F], strides=[stride_wd, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        h_desc = h_ptr         # unused
        w_desc = w_ptr
    if PERSISTENT:
        lo, hi, tiles_start, tiles_end, num_pid_m = persistent_schedule(offsets_ptr, num_experts, BLOCK_M, EXPERTS_P2)
        programs = tl.num_programs(0)
        # The epilogue finds its tile from its own counter, so the flattened loop's prefetch of
        # the next tile does not wait on this tile's index math.
        tile_out = tl.program_id(0) - programs
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, programs, flatten=True,
                             warp_specialize=WARP_SPEC == 2):
            expert, start, end, pid_n = tile_at(tile, lo, hi, tiles_start, tiles_end, num_pid_m, num_pid_n, GROUP_SIZE,
                                                BLOCK_M, EXPERTS_P2)
            acc = _down_fwd_tile(h_ptr, w_ptr, h_desc, w_desc, expert, start, end, pid_n, D, F,
                                 stride_hm, stride_hf, stride_we, stride_wd, stride_wf,
                                 TMA, PRECISION, False, BLOCK_M, BLOCK_N, BLOCK_K)
            tile_out += programs
            _, start, end, pid_n = tile_at(tile_out, lo, hi, tiles_start, tiles_end, num_pid_m, num_pid_n, GROUP_SIZE,
                                           BLOCK_M, EXPERTS_P2)
            _down_fwd_store(acc, yp_ptr, gate_ptr, row_ptr, start, end, pid_n, D, stride_gm, stride_ym, stride_yd,
                            SCATTER_ROWS, BLOCK_M, BLOCK_N)
    else:
        pid_m, pid_n = swizzle_tiles(tl.program_id(0), tl.cdiv(M, BLOCK_M) + num_experts, num_pid_n, GROUP_SIZE)
        expert, start, end = expert_tile(pid_m, offsets_ptr, num_experts, BLOCK_M, EXPERTS_P2)
        if expert < num_experts:
            acc = _down_fwd_tile(h_ptr, w_ptr, h_desc, w_desc, expert, start, end, pid_n, D, F,
                                 stride_hm, stride_hf, stride_we, stride_wd, stride_wf,
                                 TMA, PRECISION, WARP_SPEC == 1, BLOCK_M, BLOCK_N, BLOCK_K)
            _down_fwd_store(acc, yp_ptr, gate_ptr, row_ptr, start, end, pid_n, D, stride_gm, stride_ym, stride_yd,
                            SCATTER_ROWS, BLOCK_M, BLOCK_N)


@triton.jit
def _down_bwd_dh_kernel(
    dy_ptr, row_ptr, gate_ptr, h_ptr, offsets_ptr, w_ptr, dh_ptr, dgp_ptr,
    M, D, F, num_experts,
    stride_yr, stride_yd, stride_gm, stride_hm, stride_hf, stride_we, stride_wd, stride_wf,
    stride_dm, stride_df, stride_pn, stride_pm,
    PRECISION: tl.constexpr, GROUP_SIZE: tl.constexpr, EXPERTS_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M) + num_experts
    pid_m, pid_n = swizzle_tiles(tl.program_id(0), num_pid_m, tl.cdiv(F, BLOCK_N), GROUP_SIZE)
    expert, start, end = expert_tile(pid_m, offsets_ptr, num_experts, BLOCK_M, EXPERTS_P2)
    if expert >= num_experts:
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    offs_m64 = offs_m.to(tl.int64)
    rows = tl.load(row_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < F
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = dy_ptr + rows[:, None] * stride_yr + offs_k[None, :] * stride_yd
    b_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wd + offs_n[None, :] * stride_wf
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        mask_k = offs_k < D - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_yd
        b_ptrs += BLOCK_K * stride_wd
    mask_mn = mask_m[:, None] & mask_n[None, :]
    h = tl.load(h_ptr + offs_m64[:, None] * stride_hm + offs_n[None, :] * stride_hf, mask=mask_mn, other=0.0)
    tl.store(dgp_ptr + pid_n * stride_pn + offs_m64 * stride_pm, tl.sum(acc * h.to(tl.float32), axis=1),
             mask=mask_m)
    gate = tl.load(gate_ptr + offs_m64 * stride_gm, mask=mask_m, other=0.0).to(tl.float32)
    tl.store(dh_ptr + offs_m64[:, None] * stride_dm + offs_n[None, :] * stride_df,
             (acc * gate[:, None]).to(dh_ptr.dtype.element_ty), mask=mask_mn)


@triton.jit
def _down_bwd_dw_kernel(
    dy_ptr, row_ptr, gate_ptr, h_ptr, offsets_ptr, dw_ptr,
    D, F,
    stride_yr, stride_yd, stride_gm, stride_hm, stride_hf, stride_we, stride_wd, stride_wf,
    PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    X_TMA: tl.constexpr = 0,
):
    # Output tile [BLOCK_M of D, BLOCK_N of F] of expert e; the reduction runs over e's pairs.
    # X_TMA (with TMA): dy_ptr holds gate · dy[row] already gathered in pair order ([M, D], rounded
    # to h's dtype as the K loop would), loaded through a descriptor instead of gathered and scaled.
    pid = tl.program_id(0)
    tiles_d = tl.cdiv(D, BLOCK_M)
    tiles_f = tl.cdiv(F, BLOCK_N)
    expert = pid // (tiles_d * tiles_f)
    pid_d = (pid % (tiles_d * tiles_f)) // tiles_f
    pid_f = pid % tiles_f
    lo = tl.load(offsets_ptr + expert).to(tl.int32)     # pair counts fit int32; descriptor offsets need it
    hi = tl.load(offsets_ptr + expert + 1).to(tl.int32)
    offs_d = pid_d * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_d = offs_d < D
    offs_f = pid_f * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_f = offs_f < F
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        # h [M, F] in expert order, seen only up to this expert's last pair: the last K block reads
        # zeros past it (never the next expert's rows or a padded plan's unwritten ones).
        h_desc = tl.make_tensor_descriptor(h_ptr, shape=[tl.maximum(hi, 1), F], strides=[stride_hm, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    if X_TMA:       # the same bounds as h's
        y_desc = tl.make_tensor_descriptor(dy_ptr, shape=[tl.maximum(hi, 1), D], strides=[stride_yr, 1],
                                           block_shape=[BLOCK_K, BLOCK_M])
    for k0 in range(lo, hi, BLOCK_K):
        pairs = k0 + offs_k
        mask_k = pairs < hi
        pairs64 = pairs.to(tl.int64)
        if TMA:
            h = h_desc.load([k0, pid_f * BLOCK_N])
        else:
            h = tl.load(h_ptr + pairs64[:, None] * stride_hm + offs_f[None, :] * stride_hf,
                        mask=mask_k[:, None] & mask_f[None, :], other=0.0)
        if X_TMA:
            scaled = y_desc.load([k0, pid_d * BLOCK_M])
        else:
            rows = tl.load(row_ptr + pairs, mask=mask_k, other=0).to(tl.int64)
            gate = tl.load(gate_ptr + pairs64 * stride_gm, mask=mask_k, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * stride_yr + offs_d[None, :] * stride_yd,
                         mask=mask_k[:, None] & mask_d[None, :], other=0.0)
            scaled = (dy.to(tl.float32) * gate[:, None]).to(h.dtype)
        acc = tl.dot(tl.trans(scaled), h, acc, input_precision=PRECISION)
    tl.store(dw_ptr + expert.to(tl.int64) * stride_we + offs_d[:, None] * stride_wd + offs_f[None, :] * stride_wf,
             acc.to(dw_ptr.dtype.element_ty), mask=mask_d[:, None] & mask_f[None, :])


@triton.jit
def _gather_scale_rows_kernel(x_ptr, row_ptr, gate_ptr, out_ptr, M, R, D, stride_xr, stride_xd, stride_gm,
                              stride_om, stride_od, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # out[m] = gate[m] · x[row[m]] in fp32, rounded to out's dtype: the down dW's operand in pair order.
    # Rows are clamped to [0, R): a padded plan's pairs past the last expert may hold any row (their
    # output rows are never read back), and must not make the gather read out of bounds.
    offs_m = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_d < D)[None, :]
    rows = tl.minimum(tl.maximum(tl.load(row_ptr + offs_m, mask=mask_m, other=0).to(tl.int64), 0), R - 1)
    gate = tl.load(gate_ptr + offs_m.to(tl.int64) * stride_gm, mask=mask_m, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + rows[:, None] * stride_xr + offs_d[None, :] * stride_xd, mask=mask, other=0.0)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od,
             (x.to(tl.float32) * gate[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def gather_scale_rows(x_RD: torch.Tensor, pair_row_M: torch.Tensor, pair_gate_M: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """[M, D] in `dtype`: row m is pair_gate_M[m] · x_RD[pair_row_M[m]], multiplied in fp32."""
    num_pairs, hidden = pair_row_M.numel(), x_RD.shape[1]
    out = torch.empty(num_pairs, hidden, dtype=dtype, device=x_RD.device)
    if num_pairs and hidden and x_RD.shape[0]:
        block_t, block_d = (16, 16) if interpreting() else (32, 256)
        grid = (cdiv(num_pairs, block_t), cdiv(hidden, block_d))
        launch(_gather_scale_rows_kernel, grid,
               (x_RD, pair_row_M, pair_gate_M, out, num_pairs, x_RD.shape[0], hidden, *x_RD.stride(),
                pair_gate_M.stride(0), *out.stride()), dict(BLOCK_T=block_t, BLOCK_D=block_d))
    return out


_down_fwd_tuned = triton.autotune(configs=list(SINGLE_ACC_CONFIGS), key=["D", "F", "TMA"])(_down_fwd_kernel)
# The autotuner runs every config on the same buffers: zero the partials between runs so rows of
# F blocks that the chosen config does not have are not left over from another config.
_down_bwd_dh_tuned = triton.autotune(configs=list(SINGLE_ACC_CONFIGS), key=["D", "F"], reset_to_zero=["dgp_ptr"])(
    _down_bwd_dh_kernel
)
_down_bwd_dw_tuned = triton.autotune(configs=list(SINGLE_ACC_CONFIGS), key=["D", "F", "TMA"])(_down_bwd_dw_kernel)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _check_down(h_MF: torch.Tensor, pair_row_M: torch.Tensor, pair_gate_M: torch.Tensor,
                expert_offsets: torch.Tensor, w_down_EDF: torch.Tensor) -> None:
    op = "grouped_down_reduce"
    if h_MF.dim() != 2 or h_MF.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{op}: h_MF must be a 2-D fp32/fp16/bf16 tensor, got {tuple(h_MF.shape)} {h_MF.dtype}")
    check_grouped_args(op, pair_row_M, expert_offsets, w_down_EDF, "w_down_EDF", h_MF.device)
    if w_down_EDF.shape[2] != h_MF.shape[1]:
        raise ValueError(f"{op}: w_down_EDF must be [E, D, F={h_MF.shape[1]}], got {tuple(w_down_EDF.shape)}")
    if w_down_EDF.dtype != h_MF.dtype:
        raise ValueError(f"{op}: w_down_EDF is {w_down_EDF.dtype} but h_MF is {h_MF.dtype}")
    if pair_row_M.shape[0] != h_MF.shape[0]:
        raise ValueError(f"{op}: pair_row_M has {pair_row_M.shape[0]} pairs but h_MF has {h_MF.shape[0]} rows")
    if pair_gate_M.shape != pair_row_M.shape or not pair_gate_M.is_floating_point():
        raise ValueError(
            f"{op}: pair_gate_M must be a float tensor of shape {tuple(pair_row_M.shape)}, "
            f"got {tuple(pair_gate_M.shape)} {pair_gate_M.dtype}"
        )
    if pair_gate_M.device != h_MF.device:
        raise ValueError(f"{op}: pair_gate_M is on {pair_gate_M.device}, expected {h_MF.device}")


def grouped_down_reduce_forward(
    h_MF: torch.Tensor,
    pair_row_M: torch.Tensor,
    pair_gate_M: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_down_EDF: torch.Tensor,
    num_rows: int,
    row_pairs_RK: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [num_rows, D] in h's dtype (see the module docstring). `row_pairs_RK`, if given, lists
    each row's pairs (positions in expert order, −1 = none) and replaces the sort by row."""
    _check_down(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF)
    if row_pairs_RK is not None:
        check_row_table("grouped_down_reduce", row_pairs_RK, num_rows, h_MF.device)
    pair_row_M = pair_row_M.contiguous()
    expert_offsets = expert_offsets.contiguous()
    num_experts, hidden, ffn = w_down_EDF.shape
    num_pairs = h_MF.shape[0]
    if num_pairs == 0 or hidden == 0 or num_rows == 0:
        return torch.zeros(num_rows, hidden, dtype=h_MF.dtype, device=h_MF.device)
    # One pair per row (per_expert mode): the GEMM writes the rows directly, no fp32 buffer.
    scatter_rows = row_pairs_RK is not None and row_pairs_RK.shape[1] == 1 and num_pairs == num_rows
    if scatter_rows:
        yp_MD = torch.empty(num_rows, hidden, dtype=h_MF.dtype, device=h_MF.device)
    else:
        yp_MD = torch.empty(num_pairs, hidden, dtype=partial_dtype(h_MF.dtype), device=h_MF.device)
    args = (
        h_MF, pair_gate_M, expert_offsets, w_down_EDF, yp_MD, pair_row_M,
        num_pairs, hidden, ffn, num_experts,
        *h_MF.stride(), *pair_gate_M.stride(), *w_down_EDF.stride(), *yp_MD.stride(),
    )
    consts = dict(SCATTER_ROWS=scatter_rows, TMA=use_tma(h_MF, w_down_EDF), PRECISION=dot_precision(h_MF.dtype),
                  GROUP_SIZE=GROUP_M, EXPERTS_P2=next_pow2(num_experts))

    def grid(meta):
        tiles = m_tile_bound(num_pairs, num_experts, meta["BLOCK_M"]) * cdiv(hidden, meta["BLOCK_N"])
        return (gemm_programs(tiles, meta, h_MF.device),)

    launch_gemm(_down_fwd_tuned, _down_fwd_kernel, grid, args, consts, h_MF.dtype, num_pairs, (hidden, ffn))
    if scatter_rows:
        return yp_MD
    if row_pairs_RK is not None:
        return gather_sum_rows(yp_MD, row_pairs_RK, h_MF.dtype)
    order_M, row_ptr = row_csr(pair_row_M, num_rows)
    return segment_sum_rows(yp_MD, order_M, row_ptr, h_MF.dtype)


def grouped_down_reduce_backward(
    dy_RD: torch.Tensor,
    h_MF: torch.Tensor,
    pair_row_M: torch.Tensor,
    pair_gate_M: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_down_EDF: torch.Tensor,
    need_dh_or_dgate: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh_MF, dgate_M, dWd_EDF); gradients not asked for come back as empty [0] tensors."""
    _check_down(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF)
    pair_row_M = pair_row_M.contiguous()
    expert_offsets = expert_offsets.contiguous()
    num_experts, hidden, ffn = w_down_EDF.shape
    num_pairs = h_MF.shape[0]
    if dy_RD.dim() != 2 or dy_RD.shape[1] != hidden:
        raise ValueError(f"grouped_down_reduce backward: dy_RD must be [R, {hidden}], got {tuple(dy_RD.shape)}")
    dy_RD = dy_RD.to(h_MF.dtype)
    dh_MF, dgate_M, dw_EDF = h_MF.new_empty(0), pair_gate_M.new_empty(0), w_down_EDF.new_empty(0)
    precision = dot_precision(h_MF.dtype)
    trivial = num_pairs == 0 or hidden == 0 or ffn == 0
    if need_dh_or_dgate:
        if trivial:
            dh_MF = torch.zeros_like(h_MF, memory_format=torch.contiguous_format)
            dgate_M = torch.zeros_like(pair_gate_M, memory_format=torch.contiguous_format)
        else:
            dh_MF = torch.empty(num_pairs, ffn, dtype=h_MF.dtype, device=h_MF.device)
            # One row of partial dot products per F block, for the narrowest BLOCK_N that may run;
            # rows of blocks the chosen config does not have stay zero.
            meta = fixed_gemm_meta(h_MF.dtype, num_pairs, kernel_name(_down_bwd_dh_kernel))
            narrowest = meta["BLOCK_N"] if meta else min(cfg.kwargs["BLOCK_N"] for cfg in SINGLE_ACC_CONFIGS)
            dgp_NM = torch.zeros(cdiv(ffn, narrowest), num_pairs, dtype=torch.float32, device=h_MF.device)
            args = (
                dy_RD, pair_row_M, pair_gate_M, h_MF, expert_offsets, w_down_EDF, dh_MF, dgp_NM,
                num_pairs, hidden, ffn, num_experts,
                *dy_RD.stride(), *pair_gate_M.stride(), *h_MF.stride(), *w_down_EDF.stride(),
                *dh_MF.stride(), *dgp_NM.stride(),
            )
            consts = dict(PRECISION=precision, GROUP_SIZE=GROUP_M, EXPERTS_P2=next_pow2(num_experts))

            def grid_dh(meta):
                return (m_tile_bound(num_pairs, num_experts, meta["BLOCK_M"]) * cdiv(ffn, meta["BLOCK_N"]),)

            launch_gemm(_down_bwd_dh_tuned, _down_bwd_dh_kernel, grid_dh, args, consts, h_MF.dtype, num_pairs)
            dgate_M = dgp_NM.sum(dim=0).to(pair_gate_M.dtype)
    if need_dw:
        if trivial:
            dw_EDF = torch.zeros_like(w_down_EDF, memory_format=torch.contiguous_format)
        else:
            dw_EDF = torch.empty(num_experts, hidden, ffn, dtype=w_down_EDF.dtype, device=h_MF.device)
            tma = use_tma(h_MF)
            dy_operand = dy_RD
            if gathered_operand_wanted(_down_bwd_dw_kernel, h_MF.dtype, num_pairs, (hidden, ffn), h_MF.device, tma,
                                       hidden * h_MF.element_size()):
                dy_operand = gather_scale_rows(dy_RD, pair_row_M, pair_gate_M, h_MF.dtype)
            args = (
                dy_operand, pair_row_M, pair_gate_M, h_MF, expert_offsets, dw_EDF,
                hidden, ffn,
                *dy_operand.stride(), *pair_gate_M.stride(), *h_MF.stride(), *dw_EDF.stride(),
            )

            def grid_dw(meta):
                return (num_experts * cdiv(hidden, meta["BLOCK_M"]) * cdiv(ffn, meta["BLOCK_N"]),)

            launch_gemm(_down_bwd_dw_tuned, _down_bwd_dw_kernel, grid_dw, args,
                        dict(PRECISION=precision, TMA=tma), h_MF.dtype, num_pairs, (hidden, ffn))
    return dh_MF, dgate_M, dw_EDF


# ----------------------------------------------------------------------------------------------
# Differentiable op
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("occult::grouped_down_reduce", mutates_args=())
def _grouped_down_reduce_op(
    h_MF: torch.Tensor, pair_row_M: torch.Tensor, pair_gate_M: torch.Tensor, expert_offsets: torch.Tensor,
    w_down_EDF: torch.Tensor, num_rows: int, row_pairs_RK: torch.Tensor | None = None,
) -> torch.Tensor:
    return grouped_down_reduce_forward(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF, num_rows,
                                       row_pairs_RK)


@_grouped_down_reduce_op.register_fake
def _(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF, num_rows, row_pairs_RK=None):
    return h_MF.new_empty(num_rows, w_down_EDF.shape[1])


@torch.library.custom_op("occult::grouped_down_reduce_bwd", mutates_args=())
def _grouped_down_reduce_backward_op(
    dy_RD: torch.Tensor, h_MF: torch.Tensor, pair_row_M: torch.Tensor, pair_gate_M: torch.Tensor,
    expert_offsets: torch.Tensor, w_down_EDF: torch.Tensor, need_dh_or_dgate: bool, need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grouped_down_reduce_backward(dy_RD, h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF,
                                        need_dh_or_dgate, need_dw)


@_grouped_down_reduce_backward_op.register_fake
def _(dy_RD, h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF, need_dh_or_dgate, need_dw):
    dh = h_MF.new_empty(h_MF.shape if need_dh_or_dgate else (0,))
    dgate = pair_gate_M.new_empty(pair_gate_M.shape if need_dh_or_dgate else (0,))
    dw = w_down_EDF.new_empty(w_down_EDF.shape if need_dw else (0,))
    return dh, dgate, dw


def _down_setup_context(ctx, inputs, output) -> None:
    h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF = inputs[:5]
    ctx.save_for_backward(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF)


def _down_grad(ctx, dy_RD):
    h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF = ctx.saved_tensors
    need_dh, need_dgate, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[4]
    if not (need_dh or need_dgate or need_dw):
        return None, None, None, None, None, None, None
    backward = grouped_down_reduce_backward if direct_call_ok(dy_RD) else _grouped_down_reduce_backward_op
    dh_MF, dgate_M, dw_EDF = backward(
        dy_RD, h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF, need_dh or need_dgate, need_dw
    )
    return ((dh_MF if need_dh else None), None, (dgate_M if need_dgate else None), None,
            (dw_EDF if need_dw else None), None, None)


_grouped_down_reduce_op.register_autograd(_down_grad, setup_context=_down_setup_context)
_GroupedDownReduceEager = eager_function("grouped_down_reduce", grouped_down_reduce_forward, _down_setup_context,
                                         _down_grad)


def grouped_down_reduce(
    h_MF: torch.Tensor,
    pair_row_M: torch.Tensor,
    pair_gate_M: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_down_EDF: torch.Tensor,
    num_rows: int,
    row_pairs_RK: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [R, D] = Σ_{m : row[m] = r} gate[m] · h[m] Wd[e]^T, fp32 accumulation (differentiable in h,
    gate and Wd). Optional `row_pairs_RK` [R, K]: each row's pair positions (−1 = none), e.g. from
    `occult.ep.plan.build_pairs_from_slots`; it must agree with `pair_row_M` (not checked)."""
    if direct_call_ok(h_MF, pair_gate_M, w_down_EDF):
        return grouped_down_reduce_forward(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF, num_rows,
                                           row_pairs_RK)
    op = _GroupedDownReduceEager.apply if eager_function_ok() else _grouped_down_reduce_op
    return op(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF, num_rows, row_pairs_RK)
