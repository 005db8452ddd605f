"""Gather-fused grouped gate/up GEMM with the SwiGLU fused in its epilogue, in Triton: the forward
kernel, its launcher and the differentiable op `grouped_swiglu`. The backward kernels are in
`grouped_swiglu_backward.py`, the configs and operand paths in `gemm_configs.py`, the tile
schedule in `grouped_layout.py`.

Math (e = expert of pair m, Wg = W[e, :F], Wu = W[e, F:]; fp32 accumulation):
  forward   g[m] = x[row[m]] @ Wg^T,  u[m] = x[row[m]] @ Wu^T,  h[m] = silu(g[m]) * u[m]
  backward  with s = sigmoid(g):  dg = dh * u * s * (1 + g * (1 - s)),  du = dh * silu(g)
            dx[r]   = Σ_{m : row[m] = r} dg[m] @ Wg + du[m] @ Wu      (fp32, deterministic)
            dW[e]   = [dg_e^T x_e ; du_e^T x_e]                        (x_e = x[row[m]], m ∈ e)

Layout (see `reference.py`): `x_RD` [R, D]; `pair_row_M` int [M] sorted by expert with
`expert_offsets` int [E+1]; `w_gate_up_E2FD` [E, 2F, D] (rows :F gate, F: up); `h_MF` [M, F].
Any strides are accepted; the index tensors are made contiguous.

Design:
* One launch per op over all experts. The programs of the M dimension follow a tile schedule:
  expert e owns ceil(count_e / BLOCK_M) tiles; the bound cdiv(M, BLOCK_M) + E is fixed on the
  host (no host sync), and each program finds its (expert, first pair) from a cumsum of the
  per-expert tile counts, computed on the device inside the kernel (`expert_tile`); programs past
  the last tile exit at once. Program ids are swizzled in groups of GROUP_M tiles so that
  neighbouring programs share the gathered x rows and the expert's weight tile in L2.
* The forward loads x[row[m]] inside the kernel (x is never materialised in expert order), and
  one program computes both the gate and the up halves of the same F block, so both share the
  gathered A tile; the SwiGLU runs in fp32 in the epilogue.
* The backward needs the pre-activations g, u. They are SAVED by the forward (an [M, 2F] tensor in
  x's dtype, written by the same epilogue) rather than recomputed: recomputing costs another
  M·2F·D GEMM (+50% backward FLOPs), saving costs M·2F·2 bytes of memory traffic (≈0.1 ms at
  the OLMoE shape on an H200). The forward writes them only when autograd will need them.
* The backward (`grouped_swiglu_backward.py`) forms dg, du from them, then runs a dx GEMM whose
  pair rows are summed per row in a fixed order (no atomics) and a dW GEMM per expert.

Tiles are bf16/fp16 `tl.dot`s with fp32 accumulators; fp32 inputs use input_precision="ieee"
(no TF32). On a GPU the kernels are autotuned over a few configs (key: D, F); under
TRITON_INTERPRET=1 one config with 16-wide blocks is used, decided at launch time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import grouped_swiglu_backward as backward_module       # SWIGLU_BWD_MODE, read at each forward
from .combine import cdiv, direct_call_ok, eager_function, eager_function_ok, next_pow2
from .gemm_configs import (GROUP_M, MAX_BLOCK_K, SWIGLU_FWD_CONFIGS, dot_precision, launch_gemm,
                           pair_order_x_operand, use_tma)
from .grouped_layout import (check_swiglu_args, expert_tile, gemm_programs, m_tile_bound, persistent_schedule,
                             swizzle_tiles, tile_at)
from .grouped_swiglu_backward import grouped_swiglu_backward


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _swiglu_fwd_a_tile(x_desc, a_ptrs, start, k0, offs_k, D, X_TMA: tl.constexpr, EVEN_K: tl.constexpr):
    """The forward's A tile at K offset k0 on the descriptor paths: through `x_desc` (X_TMA), or
    gathered by pointer with a mask only for a K tail (rows past the tile's end gather row 0,
    valid memory, and are never stored)."""
    if X_TMA:
        a = x_desc.load([start.to(tl.int32), k0])
    elif EVEN_K:
        a = tl.load(a_ptrs)
    else:
        a = tl.load(a_ptrs, mask=(offs_k < D - k0)[None, :], other=0.0)
    return a


@triton.jit
def _swiglu_fwd_tile(
    x_ptr, row_ptr, w_ptr, w_desc, x_desc, expert, start, end, pid_n, D, F,
    stride_xr, stride_xd, stride_we, stride_wf, stride_wd,
    TMA: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, WARP_SPEC_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_TMA: tl.constexpr,
    ONE_ACC: tl.constexpr,
):
    """Gate and up accumulators [BLOCK_M, BLOCK_N] of one output tile (fp32). With X_TMA, x is
    already in pair order and its tile comes through `x_desc` (rows past the tile's end are the next
    expert's or zeros past the last pair, never stored). With ONE_ACC, `w_desc` views W as
    [E, 2, F, D] and one load brings a tile's gate and up rows: one [BLOCK_M, 2·BLOCK_N] product per
    K step, split into gate and up after the loop."""
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.load(row_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + rows[:, None] * stride_xr + offs_k[None, :] * stride_xd
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ONE_ACC:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, D, BLOCK_K, warp_specialize=WARP_SPEC_K):
            a = _swiglu_fwd_a_tile(x_desc, a_ptrs, start, k0, offs_k, D, X_TMA, EVEN_K)
            b = tl.reshape(w_desc.load([expert.to(tl.int32), 0, pid_n * BLOCK_N, k0]), (2 * BLOCK_N, BLOCK_K))
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_xd
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    elif TMA:
        gate_row = expert * 2 * F + pid_n * BLOCK_N
        for k0 in tl.range(0, D, BLOCK_K, warp_specialize=WARP_SPEC_K):
            a = _swiglu_fwd_a_tile(x_desc, a_ptrs, start, k0, offs_k, D, X_TMA, EVEN_K)
            acc_g = tl.dot(a, w_desc.load([gate_row, k0]).T, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, w_desc.load([gate_row + F, k0]).T, acc_u, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_xd
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < F
        bg_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wf + offs_k[:, None] * stride_wd
        bu_ptrs = bg_ptrs + F * stride_wf
        for k0 in range(0, D, BLOCK_K):
            mask_k = offs_k < D - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            bg = tl.load(bg_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            bu = tl.load(bu_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_xd
            bg_ptrs += BLOCK_K * stride_wd
            bu_ptrs += BLOCK_K * stride_wd
    return acc_g, acc_u


@triton.jit
def _swiglu_fwd_store(
    acc_g, acc_u, h_ptr, pre_ptr, start, end, pid_n, F, stride_hm, stride_hf, stride_pm, stride_pf,
    SAVE_PREACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """h = silu(g) * u of the tile's pairs, and [g | u] when the backward will need them."""
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_mn = (offs_m < end)[:, None] & (offs_n < F)[None, :]
    offs_m64 = offs_m.to(tl.int64)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + offs_m64[:, None] * stride_hm + offs_n[None, :] * stride_hf,
             h.to(h_ptr.dtype.element_ty), mask=mask_mn)
    if SAVE_PREACT:
        pre_ptrs = pre_ptr + offs_m64[:, None] * stride_pm + offs_n[None, :] * stride_pf
        tl.store(pre_ptrs, acc_g.to(pre_ptr.dtype.element_ty), mask=mask_mn)
        tl.store(pre_ptrs + F * stride_pf, acc_u.to(pre_ptr.dtype.element_ty), mask=mask_mn)


