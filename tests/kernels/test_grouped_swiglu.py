"""grouped_swiglu (Triton) against grouped_swiglu_ref: forward, dx and dW, over edge-case routings.

On CPU the kernels run in the Triton interpreter (tests/conftest.py) in fp32 and fp16; bf16 and
the autotuned GPU configs are checked by the `gpu` tests."""

from __future__ import annotations

import contextlib
import importlib
import math

import pytest
import torch

from occult.kernels.grouped_swiglu import grouped_swiglu, grouped_swiglu_forward
from occult.kernels.grouped_swiglu_backward import grouped_swiglu_backward
from occult.kernels.reference import grouped_swiglu_ref

gemm_configs = importlib.import_module("occult.kernels.gemm_configs")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# name -> (rows R, hidden D, ffn F, experts E, experts of each row); rows absent from the
# lists get no pair. Non-powers of two, empty experts, one hot expert, M = 0, R = 1.
CASES = {
    "basic": (24, 32, 16, 4, "random2"),
    "npow2": (20, 48, 40, 4, "random2"),
    "empty_experts": (18, 32, 24, 4, [[0, 2], [2], [], [0], [2, 0], [2]] * 3),
    "hot_expert": (40, 32, 16, 4, [[3]] * 40),
    "no_pairs": (6, 32, 16, 3, [[]] * 6),
    "one_row": (1, 48, 40, 4, [[3, 1, 0]]),
    "all_experts": (9, 32, 16, 4, [[0, 1, 2, 3], [], [3, 2, 1, 0]] * 3),
}
DTYPES = {  # dtype -> (atol, rtol) against an fp32 reference
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 1e-2),
}


