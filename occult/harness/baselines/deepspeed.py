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

Settings (`occult.method_names.BASELINE_SETTINGS`): `use_tutel=1` has DeepSpeed encode the dispatch
with Tutel's fast dispatcher (DeepSpeed's `use_tutel` option; needs Tutel importable, which
`available` checks, since DeepSpeed itself falls back silently). Its capacity settings do not apply:
with `drop_tokens=False` the capacity is the largest expert load whatever `capacity_factor` says,
and `drop_tokens=True` would drop tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from occult.harness.baselines import ExpertWeights, contiguous_experts, world_and_rank
from occult.shapes import MoEShape
from occult.harness.baselines.given_routing import GivenRoutingMethod, given_routing_logits


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
            logits = given_routing_logits(getattr(self, "ids_TK", None), getattr(self, "weights_TK", None),
                                          self.wg.out_features, input, "deepspeed gate")
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


class DeepSpeedMoE(GivenRoutingMethod):
    """DeepSpeed's `MoE` layer with `SwiGLUExpert` experts and a given-routing gate; see the module doc."""

    name = "deepspeed"
    modules = ("deepspeed", "deepspeed.moe.layer")
    distribution = "deepspeed"

    def __init__(self, use_tutel: str | int = 0) -> None:
        self.use_tutel = bool(int(use_tutel))
        self.uses_tutel_dispatch = self.use_tutel

    @property
    def config(self) -> str:
        return "drop_tokens=False,use_tutel=True" if self.use_tutel else "drop_tokens=False"

    def available(self) -> tuple[bool, str]:
        ok, reason = super().available()
        if ok and self.use_tutel:
            from deepspeed.moe import sharded_moe

            if not sharded_moe.TUTEL_INSTALLED:
                return False, "deepspeed use_tutel=1 needs tutel, which DeepSpeed could not import"
        return ok, reason

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
                    use_rts=False, use_tutel=self.use_tutel, top2_2nd_expert_sampling=False)
        moe = layer.deepspeed_moe
        if moe.use_tutel != self.use_tutel:
            raise RuntimeError(f"deepspeed: asked for use_tutel={self.use_tutel}, its layer runs use_tutel={moe.use_tutel}")
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
        self.hidden, self.element_size = shape.hidden, w_down.element_size()

    def expert_parameters(self) -> list[torch.Tensor]:
        return list(self.layer.deepspeed_moe.experts.parameters())

    def run_layer(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.layer(x_TD)[0]         # (output, aux loss, expert counts)