@triton.jit
def _swiglu_fwd_kernel(
    x_ptr, row_ptr, offsets_ptr, w_ptr, h_ptr, pre_ptr,
    M, D, F, num_experts,
    stride_xr, stride_xd, stride_we, stride_wf, stride_wd, stride_hm, stride_hf, stride_pm, stride_pf,
    SAVE_PREACT: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    GROUP_SIZE: tl.constexpr, EXPERTS_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WARP_SPEC: tl.constexpr = 0, PERSISTENT: tl.constexpr = False, X_TMA: tl.constexpr = 0,
    ONE_ACC: tl.constexpr = 0,
):
    # One tile per program, or PERSISTENT: a loop over tiles; WARP_SPEC as in `_down_fwd_kernel`.
    # X_TMA (needs TMA): x_ptr holds x gathered in pair order ([M, D]), loaded through a descriptor.
    # ONE_ACC (needs TMA): one accumulator over a tile's gate and up columns (`_swiglu_fwd_tile`).
    num_pid_n = tl.cdiv(F, BLOCK_N)
    if ONE_ACC:
        # W viewed as [E, 2, F, D]: rows past F of either half read zeros
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_experts, 2, F, D],
                                           strides=[stride_we, F * stride_wf, stride_wf, 1],
                                           block_shape=[1, 2, BLOCK_N, BLOCK_K])
    elif TMA:
        # W viewed as [E*2F, D]; gate rows of a tile at e*2F + n, up rows F further. Columns past
        # D read zeros; rows past the expert's F are other weights, in masked-out columns.
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_experts * 2 * F, D], strides=[stride_wf, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        w_desc = w_ptr         # unused
    if X_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, D], strides=[stride_xr, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    else:
        x_desc = x_ptr         # unused
    if PERSISTENT:
        lo, hi, tiles_start, tiles_end, num_pid_m = persistent_schedule(offsets_ptr, num_experts, BLOCK_M, EXPERTS_P2)
        programs = tl.num_programs(0)
        tile_out = tl.program_id(0) - programs
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, programs, flatten=True,
                             warp_specialize=WARP_SPEC == 2):
            expert, start, end, pid_n = tile_at(tile, lo, hi, tiles_start, tiles_end, num_pid_m, num_pid_n, GROUP_SIZE,
                                                BLOCK_M, EXPERTS_P2)
            acc_g, acc_u = _swiglu_fwd_tile(x_ptr, row_ptr, w_ptr, w_desc, x_desc, expert, start, end, pid_n, D, F,
                                            stride_xr, stride_xd, stride_we, stride_wf, stride_wd,
                                            TMA, EVEN_K, PRECISION, False, BLOCK_M, BLOCK_N, BLOCK_K, X_TMA, ONE_ACC)
            tile_out += programs
            _, start, end, pid_n = tile_at(tile_out, lo, hi, tiles_start, tiles_end, num_pid_m, num_pid_n, GROUP_SIZE,
                                           BLOCK_M, EXPERTS_P2)
            _swiglu_fwd_store(acc_g, acc_u, h_ptr, pre_ptr, start, end, pid_n, F, stride_hm, stride_hf, stride_pm,
                              stride_pf, SAVE_PREACT, BLOCK_M, BLOCK_N)
    else:
        pid_m, pid_n = swizzle_tiles(tl.program_id(0), tl.cdiv(M, BLOCK_M) + num_experts, num_pid_n, GROUP_SIZE)
        expert, start, end = expert_tile(pid_m, offsets_ptr, num_experts, BLOCK_M, EXPERTS_P2)
        if expert < num_experts:
            acc_g, acc_u = _swiglu_fwd_tile(x_ptr, row_ptr, w_ptr, w_desc, x_desc, expert, start, end, pid_n, D, F,
                                            stride_xr, stride_xd, stride_we, stride_wf, stride_wd,
                                            TMA, EVEN_K, PRECISION, WARP_SPEC == 1, BLOCK_M, BLOCK_N, BLOCK_K, X_TMA,
                                            ONE_ACC)
            _swiglu_fwd_store(acc_g, acc_u, h_ptr, pre_ptr, start, end, pid_n, F, stride_hm, stride_hf, stride_pm,
                              stride_pf, SAVE_PREACT, BLOCK_M, BLOCK_N)


