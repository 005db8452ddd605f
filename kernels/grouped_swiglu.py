"""Gather-fused grouped gate/up GEMM with the SwiGLU fused in its epilogue, in Triton.

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
* dg/du come from one elementwise pass that writes [dg | du] [M, 2F] once (`SWIGLU_BWD_MODE =
  "materialized"`, the default: measured faster), or are recomputed inside both backward GEMMs'
  A-operand prologues ("fused", never materialised).
* dx: each pair's dx row goes to an [M, D] buffer (`partial_dtype`), then a deterministic fp32 sum over
  a row→pairs CSR (see `combine.py`) adds the pairs of each row in a fixed order (no atomics:
  bitwise reproducible, autotune-safe, and the interpreter has no bf16 atomics).
* dW: one program per (expert, F block, D block), looping over that expert's pairs; an empty
  expert writes zeros.

Tiles are bf16/fp16 `tl.dot`s with fp32 accumulators; fp32 inputs use input_precision="ieee"
(no TF32). On a GPU the kernels are autotuned over a few configs (key: D, F); under
TRITON_INTERPRET=1 one config with 16-wide blocks is used, decided at launch time.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from .combine import (cdiv, check_row_table, direct_call_ok, eager_function, eager_function_ok, gather_sum_rows,
                      interpreting, next_pow2, row_csr, segment_sum_rows)
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


def swiglu_dx_uses_tma(preact_M2F: torch.Tensor, w_gate_up_E2FD: torch.Tensor, grads_ready: bool) -> bool:
    """The dx GEMM's operand path: descriptors only for a materialised [dg | du] and F a multiple of
    every BLOCK_K (else a dg tile's K tail would read du columns)."""
    ffn = w_gate_up_E2FD.shape[1] // 2
    return grads_ready and ffn % MAX_BLOCK_K == 0 and use_tma(preact_M2F, w_gate_up_E2FD)


def _descriptor_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_descriptor_allocator() -> None:
    """Device-side tensor descriptors need global scratch from `triton.set_allocator`; set ours
    (torch's caching allocator, so CUDA-graph capture works) unless the caller has set one. The
    setting is a context variable, so it is checked on every launch (autograd's thread too)."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_descriptor_scratch)

# ----------------------------------------------------------------------------------------------
# Shared device helpers (also used by grouped_down_reduce)
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
def capability_major(device: torch.device) -> int:
    """The compute capability's major version of a CUDA `device` (a tensor's: it has an index),
    memoised: `torch.cuda.get_device_capability` builds the device's properties on every call."""
    return torch.cuda.get_device_capability(device)[0]


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if interpreting() or device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


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


_swiglu_fwd_tuned = triton.autotune(configs=list(SWIGLU_FWD_CONFIGS), key=["D", "F", "TMA"])(_swiglu_fwd_kernel)
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
# Launchers
# ----------------------------------------------------------------------------------------------


def _check_swiglu(x_RD: torch.Tensor, pair_row_M: torch.Tensor, expert_offsets: torch.Tensor,
                  w_gate_up_E2FD: torch.Tensor) -> None:
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


def grouped_swiglu_forward(
    x_RD: torch.Tensor,
    pair_row_M: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_gate_up_E2FD: torch.Tensor,
    save_preact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_MF, preact_M2F): the SwiGLU output and, if `save_preact`, the [g | u] pre-activations
    (else a [0, 2F] tensor). Both in x's dtype."""
    _check_swiglu(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD)
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
    x_operand = _pair_order_x_operand(_swiglu_fwd_kernel, x_RD, pair_row_M, num_pairs, (hidden, ffn), tma)
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
    _check_swiglu(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD)
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
            x_operand = _pair_order_x_operand(_swiglu_bwd_dw_kernel, x_RD, pair_row_M, num_pairs, measured_shape, tma)
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


def _pair_order_x_operand(kernel, x_RD: torch.Tensor, pair_row_M: torch.Tensor, num_pairs: int,
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
    ctx.bwd_mode = SWIGLU_BWD_MODE          # the mode in force when the forward ran


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
