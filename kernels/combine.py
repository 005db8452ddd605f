"""Combine (sum each token's returned partials) and the pair→row segmented sum, in Triton.

Math (fp32 accumulation, results in the input dtype):
  combine          out[t] = Σ_{j : brim0[t,j] ≥ 0} z[brim0[t,j]]
  combine backward dz[s]  = dout[t] where brim0[t,j] = s; rows of z never named get 0.
                   Each row of z is named at most once (BRIM_0 is a re-index, not a fan-in), so
                   the backward is a scatter, not a scatter-add: no atomics, deterministic.
  segment sum      out[r] = Σ_{p : row[p] = r} src[p]   (src fp32 [M, D], pairs in any order)

Layout: `z_SD` [S, D] and `dout_TD` [T, D] of any float dtype and strides; `brim0_TJ` int [T, J]
with −1 for "no partial". The segment sum walks a CSR over rows, built on the device without a
host sync (`row_csr`): `order_M` are the pair ids sorted by row (stable sort, so the summation
order and hence the result are bitwise reproducible) and `row_ptr` [R+1] where the pairs of row r
are `order_M[row_ptr[r]:row_ptr[r+1]]`. It is the second half of the deterministic pair→row
reduction used by `grouped_down_reduce` (forward) and `grouped_swiglu` (backward, dx).

Grids: one program per (block of BLOCK_T tokens or rows, block of BLOCK_D columns). On a GPU the
block sizes are autotuned; under TRITON_INTERPRET=1 one small fixed config is used (the
interpreter cannot autotune over several configs), decided at launch time.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import triton
import triton.language as tl

from .launch import interpreting, launch_tuned

if not __name__.startswith("occult.kernels."):
    # every op module imports this one: a copy under another name (`kernels.*` with the repository root
    # on sys.path) would register the torch custom ops a second time (kernels/__init__.py)
    raise ImportError(f"{__name__}: the kernels register torch custom ops once; import them as occult.kernels")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints (`triton.cdiv` is a constexpr function: ~1.8 µs a host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two ≥ n (0 for n ≤ 0), as `triton.next_power_of_2`, without its host cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def direct_call_ok(*grad_inputs: torch.Tensor) -> bool:
    """Whether a differentiable op of this package may call its implementation directly instead of
    through its torch custom op: `plain_eager`, and no autograd graph to record for `grad_inputs`.
    The custom op's dispatch costs 30–60 µs of host time per call on the H200 machine (docs/notes/performance.md),
    for nothing in an eager no-grad forward or an autograd backward."""
    if not plain_eager():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in grad_inputs))


def plain_eager() -> bool:
    """No torch.compile tracing, no torch dispatch mode (fake tensors, op counters) and no functorch
    transform (vmap, grad) active: the cases that need the registered custom ops."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._are_functorch_transforms_active())


# A/B switch for `eager_function_ok` (benchmarks patch it; not thread-safe).
EAGER_FUNCTIONS = [True]


def eager_function_ok() -> bool:
    """Whether a forward that records autograd may run through the op's plain `autograd.Function`
    (`eager_function`) instead of its torch custom op: `plain_eager`. The custom op is what
    torch.compile, fake tensors and vmap/grad need; in plain eager training its dispatch (the custom-op wrapper and its autograd node) costs host time per
    call that the `autograd.Function` does not (docs/notes/performance.md)."""
    return EAGER_FUNCTIONS[0] and plain_eager()


def eager_function(name: str, implementation, setup_context, backward) -> type[torch.autograd.Function]:
    """An `autograd.Function` with a custom op's implementation (called with the op's arguments, all
    passed positionally) and the very `setup_context` and `backward` registered for the op, so both
    paths save the same tensors and compute the same gradients. The forward takes `ctx` itself:
    a separate `setup_context` staticmethod would make every `apply` bind its arguments through
    `inspect.signature`, a host cost of its own."""

    def forward(ctx, *args):
        output = implementation(*args)
        setup_context(ctx, args, output)
        return output

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward),
        "__doc__": f"Eager autograd path of occult::{name}."})


