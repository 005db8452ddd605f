"""Plain-torch baselines: a naive expert-parallel MoE and an FSDP-sharded dense-equivalent MoE.

`NaiveEP` is standard EP written with nothing but torch: contiguous placement (E/D experts per
rank), one hidden row per (token, expert) pair sent with `all_to_all_single`, the received rows
grouped by local expert and run through two grouped GEMMs (`torch._grouped_mm` where torch has
it, else one matmul per expert), the rows sent back with the inverse all-to-all, scaled by their
gate weights and summed into their tokens with `index_add_` in fp32. Host syncs: one (`tolist` of
the all-to-all split sizes).

`FSDPMoE` keeps every expert on every rank logically but stores each rank's 1/D of the weights
(`torch.distributed.fsdp.fully_shard` over the group): a forward all-gathers all E experts, runs
the same grouped SwiGLU over the rank's own tokens (no token all-to-all), and frees them again; the
backward all-gathers once more and reduce-scatters the weight gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from occult.harness.baselines import ExpertWeights, Method, contiguous_experts, import_error_text, world_and_rank
from occult.shapes import MoEShape
from occult.ep.layer import AllToAll


def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_swiglu(
    x_MD: torch.Tensor,
    rows_per_expert_E: torch.Tensor,
    rows_per_expert_host: list[int] | None,
    w_gate_up_E2FD: torch.Tensor,
    w_down_EDF: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU of rows sorted by expert: y[m] = Wd[e] (silu(Wg[e] x[m]) * (Wu[e] x[m])).

    `rows_per_expert_E` (device) gives the group sizes to `torch._grouped_mm`; without it, the
    host list `rows_per_expert_host` drives one matmul per expert (and must then be given).
    """
    ffn = w_gate_up_E2FD.shape[1] // 2
    if x_MD.shape[0] == 0:
        # Keep x in the graph: the backward of the all-to-all that produced it must run on every
        # rank, with or without rows.
        anchor = x_MD.sum() + w_gate_up_E2FD.sum() + w_down_EDF.sum()
        return x_MD.new_zeros(0, w_down_EDF.shape[1]) + 0.0 * anchor
    if has_grouped_mm():
        offsets = torch.cumsum(rows_per_expert_E, 0).to(torch.int32)
        gate_up_M2F = torch._grouped_mm(x_MD, w_gate_up_E2FD.transpose(-2, -1), offs=offsets)
        h_MF = F.silu(gate_up_M2F[:, :ffn]) * gate_up_M2F[:, ffn:]
        return torch._grouped_mm(h_MF.contiguous(), w_down_EDF.transpose(-2, -1), offs=offsets)
    if rows_per_expert_host is None:
        raise ValueError("grouped_swiglu: torch has no _grouped_mm; rows_per_expert_host is required")
    parts, start = [], 0
    for expert, rows in enumerate(rows_per_expert_host):
        xs = x_MD[start : start + rows]
        gate_up = xs @ w_gate_up_E2FD[expert].t()
        parts.append((F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]) @ w_down_EDF[expert].t())
        start += rows
    return torch.cat(parts)


