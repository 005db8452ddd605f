"""Which config and operand path each grouped GEMM kernel launches with.

Configs: the autotuner's candidates per kernel (`SWIGLU_*_CONFIGS`, `SINGLE_ACC_CONFIGS`), one
fixed config where autotuning does not pay (the interpreter, fp32 inputs, small problems), and
measured winners pinned per shape and operand path (`TUNED_GEMM_META`). `fixed_gemm_meta` decides
at each launch and `launch_gemm` launches with its choice; the config sweep
(`occult.harness.kernel_tune`) forces one config at a time (`forced_gemm_meta`) and reads what each
launcher chose (`LAST_LAUNCH_META`).

Operand paths: tensor descriptors (TMA) for 16-bit operands on Hopper (`use_tma`; `tma_disabled`
switches them off for A/B runs), and, for configs with `X_TMA`, the gathered operand copied once
into pair order (`gathered_operand_wanted`, `pair_order_x_operand`).

Shared by the kernels of `grouped_swiglu`, `grouped_swiglu_backward` and `grouped_down_reduce`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
from triton.runtime import _allocation

from .combine import interpreting
from .launch import launch, launch_tuned


def _configs(*shapes: tuple[int, int, int, int, int]) -> tuple[triton.Config, ...]:
    return tuple(
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)
        for bm, bn, bk, warps, stages in shapes
    )


# GPU autotuning candidates (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), chosen from an offline
# sm_90 compile (triton 3.9) so that none needs more than 227 KiB of shared memory or spills.
# The forward and dW kernels carry two accumulators (gate and up), so their N block is half-width.
SWIGLU_FWD_CONFIGS = _configs(
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 8, 4), (128, 128, 32, 8, 4), (64, 256, 64, 8, 3),
)
SWIGLU_DX_CONFIGS = _configs(
    (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 64, 64, 8, 4), (128, 128, 64, 8, 2), (64, 64, 64, 4, 4),
)
SWIGLU_DW_CONFIGS = _configs(
    (128, 64, 64, 8, 4), (128, 128, 32, 8, 4), (64, 256, 64, 8, 3), (64, 64, 64, 4, 4),
)
SINGLE_ACC_CONFIGS = _configs(
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 32, 8, 4),
)
# Without autotuning: the interpreter (16-wide blocks keep its per-program cost low while still
# giving several tiles per expert in tests), fp32 inputs on a GPU (a correctness path only) and
# small problems (tuning them buys little and each tuned shape costs several compiles).
INTERPRET_GEMM_META = MappingProxyType({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16})
FP32_GEMM_META = MappingProxyType({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2})
SMALL_GEMM_META = MappingProxyType({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3})
AUTOTUNE_MIN_PAIRS = 8192
# Every BLOCK_K a GEMM may run with divides this, so a K dimension that it divides needs no K mask.
MAX_BLOCK_K = 128
GROUP_M = 8


# Measured winners of the config sweep that beat the autotuner's pick by a margin worth pinning:
# results/nvidia-h200-x2/tune_v1 (H200, bf16, OLMoE experts D=2048, F=1024, 131k pairs a rank):
# swiglu_fwd 2.310 -> 2.226 ms (pointer operands), swiglu_dx 3.577 -> 2.687 ms, swiglu_dw 3.277 ->
# 2.747 ms. Used for 16-bit inputs of that (D, F) on compute capability 9.x from AUTOTUNE_MIN_PAIRS
# pairs on; every other case autotunes. Key: (kernel name, capability major, D, F, TMA operands).
# With TMA operands the forward SwiGLU's pointer winner ran 2.45 ms against 1.92 for 128x128x64
# (results/nvidia-h200/kernels_v3b/tune.csv), so that path has its own entries; with warp
# specialisation that config ran 1.80 ms against 2.01 without, and the down projection's best was
# 128x256x64 w8 s4 at 1.17 ms against the autotuner's 1.23 (results/nvidia-h200/tune_v2/tune.csv).
# The TMA dx GEMM's best, 128x128x64 w8 s3, ran 2.51 ms against 2.73 for the best pointer config of
# the same grid in the same call (results/nvidia-h200/tune_v3/tune.csv). Interleaved A/B pairs in one
# process (results/nvidia-h200/kernels_v8/tune_ab.csv): the persistent down GEMM 1.05/1.09 ms against
# 1.18/1.28 one tile per program; descriptor dW operands, down 1.60/1.58 against 1.82/1.84 ms with
# pointers (same config), SwiGLU 2.72/2.72 against 2.73/2.86. At F = 1408 (Qwen1.5-MoE, DeepSeek-MoE;
# DeepSeek's 98k pairs a rank, A B A B after the autotuner's pick, results/nvidia-h200/tune_v5) the
# same two pins won: the persistent down GEMM 0.98/1.06 ms against the autotuner's 1.16, the SwiGLU
# dW 2.53/2.76 against 2.88; the forward SwiGLU, dx, down dh and dW autotune (within 2% of the pins).
# The SwiGLU dW with x gathered once and loaded through a descriptor (X_TMA), A B C A B C in one
# process (results/nvidia-h200/tune_v6): F = 1024 2.75/2.71 ms (64x128x32 pin) -> 2.31/2.32 (same
# tiles, X_TMA) -> 2.13/2.23 (128x256x64 w8 s3, X_TMA and one accumulator over [dg | du]); F = 1408
# 2.81/2.96 -> 2.39/2.37 (X_TMA; one accumulator 2.25/2.57, less stable, not pinned). The down dW
# with gate · dy gathered once (X_TMA), F = 1024 (results/nvidia-h200/tune_v7): 1.65/1.73 ms (the
# 128x128x64 pin) -> 1.08/1.12 (same tiles) -> 0.99/1.04 (128x256x64 w8 s3, pinned); F = 1408
# (results/nvidia-h200/tune_v8, A B C D twice): autotuned 1.66, pointers 128x128x64 w8 s4 1.69/1.67
# -> X_TMA 1.10/1.13 (same tiles, pinned; 128x256x64 w8 s3 1.12/1.13, 64x128x32 w4 s5 1.53/1.54).
# The forward SwiGLU with X_TMA lost (results/nvidia-h200/tune_v9: 2.09-2.60 ms against the pin's
# 1.98-1.99 at F = 1024 and 1408, gather included; the layer 2-11% slower): not pinned.
# The forward SwiGLU with one accumulator over a tile's gate and up rows (ONE_ACC, W viewed as
# [E, 2, F, D]; results/nvidia-h200/tune_v10, interleaved, two passes): F = 1024 1.89/1.93 ms against
# 2.00/2.01 for the WARP_SPEC pin, F = 1408 1.99/2.00 against 2.12/2.10 (and the autotuner's 2.09);
# the layer at 2^16 tokens 1-2% faster: pinned at both widths.
TUNED_GEMM_META: Mapping[tuple[str, int, int, int, bool], Mapping[str, int]] = MappingProxyType({
    ("_swiglu_fwd_kernel", 9, 2048, 1024, False): MappingProxyType(
        {"BLOCK_M": 256, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}),
    ("_swiglu_fwd_kernel", 9, 2048, 1024, True): MappingProxyType(
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4, "ONE_ACC": 1}),
    ("_down_fwd_kernel", 9, 2048, 1024, True): MappingProxyType(
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4, "PERSISTENT": 1}),
    ("_down_bwd_dw_kernel", 9, 2048, 1024, True): MappingProxyType(
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "X_TMA": 1}),
    ("_swiglu_bwd_dw_kernel", 9, 2048, 1024, True): MappingProxyType(
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "X_TMA": 1, "ONE_ACC": 1}),
    ("_swiglu_bwd_dx_kernel", 9, 2048, 1024, True): MappingProxyType(
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}),
    ("_swiglu_bwd_dx_kernel", 9, 2048, 1024, False): MappingProxyType(
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2}),
    ("_swiglu_bwd_dw_kernel", 9, 2048, 1024, False): MappingProxyType(
        {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 4, "num_stages": 5}),
    # Qwen1.5-MoE and DeepSeek-MoE experts (F = 1408), results/nvidia-h200/tune_v5
    ("_swiglu_fwd_kernel", 9, 2048, 1408, True): MappingProxyType(
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4, "ONE_ACC": 1}),
    ("_down_fwd_kernel", 9, 2048, 1408, True): MappingProxyType(
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4, "PERSISTENT": 1}),
    ("_swiglu_bwd_dw_kernel", 9, 2048, 1408, True): MappingProxyType(
        {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 4, "num_stages": 5, "X_TMA": 1}),
    ("_down_bwd_dw_kernel", 9, 2048, 1408, True): MappingProxyType(
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4, "X_TMA": 1}),
})


def fixed_gemm_meta(dtype: torch.dtype, num_pairs: int, kernel_name: str | None = None,
                    shape: tuple[int, int] | None = None,
                    device: torch.device | None = None, tma: bool = False) -> Mapping[str, int] | None:
    """The single config to launch with, or None to autotune (decided per launch). A config forced
    for `kernel_name` (`forced_gemm_meta`, the config sweep of `tune_kernels`) wins over all; then
    a measured one of `TUNED_GEMM_META` for this (D, F) = `shape`, operand path (`tma`) and
    `device`'s architecture."""
    if kernel_name is not None and kernel_name in _FORCED_META:
        return _FORCED_META[kernel_name]
    if interpreting():
        return INTERPRET_GEMM_META
    if dtype == torch.float32:
        return FP32_GEMM_META
    if num_pairs < AUTOTUNE_MIN_PAIRS:
        return SMALL_GEMM_META
    if _PINNING[0] and shape is not None and device is not None and device.type == "cuda" and kernel_name is not None:
        tuned = TUNED_GEMM_META.get((kernel_name, capability_major(device), *shape, tma))
        if tuned is not None:
            return tuned
    return None