_GATHER_CONFIGS = (
    triton.Config({"BLOCK_T": 16, "BLOCK_D": 256}, num_warps=4),
    triton.Config({"BLOCK_T": 32, "BLOCK_D": 256}, num_warps=8),
    triton.Config({"BLOCK_T": 8, "BLOCK_D": 512}, num_warps=4),
    triton.Config({"BLOCK_T": 4, "BLOCK_D": 1024}, num_warps=4),
)
# triton 3.6 fails to compile the segment sum with BLOCK_T >= 32 (a layout-conversion pass error;
# 3.9 compiles it), so its candidates keep BLOCK_T <= 16.
_SEGMENT_CONFIGS = (
    triton.Config({"BLOCK_T": 16, "BLOCK_D": 256}, num_warps=4),
    triton.Config({"BLOCK_T": 16, "BLOCK_D": 512}, num_warps=8),
    triton.Config({"BLOCK_T": 8, "BLOCK_D": 512}, num_warps=4),
    triton.Config({"BLOCK_T": 4, "BLOCK_D": 1024}, num_warps=4),
)
_INTERPRET_META = MappingProxyType({"BLOCK_T": 16, "BLOCK_D": 32})


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _combine_fwd_kernel(
    z_ptr, brim_ptr, out_ptr,
    T, D, J,
    stride_zs, stride_zd, stride_bt, stride_bj, stride_ot, stride_od,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask_d = offs_d < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in range(0, J):
        src = tl.load(brim_ptr + offs_t * stride_bt + j * stride_bj, mask=mask_t, other=-1)
        valid = src >= 0
        src = tl.where(valid, src, 0).to(tl.int64)
        rows = tl.load(
            z_ptr + src[:, None] * stride_zs + offs_d[None, :] * stride_zd,
            mask=valid[:, None] & mask_d[None, :], other=0.0,
        )
        acc += rows.to(tl.float32)
    tl.store(
        out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + offs_d[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_t[:, None] & mask_d[None, :],
    )


@triton.jit
def _combine_bwd_kernel(
    dout_ptr, brim_ptr, dz_ptr,
    T, D, J,
    stride_ot, stride_od, stride_bt, stride_bj, stride_zs, stride_zd,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask_d = offs_d < D
    grad = tl.load(
        dout_ptr + offs_t[:, None].to(tl.int64) * stride_ot + offs_d[None, :] * stride_od,
        mask=mask_t[:, None] & mask_d[None, :], other=0.0,
    )
    grad = grad.to(dz_ptr.dtype.element_ty)
    for j in range(0, J):
        dst = tl.load(brim_ptr + offs_t * stride_bt + j * stride_bj, mask=mask_t, other=-1)
        valid = dst >= 0
        dst = tl.where(valid, dst, 0).to(tl.int64)
        tl.store(
            dz_ptr + dst[:, None] * stride_zs + offs_d[None, :] * stride_zd,
            grad,
            mask=valid[:, None] & mask_d[None, :],
        )


@triton.jit
def _segment_sum_kernel(
    src_ptr, order_ptr, row_ptr_ptr, out_ptr,
    R, D,
    stride_sm, stride_sd, stride_or, stride_od,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_r = pid_r * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_r = offs_r < R
    mask_d = offs_d < D
    first = tl.load(row_ptr_ptr + offs_r, mask=mask_r, other=0)
    count = tl.load(row_ptr_ptr + offs_r + 1, mask=mask_r, other=0) - first
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in range(0, tl.max(count, axis=0)):
        has = j < count
        pair = tl.load(order_ptr + first + j, mask=has, other=0).to(tl.int64)
        acc += tl.load(
            src_ptr + pair[:, None] * stride_sm + offs_d[None, :] * stride_sd,
            mask=has[:, None] & mask_d[None, :], other=0.0,
        ).to(tl.float32)
    tl.store(
        out_ptr + offs_r[:, None].to(tl.int64) * stride_or + offs_d[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_r[:, None] & mask_d[None, :],
    )


_combine_fwd_tuned = triton.autotune(configs=list(_GATHER_CONFIGS), key=["D", "J"])(_combine_fwd_kernel)
_combine_bwd_tuned = triton.autotune(configs=list(_GATHER_CONFIGS), key=["D", "J"])(_combine_bwd_kernel)
_segment_sum_tuned = triton.autotune(configs=list(_SEGMENT_CONFIGS), key=["D"])(_segment_sum_kernel)


def _gather_grid(rows: int, cols: int):
    return lambda meta: (cdiv(rows, meta["BLOCK_T"]), cdiv(cols, meta["BLOCK_D"]))


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _check_brim(z_SD: torch.Tensor, brim0_TJ: torch.Tensor) -> None:
    if z_SD.dim() != 2 or not z_SD.is_floating_point():
        raise ValueError(f"combine: z_SD must be a 2-D float tensor, got {tuple(z_SD.shape)} {z_SD.dtype}")
    if brim0_TJ.dim() != 2 or brim0_TJ.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"combine: brim0_TJ must be a 2-D int32/int64 tensor, got {tuple(brim0_TJ.shape)} {brim0_TJ.dtype}"
        )
    if brim0_TJ.device != z_SD.device:
        raise ValueError(f"combine: brim0_TJ is on {brim0_TJ.device}, z_SD on {z_SD.device}")


def combine_forward(z_SD: torch.Tensor, brim0_TJ: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out [T, D] (`out_dtype`, default z's) = fp32 sum over j of z[brim0[t, j]] for brim0[t, j] ≥ 0."""
    _check_brim(z_SD, brim0_TJ)
    num_tokens, num_slots = brim0_TJ.shape
    hidden = z_SD.shape[1]
    out_TD = torch.empty(num_tokens, hidden, dtype=out_dtype or z_SD.dtype, device=z_SD.device)
    if num_tokens == 0 or hidden == 0:
        return out_TD
    if z_SD.shape[0] == 0 or num_slots == 0:
        return out_TD.zero_()
    args = (
        z_SD, brim0_TJ, out_TD, num_tokens, hidden, num_slots,
        *z_SD.stride(), *brim0_TJ.stride(), *out_TD.stride(),
    )
    if interpreting():
        _combine_fwd_kernel[_gather_grid(num_tokens, hidden)(_INTERPRET_META)](*args, **_INTERPRET_META)
    else:
        launch_tuned(_combine_fwd_tuned, _gather_grid(num_tokens, hidden), args)
    return out_TD


def combine_backward(dout_TD: torch.Tensor, brim0_TJ: torch.Tensor, num_rows: int) -> torch.Tensor:
    """dz [num_rows, D]: dz[brim0[t, j]] = dout[t]; rows never named are 0."""
    _check_brim(dout_TD, brim0_TJ)
    num_tokens, num_slots = brim0_TJ.shape
    hidden = dout_TD.shape[1]
    dz_SD = torch.zeros(num_rows, hidden, dtype=dout_TD.dtype, device=dout_TD.device)
    if num_tokens == 0 or num_slots == 0 or num_rows == 0 or hidden == 0:
        return dz_SD
    args = (
        dout_TD, brim0_TJ, dz_SD, num_tokens, hidden, num_slots,
        *dout_TD.stride(), *brim0_TJ.stride(), *dz_SD.stride(),
    )
    if interpreting():
        _combine_bwd_kernel[_gather_grid(num_tokens, hidden)(_INTERPRET_META)](*args, **_INTERPRET_META)
    else:
        launch_tuned(_combine_bwd_tuned, _gather_grid(num_tokens, hidden), args)
    return dz_SD


def gather_sum_rows(src_MD: torch.Tensor, row_pairs_RK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """out [R, D] (out_dtype) = fp32 sum of src[row_pairs[r, j]] over j with row_pairs[r, j] ≥ 0.

    The pair → row reduction when each row's pairs are listed in an [R, K] table (the packed-row
    dispatch gives it for free): one gather pass, no sort, summation order fixed by the table
    (deterministic). Same kernel as `combine`.
    """
    return combine_forward(src_MD, row_pairs_RK, out_dtype)


def check_row_table(op: str, row_pairs_RK: torch.Tensor, num_rows: int, device: torch.device) -> None:
    """A row → pairs table must be int [num_rows, K] on `device`; raises ValueError naming it."""
    if row_pairs_RK.dim() != 2 or row_pairs_RK.shape[0] != num_rows or row_pairs_RK.dtype not in (
        torch.int32, torch.int64
    ):
        raise ValueError(
            f"{op}: row_pairs_RK must be an int [R={num_rows}, K] tensor, got "
            f"{tuple(row_pairs_RK.shape)} {row_pairs_RK.dtype}"
        )
    if row_pairs_RK.device != device:
        raise ValueError(f"{op}: row_pairs_RK is on {row_pairs_RK.device}, expected {device}")


def row_csr(pair_row_M: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_M, row_ptr [R+1]): the pairs of row r are order_M[row_ptr[r]:row_ptr[r+1]].

    Built with a stable sort and a binary search, entirely on the device (no host sync).
    """
    order_M = torch.argsort(pair_row_M, stable=True)
    sorted_rows = pair_row_M[order_M]
    bounds = torch.arange(num_rows + 1, device=pair_row_M.device, dtype=sorted_rows.dtype)
    row_ptr = torch.searchsorted(sorted_rows, bounds)
    return order_M, row_ptr


def segment_sum_rows(
    src_MD: torch.Tensor, order_M: torch.Tensor, row_ptr: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """out [R, D] (out_dtype) = fp32 sum of the rows of src named by each row's CSR segment."""
    num_rows = row_ptr.shape[0] - 1
    hidden = src_MD.shape[1]
    out_RD = torch.empty(num_rows, hidden, dtype=out_dtype, device=src_MD.device)
    if num_rows == 0 or hidden == 0:
        return out_RD
    if src_MD.shape[0] == 0:
        return out_RD.zero_()
    args = (src_MD, order_M, row_ptr, out_RD, num_rows, hidden, *src_MD.stride(), *out_RD.stride())
    if interpreting():
        _segment_sum_kernel[_gather_grid(num_rows, hidden)(_INTERPRET_META)](*args, **_INTERPRET_META)
    else:
        launch_tuned(_segment_sum_tuned, _gather_grid(num_rows, hidden), args)
    return out_RD


# ----------------------------------------------------------------------------------------------
# Differentiable op
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("occult::combine", mutates_args=())
def _combine_op(z_SD: torch.Tensor, brim0_TJ: torch.Tensor) -> torch.Tensor:
    return combine_forward(z_SD, brim0_TJ)


@_combine_op.register_fake
def _(z_SD: torch.Tensor, brim0_TJ: torch.Tensor) -> torch.Tensor:
    return z_SD.new_empty(brim0_TJ.shape[0], z_SD.shape[1])


@torch.library.custom_op("occult::combine_backward", mutates_args=())
def _combine_backward_op(dout_TD: torch.Tensor, brim0_TJ: torch.Tensor, num_rows: int) -> torch.Tensor:
    return combine_backward(dout_TD, brim0_TJ, num_rows)


@_combine_backward_op.register_fake
def _(dout_TD: torch.Tensor, brim0_TJ: torch.Tensor, num_rows: int) -> torch.Tensor:
    return dout_TD.new_empty(num_rows, dout_TD.shape[1])


def _combine_setup_context(ctx, inputs, output) -> None:
    z_SD, brim0_TJ = inputs
    ctx.save_for_backward(brim0_TJ)
    ctx.num_rows = z_SD.shape[0]
    ctx.z_dtype = z_SD.dtype


def _combine_grad(ctx, dout_TD: torch.Tensor):
    (brim0_TJ,) = ctx.saved_tensors
    backward = combine_backward if direct_call_ok(dout_TD) else _combine_backward_op
    dz_SD = backward(dout_TD.to(ctx.z_dtype), brim0_TJ, ctx.num_rows)
    return dz_SD, None


_combine_op.register_autograd(_combine_grad, setup_context=_combine_setup_context)
_CombineEager = eager_function("combine", combine_forward, _combine_setup_context, _combine_grad)


def combine(z_SD: torch.Tensor, brim0_TJ: torch.Tensor) -> torch.Tensor:
    """out [T, D] = Σ_j z[brim0[t, j]] over brim0[t, j] ≥ 0, fp32 accumulation (differentiable in z)."""
    if direct_call_ok(z_SD):
        return combine_forward(z_SD, brim0_TJ)
    if eager_function_ok():
        return _CombineEager.apply(z_SD, brim0_TJ)
    return _combine_op(z_SD, brim0_TJ)
