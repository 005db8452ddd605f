"""kernels/launch.py: a specialisation's compiled kernel launched directly gives what Triton's
normal launch gives, a new specialisation (integer divisibility, pointer alignment) gets its own
kernel, and a failing lookup falls back to the normal path for good."""

from __future__ import annotations

import importlib

import pytest
import torch

launch_module = importlib.import_module("occult.kernels.launch")
swiglu_module = importlib.import_module("occult.kernels.grouped_swiglu")


def _preact_case(pairs: int, ffn: int, offset: int, seed: int):
    """dh [pairs, ffn] and [g | u] [pairs, 2·ffn], each starting `offset` elements into its storage
    (offset 1 of bf16 is a base pointer off 16-byte alignment: another specialisation)."""
    gen = torch.Generator().manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def tensor(rows: int, cols: int) -> torch.Tensor:
        flat = torch.randn(rows * cols + offset, generator=gen).to(device, torch.bfloat16)
        return flat[offset:].view(rows, cols)

    return tensor(pairs, ffn), tensor(pairs, 2 * ffn)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_direct_launches_match_the_normal_launch_per_specialisation(monkeypatch):
    """Per case (divisible / not divisible sizes, aligned / unaligned bases), on fresh random inputs:
    the first launch goes through Triton (its kernel is remembered), the second straight to that
    kernel; both agree bit for bit with `FAST_LAUNCH` off. Every case adds its own entry."""
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    calls = {"normal": 0}
    import triton

    original = triton.runtime.jit.JITFunction.run

    def counted(self, *args, **kwargs):
        calls["normal"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", counted)
    cases = [(64, 128, 0), (37, 96, 0), (64, 128, 1), (1, 128, 0)]
    for index, (pairs, ffn, offset) in enumerate(cases):
        dh, preact = _preact_case(pairs, ffn, offset, seed=index)
        monkeypatch.setattr(launch_module, "FAST_LAUNCH", [False])
        want = swiglu_module.swiglu_preact_grad(dh, preact, torch.bfloat16)
        monkeypatch.setattr(launch_module, "FAST_LAUNCH", [True])
        before, entries = calls["normal"], len(launch_module._COMPILED)
        first = swiglu_module.swiglu_preact_grad(dh, preact, torch.bfloat16)
        second = swiglu_module.swiglu_preact_grad(dh, preact, torch.bfloat16)
        torch.cuda.synchronize()
        assert calls["normal"] == before + 1            # only the first went through Triton's run
        assert len(launch_module._COMPILED) == entries + 1, f"case {index}: no entry of its own"
        assert torch.equal(first, want) and torch.equal(second, want), f"case {index}"
    assert launch_module.FAST_LAUNCH[0], "the fast path switched itself off"


def test_a_failing_lookup_falls_back_to_the_normal_launch_for_good(monkeypatch):
    """If the fast path's lookups raise (Triton internals moved), the launch still happens through
    Triton's normal path, one RuntimeWarning says so, and the fast path stays off."""
    monkeypatch.setattr(launch_module, "FAST_LAUNCH", [True])
    monkeypatch.setattr(launch_module, "interpreting", lambda: False)

    def broken(*_args, **_kwargs):
        raise AttributeError("device_caches")

    monkeypatch.setattr(launch_module, "_lookup", broken)
    dh, preact = _preact_case(40, 32, 0, seed=7)
    monkeypatch.setattr(launch_module, "FAST_LAUNCH", [False])
    want = swiglu_module.swiglu_preact_grad(dh, preact, torch.bfloat16)
    monkeypatch.setattr(launch_module, "FAST_LAUNCH", [True])
    with pytest.warns(RuntimeWarning, match="direct launches disabled"):
        got = swiglu_module.swiglu_preact_grad(dh, preact, torch.bfloat16)
    assert launch_module.FAST_LAUNCH[0] is False
    assert torch.equal(got, want)