_FORCED_META: dict[str, Mapping[str, int]] = {}
_PINNING = [True]


@contextlib.contextmanager
def pinned_configs_disabled():
    """Inside the block, shapes of `TUNED_GEMM_META` autotune like any other (for the config
    sweep's autotuner baseline). Not thread-safe."""
    previous, _PINNING[0] = _PINNING[0], False
    try:
        yield
    finally:
        _PINNING[0] = previous


def kernel_name(kernel) -> str:
    """The Python name of a `triton.jit` kernel (also under the interpreter)."""
    return getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))


@contextlib.contextmanager
def forced_gemm_meta(name: str, meta: Mapping[str, int]):
    """Launch the GEMM kernel called `name` with `meta` (BLOCK_M/N/K, num_warps, num_stages and
    optionally GROUP_SIZE) inside the block, bypassing the autotuner: one config at a time for the
    config sweep. Not thread-safe; restores the previous state on exit."""
    missing = {"BLOCK_M", "BLOCK_N", "BLOCK_K"} - set(meta)
    if missing:
        raise ValueError(f"forced_gemm_meta: meta for {name} lacks {sorted(missing)}")
    if MAX_BLOCK_K % meta["BLOCK_K"]:
        raise ValueError(f"forced_gemm_meta: BLOCK_K {meta['BLOCK_K']} for {name} does not divide {MAX_BLOCK_K}")
    previous = _FORCED_META.get(name)
    _FORCED_META[name] = MappingProxyType(dict(meta))
    try:
        yield
    finally:
        if previous is None:
            _FORCED_META.pop(name, None)
        else:
            _FORCED_META[name] = previous


