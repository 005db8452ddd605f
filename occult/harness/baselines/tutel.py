"""Tutel (microsoft/tutel, built from its repository): its MoE layer with our experts and routing.

`tutel.moe.moe_layer` is built with `llama_ffn` experts (SwiGLU: `W_fc1` gate and `W_fc2` up,
[E_r, D, F]; `W_fc3` down, [E_r, F, D]; silu), E/D experts per rank (contiguous), our group, and
`capacity_factor=0`: capacity = the largest expert load over the group, so no token is dropped
(dropless, padded to that capacity; a negative factor would cap it instead).

Routing. Tutel computes `scores = softmax(gate(x))`, takes their top-k and (with
`normalize_gate=True`) renormalises the k gates. We pass a custom gate (`GivenRoutingGate`) whose
logits are log(weight) at our k experts and -inf elsewhere: the top-k are exactly our experts and
each gate is weight / sum(weights). We switch Tutel's renormalisation off (it is then already
normalised) and multiply Tutel's output by sum(weights) per token, which restores
sum_j weights[t, j] * expert_j(x[t]) exactly, for weights that do or do not sum to one. Costs
added to Tutel's time: building the [T, E] logits (where its own gate would run a [T, D]x[D, E]
GEMM) and one [T, D] scale. Everything else (its gshard aux loss, fast encode/decode kernels,
all-to-all, expert GEMMs) is Tutel's own.

Settings (`occult.method_names.BASELINE_SETTINGS`), Tutel's documented per-call switches:
`adaptive_r=0` computes the experts in place without the all-to-all (its data-parallel degree; at
D = 1 every expert is local, so the layer is unchanged) and `megablocks_size=N` (N > 0) runs the
expert GEMMs on Tutel's block-sparse kernels with blocks of N rows (inference only, one device:
Tutel itself ignores it under autograd or at D > 1, which `supports` reports). The capacity stays
`capacity_factor=0` in every setting: a negative factor caps the capacity (tokens beyond the cap
are dropped) and a positive one fixes it, both inexact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from occult.harness.baselines import ExpertWeights, contiguous_experts, world_and_rank
from occult.shapes import MoEShape
from occult.harness.baselines.given_routing import GivenRoutingMethod, given_routing_logits


class GivenRoutingGate(torch.nn.Module):
    """A Tutel gate that returns logits encoding a routing given from outside (see the module doc).

    Tutel constructs it as `GivenRoutingGate(model_dim=..., num_global_experts=..., k=..., ...)`;
    `route(ids_TK, weights_TK)` must be called before each forward of the layer.
    """

    def __init__(self, model_dim: int, num_global_experts: int, k: int, capacity_factor: float = 0.0,
                 gate_noise: float = 0.0) -> None:
        super().__init__()
        self.model_dim = model_dim
        self.num_global_experts = num_global_experts
        self.top_k = k
        self.capacity_factor = capacity_factor
        self.gate_noise = gate_noise
        self.ids_TK: torch.Tensor | None = None
        self.weights_TK: torch.Tensor | None = None

    def route(self, ids_TK: torch.Tensor | None, weights_TK: torch.Tensor | None) -> None:
        self.ids_TK, self.weights_TK = ids_TK, weights_TK

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return given_routing_logits(self.ids_TK, self.weights_TK, self.num_global_experts, x_TD, "GivenRoutingGate")


class TutelMoE(GivenRoutingMethod):
    """Tutel's `moe_layer` with `llama_ffn` experts and `GivenRoutingGate`; see the module doc."""

    name = "tutel"
    modules = ("tutel", "tutel.moe")
    distribution = "tutel"
    uses_tutel_dispatch = True

    def __init__(self, adaptive_r: str | int = 1, megablocks_size: str | int = 0) -> None:
        self.adaptive_r, self.megablocks_size = int(adaptive_r), int(megablocks_size)
        if self.adaptive_r not in (0, 1) or self.megablocks_size < 0:
            raise ValueError(f"tutel: adaptive_r must be 0 or 1 and megablocks_size >= 0, got "
                             f"{self.adaptive_r}, {self.megablocks_size}")

    @property
    def config(self) -> str:
        parts = ["capacity_factor=0"]
        if self.adaptive_r != 1:
            parts.append(f"adaptive_r={self.adaptive_r}")
        if self.megablocks_size:
            parts.append(f"megablocks_size={self.megablocks_size}")
        return ",".join(parts)

    def supports(self, shape: MoEShape, world: int, train: bool = False) -> str | None:
        why = super().supports(shape, world)
        if why:
            return why
        if self.adaptive_r == 0 and world > 1:
            return f"adaptive_r=0 keeps every expert on every device: D=1 only, not D={world}"
        if self.megablocks_size and (world > 1 or train):
            return "megablocks_size applies to inference on one device (Tutel ignores it under autograd or D > 1)"
        return None

    def run_layer(self, x_TD: torch.Tensor) -> torch.Tensor:
        switches = {}
        if self.adaptive_r != 1:
            switches["adaptive_r"] = self.adaptive_r
        if self.megablocks_size:
            switches["megablocks_size"] = self.megablocks_size
        return self.layer(x_TD, **switches)

    def setup(self, shape: MoEShape, group: dist.ProcessGroup | None, dtype: torch.dtype,
              device: torch.device, weights: ExpertWeights) -> None:
        from tutel import moe as tutel_moe

        world, rank = world_and_rank(group)
        self.group, self.world, self.rank = group, world, rank
        self.num_experts = shape.num_experts
        per_rank = shape.num_experts // world
        # Built on the device: Tutel draws its expert weights (replaced below) where they are
        # created, which on the host takes seconds per layer of the sizes swept.
        with torch.device(device):
            layer = self._build(tutel_moe, shape, group, per_rank)
        w_gate_up, w_down = weights.local(contiguous_experts(shape.num_experts, world, rank), dtype, device)
        ffn = shape.ffn
        experts = layer.experts
        with torch.no_grad():
            # Flat (sharded_count = 1) parameters viewed as [E_r, D, F], [E_r, D, F], [E_r, F, D].
            fc1 = w_gate_up[:, :ffn, :].transpose(1, 2).contiguous()
            fc2 = w_gate_up[:, ffn:, :].transpose(1, 2).contiguous()
            fc3 = w_down.transpose(1, 2).contiguous()
            for name, value in (("W_fc1", fc1), ("W_fc2", fc2), ("W_fc3", fc3)):
                param = getattr(experts, name)
                if param.numel() != value.numel():
                    raise ValueError(f"tutel: experts.{name} holds {param.numel()} values, expected {value.numel()}")
                param.copy_(value.reshape(param.shape))
        self.layer = layer.to(device=device, dtype=dtype)
        self.gate = self.layer.gates[0]
        self.hidden, self.element_size = shape.hidden, w_down.element_size()

    @staticmethod
    def _build(tutel_moe, shape: MoEShape, group: dist.ProcessGroup | None, per_rank: int) -> torch.nn.Module:
        return tutel_moe.moe_layer(
            gate_type={"type": "custom", "module": GivenRoutingGate, "k": shape.top_k, "capacity_factor": 0.0},
            model_dim=shape.hidden,
            experts={
                "type": "llama_ffn",
                "count_per_node": per_rank,
                "hidden_size_per_expert": shape.ffn,
                "activation_fn": F.silu,
            },
            group=group,
            normalize_gate=False,
            is_postscore=True,
            a2a_ffn_overlap_degree=1,
        )

    def expert_parameters(self) -> list[torch.Tensor]:
        return list(self.layer.experts.parameters())
