"""combine (Triton) against combine_ref, and the pair→row segmented sum it shares with the grouped
ops: forward, dz (a scatter; rows never named get zero), empty and degenerate BRIM_0 tables."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from occult.kernels.combine import combine
from occult.kernels.reference import combine_ref
from occult.kernels.combine import row_csr, segment_sum_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# name -> (tokens T, slots J, rows of z S, hidden D, fraction of slots filled)
CASES = {
    "dedup_2dev": (37, 2, 80, 48, 0.7),
    "per_expert_k4": (20, 4, 90, 32, 0.9),
    "one_slot": (16, 1, 16, 40, 1.0),
    "all_missing": (9, 3, 5, 32, 0.0),
    "no_tokens": (0, 2, 4, 32, 0.5),
    "one_token": (1, 3, 7, 48, 1.0),
}
DTYPES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3)}  # summation order may differ


def make_case(name: str, dtype: torch.dtype, seed: int = 0):
    tokens, slots, rows, hidden, filled = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(tokens, slots, generator=gen) < filled
    keep_count = min(int(keep.sum()), rows)
    # Each named row of z is named once: draw distinct rows for the kept slots.
    brim = torch.full((tokens, slots), -1, dtype=torch.int64)
    kept_slots = keep.nonzero()[:keep_count]
    brim[kept_slots[:, 0], kept_slots[:, 1]] = torch.randperm(rows, generator=gen)[:keep_count]
    z = torch.randn(rows, hidden, generator=gen)
    return z.to(DEVICE, dtype), brim.to(DEVICE)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every torch.empty float tensor starts as NaN, so an element a kernel skips shows up."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-(2**30))

    monkeypatch.setattr(torch, "empty", nan_empty)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_grad_match_reference(case, dtype, poisoned_empty):
    atol, rtol = DTYPES[dtype]
    z, brim = make_case(case, dtype)
    z.requires_grad_()
    out = combine(z, brim)
    z32 = z.detach().float().requires_grad_()
    out_ref = combine_ref(z32, brim)
    assert out.dtype == dtype and out.shape == (brim.shape[0], z.shape[1])
    torch.testing.assert_close(out.float(), out_ref, atol=atol, rtol=rtol)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, dtype)
    (dz,) = torch.autograd.grad(out, (z,), grad_out, allow_unused=True)
    dz = torch.zeros_like(z) if dz is None else dz
    if out.numel() > 0:
        (dz_ref,) = torch.autograd.grad(out_ref, (z32,), grad_out.float())
    else:
        dz_ref = torch.zeros_like(z32)
    assert dz.dtype == dtype
    torch.testing.assert_close(dz.float(), dz_ref, atol=0, rtol=0)   # a copy: exact


def test_rows_never_named_get_zero_gradient():
    z, brim = make_case("dedup_2dev", torch.float32)
    z.requires_grad_()
    (dz,) = torch.autograd.grad(combine(z, brim), (z,), torch.ones(brim.shape[0], z.shape[1], device=z.device))
    named = torch.zeros(z.shape[0], dtype=torch.bool, device=z.device)
    named[brim[brim >= 0]] = True
    assert (~named).any() and torch.all(dz[~named] == 0) and torch.all(dz[named] == 1)


def test_int32_brim_and_strided_z():
    z, brim = make_case("per_expert_k4", torch.float32)
    z_wide = torch.randn(z.shape[0], 2 * z.shape[1], device=z.device)
    z_view = z_wide[:, ::2]   # a non-contiguous view
    torch.testing.assert_close(combine(z_view, brim.int()), combine_ref(z_view, brim))


@pytest.mark.parametrize("num_rows", [1, 7])
def test_segment_sum_matches_index_add(num_rows, poisoned_empty):
    gen = torch.Generator().manual_seed(2)
    pair_row = torch.randint(0, num_rows, (23,), generator=gen)
    pair_row[pair_row == num_rows - 1] = 0          # the last row gets no pair
    src = torch.randn(23, 40, generator=gen)
    pair_row, src = pair_row.to(DEVICE), src.to(DEVICE)
    order, row_ptr = row_csr(pair_row, num_rows)
    out = segment_sum_rows(src, order, row_ptr, torch.float16)
    want = torch.zeros(num_rows, 40, device=src.device).index_add(0, pair_row, src)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=1e-3)


def test_bad_brim_names_the_field():
    z, brim = make_case("one_slot", torch.float32)
    with pytest.raises(ValueError, match="brim0_TJ"):
        combine(z, brim.float())
    with pytest.raises(ValueError, match="brim0_TJ"):
        combine(z, brim[:, 0])


def test_opcheck_registrations():
    z, brim = make_case("dedup_2dev", torch.float32)
    torch.library.opcheck(
        torch.ops.occult.combine.default, (z.requires_grad_(), brim),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


@pytest.mark.gpu
def test_bf16_on_gpu():
    tokens, slots, rows, hidden = 3000, 2, 5000, 2048
    gen = torch.Generator().manual_seed(4)
    brim = torch.full((tokens, slots), -1, dtype=torch.int64)
    keep = (torch.rand(tokens, slots, generator=gen) < 0.8).nonzero()[:rows]
    brim[keep[:, 0], keep[:, 1]] = torch.randperm(rows, generator=gen)[: keep.shape[0]]
    z = torch.randn(rows, hidden, generator=gen).cuda().bfloat16().requires_grad_()
    brim = brim.cuda()
    out = combine(z, brim)
    out_ref = combine_ref(z.detach().float(), brim)
    assert ((out.float() - out_ref).norm() / out_ref.norm()).item() <= 1e-2
    grad_out = torch.randn_like(out)
    (dz,) = torch.autograd.grad(out, (z,), grad_out)
    (dz_ref,) = torch.autograd.grad(combine_ref(z, brim), (z,), grad_out)
    torch.testing.assert_close(dz, dz_ref, atol=0, rtol=0)


def test_the_three_ops_trace_under_torch_compile():
    """swiglu → down_reduce → combine in one fullgraph torch.compile (fake impls + autograd)."""
    from occult.kernels.grouped_down_reduce import grouped_down_reduce
    from occult.kernels.grouped_swiglu import grouped_swiglu

    gen = torch.Generator().manual_seed(5)
    rows, hidden, ffn, experts = 12, 32, 16, 3
    pair_row = torch.tensor([0, 3, 5, 1, 3, 7, 2, 9, 11, 4], device=DEVICE)
    offsets = torch.tensor([0, 4, 4, 10], device=DEVICE)
    brim = torch.tensor([[0, 1], [2, -1], [3, 4], [5, 6], [7, 8], [9, 10], [11, -1]], device=DEVICE)
    leaves = [torch.randn(shape, generator=gen).to(DEVICE).requires_grad_()
              for shape in ((rows, hidden), (experts, 2 * ffn, hidden), (experts, hidden, ffn), (10,))]

    def layer(x, w_gate_up, w_down, gate):
        h = grouped_swiglu(x, pair_row, offsets, w_gate_up)
        return combine(grouped_down_reduce(h, pair_row, gate, offsets, w_down, rows), brim)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    out = compiled(*leaves)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    out_eager = layer(*leaves)
    grads_eager = torch.autograd.grad(out_eager.square().sum(), leaves)
    torch.testing.assert_close(out, out_eager)
    for got, want in zip(grads, grads_eager):
        torch.testing.assert_close(got, want)


def test_eager_calls_skip_the_custom_ops_only_when_nothing_needs_them(monkeypatch):
    """`direct_call_ok`: an eager no-grad forward and the autograd backward call the implementations
    directly (same numbers); an eager forward that records autograd runs through the ops' plain
    `autograd.Function`s (`eager_function_ok`), with the same outputs and gradients bit for bit as
    through the custom ops; under a torch dispatch mode (fake tensors, op counters) the registered
    custom ops run, with autograd or without."""
    import importlib

    from occult.kernels.grouped_down_reduce import grouped_down_reduce
    from occult.kernels.grouped_swiglu import grouped_swiglu

    modules = {name: importlib.import_module(f"occult.kernels.{name}")
               for name in ("combine", "grouped_swiglu", "grouped_down_reduce")}
    op_names = {"combine": ("_combine_op", "_combine_backward_op"),
                "grouped_swiglu": ("_grouped_swiglu_op", "_grouped_swiglu_backward_op"),
                "grouped_down_reduce": ("_grouped_down_reduce_op", "_grouped_down_reduce_backward_op")}
    calls: dict[str, int] = {}
    for module_name, names in op_names.items():
        for name in names:
            original = getattr(modules[module_name], name)

            def counted(*args, _original=original, _name=name):
                calls[_name] = calls.get(_name, 0) + 1
                return _original(*args)
            monkeypatch.setattr(modules[module_name], name, counted)

    gen = torch.Generator().manual_seed(6)
    rows, hidden, ffn, experts = 12, 32, 16, 3
    pair_row = torch.tensor([0, 3, 5, 1, 3, 7, 2, 9, 11, 4], device=DEVICE)
    offsets = torch.tensor([0, 4, 4, 10], device=DEVICE)
    brim = torch.tensor([[0, 1], [2, -1], [3, 4], [5, 6], [7, 8], [9, 10], [11, -1]], device=DEVICE)
    leaves = [torch.randn(shape, generator=gen).to(DEVICE)
              for shape in ((rows, hidden), (experts, 2 * ffn, hidden), (experts, hidden, ffn), (10,))]

    def layer(x, w_gate_up, w_down, gate):
        h = grouped_swiglu(x, pair_row, offsets, w_gate_up)
        return combine(grouped_down_reduce(h, pair_row, gate, offsets, w_down, rows), brim)

    with torch.no_grad():
        direct = layer(*leaves)
    assert calls == {}
    with torch.no_grad(), _PassThrough():
        through_ops = layer(*leaves)
    assert calls == {"_grouped_swiglu_op": 1, "_grouped_down_reduce_op": 1, "_combine_op": 1}
    torch.testing.assert_close(direct, through_ops, atol=0, rtol=0)

    calls.clear()
    graded = [leaf.clone().requires_grad_() for leaf in leaves]
    out = layer(*graded)
    assert calls == {}                     # eager autograd: the plain autograd.Functions
    torch.testing.assert_close(out.detach(), direct, atol=0, rtol=0)
    out.square().sum().backward()
    assert calls == {}                     # the backward ops are called directly in eager autograd
    assert all(leaf.grad is not None and leaf.grad.abs().sum() > 0 for leaf in graded)

    monkeypatch.setattr(modules["combine"], "EAGER_FUNCTIONS", [False])
    through = [leaf.clone().requires_grad_() for leaf in leaves]
    out_ops = layer(*through)
    assert calls == {"_grouped_swiglu_op": 1, "_grouped_down_reduce_op": 1, "_combine_op": 1}
    out_ops.square().sum().backward()
    torch.testing.assert_close(out_ops.detach(), out.detach(), atol=0, rtol=0)
    for leaf_fn, leaf_op in zip(graded, through):
        torch.testing.assert_close(leaf_op.grad, leaf_fn.grad, atol=0, rtol=0)

    monkeypatch.setattr(modules["combine"], "EAGER_FUNCTIONS", [True])
    calls.clear()
    with _PassThrough():
        layer(*[leaf.clone().requires_grad_() for leaf in leaves])
    assert calls == {"_grouped_swiglu_op": 1, "_grouped_down_reduce_op": 1, "_combine_op": 1}


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that only passes every op on (any mode keeps the custom ops)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
