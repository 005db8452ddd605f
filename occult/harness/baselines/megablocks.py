"""MegaBlocks (PyPI `megablocks` 0.10.0): its dropless expert layer with our routing and weights.

`megablocks.layers.dmoe.dMoE` is a router (`LearnedRouter`: softmax, top-k) followed by
`ParallelDroplessMLP`, whose `forward(x, scores, expert_weights, top_experts)` is everything after
the router: local permutation, the token-count all-to-all, the row all-to-all over the expert
parallel group, the grouped-GEMM GLU (`mlp_type="glu"`, `mlp_impl="grouped"`, grouped_gemm's
CUTLASS kernels), the inverse all-to-all and the weighted un-permutation. We build that module
alone and call it with our `ids_TK` / `weights_TK`, so MegaBlocks sees exactly the routing every
other method sees, and its router (one small GEMM and a top-k) is not timed, as for the others.

Configuration: `moe_expert_model_parallelism=True` over our group when D > 1 (experts sharded
contiguously, E/D per rank: E must divide by D), no bias, SiLU GLU, no load-balancing loss
(`moe_loss_weight=0`), weights in the run's dtype. MegaBlocks scales expert-weight gradients by
1/D under expert parallelism (its data-parallel convention): their values differ from ours by
that factor, their cost does not. Needs CUDA (grouped_gemm, its custom sort/histogram ops).
"""

from __future__ import annotations

import importlib
from importlib import metadata

import torch
import torch.distributed as dist
import torch.nn.functional as F

from occult.harness.baselines import ExpertWeights, Method, MoEShape, contiguous_experts, import_error_text, world_and_rank


def _leave_uninitialised(tensor: torch.Tensor) -> None:
    """MegaBlocks' init hook; our weights are copied in right after construction."""


def per_expert_traffic_bytes(ids_TK: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None,
                             row_bytes: int) -> int:
    """Bytes a rank sends in contiguous EP with one row per (token, expert): out and back."""
    world, rank = world_and_rank(group)
    per_rank = num_experts // world
    send_D = torch.bincount(ids_TK.reshape(-1) // per_rank, minlength=world)
    recv_D = send_D.clone()
    if world > 1:
        dist.all_to_all_single(recv_D, send_D.contiguous(), group=group)
    send, recv = torch.stack([send_D, recv_D]).tolist()
    return (sum(send) - send[rank] + sum(recv) - recv[rank]) * row_bytes


class MegaBlocksMoE(Method):
    """MegaBlocks' `ParallelDroplessMLP` (grouped GEMM), fed our routing; see the module doc."""

    name = "megablocks"

    def available(self) -> tuple[bool, str]:
        try:
            for module in ("stk", "grouped_gemm", "megablocks", "megablocks.layers.dmoe"):
                importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - any import failure is the reason
            return False, import_error_text(err)
        if not torch.cuda.is_available():
            return False, "megablocks needs CUDA (grouped_gemm kernels and its sort/histogram ops)"
        return True, f"megablocks {metadata.version('megablocks')}"

    def setup(self, shape: MoEShape, group: dist.ProcessGroup | None, dtype: torch.dtype,
              device: torch.device, weights: ExpertWeights) -> None:
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import ParallelDroplessMLP

        self.group = group
        self.num_experts = shape.num_experts
        world, rank = world_and_rank(group)
        args = Arguments(
            hidden_size=shape.hidden,
            ffn_hidden_size=shape.ffn,
            num_layers=1,
            bias=False,
            return_bias=False,
            activation_fn=F.silu,
            moe_num_experts=shape.num_experts,
            moe_top_k=shape.top_k,
            moe_loss_weight=0.0,
            moe_expert_model_parallelism=world > 1,
            expert_parallel_group=group if world > 1 else None,
            mlp_type="glu",
            mlp_impl="grouped",
            memory_optimized_mlp=False,
            fp16=dtype == torch.float16,
            bf16=dtype == torch.bfloat16,
            device=device,
            init_method=_leave_uninitialised,
            output_layer_init_method=_leave_uninitialised,
        )
        self.layer = ParallelDroplessMLP(args)
        experts = contiguous_experts(shape.num_experts, world, rank)
        w_gate_up, w_down = weights.local(experts, dtype, device)
        ffn, hidden = shape.ffn, shape.hidden
        glu = self.layer.mlp
        with torch.no_grad():
            # GroupedGLU: w1 (gate) and v1 (up) are [E_r*F, D]; w2 is the down projection stored
            # transposed, [E_r*F, D] (it computes h @ w2[e]).
            glu.w1.copy_(w_gate_up[:, :ffn, :].reshape(-1, hidden))
            glu.v1.copy_(w_gate_up[:, ffn:, :].reshape(-1, hidden))
            glu.w2.copy_(w_down.transpose(1, 2).reshape(-1, hidden))
        self.row_bytes = hidden * torch.finfo(dtype).bits // 8

    def expert_parameters(self) -> list[torch.Tensor]:
        return [self.layer.mlp.w1, self.layer.mlp.v1, self.layer.mlp.w2]

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        # scores feed only the load-balancing loss, which is off.
        return self.layer(x_TD, None, weights_TK.to(x_TD.dtype), ids_TK)

    def bytes_sent(self, ids_TK: torch.Tensor) -> int | None:
        return per_expert_traffic_bytes(ids_TK, self.num_experts, self.group, self.row_bytes)
