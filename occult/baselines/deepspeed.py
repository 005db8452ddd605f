"""DeepSpeed-MoE (PyPI `deepspeed`): its `MoE` layer with our experts, routing and group.

`deepspeed.moe.layer.MoE` is built with E experts, `ep_size` = D, our top-k and `drop_tokens=False`:
capacity = the largest expert load over the group, so no token is dropped (dropless, padded to that
capacity). Its `Experts` holds E/D deep copies of one expert module and calls them one after the
other on their capacity slots; ours is a SwiGLU (`SwiGLUExpert`) holding the expert's own weights.
Its all-to-alls run over our group (`_set_ep_group`), not a group DeepSpeed creates.

Routing. DeepSpeed's `TopKGate` takes logits = x · W_g and, for k ≥ 3 (`topkgating`), renormalises
the softmax of its top-k (k = 2: `top2gating`, also renormalised, with its second-expert sampling off;
k = 1: the softmax's top-1). `GivenRoutingTopKGate` replaces only the logits: log(weight) at our k
experts and -inf elsewhere, so the top-k are exactly ours and each gate is weight / sum(weights); the
gating functions, capacity, dispatch slots, all-to-all, expert loop and combine are DeepSpeed's. The
output is multiplied by sum(weights) per token, which restores sum_j weights[t, j] * expert_j(x[t])
exactly (OLMoE's gates are not renormalised). Costs added to DeepSpeed's time: building the [T, E]
logits (its own gate runs a [T, D] x [D, E] GEMM) and one [T, D] scale.
"""

from __future__ import annotations

import importlib
from importlib import metadata

import torch
import torch.distributed as dist
import torch.nn.functional as F

from occult.baselines import ExpertWeights, Method, MoEShape, contiguous_experts, import_error_text, world_and_rank
from occult.baselines.tutel import TINY_WEIGHT


