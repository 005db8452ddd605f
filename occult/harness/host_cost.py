"""What one eager `ep_moe` forward costs the host.

    TRITON_INTERPRET=1 python -m occult.harness.host_cost          # count launches (CPU)
    python -m occult.harness.host_cost --host-us --tokens 1024     # host µs per part (GPU)

Counting: aten ops (a torch dispatch mode; allocations and views left out) and Triton kernel
launches (the interpreter's launcher), for one device (D = 1: the 3 all-to-alls of D > 1 come on
top), OLMoE-like routing (64 experts, top-8), Triton backend with the fused dispatch plan and with
`OCCULT_FUSED_PLAN=0`.

Host time (`host_breakdown`): the OLMoE layer shape on one GPU, bf16, no process group; each call
starts on a drained GPU, and wall-clock µs are summed per part of the forward by wrappers around
the layer's steps (the Triton launcher `JITFunction.run` also separately, wherever it is called
from, and the direct launches' lookup, `occult.kernels.launch._lookup`, which replaces it once a
kernel's specialisation is compiled). "rest" is the forward's time outside the wrapped parts (ep_moe's own Python and torch ops).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

NOT_LAUNCHES = ("empty", "view", "slice", "select", "detach", "unsqueeze", "expand", "alias", "reshape",
                "t.default", "squeeze", "_unsafe_view", "lift_fresh", "as_strided")


class _AtenCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not any(name in str(func) for name in NOT_LAUNCHES):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_forward(fused: bool, tokens: int = 8, seed: int = 0) -> dict[str, int]:
    """{"aten": ..., "triton": ...} for one no-grad forward (after a warm-up call)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("occult.harness.host_cost counts under the Triton interpreter: set TRITON_INTERPRET=1")
    import triton.runtime.interpreter as interpreter

    from occult.ep.layer import ep_moe, get_backend

    gen = torch.Generator().manual_seed(seed)
    experts, top_k, hidden, ffn = 64, 8, 64, 32
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=gen)
    w_gate_up, w_down = torch.randn(experts, 2 * ffn, hidden, generator=gen), torch.randn(experts, hidden, ffn, generator=gen)
    placement = torch.zeros(experts, dtype=torch.long)
    ops = get_backend("triton")
    if not fused:
        ops = dataclasses.replace(ops, dedup_count=None, dedup_plan_pack=None, group_pairs=None)
    triton_launches = [0]
    original = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        triton_launches[0] += 1
        with _disable_current_modes():
            return original(self, *args, **kwargs)

    with torch.no_grad():
        ep_moe(x, ids, weights, placement, w_gate_up, w_down, backend=ops)          # warm-up: placement tables
        interpreter.GridExecutor.__call__ = counted
        try:
            with _AtenCount() as aten:
                ep_moe(x, ids, weights, placement, w_gate_up, w_down, backend=ops)
        finally:
            interpreter.GridExecutor.__call__ = original
    return {"aten": sum(aten.ops.values()), "triton": triton_launches[0]}


class _Clock:
    """µs of wall-clock time per part, summed over the timed calls (nested parts count in each)."""

    def __init__(self) -> None:
        self.us: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.on = False

    def wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.us[part] += 1e6 * (time.perf_counter() - begin)
                self.calls[part] += 1
        return timed


@contextlib.contextmanager
def _patched(obj, name: str, value) -> Iterator[None]:
    original = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, original)


# the wrapped parts of one forward, in call order
HOST_PARTS = ("checks+tables", "plan_count", "plan_pack", "dispatch_rows", "group_pairs", "swiglu", "down_reduce",
              "combine")
# nested inside them: the kernels' launchers without their differentiable-op wrappers
INNER_PARTS = ("swiglu_launcher", "down_launcher")


