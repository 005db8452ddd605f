"""grouped_down_reduce (Triton) against grouped_down_reduce_ref: forward, dh, dgate and dWd, over
edge-case routings (several pairs per row, rows with none, empty / hot experts, M = 0, R = 1)."""

from __future__ import annotations

import contextlib
import importlib
import math

import pytest
import torch

from occult.kernels.grouped_down_reduce import grouped_down_reduce
from occult.kernels.reference import grouped_down_reduce_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# name -> (rows R, hidden D, ffn F, experts E, experts of each row)
CASES = {
    "basic": (24, 32, 16, 4, "random2"),
    "npow2": (20, 48, 40, 4, "random2"),
    "empty_experts": (18, 32, 24, 4, [[0, 2], [2], [], [0], [2, 0], [2]] * 3),
    "hot_expert": (40, 32, 16, 4, [[3]] * 40),
    "one_per_row": (12, 32, 16, 4, [[3], [1], [0], [2]] * 3),
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


def make_case(name: str, dtype: torch.dtype, gate_dtype: torch.dtype | None = None, seed: int = 0):
    rows, hidden, ffn, experts, routing = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    if routing == "random2":
        routing = [torch.randperm(experts, generator=gen)[:2].tolist() if r % 5 else [] for r in range(rows)]
    pair_row, offsets = pairs_from_rows(routing, experts)
    num_pairs = pair_row.numel()
    h = torch.randn(num_pairs, ffn, generator=gen)
    gate = torch.rand(num_pairs, generator=gen)
    w = torch.randn(experts, hidden, ffn, generator=gen) / math.sqrt(ffn)
    dev = torch.device(DEVICE)
    return (h.to(dev, dtype), pair_row.to(dev), gate.to(dev, gate_dtype or dtype), offsets.to(dev),
            w.to(dev, dtype), rows)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every torch.empty float tensor starts as NaN, so an element a kernel skips shows up."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-(2**30))

    monkeypatch.setattr(torch, "empty", nan_empty)


def reference_grads(h, pair_row, gate, offsets, w, rows, grad_out):
    h32, gate32, w32 = (t.detach().float().requires_grad_() for t in (h, gate, w))
    y32 = grouped_down_reduce_ref(h32, pair_row, gate32, offsets, w32, rows)
    if h32.numel() == 0:
        return y32.detach(), torch.zeros_like(h32), torch.zeros_like(gate32), torch.zeros_like(w32)
    return (y32.detach(), *torch.autograd.grad(y32, (h32, gate32, w32), grad_out.float()))


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_grads_match_reference(case, dtype, poisoned_empty):
    atol, rtol = DTYPES[dtype]
    h, pair_row, gate, offsets, w, rows = make_case(case, dtype)
    for leaf in (h, gate, w):
        leaf.requires_grad_()
    y = grouped_down_reduce(h, pair_row, gate, offsets, w, rows)
    assert y.dtype == dtype and y.shape == (rows, w.shape[1])
    grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device, dtype)
    y_ref, dh_ref, dgate_ref, dw_ref = reference_grads(h, pair_row, gate, offsets, w, rows, grad_out)
    torch.testing.assert_close(y.float(), y_ref, atol=atol, rtol=rtol)
    grads = torch.autograd.grad(y, (h, gate, w), grad_out, allow_unused=True)
    for got, want, leaf in zip(grads, (dh_ref, dgate_ref, dw_ref), (h, gate, w)):
        got = torch.zeros_like(leaf) if got is None else got   # M = 0: autograd may skip the op
        assert got.dtype == leaf.dtype
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


