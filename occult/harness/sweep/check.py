"""Each method's correctness check against the dense reference, and errors every rank agrees on."""

from __future__ import annotations

import sys
import traceback

import torch
import torch.distributed as dist

from occult.harness.baselines import ExpertWeights, Method
from occult.harness.sweep.inputs import InputSet

REF_CHUNK_TOKENS = 16


def agree(error: str | None, world: int) -> str | None:
    """The first rank's error (or None) on every rank, so that all ranks take the same branch."""
    if world == 1:
        return error
    errors: list[str | None] = [None] * world
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)


def error_text(err: BaseException) -> str:
    traceback.print_exception(err, file=sys.stderr)
    return " ".join(f"{type(err).__name__}: {err}".split())[:500]


def reference_outputs(inputs: InputSet, nd: int | None, weights: ExpertWeights, device: torch.device,
                      with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """moe_dense_ref (fp32, token chunks) of the routed experts: output and, if asked, dL/dx."""
    from occult.kernels.reference import moe_dense_ref

    w_gate_up = weights.w_gate_up_E2FD.to(device=device, dtype=torch.float32)
    w_down = weights.w_down_EDF.to(device=device, dtype=torch.float32)
    ids, gate = inputs.routes[nd]
    x = inputs.x_TD.float().detach().requires_grad_(with_grad)
    outputs = []
    for start in range(0, x.shape[0], REF_CHUNK_TOKENS):
        part = slice(start, start + REF_CHUNK_TOKENS)
        y = moe_dense_ref(x[part], ids[part], gate[part].float(), w_gate_up, w_down)
        if with_grad:
            (y * inputs.dy_TD[part].float()).sum().backward()
        outputs.append(y.detach())
    return torch.cat(outputs), (x.grad if with_grad else None)


def relative_error(method: Method, inputs: InputSet, nd: int | None, reference: tuple[torch.Tensor, torch.Tensor | None],
                   world: int) -> float:
    """max |y - ref| / max |ref| over ranks (and the same for dL/dx when the reference has it). The
    forward runs in the grad mode the timed steps use: recording autograd only when the reference
    has dL/dx (a library may take another path under autograd)."""
    ids, gate = inputs.routes[nd]
    want_y, want_gx = reference
    x = inputs.x_TD.detach().requires_grad_(want_gx is not None)
    with torch.set_grad_enabled(want_gx is not None):
        y = method.forward(x, ids, gate)
    stats = [(y.detach().float() - want_y).abs().max(), want_y.abs().max()]
    if want_gx is not None:
        y.backward(inputs.dy_TD)
        stats += [(x.grad.float() - want_gx).abs().max(), want_gx.abs().max()]
    for p in method.expert_parameters():
        p.grad = None
    values = torch.stack([s.float() for s in stats])
    if world > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    pairs = values.view(-1, 2).tolist()
    return max(err / max(scale, 1e-30) for err, scale in pairs)