class NaiveEP(Method):
    """Standard EP in plain torch: one replica per (token, expert); see the module doc."""

    name = "naive"

    def setup(self, shape: MoEShape, group: dist.ProcessGroup | None, dtype: torch.dtype,
              device: torch.device, weights: ExpertWeights) -> None:
        self.group = group
        self.world, self.rank = world_and_rank(group)
        self.num_experts = shape.num_experts
        self.experts_per_rank = shape.num_experts // self.world
        block = contiguous_experts(shape.num_experts, self.world, self.rank)
        self.w_gate_up, self.w_down = weights.local(block, dtype, device)

    def expert_parameters(self) -> list[torch.Tensor]:
        return [self.w_gate_up, self.w_down]

    def _counts(self, ids_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], list[list[int]]]:
        """(send counts [D, E_r], recv counts [D, E_r] on device, and both on the host): one sync."""
        send_DE = torch.bincount(ids_TK.reshape(-1), minlength=self.num_experts).view(self.world, self.experts_per_rank)
        if self.world == 1:
            recv_DE = send_DE
        else:
            recv_DE = torch.empty_like(send_DE)
            dist.all_to_all_single(recv_DE, send_DE.contiguous(), group=self.group)
        send_host, recv_host = torch.stack([send_DE, recv_DE]).tolist()
        return send_DE, recv_DE, send_host, recv_host

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = ids_TK.shape
        ids_P = ids_TK.reshape(-1)
        # Contiguous placement: sorting by global id groups the pairs by (rank, local expert).
        order_P = torch.argsort(ids_P, stable=True)
        token_P = order_P // top_k
        send_DE, recv_DE, send_host, recv_host = self._counts(ids_TK)
        x_PD = x_TD[token_P]
        if self.world == 1:
            y_PD = grouped_swiglu(x_PD, send_DE[0], send_host[0], self.w_gate_up, self.w_down)
        else:
            send_splits = [sum(row) for row in send_host]
            recv_splits = [sum(row) for row in recv_host]
            x_RD = AllToAll.apply(x_PD, recv_splits, send_splits, self.group)
            # Received rows come in (source rank, local expert) blocks: regroup them by expert.
            experts_pattern = torch.arange(self.experts_per_rank, device=x_TD.device).repeat(self.world)
            expert_R = torch.repeat_interleave(experts_pattern, recv_DE.reshape(-1), output_size=x_RD.shape[0])
            perm_R = torch.argsort(expert_R, stable=True)
            inverse_R = torch.empty_like(perm_R)
            inverse_R[perm_R] = torch.arange(perm_R.numel(), device=perm_R.device)
            per_expert_host = [sum(col) for col in zip(*recv_host)]
            y_sorted = grouped_swiglu(x_RD[perm_R], recv_DE.sum(0), per_expert_host, self.w_gate_up, self.w_down)
            y_PD = AllToAll.apply(y_sorted[inverse_R], send_splits, recv_splits, self.group)
        contrib_PD = y_PD.float() * weights_TK.reshape(-1)[order_P].float()[:, None]
        out = torch.zeros(num_tokens, x_TD.shape[1], dtype=torch.float32, device=x_TD.device)
        return out.index_add(0, token_P, contrib_PD).to(x_TD.dtype)

    def bytes_sent(self, ids_TK: torch.Tensor) -> int | None:
        """Hidden rows this rank sends to other ranks: dispatched pairs plus returned results."""
        _, _, send_host, recv_host = self._counts(ids_TK)
        row_bytes = self.w_down.shape[1] * self.w_down.element_size()
        remote_dispatch = sum(map(sum, send_host)) - sum(send_host[self.rank])
        remote_return = sum(map(sum, recv_host)) - sum(recv_host[self.rank])
        return (remote_dispatch + remote_return) * row_bytes


class DenseExperts(nn.Module):
    """All E experts as one module (the unit FSDP shards); forward = grouped SwiGLU of local tokens."""

    def __init__(self, w_gate_up_E2FD: torch.Tensor, w_down_EDF: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(w_gate_up_E2FD)
        self.down_proj = nn.Parameter(w_down_EDF)

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        num_experts = self.gate_up_proj.shape[0]
        top_k = ids_TK.shape[1]
        ids_P = ids_TK.reshape(-1)
        order_P = torch.argsort(ids_P, stable=True)
        token_P = order_P // top_k
        counts_E = torch.bincount(ids_P, minlength=num_experts)
        counts_host = None if has_grouped_mm() else counts_E.tolist()
        y_PD = grouped_swiglu(x_TD[token_P], counts_E, counts_host, self.gate_up_proj, self.down_proj)
        contrib_PD = y_PD.float() * weights_TK.reshape(-1)[order_P].float()[:, None]
        out = torch.zeros(x_TD.shape[0], x_TD.shape[1], dtype=torch.float32, device=x_TD.device)
        return out.index_add(0, token_P, contrib_PD).to(x_TD.dtype)


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


class FSDPMoE(Method):
    """The dense-equivalent MoE (all experts, own tokens) under FSDP2 `fully_shard` over the group."""

    name = "fsdp"

    def available(self) -> tuple[bool, str]:
        try:
            _fully_shard()
            from torch.distributed.device_mesh import DeviceMesh  # noqa: F401
        except ImportError as err:
            return False, import_error_text(err)
        return True, ""

    def supports(self, shape: MoEShape, world: int, train: bool = False) -> str | None:
        return None   # FSDP pads uneven shards

    def setup(self, shape: MoEShape, group: dist.ProcessGroup | None, dtype: torch.dtype,
              device: torch.device, weights: ExpertWeights) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("fsdp: needs an initialised process group (run under torchrun or gloo ranks)")
        self.world, self.rank = world_and_rank(group)
        w_gate_up, w_down = weights.local(slice(None), dtype, device)   # replicated, then sharded
        self.module = DenseExperts(w_gate_up.detach(), w_down.detach())
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
        _fully_shard()(self.module, mesh=mesh, reshard_after_forward=True)
        self.param_bytes = (w_gate_up.numel() + w_down.numel()) * w_gate_up.element_size()

    def expert_parameters(self) -> list[torch.Tensor]:
        return list(self.module.parameters())

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return self.module(x_TD, ids_TK, weights_TK)

    def bytes_sent(self, ids_TK: torch.Tensor) -> int | None:
        """Forward all-gather: this rank's shard goes to the D-1 others (ring: (D-1)/D of the weights)."""
        return self.param_bytes * (self.world - 1) // self.world