def test_fp32_gates_with_fp16_activations(poisoned_empty):
    h, pair_row, gate, offsets, w, rows = make_case("npow2", torch.float16, gate_dtype=torch.float32)
    gate.requires_grad_()
    y = grouped_down_reduce(h, pair_row, gate, offsets, w, rows)
    grad_out = torch.randn_like(y)
    (dgate,) = torch.autograd.grad(y, (gate,), grad_out)
    y_ref, _, dgate_ref, _ = reference_grads(h, pair_row, gate, offsets, w, rows, grad_out)
    assert dgate.dtype == torch.float32
    torch.testing.assert_close(y.float(), y_ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(dgate, dgate_ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("which", ["h", "gate", "w"])
def test_gradient_of_one_input_only(which, poisoned_empty):
    h, pair_row, gate, offsets, w, rows = make_case("basic", torch.float32)
    leaf = {"h": h, "gate": gate, "w": w}[which]
    leaf.requires_grad_()
    y = grouped_down_reduce(h, pair_row, gate, offsets, w, rows)
    grad_out = torch.randn_like(y)
    (grad,) = torch.autograd.grad(y, (leaf,), grad_out)
    _, dh_ref, dgate_ref, dw_ref = reference_grads(h, pair_row, gate, offsets, w, rows, grad_out)
    want = {"h": dh_ref, "gate": dgate_ref, "w": dw_ref}[which]
    torch.testing.assert_close(grad, want, atol=1e-4, rtol=1e-4)


def test_rows_without_pairs_are_zero_and_result_is_deterministic(poisoned_empty):
    h, pair_row, gate, offsets, w, rows = make_case("empty_experts", torch.float32)
    first = grouped_down_reduce(h, pair_row, gate, offsets, w, rows)
    again = grouped_down_reduce(h, pair_row, gate, offsets, w, rows)
    assert torch.equal(first, again)
    unrouted = torch.ones(rows, dtype=torch.bool, device=first.device)
    unrouted[pair_row] = False
    assert unrouted.any() and torch.all(first[unrouted] == 0)


def test_bad_input_names_the_field():
    h, pair_row, gate, offsets, w, rows = make_case("basic", torch.float32)
    with pytest.raises(ValueError, match="pair_gate_M"):
        grouped_down_reduce(h, pair_row, gate[:-1], offsets, w, rows)
    with pytest.raises(ValueError, match="w_down_EDF"):
        grouped_down_reduce(h, pair_row, gate, offsets, w.transpose(1, 2), rows)
    with pytest.raises(ValueError, match="expert_offsets"):
        grouped_down_reduce(h, pair_row, gate, offsets[1:], w, rows)


def test_opcheck_registrations():
    h, pair_row, gate, offsets, w, rows = make_case("basic", torch.float32)
    torch.library.opcheck(
        torch.ops.occult.grouped_down_reduce.default,
        (h.requires_grad_(), pair_row, gate.requires_grad_(), offsets, w.requires_grad_(), rows),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).norm() / b.norm().clamp_min(1e-12)).item()



@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("case", ["npow2", "empty_experts", "one_row"])
def test_operand_paths_match_reference(case, tma, poisoned_empty):
    """Both ways the forward and the dW GEMM load h (and the forward the weights): tensor
    descriptors (the default where their layout allows) and pointers. F = 40 and 24 leave K tails
    after 16-wide blocks; D = 48 is not a multiple of 32; tiles past an expert's pairs read the
    next expert's rows, which are not stored (forward) or meet zero dy rows (dW)."""
    module = importlib.import_module("occult.kernels.gemm_configs")    # owns the TMA switch
    h, pair_row, gate, offsets, w, rows = make_case(case, torch.float32)
    h.requires_grad_()
    gate.requires_grad_()
    w.requires_grad_()
    hopper = DEVICE == "cpu"     # the interpreter emulates TMA for any dtype; a GPU uses it for 16-bit only
    grad_out = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with contextlib.nullcontext() if tma else module.tma_disabled():
        assert module.use_tma(h, w) == (tma and hopper)
        y = grouped_down_reduce(h, pair_row, gate, offsets, w, rows)
        grads = torch.autograd.grad(y, (h, gate, w), grad_out)
    for got, want in zip((y, *grads), reference_grads(h, pair_row, gate, offsets, w, rows, grad_out)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("case", ["npow2", "empty_experts", "hot_expert", "all_experts"])
def test_persistent_forward_matches_reference(case, tma, poisoned_empty):
    """A PERSISTENT config launches fewer programs than tiles (3 in the interpreter, one per SM
    on a GPU): each program loops over its tiles, and every tile is written exactly once."""
    module = importlib.import_module("occult.kernels.gemm_configs")
    h, pair_row, gate, offsets, w, rows = make_case(case, torch.float32)
    meta = {**module.fixed_gemm_meta(torch.float32, h.shape[0]), "PERSISTENT": 1}
    with module.forced_gemm_meta("_down_fwd_kernel", meta), \
            contextlib.nullcontext() if tma else module.tma_disabled():
        y = grouped_down_reduce(h, pair_row, gate, offsets, w, rows)
    torch.testing.assert_close(y, grouped_down_reduce_ref(h, pair_row, gate, offsets, w, rows), atol=1e-4, rtol=1e-4)


def test_operands_without_a_descriptor_layout_load_through_pointers(poisoned_empty):
    module = importlib.import_module("occult.kernels.gemm_configs")
    h, pair_row, gate, offsets, w, rows = make_case("npow2", torch.float32)
    h_strided = h.t().contiguous().t()
    assert not module.use_tma(h_strided, w)
    torch.testing.assert_close(grouped_down_reduce(h_strided, pair_row, gate, offsets, w, rows),
                               grouped_down_reduce_ref(h, pair_row, gate, offsets, w, rows), atol=1e-4, rtol=1e-4)

@pytest.mark.gpu
@pytest.mark.parametrize("case", ["npow2", "hot_expert", "all_experts"])
def test_bf16_on_gpu(case):
    h, pair_row, gate, offsets, w, rows = make_case(case, torch.bfloat16, gate_dtype=torch.float32)
    _check_bf16(h, pair_row, gate, offsets, w, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("warp_spec", [0, 2], ids=["pipelined", "warp_specialized"])
def test_persistent_forward_bf16_on_gpu(warp_spec):
    """The persistent tile loop (one program per SM) with descriptor operands, flattened and
    software-pipelined or warp-specialised, against fp32 (forward and gradients)."""
    module = importlib.import_module("occult.kernels.gemm_configs")
    meta = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "PERSISTENT": 1,
            "WARP_SPEC": warp_spec}
    gen = torch.Generator().manual_seed(4)
    rows, hidden, ffn, experts = 3500, 256, 192, 8
    routing = [torch.randperm(experts, generator=gen)[:3].tolist() for _ in range(rows)]
    routing[:1000] = [[5, 1]] * 1000
    pair_row, offsets = pairs_from_rows(routing, experts)
    h = torch.randn(pair_row.numel(), ffn, generator=gen).cuda().bfloat16()
    gate = torch.rand(pair_row.numel(), generator=gen).cuda()
    w = (torch.randn(experts, hidden, ffn, generator=gen) / math.sqrt(ffn)).cuda().bfloat16()
    with module.forced_gemm_meta("_down_fwd_kernel", meta):
        _check_bf16(h, pair_row.cuda(), gate, offsets.cuda(), w, rows)


@pytest.mark.gpu
def test_bf16_on_gpu_autotuned_shape():
    gen = torch.Generator().manual_seed(3)
    rows, hidden, ffn, experts = 3500, 256, 192, 8  # M > AUTOTUNE_MIN_PAIRS
    routing = [torch.randperm(experts, generator=gen)[:3].tolist() for _ in range(rows)]
    routing[:1000] = [[5, 1]] * 1000
    pair_row, offsets = pairs_from_rows(routing, experts)
    num_pairs = pair_row.numel()
    h = torch.randn(num_pairs, ffn, generator=gen).cuda().bfloat16()
    gate = torch.rand(num_pairs, generator=gen).cuda()
    w = (torch.randn(experts, hidden, ffn, generator=gen) / math.sqrt(ffn)).cuda().bfloat16()
    _check_bf16(h, pair_row.cuda(), gate, offsets.cuda(), w, rows)


def _check_bf16(h, pair_row, gate, offsets, w, rows):
    for leaf in (h, gate, w):
        leaf.requires_grad_()
    y = grouped_down_reduce(h, pair_row, gate, offsets, w, rows)
    grad_out = torch.randn_like(y)
    y_ref, *grads_ref = reference_grads(h, pair_row, gate, offsets, w, rows, grad_out)
    grads = torch.autograd.grad(y, (h, gate, w), grad_out)
    assert _rel_err(y, y_ref) <= 1e-2
    for got, want in zip(grads, grads_ref):
        assert _rel_err(got, want) <= 1e-2


def row_table(pair_row: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """[rows, width] positions of each row's pairs (−1 = none), columns in a shuffled order."""
    table = torch.full((rows, width), -1, dtype=torch.long)
    filled = [0] * rows
    for m, r in enumerate(pair_row.tolist()):
        table[r, filled[r]] = m
        filled[r] += 1
    gen = torch.Generator().manual_seed(rows)
    return table[:, torch.randperm(width, generator=gen)].to(pair_row.device)


@pytest.mark.parametrize("case", ["basic", "empty_experts", "all_experts", "no_pairs", "hot_expert", "one_per_row"])
def test_row_table_path_matches_reference(case, poisoned_empty):
    """With `row_pairs_RK` the reduction (down forward, SwiGLU dx) gathers through the table; a
    one-column table with one pair per row (hot_expert) takes the direct-store path."""
    from occult.kernels.grouped_swiglu import grouped_swiglu
    from occult.kernels.reference import grouped_swiglu_ref

    h, pair_row, gate, offsets, w, rows = make_case(case, torch.float32)
    width = max([1] + torch.bincount(pair_row.cpu(), minlength=rows).tolist())
    table = row_table(pair_row.cpu(), rows, width).to(pair_row.device)
    for leaf in (h, gate, w):
        leaf.requires_grad_()
    y = grouped_down_reduce(h, pair_row, gate, offsets, w, rows, row_pairs_RK=table)
    grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(y.device)
    y_ref, dh_ref, dgate_ref, dw_ref = reference_grads(h, pair_row, gate, offsets, w, rows, grad_out)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    if h.numel():
        grads = torch.autograd.grad(y, (h, gate, w), grad_out)
        for got, want in zip(grads, (dh_ref, dgate_ref, dw_ref)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    hidden, ffn = w.shape[1], w.shape[2]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, hidden, generator=gen).to(h.device).requires_grad_()
    w_gu = (torch.randn(w.shape[0], 2 * ffn, hidden, generator=gen) / hidden**0.5).to(h.device)
    out = grouped_swiglu(x, pair_row, offsets, w_gu, row_pairs_RK=table)
    x32 = x.detach().clone().requires_grad_()
    ref = grouped_swiglu_ref(x32, pair_row, offsets, w_gu)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    if out.numel():
        dh = torch.randn(out.shape, generator=gen).to(h.device)
        (dx,) = torch.autograd.grad(out, (x,), dh)
        (dx_ref,) = torch.autograd.grad(ref, (x32,), dh)
        torch.testing.assert_close(dx, dx_ref, atol=1e-4, rtol=1e-4)


def test_bad_row_table_names_the_field():
    h, pair_row, gate, offsets, w, rows = make_case("basic", torch.float32)
    with pytest.raises(ValueError, match="row_pairs_RK"):
        grouped_down_reduce(h, pair_row, gate, offsets, w, rows, row_pairs_RK=torch.zeros(rows + 1, 2, dtype=torch.long))


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_backward_ignores_padded_pairs_past_the_last_expert(tma):
    """A padded plan (`occult.ep` static mode) has more pair rows than pairs: rows past
    expert_offsets[-1] are never written (NaN here). The dW GEMM's last K block must not read
    them, nor the next expert's rows: its descriptor ends at the expert's last pair."""
    module = importlib.import_module("occult.kernels.gemm_configs")
    h, pair_row, gate, offsets, w, rows = make_case("npow2", torch.float32)
    pad = 7
    h_pad = torch.cat([h, torch.full((pad, h.shape[1]), float("nan"), device=h.device)])
    row_pad = torch.cat([pair_row, torch.zeros(pad, dtype=pair_row.dtype, device=pair_row.device)])
    gate_pad = torch.cat([gate, torch.full((pad,), float("nan"), device=gate.device)])
    dy = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(2)).to(h.device)
    backward = importlib.import_module("occult.kernels.grouped_down_reduce").grouped_down_reduce_backward
    with contextlib.nullcontext() if tma else module.tma_disabled():
        dh, dgate, dw = backward(dy, h_pad, row_pad, gate_pad, offsets, w, True, True)
    _, dh_ref, dgate_ref, dw_ref = reference_grads(h, pair_row, gate, offsets, w, rows, dy)
    n = h.shape[0]
    torch.testing.assert_close(dw, dw_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dh[:n], dh_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dgate[:n], dgate_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["npow2", "empty_experts", "hot_expert", "all_experts", "one_row"])
def test_dw_with_gathered_rows_matches_reference(case):
    """The down dW's X_TMA option (gate · dy gathered once in pair order, then loaded through a
    descriptor) gives the reference dW, also with unwritten (NaN) pair rows of a padded plan past
    the last expert. bf16 on a GPU (the TMA path), fp32 in the interpreter."""
    configs_module = importlib.import_module("occult.kernels.gemm_configs")
    down_module = importlib.import_module("occult.kernels.grouped_down_reduce")
    on_gpu = DEVICE == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    h, pair_row, gate, offsets, w, rows = make_case(case, dtype, seed=4)
    pad = 3
    h_pad = torch.cat([h, torch.full((pad, h.shape[1]), float("nan"), device=h.device, dtype=dtype)])
    # a padded plan's rows past the last expert may hold anything, out-of-range values included
    row_pad = torch.cat([pair_row, torch.tensor([-1, 10**6, 0], dtype=pair_row.dtype, device=pair_row.device)])
    gate_pad = torch.cat([gate, torch.full((pad,), float("nan"), device=gate.device, dtype=gate.dtype)])
    dy = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(6)).to(h.device, dtype)
    blocks = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3} if on_gpu else \
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
    with configs_module.forced_gemm_meta("_down_bwd_dw_kernel", {**blocks, "X_TMA": 1}):
        _, _, dw = down_module.grouped_down_reduce_backward(dy, h_pad, row_pad, gate_pad, offsets, w, False, True)
    _, _, _, dw_ref = reference_grads(h, pair_row, gate, offsets, w, rows, dy)
    if on_gpu:
        assert _rel_err(dw, dw_ref) <= 1e-2
    else:
        torch.testing.assert_close(dw, dw_ref, atol=1e-4, rtol=1e-4)