# The config each GEMM kernel was last launched with (None: autotuned), by kernel name: what an op
# launches by default, as its own launcher decided it (the config sweep's "pinned" row).
LAST_LAUNCH_META: dict[str, Mapping[str, int] | None] = {}


def launch_gemm(tuned, kernel, grid, args: tuple, consts: dict, dtype: torch.dtype, num_pairs: int,
                shape: tuple[int, int] | None = None) -> None:
    """Launch `kernel` with the fixed, forced or measured config for (dtype, size, (D, F) = `shape`),
    or its autotuned wrapper `tuned`. The device is that of the first tensor argument."""
    device = args[0].device if shape is not None else None
    name = kernel_name(kernel)
    meta = fixed_gemm_meta(dtype, num_pairs, name, shape, device, bool(consts.get("TMA", False)))
    LAST_LAUNCH_META[name] = meta
    if meta is None:
        launch_tuned(tuned, grid, args, consts)
    else:
        launch(kernel, grid(meta), args, {**consts, **meta})


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of per-pair rows that are summed per row afterwards (in fp32): the activation dtype for
    16-bit activations (half the memory traffic; one rounding per pair, as per-expert dispatch
    rounds each returned row), fp32 for fp32 inputs."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 products for fp32 inputs (tensor cores otherwise)."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------------------------
# TMA (tensor-descriptor) operands: both forward GEMMs and the SwiGLU dx GEMM
# ----------------------------------------------------------------------------------------------

_TMA = [True]


@contextlib.contextmanager
def tma_disabled():
    """Inside the block every GEMM loads its operands through pointers (the pre-TMA path), for A/B
    runs of the benchmark. Not thread-safe."""
    previous, _TMA[0] = _TMA[0], False
    try:
        yield
    finally:
        _TMA[0] = previous