_swiglu_fwd_tuned = triton.autotune(configs=list(SWIGLU_FWD_CONFIGS), key=["D", "F", "TMA"])(_swiglu_fwd_kernel)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def grouped_swiglu_forward(
    x_RD: torch.Tensor,
    pair_row_M: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_gate_up_E2FD: torch.Tensor,
    save_preact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_MF, preact_M2F): the SwiGLU output and, if `save_preact`, the [g | u] pre-activations
    (else a [0, 2F] tensor). Both in x's dtype."""
    check_swiglu_args(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD)
    pair_row_M = pair_row_M.contiguous()
    expert_offsets = expert_offsets.contiguous()
    num_experts, two_f, hidden = w_gate_up_E2FD.shape
    ffn = two_f // 2
    num_pairs = pair_row_M.shape[0]
    h_MF = torch.empty(num_pairs, ffn, dtype=x_RD.dtype, device=x_RD.device)
    preact_M2F = torch.empty(num_pairs if save_preact else 0, two_f, dtype=x_RD.dtype, device=x_RD.device)
    if num_pairs == 0 or ffn == 0:
        return h_MF, preact_M2F
    if hidden == 0:
        preact_M2F.zero_()
        return h_MF.zero_(), preact_M2F
    pre = preact_M2F if save_preact else h_MF     # a placeholder pointer when not saving
    tma = use_tma(w_gate_up_E2FD)
    x_operand = pair_order_x_operand(_swiglu_fwd_kernel, x_RD, pair_row_M, num_pairs, (hidden, ffn), tma)
    args = (
        x_operand, pair_row_M, expert_offsets, w_gate_up_E2FD, h_MF, pre,
        num_pairs, hidden, ffn, num_experts,
        *x_operand.stride(), *w_gate_up_E2FD.stride(), *h_MF.stride(), *pre.stride(),
    )
    consts = dict(SAVE_PREACT=save_preact, TMA=tma, EVEN_K=hidden % MAX_BLOCK_K == 0,
                  PRECISION=dot_precision(x_RD.dtype),
                  GROUP_SIZE=GROUP_M, EXPERTS_P2=next_pow2(num_experts))

    def grid(meta):
        tiles = m_tile_bound(num_pairs, num_experts, meta["BLOCK_M"]) * cdiv(ffn, meta["BLOCK_N"])
        return (gemm_programs(tiles, meta, x_RD.device),)

    launch_gemm(_swiglu_fwd_tuned, _swiglu_fwd_kernel, grid, args, consts, x_RD.dtype, num_pairs,
                (hidden, ffn))
    return h_MF, preact_M2F