def test_gather_scale_rows_matches_torch():
    down_module = importlib.import_module("occult.kernels.grouped_down_reduce")
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(7, 40, generator=gen).to(DEVICE)
    rows = torch.tensor([6, 0, 0, 3, 5, 1, 6, 2, 4, 3, 0]).to(DEVICE)
    gate = torch.rand(rows.numel(), generator=gen).to(DEVICE)
    got = down_module.gather_scale_rows(x[:, ::2], rows, gate, torch.float32)      # strided x
    torch.testing.assert_close(got, x[:, ::2][rows] * gate[:, None])
    assert down_module.gather_scale_rows(x, rows[:0], gate[:0], torch.float32).shape == (0, 40)
    # out-of-range rows (what a padded plan may leave past its last expert) are clamped, not read
    wild = torch.tensor([-5, 2, 99]).to(DEVICE)
    torch.testing.assert_close(down_module.gather_scale_rows(x, wild, gate[:3], torch.float32),
                               x[[0, 2, 6]] * gate[:3, None])


def test_dw_options_without_descriptors_are_refused():
    configs_module = importlib.import_module("occult.kernels.gemm_configs")
    down_module = importlib.import_module("occult.kernels.grouped_down_reduce")
    h, pair_row, gate, offsets, w, rows = make_case("npow2", torch.float32)
    dy = torch.randn(rows, w.shape[1]).to(h.device)
    with configs_module.tma_disabled(), configs_module.forced_gemm_meta(
            "_down_bwd_dw_kernel", {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "X_TMA": 1}):
        with pytest.raises(ValueError, match="needs descriptor operands"):
            down_module.grouped_down_reduce_backward(dy, h, pair_row, gate, offsets, w, False, True)