def host_breakdown(tokens: int, repeats: int = 100, warmup: int = 10, seed: int = 0,
                   experts: int = 64, top_k: int = 8, hidden: int = 2048, ffn: int = 1024) -> dict[str, float]:
    """Median host µs of one eager no-grad `ep_moe` forward (`total`), and the mean µs per call of
    each part of `HOST_PARTS` (0 for parts a one-device call skips), `rest`, the `INNER_PARTS` and
    `triton_launch` (launches through Triton's `JITFunction.run`) and `direct_lookup` (the lookup of
    `occult.kernels.launch`'s direct launches, which skip it), on the GPU."""
    import triton

    from occult.ep import layer

    # the modules (occult.kernels exports functions of the same names)
    swiglu_module = importlib.import_module("occult.kernels.grouped_swiglu")
    down_module = importlib.import_module("occult.kernels.grouped_down_reduce")
    launch_module = importlib.import_module("occult.kernels.launch")

    if not torch.cuda.is_available():
        raise RuntimeError("host_breakdown: needs a GPU (the Triton backend's launches are what it times)")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, generator=gen).bfloat16()
    ids = torch.rand(tokens, experts, device=device, generator=gen).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, device=device, generator=gen)
    w_gate_up = (torch.randn(experts, 2 * ffn, hidden, device=device, generator=gen) * hidden ** -0.5).bfloat16()
    w_down = (torch.randn(experts, hidden, ffn, device=device, generator=gen) * ffn ** -0.5).bfloat16()
    placement = torch.zeros(experts, dtype=torch.long)
    clock = _Clock()
    base = layer.get_backend("triton")
    ops = dataclasses.replace(
        base, dedup_count=clock.wrap("plan_count", base.dedup_count),
        dedup_plan_pack=clock.wrap("plan_pack", base.dedup_plan_pack),
        group_pairs=clock.wrap("group_pairs", base.group_pairs), grouped_swiglu=clock.wrap("swiglu", base.grouped_swiglu),
        grouped_down_reduce=clock.wrap("down_reduce", base.grouped_down_reduce),
        combine=clock.wrap("combine", base.combine))

    class Dispatch:
        apply = staticmethod(clock.wrap("dispatch_rows", layer._Dispatch.apply))

    totals: list[float] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(layer, "_Dispatch", Dispatch))
        stack.enter_context(_patched(layer, "_check_inputs", clock.wrap("checks+tables", layer._check_inputs)))
        stack.enter_context(_patched(layer, "placement_tables", clock.wrap("checks+tables", layer.placement_tables)))
        stack.enter_context(_patched(swiglu_module, "grouped_swiglu_forward",
                                     clock.wrap("swiglu_launcher", swiglu_module.grouped_swiglu_forward)))
        stack.enter_context(_patched(down_module, "grouped_down_reduce_forward",
                                     clock.wrap("down_launcher", down_module.grouped_down_reduce_forward)))
        stack.enter_context(_patched(triton.runtime.jit.JITFunction, "run",
                                     clock.wrap("triton_launch", triton.runtime.jit.JITFunction.run)))
        stack.enter_context(_patched(launch_module, "_lookup", clock.wrap("direct_lookup", launch_module._lookup)))
        with torch.no_grad():
            for i in range(warmup + repeats):
                torch.cuda.synchronize(device)
                clock.on = i >= warmup
                begin = time.perf_counter()
                layer.ep_moe(x, ids, weights, placement, w_gate_up, w_down, backend=ops)
                if clock.on:
                    totals.append(1e6 * (time.perf_counter() - begin))
                clock.on = False
        torch.cuda.synchronize(device)
    for inner, outer in zip(INNER_PARTS, ("swiglu", "down_reduce")):
        if clock.calls[outer] and not clock.calls[inner]:     # a wrapper that was bypassed would read 0 µs
            raise RuntimeError(f"host_breakdown: {inner} was never reached inside {outer}; the launcher was "
                               "called through a reference the wrapper does not replace")
    out = {"total": statistics.median(totals), "total_mean": statistics.fmean(totals)}
    timed = (*HOST_PARTS, *INNER_PARTS, "triton_launch", "direct_lookup")
    out.update({part: clock.us[part] / repeats for part in timed})
    out["rest"] = out["total_mean"] - sum(out[part] for part in HOST_PARTS)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.host_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host-us", action="store_true", help="time the host per part on the GPU (else count)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args(argv)
    if not args.host_us:
        for fused in (True, False):
            counts = count_forward(fused)
            print(f"{'fused plan' if fused else 'OCCULT_FUSED_PLAN=0':>20}: {counts['aten']} aten ops, "
                  f"{counts['triton']} Triton launches")
        return 0
    rows = {str(tokens): host_breakdown(tokens, args.repeats) for tokens in args.tokens}
    keys = ["total", "total_mean", *HOST_PARTS, "rest", *INNER_PARTS, "triton_launch", "direct_lookup"]
    print("host µs per eager forward (OLMoE layer, D = 1, no process group; parts are means)")
    print(f"{'part':>15} " + " ".join(f"{t:>9}" for t in rows))
    for key in keys:
        print(f"{key:>15} " + " ".join(f"{rows[t][key]:9.1f}" for t in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
