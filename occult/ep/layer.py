"""The expert-parallel MoE layer: dispatch, expert compute, combine, with autograd throughout.

`ep_moe` runs on every rank of an EP group of D ranks, each with its own tokens and the experts
the placement gives it:

  1. plan (`occult.ep.plan.build_plan`): send order, BRIM_0, split sizes;
  2. exchange the row/pair counts (one small all-to-all, one host sync for the receive splits);
  3. dispatch: all-to-all of the token rows, the pair codes and the gate weights (fp32);
  4. expert side: BRIM_1 (`build_pairs`), grouped SwiGLU, grouped down projection scaled by the
     gates and summed per received row in fp32 (`dedup`: one returned row per (token, device));
  5. return the rows with the inverse all-to-all and combine the C_T partials per token.

Backward runs the same indices the other way: the transposed all-to-alls swap dispatch and
combine, and the gate-weight gradient is formed on the expert side (from `pair_gate_M`) and
travels back through the gate all-to-all. The expert compute and combine are a pluggable
backend: "torch" (the plain references of `occult.kernels.reference`) or "triton"
(`occult.kernels.grouped_swiglu`, `grouped_down_reduce`, `combine`, imported on first use).
"""

from __future__ import annotations

import importlib
import types
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from occult.ep.plan import (
    META_BYTES_PER_PAIR,
    MODES,
    DispatchPlan,
    build_pairs,
    build_plan,
    check_placement,
    local_expert_ids,
)

BACKENDS = ("torch", "triton")
KERNEL_NAMES = ("grouped_swiglu", "grouped_down_reduce", "combine")


@dataclass(frozen=True)
class ExpertBackend:
    """The three ops of the expert side and the combine, with the signatures of the references."""

    name: str
    grouped_swiglu: Callable[..., torch.Tensor]
    grouped_down_reduce: Callable[..., torch.Tensor]
    combine: Callable[..., torch.Tensor]


def _resolve_kernel(name: str) -> Callable[..., torch.Tensor]:
    package = importlib.import_module("occult.kernels")
    found = getattr(package, name, None)
    if found is None:
        found = importlib.import_module(f"occult.kernels.{name}")
    if isinstance(found, types.ModuleType):
        found = getattr(found, name)
    if not callable(found):
        raise TypeError(f"occult.kernels.{name} is not callable")
    return found


def get_backend(name: str) -> ExpertBackend:
    """"torch" = plain references through autograd; "triton" = the kernels (never a silent fallback)."""
    if name == "torch":
        from occult.kernels.reference import combine_ref, grouped_down_reduce_ref, grouped_swiglu_ref

        return ExpertBackend("torch", grouped_swiglu_ref, grouped_down_reduce_ref, combine_ref)
    if name == "triton":
        try:
            ops = [_resolve_kernel(op) for op in KERNEL_NAMES]
        except (ImportError, AttributeError, TypeError) as err:
            raise RuntimeError(
                f"backend='triton' needs occult.kernels.{{{', '.join(KERNEL_NAMES)}}} "
                f"(the folder kernels/), which could not be loaded: {err}"
            ) from err
        return ExpertBackend("triton", *ops)
    raise ValueError(f"backend: {name!r} is not one of {BACKENDS}")