class SwiGLUExpert(torch.nn.Module):
    """One expert: silu(x · W_gᵀ) ⊙ (x · W_uᵀ) · W_dᵀ with `w_gate_up` [2F, D] (gate rows first), `w_down` [D, F]."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w_gate_up = torch.nn.Parameter(torch.empty(2 * ffn, hidden))
        self.w_down = torch.nn.Parameter(torch.empty(hidden, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.w_gate_up.t()).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_down.t()


def given_routing_gate(gate: torch.nn.Module) -> torch.nn.Module:
    """`gate` (a DeepSpeed `TopKGate`) turned into a `GivenRoutingTopKGate` in place."""
    from deepspeed.moe import sharded_moe

    class GivenRoutingTopKGate(sharded_moe.TopKGate):
        """DeepSpeed's `TopKGate` with logits encoding a routing given from outside (module doc);
        `route(ids_TK, weights_TK)` must be called before each forward of the layer."""

        def route(self, ids_TK: torch.Tensor | None, weights_TK: torch.Tensor | None) -> None:
            self.ids_TK, self.weights_TK = ids_TK, weights_TK

        def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None,  # noqa: A002 - DeepSpeed's name
                    sparse_routes: bool = False, use_tutel: bool = False):
            ids_TK, weights_TK = getattr(self, "ids_TK", None), getattr(self, "weights_TK", None)
            if ids_TK is None or weights_TK is None:
                raise RuntimeError("deepspeed gate: route(ids_TK, weights_TK) was not called before the layer")
            if ids_TK.shape[0] != input.shape[0]:
                raise ValueError(f"deepspeed gate: routing has {ids_TK.shape[0]} tokens, input {input.shape[0]}")
            logits = torch.full((input.shape[0], self.wg.out_features), float("-inf"), dtype=torch.float32,
                                device=input.device)
            logits = logits.scatter(1, ids_TK, torch.log(weights_TK.float().clamp_min(TINY_WEIGHT)))
            capacity = self.capacity_factor if self.training else self.eval_capacity_factor
            if self.k == 1:
                return sharded_moe.top1gating(logits, capacity, self.min_capacity, used_token, None, self.drop_tokens,
                                              self.use_rts, self.ep_group, sparse_routes, use_tutel)
            if self.k == 2:
                return sharded_moe.top2gating(logits, capacity, self.min_capacity, self.drop_tokens, self.ep_group,
                                              self.top2_2nd_expert_sampling, sparse_routes)
            return sharded_moe.topkgating(logits, self.k, capacity, self.min_capacity, self.drop_tokens,
                                          self.ep_group, sparse_routes=sparse_routes)

    gate.__class__ = GivenRoutingTopKGate
    gate.route(None, None)
    return gate


class DeepSpeedMoE(Method):
    """DeepSpeed's `MoE` layer with `SwiGLUExpert` experts and a given-routing gate; see the module doc."""

    name = "deepspeed"

    def available(self) -> tuple[bool, str]:
        try:
            importlib.import_module("deepspeed")
            importlib.import_module("deepspeed.moe.layer")
        except Exception as err:  # noqa: BLE001 - any import failure is the reason
            return False, import_error_text(err)
        return True, f"deepspeed {metadata.version('deepspeed')}"

    def setup(self, shape: MoEShape, group: dist.ProcessGroup | None, dtype: torch.dtype,
              device: torch.device, weights: ExpertWeights) -> None:
        import deepspeed.comm
        from deepspeed.moe.layer import MoE

        world, rank = world_and_rank(group)
        if world > 1 and not deepspeed.comm.is_initialized():
            deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        self.group, self.world, self.rank, self.num_experts = group, world, rank, shape.num_experts
        layer = MoE(shape.hidden, SwiGLUExpert(shape.hidden, shape.ffn), num_experts=shape.num_experts,
                    ep_size=world, k=shape.top_k, min_capacity=0, noisy_gate_policy=None, drop_tokens=False,
                    use_rts=False, top2_2nd_expert_sampling=False)
        moe = layer.deepspeed_moe
        # one device: no group (DeepSpeed's own check of a group's size needs deepspeed.comm set up)
        moe._set_ep_group(None if world == 1 else (group if group is not None else dist.group.WORLD))
        w_gate_up, w_down = weights.local(contiguous_experts(shape.num_experts, world, rank), dtype, device)
        experts = moe.experts.deepspeed_experts
        if len(experts) != w_gate_up.shape[0]:
            raise ValueError(f"deepspeed: {len(experts)} local experts, expected {w_gate_up.shape[0]}")
        with torch.no_grad():
            for i, expert in enumerate(experts):
                expert.w_gate_up.copy_(w_gate_up[i])
                expert.w_down.copy_(w_down[i])
        self.layer = layer.to(device=device, dtype=dtype)
        self.gate = given_routing_gate(moe.gate)
        self.element_size = w_down.element_size()

    def expert_parameters(self) -> list[torch.Tensor]:
        return list(self.layer.deepspeed_moe.experts.parameters())

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        self.gate.route(ids_TK, weights_TK)
        try:
            y_TD = self.layer(x_TD)[0]
        finally:
            self.gate.route(None, None)
        scale_T1 = weights_TK.float().sum(dim=1, keepdim=True)
        return (y_TD.float() * scale_T1).to(x_TD.dtype)

    def bytes_sent(self, ids_TK: torch.Tensor) -> int | None:
        """Padded dispatch buffer [E, capacity, D]: the (D-1)/D of it bound elsewhere, out and back."""
        load_max = torch.bincount(ids_TK.reshape(-1), minlength=self.num_experts).max()
        if self.world > 1:
            dist.all_reduce(load_max, op=dist.ReduceOp.MAX, group=self.group)
        remote_experts = self.num_experts - self.num_experts // self.world
        hidden = self.layer.deepspeed_moe.experts.deepspeed_experts[0].w_down.shape[0]
        return 2 * remote_experts * int(load_max) * hidden * self.element_size
