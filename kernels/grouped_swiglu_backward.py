"""Backward of `grouped_swiglu` in Triton: dx and dW of the gather-fused gate/up GEMM, from the
pre-activations [g | u] the forward saved (math and layout: `grouped_swiglu.py`).

  with s = sigmoid(g):  dg = dh * u * s * (1 + g * (1 - s)),  du = dh * silu(g)
  dx[r] = Σ_{m : row[m] = r} dg[m] @ Wg + du[m] @ Wu      (fp32, deterministic)
  dW[e] = [dg_e^T x_e ; du_e^T x_e]                        (x_e = x[row[m]], m ∈ e)

Design:
* dg/du come from one elementwise pass that writes [dg | du] [M, 2F] once (`SWIGLU_BWD_MODE =
  "materialized"`, the default: measured faster), or are recomputed inside both backward GEMMs'
  A-operand prologues ("fused", never materialised).
* dx: each pair's dx row goes to an [M, D] buffer (`partial_dtype`), then a deterministic fp32 sum over
  a row→pairs CSR (see `combine.py`) adds the pairs of each row in a fixed order (no atomics:
  bitwise reproducible, autotune-safe, and the interpreter has no bf16 atomics). The dx GEMM runs
  the forward's tile schedule (`grouped_layout.py`).
* dW: one program per (expert, F block, D block), looping over that expert's pairs; an empty
  expert writes zeros.

Configs and operand paths as for the forward (`gemm_configs.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .combine import cdiv, check_row_table, gather_sum_rows, interpreting, next_pow2, row_csr, segment_sum_rows
from .gemm_configs import (GROUP_M, MAX_BLOCK_K, SWIGLU_DW_CONFIGS, SWIGLU_DX_CONFIGS, dot_precision, launch_gemm,
                           pair_order_x_operand, partial_dtype, use_tma)
from .grouped_layout import (check_swiglu_args, expert_tile, gemm_programs, m_tile_bound, persistent_schedule,
                             store_pair_rows, swizzle_tiles, tile_at)
from .launch import launch


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _swiglu_grad_preact(dh, g, u):
    """(dg, du) in fp32 from dh and the saved pre-activations g (gate) and u (up)."""
    dh = dh.to(tl.float32)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    sig = tl.sigmoid(g)
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    du = dh * g * sig
    return dg, du


@triton.jit
def _swiglu_preact_grad_kernel(
    dh_ptr, pre_ptr, out_ptr, M, F,
    stride_dm, stride_df, stride_pm, stride_pf, stride_om, stride_of,
    BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """out[:, :F] = dg, out[:, F:] = du for a [BLOCK_T, BLOCK_F] tile (fp32 math)."""
    offs_m = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (offs_m[:, None] < M) & (offs_f[None, :] < F)
    g_ptrs = pre_ptr + offs_m[:, None] * stride_pm + offs_f[None, :] * stride_pf
    dg, du = _swiglu_grad_preact(
        tl.load(dh_ptr + offs_m[:, None] * stride_dm + offs_f[None, :] * stride_df, mask=mask, other=0.0),
        tl.load(g_ptrs, mask=mask, other=0.0),
        tl.load(g_ptrs + F * stride_pf, mask=mask, other=0.0),
    )
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_f[None, :] * stride_of
    tl.store(o_ptrs, dg.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptrs + F * stride_of, du.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_dx_tile(
    dh_ptr, pre_ptr, w_ptr, a_desc, w_desc, expert, start, end, pid_n, D, F,
    stride_dm, stride_df, stride_pm, stride_pf, stride_we, stride_wf, stride_wd,
    PRECISION: tl.constexpr, GRADS_READY: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dx accumulator [BLOCK_M, BLOCK_N] of one tile: dg @ Wg + du @ Wu over the tile's pairs (fp32)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        # Only with [dg | du] materialised and F a multiple of BLOCK_K (the host checks both): the dg
        # and du tiles of one K step then never cross into each other's columns. A rows past the
        # expert's pairs feed only masked-out outputs.
        m0 = start.to(tl.int32)
        w_row = expert * 2 * F
        n0 = pid_n * BLOCK_N
        for k0 in range(0, F, BLOCK_K):
            acc = tl.dot(a_desc.load([m0, k0]), w_desc.load([w_row + k0, n0]), acc, input_precision=PRECISION)
            acc = tl.dot(a_desc.load([m0, F + k0]), w_desc.load([w_row + F + k0, n0]), acc,
                         input_precision=PRECISION)
    else:
        offs_m64 = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_m = offs_m64 < end
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < D
        offs_k = tl.arange(0, BLOCK_K)
        dh_ptrs = dh_ptr + offs_m64[:, None] * stride_dm + offs_k[None, :] * stride_df
        g_ptrs = pre_ptr + offs_m64[:, None] * stride_pm + offs_k[None, :] * stride_pf
        u_ptrs = g_ptrs + F * stride_pf
        bg_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wf + offs_n[None, :] * stride_wd
        bu_ptrs = bg_ptrs + F * stride_wf
        for k0 in range(0, F, BLOCK_K):
            mask_k = offs_k < F - k0
            mask_a = mask_m[:, None] & mask_k[None, :]
            if GRADS_READY:     # pre_ptr holds [dg | du] (`swiglu_preact_grad`)
                dg = tl.load(g_ptrs, mask=mask_a, other=0.0)
                du = tl.load(u_ptrs, mask=mask_a, other=0.0)
            else:
                dg, du = _swiglu_grad_preact(
                    tl.load(dh_ptrs, mask=mask_a, other=0.0),
                    tl.load(g_ptrs, mask=mask_a, other=0.0),
                    tl.load(u_ptrs, mask=mask_a, other=0.0),
                )
            bg = tl.load(bg_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            bu = tl.load(bu_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(dg.to(bg.dtype), bg, acc, input_precision=PRECISION)
            acc = tl.dot(du.to(bu.dtype), bu, acc, input_precision=PRECISION)
            dh_ptrs += BLOCK_K * stride_df
            g_ptrs += BLOCK_K * stride_pf
            u_ptrs += BLOCK_K * stride_pf
            bg_ptrs += BLOCK_K * stride_wf
            bu_ptrs += BLOCK_K * stride_wf
    return acc


@triton.jit
def _swiglu_bwd_dx_kernel(
    dh_ptr, pre_ptr, offsets_ptr, w_ptr, dxp_ptr, row_ptr,
    M, D, F, num_experts,
    stride_dm, stride_df, stride_pm, stride_pf, stride_we, stride_wf, stride_wd, stride_xm, stride_xd,
    SCATTER_ROWS: tl.constexpr, PRECISION: tl.constexpr, GROUP_SIZE: tl.constexpr, EXPERTS_P2: tl.constexpr,
    GRADS_READY: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PERSISTENT: tl.constexpr = False,
):
    # One tile per program, or PERSISTENT: a loop over tiles (as in `_down_fwd_kernel`).
    num_pid_n = tl.cdiv(D, BLOCK_N)
    if TMA:     # [dg | du] is [M, 2F] in expert order; W is viewed as [E*2F, D]
        a_desc = tl.make_tensor_descriptor(pre_ptr, shape=[M, 2 * F], strides=[stride_pm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_experts * 2 * F, D], strides=[stride_wf, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    else:
        a_desc = pre_ptr       # unused
        w_desc = w_ptr
    if PERSISTENT:
        lo, hi, tiles_start, tiles_end, num_pid_m = persistent_schedule(offsets_ptr, num_experts, BLOCK_M, EXPERTS_P2)
        programs = tl.num_programs(0)
        tile_out = tl.program_id(0) - programs
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, programs, flatten=True):
            expert, start, end, pid_n = tile_at(tile, lo, hi, tiles_start, tiles_end, num_pid_m, num_pid_n, GROUP_SIZE,
                                                BLOCK_M, EXPERTS_P2)
            acc = _swiglu_dx_tile(dh_ptr, pre_ptr, w_ptr, a_desc, w_desc, expert, start, end, pid_n, D, F,
                                  stride_dm, stride_df, stride_pm, stride_pf, stride_we, stride_wf, stride_wd,
                                  PRECISION, GRADS_READY, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
            tile_out += programs
            _, start, end, pid_n = tile_at(tile_out, lo, hi, tiles_start, tiles_end, num_pid_m, num_pid_n, GROUP_SIZE,
                                           BLOCK_M, EXPERTS_P2)
            store_pair_rows(acc, dxp_ptr, row_ptr, start, end, pid_n, D, stride_xm, stride_xd, SCATTER_ROWS,
                        BLOCK_M, BLOCK_N)
    else:
        pid_m, pid_n = swizzle_tiles(tl.program_id(0), tl.cdiv(M, BLOCK_M) + num_experts, num_pid_n, GROUP_SIZE)
        expert, start, end = expert_tile(pid_m, offsets_ptr, num_experts, BLOCK_M, EXPERTS_P2)
        if expert < num_experts:
            acc = _swiglu_dx_tile(dh_ptr, pre_ptr, w_ptr, a_desc, w_desc, expert, start, end, pid_n, D, F,
                                  stride_dm, stride_df, stride_pm, stride_pf, stride_we, stride_wf, stride_wd,
                                  PRECISION, GRADS_READY, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
            store_pair_rows(acc, dxp_ptr, row_ptr, start, end, pid_n, D, stride_xm, stride_xd, SCATTER_ROWS,
                        BLOCK_M, BLOCK_N)


@triton.jit
def _swiglu_bwd_dw_kernel(
    dh_ptr, pre_ptr, x_ptr, row_ptr, offsets_ptr, dw_ptr,
    D, F,
    stride_dm, stride_df, stride_pm, stride_pf, stride_xr, stride_xd, stride_we, stride_wf, stride_wd,
    PRECISION: tl.constexpr, GRADS_READY: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    X_TMA: tl.constexpr = 0, ONE_ACC: tl.constexpr = 0,
):
    # Output tile [BLOCK_M of F, BLOCK_N of D] of expert e (of 2F with ONE_ACC); the reduction runs
    # over e's pairs. Both options need TMA ([dg | du] through a descriptor). X_TMA: x_ptr holds x
    # already gathered in pair order ([M, D]), loaded through a descriptor like [dg | du] (no row
    # gather in the K loop). ONE_ACC: [dg | du] is one [M, 2F] operand and dW_gate_up one [2F, D]
    # output, so a tile needs one accumulator instead of a gate and an up one.
    pid = tl.program_id(0)
    out_rows = 2 * F if ONE_ACC else F
    tiles_f = tl.cdiv(out_rows, BLOCK_M)
    tiles_d = tl.cdiv(D, BLOCK_N)
    expert = pid // (tiles_f * tiles_d)
    pid_f = (pid % (tiles_f * tiles_d)) // tiles_d
    pid_d = pid % tiles_d
    lo = tl.load(offsets_ptr + expert).to(tl.int32)     # pair counts fit int32; descriptor offsets need it
    hi = tl.load(offsets_ptr + expert + 1).to(tl.int32)
    offs_f = pid_f * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_f = offs_f < out_rows
    offs_d = pid_d * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_d = offs_d < D
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        # Only with [dg | du] materialised ([M, 2F] in expert order). The descriptor ends at this
        # expert's last pair, so the last K block reads zeros past it (never the next expert's rows
        # or a padded plan's unwritten ones); a dg tile's columns past F are du's, in masked-out
        # rows of dW. (max: a descriptor of an empty expert, never loaded from, keeps one row.)
        g_desc = tl.make_tensor_descriptor(pre_ptr, shape=[tl.maximum(hi, 1), 2 * F], strides=[stride_pm, 1],
                                           block_shape=[BLOCK_K, BLOCK_M])
    if X_TMA:       # the same bounds: rows past this expert's last pair read as zeros
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[tl.maximum(hi, 1), D], strides=[stride_xr, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    for k0 in range(lo, hi, BLOCK_K):
        pairs = k0 + offs_k
        mask_k = pairs < hi
        pairs64 = pairs.to(tl.int64)
        mask_kf = mask_k[:, None] & mask_f[None, :]
        if X_TMA:
            xk = x_desc.load([k0, pid_d * BLOCK_N])
        else:
            rows = tl.load(row_ptr + pairs, mask=mask_k, other=0).to(tl.int64)
            xk = tl.load(x_ptr + rows[:, None] * stride_xr + offs_d[None, :] * stride_xd,
                         mask=mask_k[:, None] & mask_d[None, :], other=0.0)
        if ONE_ACC:
            a = g_desc.load([k0, pid_f * BLOCK_M])
            acc_g = tl.dot(tl.trans(a.to(xk.dtype)), xk, acc_g, input_precision=PRECISION)
        else:
            if TMA:
                dg = g_desc.load([k0, pid_f * BLOCK_M])
                du = g_desc.load([k0, F + pid_f * BLOCK_M])
            elif GRADS_READY:     # pre_ptr holds [dg | du]
                g_ptrs = pre_ptr + pairs64[:, None] * stride_pm + offs_f[None, :] * stride_pf
                dg = tl.load(g_ptrs, mask=mask_kf, other=0.0)
                du = tl.load(g_ptrs + F * stride_pf, mask=mask_kf, other=0.0)
            else:
                g_ptrs = pre_ptr + pairs64[:, None] * stride_pm + offs_f[None, :] * stride_pf
                dg, du = _swiglu_grad_preact(
                    tl.load(dh_ptr + pairs64[:, None] * stride_dm + offs_f[None, :] * stride_df, mask=mask_kf,
                            other=0.0),
                    tl.load(g_ptrs, mask=mask_kf, other=0.0),
                    tl.load(g_ptrs + F * stride_pf, mask=mask_kf, other=0.0),
                )
            acc_g = tl.dot(tl.trans(dg.to(xk.dtype)), xk, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(tl.trans(du.to(xk.dtype)), xk, acc_u, input_precision=PRECISION)
    out_ptrs = dw_ptr + expert.to(tl.int64) * stride_we + offs_f[:, None] * stride_wf + offs_d[None, :] * stride_wd
    mask_fd = mask_f[:, None] & mask_d[None, :]
    tl.store(out_ptrs, acc_g.to(dw_ptr.dtype.element_ty), mask=mask_fd)
    if not ONE_ACC:
        tl.store(out_ptrs + F * stride_wf, acc_u.to(dw_ptr.dtype.element_ty), mask=mask_fd)


_swiglu_bwd_dx_tuned = triton.autotune(configs=list(SWIGLU_DX_CONFIGS), key=["D", "F", "GRADS_READY", "TMA"])(
    _swiglu_bwd_dx_kernel)
_swiglu_bwd_dw_tuned = triton.autotune(configs=list(SWIGLU_DW_CONFIGS), key=["D", "F", "GRADS_READY", "TMA"])(
    _swiglu_bwd_dw_kernel)

# How the backward gets dg, du:
#   "fused":        recomputed from (dh, g, u) in the A-operand prologue of both GEMMs (no extra
#                   memory, but D/BLOCK_N-fold repeated elementwise work and 3 loads per A tile);
#   "materialized": one elementwise pass writes [dg | du] [M, 2F] in x's dtype, then both GEMMs
#                   load it directly (M·2F·2·2 extra bytes of traffic). The default: on one H200,
#                   OLMoE shape, 2^14 tokens × 2 ranks, SwiGLU fwd+bwd 13.5 → 8.4 ms
#                   (results/nvidia-h200/kernels_v2).
SWIGLU_BWD_MODES = ("fused", "materialized")
SWIGLU_BWD_MODE = "materialized"


def swiglu_preact_grad(dh_MF: torch.Tensor, preact_M2F: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[dg | du] [M, 2F] in `dtype` from dh [M, F] and the saved pre-activations [g | u]."""
    num_pairs, ffn = dh_MF.shape
    out = torch.empty(num_pairs, 2 * ffn, dtype=dtype, device=dh_MF.device)
    if num_pairs == 0 or ffn == 0:
        return out
    block_t, block_f = (16, 16) if interpreting() else (32, 128)
    grid = (cdiv(num_pairs, block_t), cdiv(ffn, block_f))
    launch(_swiglu_preact_grad_kernel, grid,
           (dh_MF, preact_M2F, out, num_pairs, ffn, *dh_MF.stride(), *preact_M2F.stride(), *out.stride()),
           dict(BLOCK_T=block_t, BLOCK_F=block_f))
    return out


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def swiglu_dx_uses_tma(preact_M2F: torch.Tensor, w_gate_up_E2FD: torch.Tensor, grads_ready: bool) -> bool:
    """The dx GEMM's operand path: descriptors only for a materialised [dg | du] and F a multiple of
    every BLOCK_K (else a dg tile's K tail would read du columns)."""
    ffn = w_gate_up_E2FD.shape[1] // 2
    return grads_ready and ffn % MAX_BLOCK_K == 0 and use_tma(preact_M2F, w_gate_up_E2FD)


