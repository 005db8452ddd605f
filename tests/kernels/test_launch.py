"""kernels/launch.py: a specialisation's compiled kernel launched directly gives what Triton's
normal launch gives, a new specialisation (integer divisibility, pointer alignment) gets its own
kernel, and a failing lookup falls back to the normal path for good."""

from __future__ import annotations

import importlib

import pytest
import torch

launch_module = importlib.import_module("occult.kernels.launch")
swiglu_backward = importlib.import_module("occult.kernels.grouped_swiglu_backward")


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
        want = swiglu_backward.swiglu_preact_grad(dh, preact, torch.bfloat16)
        monkeypatch.setattr(launch_module, "FAST_LAUNCH", [True])
        before, entries = calls["normal"], len(launch_module._COMPILED)
        first = swiglu_backward.swiglu_preact_grad(dh, preact, torch.bfloat16)
        second = swiglu_backward.swiglu_preact_grad(dh, preact, torch.bfloat16)
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
    want = swiglu_backward.swiglu_preact_grad(dh, preact, torch.bfloat16)
    monkeypatch.setattr(launch_module, "FAST_LAUNCH", [True])
    with pytest.warns(RuntimeWarning, match="direct launches disabled"):
        got = swiglu_backward.swiglu_preact_grad(dh, preact, torch.bfloat16)
    assert launch_module.FAST_LAUNCH[0] is False
    assert torch.equal(got, want)


def _combine_case(tokens: int, slots: int, hidden: int, dtype: torch.dtype, seed: int):
    """z [S, hidden] and a BRIM table [tokens, slots] with some empty (−1) slots."""
    gen = torch.Generator().manual_seed(seed)
    rows = 3 * tokens
    z = torch.randn(rows, hidden, generator=gen).to("cuda", dtype)
    brim = torch.randint(-1, rows, (tokens, slots), generator=gen).to("cuda", torch.int32)
    return z, brim


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tuned_launches_skip_the_autotuner_once_it_has_chosen(monkeypatch):
    """Per tuning key (hidden, slots, dtypes), on fresh random inputs: the config `launch_tuned`
    finds is the one the autotuner's own launch chose, later launches pass neither `Autotuner.run`
    nor `JITFunction.run`, and every output equals the autotuner's bit for bit."""
    import triton

    combine_module = importlib.import_module("occult.kernels.combine")
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    monkeypatch.setattr(launch_module, "FAST_LAUNCH", [True])
    calls = {"tuner": 0, "jit": 0}
    seen: list[tuple] = []
    tuner_run, jit_run, original_launch_tuned = (triton.runtime.autotuner.Autotuner.run,
                                                 triton.runtime.jit.JITFunction.run, launch_module.launch_tuned)

    def counted_tuner(self, *args, **kwargs):
        calls["tuner"] += 1
        return tuner_run(self, *args, **kwargs)

    def counted_jit(self, *args, **kwargs):
        calls["jit"] += 1
        return jit_run(self, *args, **kwargs)

    def recorded(tuned, grid, args, kwargs=None):
        seen.append((tuned, args, kwargs or {}))
        return original_launch_tuned(tuned, grid, args, kwargs)

    monkeypatch.setattr(triton.runtime.autotuner.Autotuner, "run", counted_tuner)
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", counted_jit)
    monkeypatch.setattr(combine_module, "launch_tuned", recorded)
    cases = [(257, 4, 2048, torch.bfloat16), (64, 8, 1024, torch.bfloat16), (33, 4, 2048, torch.float32)]
    for index, (tokens, slots, hidden, dtype) in enumerate(cases):
        z, brim = _combine_case(tokens, slots, hidden, dtype, seed=index)
        monkeypatch.setattr(launch_module, "FAST_TUNED_LAUNCH", [False])
        want = combine_module.combine_forward(z, brim)
        tuned, args, kwargs = seen[-1]
        chosen = tuned.best_config
        assert launch_module._tuned_config(tuned, args, kwargs) is chosen, f"case {index}: another config"
        monkeypatch.setattr(launch_module, "FAST_TUNED_LAUNCH", [True])
        first = combine_module.combine_forward(z, brim)      # through Triton's run once (remembered)
        before = dict(calls)
        z2, brim2 = _combine_case(tokens, slots, hidden, dtype, seed=100 + index)
        second = combine_module.combine_forward(z2, brim2)
        torch.cuda.synchronize()
        assert calls == before, f"case {index}: a later launch went through Triton's Python ({calls} vs {before})"
        monkeypatch.setattr(launch_module, "FAST_TUNED_LAUNCH", [False])
        want2 = combine_module.combine_forward(z2, brim2)
        assert torch.equal(first, want) and torch.equal(second, want2), f"case {index}"
    assert launch_module.FAST_LAUNCH[0], "the fast path switched itself off"


class _NormalPath:
    """Stands in for an autotuned kernel: records launches through `kernel[grid](...)`."""

    def __init__(self):
        self.launches: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_tuned_launches_take_the_normal_path_when_they_must(monkeypatch):
    """Under the interpreter, with either switch off, or for anything but a Triton autotuner, the
    launch is `tuned[grid](*args, **kwargs)` with the arguments unchanged."""
    def grid(meta):
        return (1,)

    for interp, fast, fast_tuned in ((True, True, True), (False, False, True), (False, True, False), (False, True, True)):
        monkeypatch.setattr(launch_module, "interpreting", lambda interp=interp: interp)
        monkeypatch.setattr(launch_module, "FAST_LAUNCH", [fast])
        monkeypatch.setattr(launch_module, "FAST_TUNED_LAUNCH", [fast_tuned])
        tuned = _NormalPath()
        launch_module.launch_tuned(tuned, grid, (1, 2), {"X": 3})
        assert tuned.launches == [(grid, (1, 2), {"X": 3})]
        assert launch_module._tuned_config(tuned, (1, 2), {"X": 3}) is None


def test_a_config_with_a_pre_hook_is_never_launched_directly():
    """A config's pre-hook must run before its launch: `_tuned_config` leaves such a config to the
    autotuner even when it is the only one."""
    import triton
    import triton.language as tl

    @triton.jit
    def _noop(x_ptr, n, BLOCK: tl.constexpr):
        pass

    hooked = triton.autotune(configs=[triton.Config({"BLOCK": 16}, pre_hook=lambda nargs: None)], key=["n"])(_noop)
    assert launch_module._tuned_config(hooked, (torch.zeros(4), 4), {}) is None
