"""Count the launches of one eager `ep_moe` forward on CPU: aten ops (a torch dispatch mode;
allocations and views left out) and Triton kernel launches (the interpreter's launcher).

    TRITON_INTERPRET=1 python -m occult.ep.launches

One device (D = 1: the 3 all-to-alls of D > 1 come on top), OLMoE-like routing (64 experts,
top-8), Triton backend with the fused dispatch plan and with `OCCULT_FUSED_PLAN=0`.
"""

from __future__ import annotations

import collections
import dataclasses
import os

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
        raise RuntimeError("occult.ep.launches counts under the Triton interpreter: set TRITON_INTERPRET=1")
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


if __name__ == "__main__":
    for fused in (True, False):
        counts = count_forward(fused)
        print(f"{'fused plan' if fused else 'OCCULT_FUSED_PLAN=0':>20}: {counts['aten']} aten ops, "
              f"{counts['triton']} Triton launches")