def grouped_swiglu_backward(
    dh_MF: torch.Tensor,
    x_RD: torch.Tensor,
    pair_row_M: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_gate_up_E2FD: torch.Tensor,
    preact_M2F: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
    row_pairs_RK: torch.Tensor | None = None,
    bwd_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx_RD, dW_E2FD); a gradient that is not needed comes back as an empty [0] tensor.
    `row_pairs_RK` [R, K], if given, lists each row's pairs and replaces the sort by row.
    `bwd_mode` (default `SWIGLU_BWD_MODE`) selects how dg, du are formed."""
    check_swiglu_args(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD)
    if row_pairs_RK is not None:
        check_row_table("grouped_swiglu", row_pairs_RK, x_RD.shape[0], x_RD.device)
    pair_row_M = pair_row_M.contiguous()
    expert_offsets = expert_offsets.contiguous()
    num_experts, two_f, hidden = w_gate_up_E2FD.shape
    ffn = two_f // 2
    num_pairs = pair_row_M.shape[0]
    if preact_M2F.shape != (num_pairs, two_f):
        raise ValueError(
            f"grouped_swiglu backward: preact_M2F is {tuple(preact_M2F.shape)}, expected ({num_pairs}, {two_f}); "
            "was the forward run without grad enabled?"
        )
    if dh_MF.shape != (num_pairs, ffn):
        raise ValueError(f"grouped_swiglu backward: dh_MF is {tuple(dh_MF.shape)}, expected ({num_pairs}, {ffn})")
    dx_RD, dw_E2FD = x_RD.new_empty(0), w_gate_up_E2FD.new_empty(0)
    precision = dot_precision(x_RD.dtype)
    bwd_mode = SWIGLU_BWD_MODE if bwd_mode is None else bwd_mode
    if bwd_mode not in SWIGLU_BWD_MODES:
        raise ValueError(f"SWIGLU_BWD_MODE: {bwd_mode!r} is not one of {SWIGLU_BWD_MODES}")
    ready = bwd_mode == "materialized" and num_pairs > 0 and (need_dx or need_dw)
    if ready:      # the GEMMs read [dg | du] through the pre-activation arguments
        preact_M2F = swiglu_preact_grad(dh_MF, preact_M2F, x_RD.dtype)
    # TUNED_GEMM_META's backward configs were measured in the materialised mode only
    measured_shape = (hidden, ffn) if ready else None
    if need_dx:
        if num_pairs == 0 or ffn == 0 or hidden == 0:
            dx_RD = torch.zeros_like(x_RD, memory_format=torch.contiguous_format)
        else:
            num_rows = x_RD.shape[0]
            scatter_rows = row_pairs_RK is not None and row_pairs_RK.shape[1] == 1 and num_pairs == num_rows
            if scatter_rows:    # one pair per row: the GEMM writes dx directly
                dxp_MD = torch.empty(num_rows, hidden, dtype=x_RD.dtype, device=x_RD.device)
            else:
                dxp_MD = torch.empty(num_pairs, hidden, dtype=partial_dtype(x_RD.dtype), device=x_RD.device)
            args = (
                dh_MF, preact_M2F, expert_offsets, w_gate_up_E2FD, dxp_MD, pair_row_M,
                num_pairs, hidden, ffn, num_experts,
                *dh_MF.stride(), *preact_M2F.stride(), *w_gate_up_E2FD.stride(), *dxp_MD.stride(),
            )
            tma = swiglu_dx_uses_tma(preact_M2F, w_gate_up_E2FD, ready)
            consts = dict(SCATTER_ROWS=scatter_rows, PRECISION=precision, GROUP_SIZE=GROUP_M,
                          EXPERTS_P2=next_pow2(num_experts), GRADS_READY=ready, TMA=tma)

            def grid_dx(meta):
                tiles = m_tile_bound(num_pairs, num_experts, meta["BLOCK_M"]) * cdiv(hidden, meta["BLOCK_N"])
                return (gemm_programs(tiles, meta, x_RD.device),)

            launch_gemm(_swiglu_bwd_dx_tuned, _swiglu_bwd_dx_kernel, grid_dx, args, consts, x_RD.dtype, num_pairs,
                        measured_shape)
            if scatter_rows:
                dx_RD = dxp_MD
            elif row_pairs_RK is not None:
                dx_RD = gather_sum_rows(dxp_MD, row_pairs_RK, x_RD.dtype)
            else:
                order_M, row_ptr = row_csr(pair_row_M, num_rows)
                dx_RD = segment_sum_rows(dxp_MD, order_M, row_ptr, x_RD.dtype)
    if need_dw:
        if num_pairs == 0 or ffn == 0 or hidden == 0:
            dw_E2FD = torch.zeros_like(w_gate_up_E2FD, memory_format=torch.contiguous_format)
        else:
            dw_E2FD = torch.empty(num_experts, two_f, hidden, dtype=w_gate_up_E2FD.dtype, device=x_RD.device)
            tma = ready and use_tma(preact_M2F)
            x_operand = pair_order_x_operand(_swiglu_bwd_dw_kernel, x_RD, pair_row_M, num_pairs, measured_shape, tma)
            args = (
                dh_MF, preact_M2F, x_operand, pair_row_M, expert_offsets, dw_E2FD,
                hidden, ffn,
                *dh_MF.stride(), *preact_M2F.stride(), *x_operand.stride(), *dw_E2FD.stride(),
            )

            def grid_dw(meta):
                out_rows = two_f if meta.get("ONE_ACC") else ffn
                return (num_experts * cdiv(out_rows, meta["BLOCK_M"]) * cdiv(hidden, meta["BLOCK_N"]),)

            launch_gemm(_swiglu_bwd_dw_tuned, _swiglu_bwd_dw_kernel, grid_dw, args,
                        dict(PRECISION=precision, GRADS_READY=ready, TMA=tma), x_RD.dtype, num_pairs, measured_shape)
    return dx_RD, dw_E2FD