@dataclass
class EPStats:
    """Traffic of `ep_moe` calls on one rank, accumulated over calls (forward only).

    Remote bytes cross the network; self bytes are the rows a rank routes to its own experts
    (a copy, listed apart). Dispatch bytes = hidden rows + 8 bytes of metadata per pair.
    """

    calls: int = 0
    tokens: int = 0
    devices_per_token_sum: int = 0   # sum of C_T over the tokens
    rows_remote: int = 0             # rows dispatched to other ranks
    rows_self: int = 0
    pairs_remote: int = 0
    bytes_dispatch_remote: int = 0
    bytes_combine_remote: int = 0    # partial rows this rank returns to other ranks
    bytes_self: int = 0              # dispatch + combine bytes that stay on this rank

    @property
    def mean_devices_per_token(self) -> float:
        """E[C_T] over the tokens seen (nan before any token)."""
        return self.devices_per_token_sum / self.tokens if self.tokens else float("nan")

    @property
    def bytes_remote(self) -> int:
        return self.bytes_dispatch_remote + self.bytes_combine_remote

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "mean_devices_per_token": self.mean_devices_per_token}


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits; its backward is the transposed all-to-all."""

    @staticmethod
    def forward(ctx, x, recv_splits: list[int], send_splits: list[int], group):  # type: ignore[override]
        ctx.recv_splits, ctx.send_splits, ctx.group = recv_splits, send_splits, group
        return _all_to_all(x, recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_to_all(grad, ctx.send_splits, ctx.recv_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(D, rank); `group=None` without an initialised process group is a single device."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def ep_moe(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    device_of_expert_E: torch.Tensor,
    w_gate_up_local: torch.Tensor,
    w_down_local: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    mode: str = "dedup",
    backend: str | ExpertBackend = "torch",
    shared_expert: Callable[[torch.Tensor], torch.Tensor] | None = None,
    stats: EPStats | None = None,
) -> torch.Tensor:
    """MoE output [T, D] for this rank's tokens, experts spread over the ranks of `group`.

    `ids_TK` are global expert ids, `weights_TK` their gate weights; `device_of_expert_E`
    (best kept on the CPU) maps each expert to a rank of `group`. This rank holds the experts
    `experts_of_device(device_of_expert_E, rank)` stacked in `w_gate_up_local` [E_r, 2F, D] and
    `w_down_local` [E_r, D, F]. Every rank of the group must call this together. `shared_expert`,
    if given, is computed locally and added. `stats`, if given, accumulates the traffic (one more
    host sync for the C_T sum).
    """
    world, rank = group_size_and_rank(group)
    ops = get_backend(backend) if isinstance(backend, str) else backend
    _check_inputs(x_TD, ids_TK, weights_TK, w_gate_up_local, w_down_local, mode)
    placement_cpu = check_placement(device_of_expert_E.detach().cpu(), world)
    local_id_E = local_expert_ids(placement_cpu, world)
    experts_here = int((placement_cpu == rank).sum())
    if w_gate_up_local.shape[0] != experts_here:
        raise ValueError(
            f"w_gate_up_local: holds {w_gate_up_local.shape[0]} experts but device_of_expert_E puts "
            f"{experts_here} on rank {rank}"
        )

    device = x_TD.device
    plan = build_plan(ids_TK, placement_cpu.to(device), world, local_id_E.to(device), mode)
    send_rows, send_pairs = plan.rows_per_device, plan.pairs_per_device
    if world == 1:
        recv_rows, recv_pairs = send_rows, send_pairs
    else:
        counts_D2 = torch.tensor([send_rows, send_pairs], dtype=torch.long, device=device).t().contiguous()
        recv_counts_D2 = _all_to_all(counts_D2, [1] * world, [1] * world, group)
        recv_rows, recv_pairs = recv_counts_D2.t().tolist()  # host sync: receive split sizes

    gate_P = weights_TK.reshape(-1)[plan.pair_slot_P].float()
    x_SD = x_TD[plan.send_token_S]

    def exchange(t: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        return t if world == 1 else _AllToAll.apply(t, recv, send, group)

    x_RD = exchange(x_SD, recv_rows, send_rows)
    gate_recv_P = exchange(gate_P, recv_pairs, send_pairs)
    code_recv_P = exchange(plan.pair_code_P, recv_pairs, send_pairs)

    pair_row_M, pair_gate_M, expert_offsets = build_pairs(code_recv_P, gate_recv_P, experts_here)
    h_MF = ops.grouped_swiglu(x_RD, pair_row_M, expert_offsets, w_gate_up_local)
    y_RD = ops.grouped_down_reduce(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_local, x_RD.shape[0])
    z_SD = exchange(y_RD, send_rows, recv_rows)
    y_TD = ops.combine(z_SD, plan.brim0_TJ)

    if shared_expert is not None:
        y_TD = y_TD + shared_expert(x_TD)
    if stats is not None:
        _record(stats, plan, rank, x_TD, z_SD, recv_rows)
    return y_TD


def _check_inputs(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w_gate_up_local: torch.Tensor,
    w_down_local: torch.Tensor,
    mode: str,
) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {MODES}")
    if x_TD.dim() != 2:
        raise ValueError(f"x_TD: expected [T, D], got shape {tuple(x_TD.shape)}")
    if ids_TK.dim() != 2 or ids_TK.shape[0] != x_TD.shape[0] or ids_TK.is_floating_point():
        raise ValueError(f"ids_TK: expected integer [T={x_TD.shape[0]}, k], got {ids_TK.dtype} {tuple(ids_TK.shape)}")
    if weights_TK.shape != ids_TK.shape:
        raise ValueError(f"weights_TK: shape {tuple(weights_TK.shape)} differs from ids_TK {tuple(ids_TK.shape)}")
    hidden = x_TD.shape[1]
    if w_gate_up_local.dim() != 3 or w_gate_up_local.shape[2] != hidden or w_gate_up_local.shape[1] % 2:
        raise ValueError(f"w_gate_up_local: expected [E_r, 2F, {hidden}], got {tuple(w_gate_up_local.shape)}")
    ffn = w_gate_up_local.shape[1] // 2
    if w_down_local.shape != (w_gate_up_local.shape[0], hidden, ffn):
        raise ValueError(
            f"w_down_local: expected {(w_gate_up_local.shape[0], hidden, ffn)}, got {tuple(w_down_local.shape)}"
        )


def _record(
    stats: EPStats, plan: DispatchPlan, rank: int, x_TD: torch.Tensor, z_SD: torch.Tensor, recv_rows: list[int]
) -> None:
    row_bytes = x_TD.shape[1] * x_TD.element_size()
    back_bytes = x_TD.shape[1] * z_SD.element_size()
    rows, pairs = plan.rows_per_device, plan.pairs_per_device
    remote_rows = sum(rows) - rows[rank]
    remote_pairs = sum(pairs) - pairs[rank]
    stats.calls += 1
    stats.tokens += x_TD.shape[0]
    stats.devices_per_token_sum += int(plan.devices_per_token_T.sum())  # host sync
    stats.rows_remote += remote_rows
    stats.rows_self += rows[rank]
    stats.pairs_remote += remote_pairs
    stats.bytes_dispatch_remote += remote_rows * row_bytes + remote_pairs * META_BYTES_PER_PAIR
    stats.bytes_combine_remote += (sum(recv_rows) - recv_rows[rank]) * back_bytes
    stats.bytes_self += rows[rank] * (row_bytes + back_bytes) + pairs[rank] * META_BYTES_PER_PAIR