# ----------------------------------------------------------------------------------------------
# Differentiable op
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("occult::grouped_swiglu_fwd", mutates_args=())
def _grouped_swiglu_op(
    x_RD: torch.Tensor, pair_row_M: torch.Tensor, expert_offsets: torch.Tensor, w_gate_up_E2FD: torch.Tensor,
    save_preact: bool, row_pairs_RK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return grouped_swiglu_forward(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD, save_preact)


@_grouped_swiglu_op.register_fake
def _(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD, save_preact, row_pairs_RK=None):
    two_f = w_gate_up_E2FD.shape[1]
    num_pairs = pair_row_M.shape[0]
    return x_RD.new_empty(num_pairs, two_f // 2), x_RD.new_empty(num_pairs if save_preact else 0, two_f)


@torch.library.custom_op("occult::grouped_swiglu_bwd", mutates_args=())
def _grouped_swiglu_backward_op(
    dh_MF: torch.Tensor, x_RD: torch.Tensor, pair_row_M: torch.Tensor, expert_offsets: torch.Tensor,
    w_gate_up_E2FD: torch.Tensor, preact_M2F: torch.Tensor, need_dx: bool, need_dw: bool,
    row_pairs_RK: torch.Tensor | None = None, bwd_mode: str = "fused",
) -> tuple[torch.Tensor, torch.Tensor]:
    return grouped_swiglu_backward(dh_MF, x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD, preact_M2F,
                                   need_dx, need_dw, row_pairs_RK, bwd_mode)


@_grouped_swiglu_backward_op.register_fake
def _(dh_MF, x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD, preact_M2F, need_dx, need_dw, row_pairs_RK=None,
      bwd_mode="fused"):
    dx = x_RD.new_empty(x_RD.shape if need_dx else (0,))
    dw = w_gate_up_E2FD.new_empty(w_gate_up_E2FD.shape if need_dw else (0,))
    return dx, dw


def _swiglu_setup_context(ctx, inputs, output) -> None:
    x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD, _ = inputs[:5]
    row_pairs_RK = inputs[5] if len(inputs) > 5 else None
    _, preact_M2F = output
    ctx.save_for_backward(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD, preact_M2F, row_pairs_RK)
    ctx.set_materialize_grads(False)
    ctx.bwd_mode = backward_module.SWIGLU_BWD_MODE          # the mode in force when the forward ran


def _swiglu_grad(ctx, dh_MF, _dpreact):
    x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD, preact_M2F, row_pairs_RK = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
    if dh_MF is None or not (need_dx or need_dw):
        return None, None, None, None, None, None
    backward = grouped_swiglu_backward if direct_call_ok(dh_MF) else _grouped_swiglu_backward_op
    dx_RD, dw_E2FD = backward(
        dh_MF, x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD, preact_M2F, need_dx, need_dw, row_pairs_RK,
        ctx.bwd_mode,
    )
    return (dx_RD if need_dx else None), None, None, (dw_E2FD if need_dw else None), None, None


_grouped_swiglu_op.register_autograd(_swiglu_grad, setup_context=_swiglu_setup_context)
_GroupedSwigluEager = eager_function(
    "grouped_swiglu_fwd",
    lambda x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD, save_preact, row_pairs_RK=None:
        grouped_swiglu_forward(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD, save_preact),
    _swiglu_setup_context, _swiglu_grad)


def grouped_swiglu(
    x_RD: torch.Tensor,
    pair_row_M: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_gate_up_E2FD: torch.Tensor,
    row_pairs_RK: torch.Tensor | None = None,
) -> torch.Tensor:
    """h [M, F] = silu(x[row] Wg[e]^T) * (x[row] Wu[e]^T), fp32 accumulation (differentiable in x, W).
    Optional `row_pairs_RK` [R, K] (each row's pair positions, −1 = none) is used by the backward
    to sum dx per row without sorting; it must agree with `pair_row_M` (not checked)."""
    save_preact = torch.is_grad_enabled() and (x_RD.requires_grad or w_gate_up_E2FD.requires_grad)
    if not save_preact and direct_call_ok():
        return grouped_swiglu_forward(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD, False)[0]
    op = _GroupedSwigluEager.apply if eager_function_ok() else _grouped_swiglu_op
    h_MF, _ = op(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD, save_preact, row_pairs_RK)
    return h_MF