def tma_matrix_ok(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (2-D, or 3-D whose first two dims collapse) can back a tensor descriptor:
    last dim contiguous, 16-byte aligned base and row stride."""
    if tensor.dim() == 3:
        if tensor.stride(0) != tensor.shape[1] * tensor.stride(1) and tensor.shape[0] > 1:
            return False
        row_stride = tensor.stride(1)
    elif tensor.dim() == 2:
        row_stride = tensor.stride(0)
    else:
        return False
    size = tensor.element_size()
    return (tensor.numel() > 0 and tensor.stride(-1) == 1 and tensor.data_ptr() % 16 == 0
            and (row_stride * size) % 16 == 0)


def use_tma(*tensors: torch.Tensor) -> bool:
    """TMA loads for these operands: 16-bit operands on Hopper or newer (the measured case; fp32, a
    correctness path on GPUs, keeps pointers), or any dtype in the interpreter, which emulates them;
    every operand descriptor-compatible, and not switched off by `tma_disabled`."""
    if not _TMA[0] or not all(tma_matrix_ok(t) for t in tensors):
        return False
    if interpreting():
        return True
    device = tensors[0].device
    if device.type != "cuda" or capability_major(device) < 9:
        return False
    if any(t.element_size() != 2 for t in tensors):
        return False
    _ensure_descriptor_allocator()
    return True


def _descriptor_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_descriptor_allocator() -> None:
    """Device-side tensor descriptors need global scratch from `triton.set_allocator`; set ours
    (torch's caching allocator, so CUDA-graph capture works) unless the caller has set one. The
    setting is a context variable, so it is checked on every launch (autograd's thread too)."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_descriptor_scratch)


@functools.lru_cache(maxsize=None)
def capability_major(device: torch.device) -> int:
    """The compute capability's major version of a CUDA `device` (a tensor's: it has an index),
    memoised: `torch.cuda.get_device_capability` builds the device's properties on every call."""
    return torch.cuda.get_device_capability(device)[0]


# ----------------------------------------------------------------------------------------------
# Gathered operands in pair order (configs with X_TMA)
# ----------------------------------------------------------------------------------------------


def gathered_operand_wanted(kernel, dtype: torch.dtype, num_pairs: int, shape: tuple[int, int] | None,
                            device: torch.device, tma: bool, row_bytes: int) -> bool:
    """Whether the config `kernel` launches with asks for its gathered operand in pair order
    (`X_TMA`: gathered once before the launch into rows of `row_bytes`, then loaded through a
    descriptor). `X_TMA` and `ONE_ACC` need descriptor operands (`tma`), and `X_TMA` rows a
    descriptor can address (16-byte multiples); a config asking for them without is refused."""
    meta = fixed_gemm_meta(dtype, num_pairs, kernel_name(kernel), shape, device, tma)
    if meta is None or not (meta.get("X_TMA") or meta.get("ONE_ACC")):
        return False
    if not tma:
        raise ValueError(f"{kernel_name(kernel)}: config {dict(meta)} needs descriptor operands (16-bit, "
                         "TMA-capable, and for the SwiGLU dW a materialised [dg | du])")
    if meta.get("X_TMA") and row_bytes % 16:
        raise ValueError(f"{kernel_name(kernel)}: X_TMA needs rows of a multiple of 16 bytes, got {row_bytes}")
    return bool(meta.get("X_TMA"))


def pair_order_x_operand(kernel, x_RD: torch.Tensor, pair_row_M: torch.Tensor, num_pairs: int,
                         shape: tuple[int, int] | None, tma: bool) -> torch.Tensor:
    """The x operand of a SwiGLU GEMM that reads x by pair (the forward, the dW): x_RD itself
    (rows gathered in the K loop), or, for a config of `kernel` with X_TMA, x gathered once in pair
    order ([M, D], one extra write and read of M·D elements) so that the K loop loads it through a
    descriptor."""
    if not gathered_operand_wanted(kernel, x_RD.dtype, num_pairs, shape, x_RD.device, tma,
                                   x_RD.shape[1] * x_RD.element_size()):
        return x_RD
    # rows of a padded plan's pairs past the last expert are never read back; clamped, they are
    # always valid indices whatever the plan left there
    return x_RD.index_select(0, pair_row_M.clamp(0, max(x_RD.shape[0] - 1, 0)))