def pairs_from_rows(row_experts: list[list[int]], num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_row_M, expert_offsets) with pairs sorted by expert (row order inside an expert)."""
    by_expert = [[r for r, experts in enumerate(row_experts) if e in experts] for e in range(num_experts)]
    pair_row = torch.tensor([r for rows in by_expert for r in rows], dtype=torch.int64)
    counts = torch.tensor([len(rows) for rows in by_expert], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    return pair_row, offsets


def make_case(name: str, dtype: torch.dtype, seed: int = 0):
    rows, hidden, ffn, experts, routing = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    if routing == "random2":
        routing = [torch.randperm(experts, generator=gen)[:2].tolist() if r % 5 else [] for r in range(rows)]
    pair_row, offsets = pairs_from_rows(routing, experts)
    x = torch.randn(rows, hidden, generator=gen)
    w = torch.randn(experts, 2 * ffn, hidden, generator=gen) / math.sqrt(hidden)
    dev = torch.device(DEVICE)
    return x.to(dev, dtype), pair_row.to(dev), offsets.to(dev), w.to(dev, dtype)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every torch.empty float tensor starts as NaN, so an element a kernel skips shows up."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-(2**30))

    monkeypatch.setattr(torch, "empty", nan_empty)


@pytest.fixture(params=["fused", "materialized"])
def bwd_mode(request, monkeypatch):
    """Both ways the backward gets (dg, du): recomputed in the GEMM prologues, or one elementwise pass."""
    import importlib

    module = importlib.import_module("occult.kernels.grouped_swiglu_backward")
    monkeypatch.setattr(module, "SWIGLU_BWD_MODE", request.param)
    return request.param


def reference_grads(x, pair_row, offsets, w, grad_out):
    x32 = x.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    h32 = grouped_swiglu_ref(x32, pair_row, offsets, w32)
    if h32.numel() == 0:
        return h32, torch.zeros_like(x32), torch.zeros_like(w32)
    dx32, dw32 = torch.autograd.grad(h32, (x32, w32), grad_out.float())
    return h32.detach(), dx32, dw32


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_grads_match_reference(case, dtype, poisoned_empty, bwd_mode):
    atol, rtol = DTYPES[dtype]
    x, pair_row, offsets, w = make_case(case, dtype)
    x.requires_grad_()
    w.requires_grad_()
    h = grouped_swiglu(x, pair_row, offsets, w)
    assert h.dtype == dtype and h.shape == (pair_row.numel(), w.shape[1] // 2)
    grad_out = torch.randn(h.shape, generator=torch.Generator().manual_seed(1)).to(h.device, dtype)
    h_ref, dx_ref, dw_ref = reference_grads(x, pair_row, offsets, w, grad_out)
    torch.testing.assert_close(h.float(), h_ref, atol=atol, rtol=rtol)
    dx, dw = torch.autograd.grad(h, (x, w), grad_out, allow_unused=True)
    if h.numel() == 0:  # nothing flowed through the op: autograd may skip it altogether
        dx = torch.zeros_like(x) if dx is None else dx
        dw = torch.zeros_like(w) if dw is None else dw
    assert dx.dtype == dtype and dw.dtype == dtype
    torch.testing.assert_close(dx.float(), dx_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(dw.float(), dw_ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("which", ["x", "w"])
def test_gradient_of_one_input_only(which, poisoned_empty):
    x, pair_row, offsets, w = make_case("npow2", torch.float32)
    leaf = x if which == "x" else w
    leaf.requires_grad_()
    h = grouped_swiglu(x, pair_row, offsets, w)
    grad_out = torch.randn_like(h)
    (grad,) = torch.autograd.grad(h, (leaf,), grad_out)
    _, dx_ref, dw_ref = reference_grads(x, pair_row, offsets, w, grad_out)
    torch.testing.assert_close(grad, dx_ref if which == "x" else dw_ref, atol=1e-4, rtol=1e-4)


def test_rows_without_pairs_get_zero_gradient():
    x, pair_row, offsets, w = make_case("empty_experts", torch.float32)
    x.requires_grad_()
    h = grouped_swiglu(x, pair_row, offsets, w)
    (dx,) = torch.autograd.grad(h, (x,), torch.ones_like(h))
    unrouted = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    unrouted[pair_row] = False
    assert unrouted.any() and torch.all(dx[unrouted] == 0)
    assert torch.all(dx[~unrouted].abs().sum(dim=1) > 0)


def test_no_grad_forward_matches():
    x, pair_row, offsets, w = make_case("basic", torch.float32)
    with torch.no_grad():
        h = grouped_swiglu(x, pair_row, offsets, w)
    torch.testing.assert_close(h, grouped_swiglu_ref(x, pair_row, offsets, w), atol=1e-4, rtol=1e-4)


def test_bad_input_names_the_field():
    x, pair_row, offsets, w = make_case("basic", torch.float32)
    with pytest.raises(ValueError, match="expert_offsets"):
        grouped_swiglu(x, pair_row, offsets[:-1], w)
    with pytest.raises(ValueError, match="w_gate_up_E2FD"):
        grouped_swiglu(x, pair_row, offsets, w.half())
    with pytest.raises(ValueError, match="pair_row_M"):
        grouped_swiglu(x, pair_row.float(), offsets, w)


def test_opcheck_registrations():
    x, pair_row, offsets, w = make_case("basic", torch.float32)
    torch.library.opcheck(
        torch.ops.occult.grouped_swiglu_fwd.default,
        (x.requires_grad_(), pair_row, offsets, w.requires_grad_(), True),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )



@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("hidden", [40, 128])
def test_forward_weight_operand_paths_match_reference(tma, hidden, poisoned_empty):
    """Both ways the forward loads the weights: tensor descriptors (the default where their layout
    allows) and pointers. D = 40 leaves a K tail after the 16-wide blocks (masked A loads, checked
    against NaN past the row's end); D = 128
    is a multiple of every BLOCK_K (unmasked); F = 24 is not a multiple of the N block, so the gate
    tile's last columns read up-projection rows that are not stored."""
    gen = torch.Generator().manual_seed(hidden)
    rows, ffn, experts = 30, 24, 4
    routing = [torch.randperm(experts, generator=gen)[:2].tolist() if r % 4 else [3] for r in range(rows)]
    pair_row, offsets = pairs_from_rows(routing, experts)
    # x's rows sit in a wider buffer whose extra columns are NaN: a K tail that reads past D would
    # turn the output NaN even where the weights' side of the product is zero
    padded = torch.full((rows, hidden + 8), float("nan"))
    padded[:, :hidden] = torch.randn(rows, hidden, generator=gen)
    x = padded.to(DEVICE)[:, :hidden]
    w = (torch.randn(experts, 2 * ffn, hidden, generator=gen) / math.sqrt(hidden)).to(DEVICE)
    hopper = DEVICE == "cpu"     # the interpreter emulates TMA for any dtype; a GPU uses it for 16-bit only
    with contextlib.nullcontext() if tma else gemm_configs.tma_disabled():
        assert gemm_configs.use_tma(w) == (tma and hopper)
        h = grouped_swiglu(x, pair_row.to(DEVICE), offsets.to(DEVICE), w)
    torch.testing.assert_close(h, grouped_swiglu_ref(x, pair_row.to(DEVICE), offsets.to(DEVICE), w),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("case", ["npow2", "empty_experts", "hot_expert"])
def test_persistent_forward_matches_reference(case, tma, poisoned_empty):
    """A PERSISTENT forward config (3 programs in the interpreter, one per SM on a GPU) loops each
    program over several tiles; h and the saved pre-activations (checked through dx and dW) are
    those of the reference."""
    x, pair_row, offsets, w = make_case(case, torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    meta = {**gemm_configs.fixed_gemm_meta(torch.float32, pair_row.numel()), "PERSISTENT": 1}
    with gemm_configs.forced_gemm_meta("_swiglu_fwd_kernel", meta), \
            contextlib.nullcontext() if tma else gemm_configs.tma_disabled():
        h = grouped_swiglu(x, pair_row, offsets, w)
    grad_out = torch.randn(h.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    dx, dw = torch.autograd.grad(h, (x, w), grad_out)
    h_ref, dx_ref, dw_ref = reference_grads(x, pair_row, offsets, w, grad_out)
    for got, want in ((h, h_ref), (dx, dx_ref), (dw, dw_ref)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("options", [{"X_TMA": 1}, {"ONE_ACC": 1}, {"X_TMA": 1, "ONE_ACC": 1}],
                         ids=["x_tma", "one_acc", "x_tma+one_acc"])
@pytest.mark.parametrize("persistent", [False, True], ids=["tile_per_program", "persistent"])
@pytest.mark.parametrize("case", ["npow2", "empty_experts", "hot_expert", "one_row"])
def test_forward_descriptor_options_match_reference(case, persistent, options):
    """The forward's descriptor options give the reference h and save the pre-activations the
    backward needs (checked through dx and dW): X_TMA (x gathered once in pair order, its tiles
    loaded through a descriptor; rows of a padded plan past the last expert, with out-of-range row
    ids, are gathered clamped and never change the real pairs' output) and ONE_ACC (a tile's gate
    and up rows in one load, one accumulator split after the K loop; F = 40 and 16 leave rows past F
    in the last N tile). bf16 on a GPU, fp32 in the interpreter."""
    on_gpu = DEVICE == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    x, pair_row, offsets, w = make_case(case, dtype, seed=11)
    x.requires_grad_()
    w.requires_grad_()
    blocks = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3} if on_gpu else \
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
    meta = {**blocks, **options, **({"PERSISTENT": 1} if persistent else {})}
    n = pair_row.numel()
    row_pad = torch.cat([pair_row, torch.tensor([-1, 10**6, 0], dtype=pair_row.dtype, device=pair_row.device)])
    with gemm_configs.forced_gemm_meta("_swiglu_fwd_kernel", meta):
        h = grouped_swiglu(x, pair_row, offsets, w)
        h_pad, _ = grouped_swiglu_forward(x.detach(), row_pad, offsets, w.detach(), False)
    grad_out = torch.randn(h.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    dx, dw = torch.autograd.grad(h, (x, w), grad_out)
    h_ref, dx_ref, dw_ref = reference_grads(x, pair_row, offsets, w, grad_out)
    for got, want in ((h, h_ref), (h_pad[:n], h_ref), (dx, dx_ref), (dw, dw_ref)):
        if on_gpu:
            assert _rel_err(got, want) <= 1e-2
        else:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("option", ["X_TMA", "ONE_ACC"])
def test_forward_descriptor_options_need_descriptors(option):
    """X_TMA / ONE_ACC in the forward need descriptor operands: with them switched off the launcher says so."""
    x, pair_row, offsets, w = make_case("npow2", torch.float32)
    with gemm_configs.tma_disabled(), gemm_configs.forced_gemm_meta(
            "_swiglu_fwd_kernel", {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, option: 1}):
        with pytest.raises(ValueError, match="_swiglu_fwd_kernel: config .* needs descriptor operands"):
            grouped_swiglu_forward(x, pair_row, offsets, w, False)


@pytest.mark.parametrize("persistent", [False, True], ids=["tile_per_program", "persistent"])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_backward_dx_operand_paths_match_reference(tma, persistent, bwd_mode, poisoned_empty):
    """dx with F = 128 (a multiple of every BLOCK_K): in the materialised mode the dx GEMM loads
    [dg | du] and the weights through tensor descriptors; the fused mode and `tma_disabled` use
    pointers. Tiles cross experts (uneven pair counts); D = 40 is not a multiple of the N block.
    `persistent`: a PERSISTENT config, 3 programs looping over the tiles in the interpreter."""
    gen = torch.Generator().manual_seed(7)
    rows, hidden, ffn, experts = 26, 40, 128, 3
    routing = [torch.randperm(experts, generator=gen)[:2].tolist() if r % 3 else [1] for r in range(rows)]
    pair_row, offsets = (t.to(DEVICE) for t in pairs_from_rows(routing, experts))
    x = torch.randn(rows, hidden, generator=gen).to(DEVICE).requires_grad_()
    w = (torch.randn(experts, 2 * ffn, hidden, generator=gen) / math.sqrt(hidden)).to(DEVICE).requires_grad_()
    meta = {**gemm_configs.fixed_gemm_meta(torch.float32, pair_row.numel()), "PERSISTENT": 1}
    forced = gemm_configs.forced_gemm_meta("_swiglu_bwd_dx_kernel", meta) if persistent else contextlib.nullcontext()
    with forced, contextlib.nullcontext() if tma else gemm_configs.tma_disabled():
        h = grouped_swiglu(x, pair_row, offsets, w)
        grad_out = torch.randn(h.shape, generator=gen).to(DEVICE)
        dx, dw = torch.autograd.grad(h, (x, w), grad_out)
    _, dx_ref, dw_ref = reference_grads(x, pair_row, offsets, w, grad_out)
    torch.testing.assert_close(dx, dx_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dw, dw_ref, atol=1e-4, rtol=1e-4)


def test_weights_without_a_descriptor_layout_load_through_pointers(poisoned_empty):
    """A weight whose last dim is not contiguous cannot back a tensor descriptor: the pointer path
    runs and gives the same result."""
    x, pair_row, offsets, w = make_case("npow2", torch.float16)
    w_strided = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert gemm_configs.use_tma(w) == (DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9)
    assert not gemm_configs.use_tma(w_strided)
    torch.testing.assert_close(grouped_swiglu(x, pair_row, offsets, w_strided).float(),
                               grouped_swiglu_ref(x.float(), pair_row, offsets, w.float()), atol=2e-2, rtol=1e-2)

@pytest.mark.gpu
@pytest.mark.parametrize("case", ["npow2", "hot_expert", "empty_experts"])
def test_bf16_on_gpu(case, bwd_mode):
    x, pair_row, offsets, w = make_case(case, torch.bfloat16)
    _check_bf16(x, pair_row, offsets, w)


@pytest.mark.gpu
@pytest.mark.parametrize("warp_spec", [0, 2], ids=["pipelined", "warp_specialized"])
def test_persistent_forward_and_dx_bf16_on_gpu(warp_spec):
    """The persistent tile loop (one program per SM) of the forward and dx GEMMs with descriptor
    operands, flattened and software-pipelined (the forward's also warp-specialised), against
    fp32 (forward and gradients)."""
    meta = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "PERSISTENT": 1,
            "WARP_SPEC": warp_spec}
    gen = torch.Generator().manual_seed(4)
    rows, hidden, ffn, experts = 3500, 256, 256, 8      # F = 256: the dx GEMM's descriptor path
    routing = [torch.randperm(experts, generator=gen)[:3].tolist() for _ in range(rows)]
    routing[:1000] = [[5, 1]] * 1000
    pair_row, offsets = pairs_from_rows(routing, experts)
    x = torch.randn(rows, hidden, generator=gen).cuda().bfloat16()
    w = (torch.randn(experts, 2 * ffn, hidden, generator=gen) / math.sqrt(hidden)).cuda().bfloat16()
    dx_meta = {key: value for key, value in meta.items() if key != "WARP_SPEC"}     # dx has no such loop
    with gemm_configs.forced_gemm_meta("_swiglu_fwd_kernel", meta), \
            gemm_configs.forced_gemm_meta("_swiglu_bwd_dx_kernel", dx_meta):
        _check_bf16(x, pair_row.cuda(), offsets.cuda(), w)


@pytest.mark.gpu
def test_bf16_on_gpu_autotuned_shape(bwd_mode):
    gen = torch.Generator().manual_seed(3)
    rows, hidden, ffn, experts = 3500, 256, 192, 8  # M > AUTOTUNE_MIN_PAIRS
    routing = [torch.randperm(experts, generator=gen)[:3].tolist() for _ in range(rows)]
    routing[:1000] = [[5, 1]] * 1000  # a skew: two hot experts
    pair_row, offsets = pairs_from_rows(routing, experts)
    x = torch.randn(rows, hidden, generator=gen).cuda().bfloat16()
    w = (torch.randn(experts, 2 * ffn, hidden, generator=gen) / math.sqrt(hidden)).cuda().bfloat16()
    _check_bf16(x, pair_row.cuda(), offsets.cuda(), w)


@pytest.mark.gpu
@pytest.mark.parametrize("ffn", [1024, 1408])
def test_pinned_configs_at_the_measured_shapes_on_gpu(ffn):
    """The forward SwiGLU's pinned config of TUNED_GEMM_META (D = 2048, F = 1024 and 1408) is what
    the launcher resolves and launches for this call, and at that shape it gives the fp32
    reference's h, dx and dW in bf16. (In a pytest run that also collected tests/ep this once read
    another config from LAST_LAUNCH_META: transformers had imported a second copy of the kernels,
    whose custom ops the recording forward ran; test_package.py covers the fix.)"""
    gen = torch.Generator().manual_seed(ffn)
    rows, hidden, experts, top_k = 2048, 2048, 64, 6          # 12,288 pairs > AUTOTUNE_MIN_PAIRS
    routing = [torch.randperm(experts, generator=gen)[:top_k].tolist() for _ in range(rows)]
    pair_row, offsets = pairs_from_rows(routing, experts)
    x = torch.randn(rows, hidden, generator=gen).cuda().bfloat16()
    w = (torch.randn(experts, 2 * ffn, hidden, generator=gen) / math.sqrt(hidden)).cuda().bfloat16()
    pinned = gemm_configs.TUNED_GEMM_META[("_swiglu_fwd_kernel", 9, hidden, ffn, True)]
    assert gemm_configs.use_tma(w)
    assert gemm_configs.fixed_gemm_meta(torch.bfloat16, pair_row.numel(), "_swiglu_fwd_kernel", (hidden, ffn),
                                        x.device, True) is pinned
    _check_bf16(x, pair_row.cuda(), offsets.cuda(), w)
    assert gemm_configs.LAST_LAUNCH_META["_swiglu_fwd_kernel"] is pinned


@pytest.mark.gpu
def test_descriptor_kernels_replay_from_a_cuda_graph():
    """The device-side tensor descriptors take scratch from torch's allocator at launch: captured
    in a CUDA graph (as `occult.ep.graph` captures the layer), the forward SwiGLU and down GEMMs
    replay on new inputs to the eager result."""
    from occult.kernels.grouped_down_reduce import grouped_down_reduce

    gen = torch.Generator().manual_seed(11)
    rows, hidden, ffn, experts = 600, 256, 128, 8
    routing = [torch.randperm(experts, generator=gen)[:2].tolist() for _ in range(rows)]
    pair_row, offsets = (t.cuda() for t in pairs_from_rows(routing, experts))
    gate = torch.rand(pair_row.numel(), generator=gen).cuda()
    w1 = (torch.randn(experts, 2 * ffn, hidden, generator=gen) / math.sqrt(hidden)).cuda().bfloat16()
    w2 = (torch.randn(experts, hidden, ffn, generator=gen) / math.sqrt(ffn)).cuda().bfloat16()
    assert gemm_configs.use_tma(w1)

    def layer(x):
        return grouped_down_reduce(grouped_swiglu(x, pair_row, offsets, w1), pair_row, gate, offsets, w2, rows)

    static_x = torch.randn(rows, hidden, generator=gen).cuda().bfloat16()
    with torch.no_grad():
        layer(static_x)                       # compile and pick configs outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        fresh = torch.randn(rows, hidden, generator=gen).cuda().bfloat16()
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_y, layer(fresh), atol=0, rtol=0)

def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).norm() / b.norm().clamp_min(1e-12)).item()


def _check_bf16(x, pair_row, offsets, w):
    x.requires_grad_()
    w.requires_grad_()
    h = grouped_swiglu(x, pair_row, offsets, w)
    grad_out = torch.randn_like(h)
    h_ref, dx_ref, dw_ref = reference_grads(x, pair_row, offsets, w, grad_out)
    dx, dw = torch.autograd.grad(h, (x, w), grad_out)
    assert _rel_err(h, h_ref) <= 1e-2
    assert _rel_err(dx, dx_ref) <= 1e-2
    assert _rel_err(dw, dw_ref) <= 1e-2


# ----------------------------------------------------------------------------------------------
# Every kernel and every autotuning candidate compiles for Hopper (sm_90), without a GPU.
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_kernel_config_compiles_for_sm90(tmp_path):
    """Runs this file as a script without TRITON_INTERPRET: the ops are called on CPU tensors with
    every kernel launch intercepted, and each intercepted launch (each autotuning candidate) is
    compiled for sm_90 with the arguments' specialisation (16-byte alignment, unit strides)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "compiled" in result.stdout


def _compile_every_launch_for_sm90() -> int:
    import importlib
    import inspect
    import itertools

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from occult.kernels.combine import combine
    from occult.kernels.grouped_down_reduce import grouped_down_reduce

    modules = {name: importlib.import_module(f"occult.kernels.{name}")
               for name in ("grouped_swiglu", "grouped_swiglu_backward", "grouped_down_reduce", "combine",
                            "dispatch_plan")}
    backward_module = modules["grouped_swiglu_backward"]
    launches = []

    class Recorder:
        def __init__(self, launchable):
            self.launchable = launchable

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.launchable, args, kwargs))

    for module in modules.values():
        for name, value in list(vars(module).items()):
            launched = isinstance(value, triton.runtime.Autotuner) or (
                isinstance(value, triton.runtime.JITFunction) and name.endswith("_kernel"))
            if launched:   # only launch points: jit helpers called from kernels stay as they are
                setattr(module, name, Recorder(value))

    gen = torch.Generator().manual_seed(0)
    cases = [(hidden, ffn, num_pairs, dtype, mode)
             for hidden, ffn, num_pairs in ((64, 32, 9000), (48, 40, 100), (64, 128, 200))   # autotuned / fixed;
             # F = 128: the TMA dx GEMM
             for dtype in (torch.bfloat16, torch.float32)
             for mode in backward_module.SWIGLU_BWD_MODES]
    # CPU tensors never take the TMA path on their own: record both operand paths of the forwards.
    tma_users = [modules[name] for name in ("grouped_swiglu", "grouped_swiglu_backward", "grouped_down_reduce")]
    with_tma = gemm_configs.use_tma
    for tma, (hidden, ffn, num_pairs, dtype, mode) in itertools.product((False, True), cases):
        for module in tma_users:
            module.use_tma = lambda *tensors, tma=tma: tma and all(gemm_configs.tma_matrix_ok(t) for t in tensors)
        backward_module.SWIGLU_BWD_MODE = mode
        experts, rows = 4, num_pairs // 2
        pair_row = torch.randint(0, rows, (num_pairs,), generator=gen)
        offsets = torch.tensor([0, num_pairs // 3, num_pairs // 3, num_pairs - 7, num_pairs])
        x = torch.randn(rows, hidden, dtype=dtype, requires_grad=True)
        w1 = torch.randn(experts, 2 * ffn, hidden, dtype=dtype, requires_grad=True)
        w2 = torch.randn(experts, hidden, ffn, dtype=dtype, requires_grad=True)
        gate = torch.rand(num_pairs, requires_grad=True)
        h = grouped_swiglu(x, pair_row, offsets, w1)
        y = grouped_down_reduce(h, pair_row, gate, offsets, w2, rows)
        brim = torch.randperm(2 * rows, generator=gen)[: rows].view(-1, 2)
        out = combine(y, brim)
        torch.autograd.grad(out, (x, w1, w2, gate), torch.randn_like(out))
    for module in tma_users:
        module.use_tma = with_tma
    for dtype in (torch.bfloat16, torch.float32):      # the down dW's X_TMA operand (gathered, scaled rows)
        grouped_down_reduce_module = modules["grouped_down_reduce"]
        grouped_down_reduce_module.gather_scale_rows(torch.randn(50, 64, dtype=dtype), torch.randint(0, 50, (90,)),
                                                     torch.rand(90), dtype)

    # the fused dedup plan + pack (kernel launches recorded, not run: the counts are placeholders)
    plan_module = modules["dispatch_plan"]
    for num_devices, top_k, dtype in ((2, 8, torch.bfloat16), (8, 6, torch.bfloat16), (4, 4, torch.float32)):
        experts = 8 * num_devices
        placement = torch.arange(experts) % num_devices
        ids = torch.randint(0, experts, (300, top_k), generator=gen)
        counts = plan_module.dedup_plan_count(ids, placement, num_devices)
        plan_module.dedup_plan_pack(counts, ids, torch.rand(300, top_k), torch.randn(300, 64, dtype=dtype),
                                    placement, placement // num_devices, [300, 300], [1200, 1200], top_k)
        received = torch.randint(-1, 8, (600, top_k + 3), dtype=torch.int32, generator=gen)[:, :top_k]
        for num_pairs in (None, 500):
            plan_module.group_pairs_by_expert(received, num_pairs, 8)

    type_names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                  torch.int64: "i64", torch.int32: "i32"}
    target = GPUTarget("cuda", 90, 32)
    done = set()
    for launchable, args, kwargs in launches:
        if isinstance(launchable, triton.runtime.Autotuner):
            fn, configs = launchable.fn, launchable.configs
            metas = [({**kwargs, **cfg.kwargs}, cfg.num_warps, cfg.num_stages) for cfg in configs]
            metas += [({**kwargs, **{k: v for k, v in tuned.items() if k not in ("num_warps", "num_stages")}},
                       tuned["num_warps"], tuned["num_stages"])            # the measured, pinned ones
                      for key, tuned in gemm_configs.TUNED_GEMM_META.items()
                      if key[0] == fn.__name__ and key[4] == bool(kwargs.get("TMA", False))]   # pinned per path
            if "PERSISTENT" in fn.arg_names:      # the persistent tile loop of the first config
                metas.append(({**metas[0][0], "PERSISTENT": True}, *metas[0][1:]))
            if "X_TMA" in fn.arg_names and kwargs.get("TMA"):        # the dW GEMMs' descriptor options
                options = [{"X_TMA": 1}] + ([{"ONE_ACC": 1}, {"X_TMA": 1, "ONE_ACC": 1}]
                                            if "ONE_ACC" in fn.arg_names else [])
                metas += [({**metas[0][0], **option}, *metas[0][1:]) for option in options]
        else:
            fn = launchable
            meta = dict(kwargs)
            metas = [(meta, meta.pop("num_warps", 4), meta.pop("num_stages", 3))]
        for consts, num_warps, num_stages in metas:
            signature, constants, attrs = {}, dict(consts), {}
            for index, (name, value) in enumerate(zip(fn.arg_names, args)):
                if isinstance(value, torch.Tensor):
                    signature[name] = "*" + type_names[value.dtype]
                    if value.data_ptr() % 16 == 0:
                        attrs[(index,)] = [["tt.divisibility", 16]]
                elif value == 1:
                    constants[name] = 1
                else:
                    signature[name] = "i32" if abs(value) < 2**31 else "i64"
                    if value % 16 == 0:
                        attrs[(index,)] = [["tt.divisibility", 16]]
            for name, param in inspect.signature(fn.fn).parameters.items():   # constexprs left at their default
                if name not in signature and name not in constants and param.default is not inspect.Parameter.empty:
                    constants[name] = param.default
            for name in constants:
                signature[name] = "constexpr"
            signature = {name: signature[name] for name in fn.arg_names}
            key = (fn.__name__, repr(sorted(signature.items())), repr(sorted(constants.items())), repr(attrs),
                   num_warps, num_stages)
            if key in done:
                continue
            done.add(key)
            triton.compile(ASTSource(fn, signature, constants, attrs), target=target,
                           options={"num_warps": num_warps, "num_stages": num_stages})
    return len(done)


if __name__ == "__main__":
    print(f"compiled {_compile_every_launch_for_sm90()} kernel variants for sm_90")


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_backward_ignores_padded_pairs_past_the_last_expert(tma, bwd_mode):
    """Rows past expert_offsets[-1] of a padded plan are never written (NaN here): the dW GEMM's
    last K block must read zeros there (its descriptor ends at the expert's last pair), and dx,
    summed through a row table that lists only real pairs (as the layer's plan does), must not
    see them."""
    x, pair_row, offsets, w = make_case("npow2", torch.float32)
    n, ffn, pad = pair_row.numel(), w.shape[1] // 2, 5
    _, preact = grouped_swiglu_forward(x, pair_row, offsets, w, True)
    nan_rows = torch.full((pad, 2 * ffn), float("nan"), device=x.device)
    preact_pad = torch.cat([preact, nan_rows])
    row_pad = torch.cat([pair_row, torch.zeros(pad, dtype=pair_row.dtype, device=pair_row.device)])
    dh = torch.randn(n, ffn, generator=torch.Generator().manual_seed(3)).to(x.device)
    dh_pad = torch.cat([dh, nan_rows[:, :ffn]])
    table = torch.full((x.shape[0], 4), -1, dtype=torch.long)
    for m, r in enumerate(pair_row.tolist()):
        table[r, int((table[r] >= 0).sum())] = m
    with contextlib.nullcontext() if tma else gemm_configs.tma_disabled():
        dx, dw = grouped_swiglu_backward(dh_pad, x, row_pad, offsets, w, preact_pad, True, True,
                                         table.to(x.device), bwd_mode=bwd_mode)
    _, dx_ref, dw_ref = reference_grads(x, pair_row, offsets, w, dh)
    torch.testing.assert_close(dw, dw_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dx, dx_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("options", [{"X_TMA": 1}, {"ONE_ACC": 1}, {"X_TMA": 1, "ONE_ACC": 1}],
                         ids=["x_tma", "one_acc", "x_tma+one_acc"])
@pytest.mark.parametrize("case", ["npow2", "empty_experts", "hot_expert", "all_experts", "one_row"])
def test_swiglu_dw_options_match_reference(case, options):
    """The SwiGLU dW GEMM's descriptor options (x gathered once in pair order; [dg | du] as one
    operand with one accumulator) give the reference dW, also with unwritten (NaN) rows of a padded
    plan past the last expert. bf16 on a GPU (the TMA path), fp32 in the interpreter."""
    on_gpu = DEVICE == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    x, pair_row, offsets, w = make_case(case, dtype, seed=5)
    n, ffn, pad = pair_row.numel(), w.shape[1] // 2, 3
    _, preact = grouped_swiglu_forward(x, pair_row, offsets, w, True)
    nan_rows = torch.full((pad, 2 * ffn), float("nan"), device=x.device, dtype=dtype)
    dh = torch.randn(n, ffn, generator=torch.Generator().manual_seed(7)).to(x.device, dtype)
    # a padded plan's rows past the last expert may hold anything, out-of-range values included
    row_pad = torch.cat([pair_row, torch.tensor([-1, 10**6, 0][:pad], dtype=pair_row.dtype, device=pair_row.device)])
    blocks = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3} if on_gpu else \
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
    with gemm_configs.forced_gemm_meta("_swiglu_bwd_dw_kernel", {**blocks, **options}):
        _, dw = grouped_swiglu_backward(torch.cat([dh, nan_rows[:, :ffn]]), x, row_pad, offsets, w,
                                        torch.cat([preact, nan_rows]), False, True, None,
                                        bwd_mode="materialized")
    _, _, dw_ref = reference_grads(x, pair_row, offsets, w, dh)
    if on_gpu:
        assert _rel_err(dw, dw_ref) <= 1e-2
    else:
        torch.testing.assert_close(dw, dw_ref, atol=1e-4, rtol=1e-4)


def test_swiglu_dw_options_without_descriptors_are_refused():
    """X_TMA / ONE_ACC need descriptor operands: with them switched off the launcher says so."""
    x, pair_row, offsets, w = make_case("npow2", torch.float32)
    _, preact = grouped_swiglu_forward(x, pair_row, offsets, w, True)
    dh = torch.randn(pair_row.numel(), w.shape[1] // 2).to(x.device)
    with gemm_configs.tma_disabled(), gemm_configs.forced_gemm_meta(
            "_swiglu_bwd_dw_kernel", {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "ONE_ACC": 1}):
        with pytest.raises(ValueError, match="needs descriptor operands"):
            grouped_swiglu_backward(dh, x, pair_row, offsets, w, preact, False, True, None,
                                    bwd_mode="materialized")


def test_swiglu_dw_gathered_rows_must_be_descriptor_addressable():
    """X_TMA gathers x into [M, D] rows a descriptor loads: 24-byte rows (D = 6 in fp32 in the
    interpreter, D = 12 in bf16 on a GPU, where only 16-bit inputs take descriptors) are refused
    before anything is gathered."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    hidden = 24 // torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(2)
    pair_row, offsets = pairs_from_rows([[0], [1, 0], [1]], 2)
    x = torch.randn(3, hidden, generator=gen).to(DEVICE, dtype)
    w = torch.randn(2, 16, hidden, generator=gen).to(DEVICE, dtype)
    pair_row, offsets = pair_row.to(DEVICE), offsets.to(DEVICE)
    _, preact = grouped_swiglu_forward(x, pair_row, offsets, w, True)
    dh = torch.randn(pair_row.numel(), 8, generator=gen).to(DEVICE, dtype)
    with gemm_configs.forced_gemm_meta("_swiglu_bwd_dw_kernel",
                                       {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "X_TMA": 1}):
        with pytest.raises(ValueError, match="multiple of 16 bytes, got 24"):
            grouped_swiglu_backward(dh, x, pair_row, offsets, w, preact, False, True, None,
                                    bwd_mode="materialized")
