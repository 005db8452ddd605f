"""Run a transformers MoE model's experts through `occult.ep.ep_moe` in one line.

`use_ep(model, placements, group, mode, backend)` shards every MoE layer's fused expert weights
(`gate_up_proj` [E, 2F, D], `down_proj` [E, D, F]) to the experts the layer's placement gives
this rank, and routes the experts' forward through `ep_moe`. Each rank keeps running the whole
model on its own tokens (attention, router, norms are replicated); only the experts are spread.

transformers 5.x dispatches an experts module's forward through its experts-implementation
registry (`ALL_EXPERTS_FUNCTIONS`, chosen by `config._experts_implementation`); `use_ep`
registers `ep_experts_forward` there under the name "occult_ep" and selects it for the model.
The per-layer EP settings live on each experts module (`module.occult_ep`). Where the registry
is missing, the module's forward is replaced instead.

Checked on OLMoE, Qwen2-MoE (shared expert) and DeepSeek-V2 (shared experts, dense first layer,
grouped top-k): logits equal the unpatched model's on 2 gloo ranks (`tests/ep/test_hf.py`).
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from occult.ep.layer import BACKENDS, EPStats, ep_moe, group_size_and_rank
from occult.ep.plan import MODES, check_placement, experts_of_device

IMPLEMENTATION_NAME = "occult_ep"
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class EPExpertsSpec:
    """What `ep_experts_forward` needs beside the module's (local) weights."""

    layer: int
    device_of_expert_E: torch.Tensor   # int64 [E] on the CPU
    group: dist.ProcessGroup | None
    mode: str
    backend: str
    stats: EPStats | None = None       # accumulates this layer's traffic, if given


def ep_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Drop-in forward of a transformers experts module, through `ep_moe`."""
    spec: EPExpertsSpec | None = getattr(self, "occult_ep", None)
    if spec is None:
        raise RuntimeError(
            f"{type(self).__name__}: experts implementation {IMPLEMENTATION_NAME!r} is selected but "
            "occult.ep.hf.use_ep did not shard this module"
        )
    return ep_moe(
        hidden_states,
        top_k_index,
        top_k_weights,
        spec.device_of_expert_E,
        self.gate_up_proj,
        self.down_proj,
        group=spec.group,
        mode=spec.mode,
        backend=spec.backend,
        stats=spec.stats,
    )


def moe_experts_modules(model: nn.Module) -> dict[int, nn.Module]:
    """{decoder layer index: experts module} for every module holding fused 3-D expert weights."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3):
            continue
        match = _LAYER_RE.search(f".{name}.")
        if match is None:
            raise ValueError(f"model: cannot tell the layer index of experts module {name!r}")
        found[int(match.group(1))] = module
    return found


def placements_from_json(obj: Mapping[str, Any]) -> dict[int, torch.Tensor]:
    """{layer: device_of_expert_E} from a placement file's {"layers": [...], "device_of_expert": [[...]]}."""
    try:
        layers, table = obj["layers"], obj["device_of_expert"]
    except KeyError as err:
        raise ValueError(f"placement: missing key {err.args[0]!r}") from None
    if len(layers) != len(table):
        raise ValueError(f"placement: {len(layers)} layers but {len(table)} device_of_expert rows")
    return {int(layer): torch.as_tensor(row, dtype=torch.long) for layer, row in zip(layers, table)}


def _check_supported(module: nn.Module, hidden_act: str) -> None:
    for attr, wanted in (("has_bias", False), ("is_transposed", False), ("has_gate", True), ("is_concatenated", True)):
        if getattr(module, attr, wanted) != wanted:
            raise ValueError(f"{type(module).__name__}.{attr}={not wanted} is not supported by occult.ep")
    if hidden_act != "silu":
        raise ValueError(f"config.hidden_act: {hidden_act!r} is not supported by occult.ep (only silu)")


def _select_implementation(model: nn.Module, experts: Sequence[nn.Module]) -> None:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        ALL_EXPERTS_FUNCTIONS = None
    if ALL_EXPERTS_FUNCTIONS is None or not hasattr(model, "set_experts_implementation"):
        for module in experts:
            module.forward = types.MethodType(ep_experts_forward, module)
        return
    if ALL_EXPERTS_FUNCTIONS.get(IMPLEMENTATION_NAME) is not ep_experts_forward:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION_NAME, ep_experts_forward)
    model.set_experts_implementation(IMPLEMENTATION_NAME)


def use_ep(
    model: nn.Module,
    placements: Mapping[int, Sequence[int] | torch.Tensor],
    group: dist.ProcessGroup | None = None,
    mode: str = "dedup",
    backend: str = "torch",
    stats: EPStats | Mapping[int, EPStats] | None = None,
) -> nn.Module:
    """Shard `model`'s experts to this rank of `group` and run them through `ep_moe` (in place).

    `placements[layer]` is the layer's `device_of_expert_E` (ranks of `group`); every MoE layer
    needs one. Call it on every rank; `group=None` without a process group = one device.
    `stats` (one `EPStats` for all layers, or one per layer) accumulates the traffic of every
    forward (rows, pairs and bytes sent, E[C_T]; one more host sync per layer call).
    """
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {MODES}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
    world, rank = group_size_and_rank(group)
    experts_by_layer = moe_experts_modules(model)
    if not experts_by_layer:
        raise ValueError(f"model: {type(model).__name__} has no experts module with fused 3-D weights")
    missing = sorted(set(experts_by_layer) - set(int(layer) for layer in placements))
    if missing:
        raise ValueError(f"placements: no placement for MoE layers {missing}")
    hidden_act = getattr(getattr(model, "config", None), "hidden_act", "silu")
    for layer, module in experts_by_layer.items():
        _check_supported(module, hidden_act)
        num_experts = module.gate_up_proj.shape[0]
        placement = check_placement(torch.as_tensor(placements[layer]).cpu(), world)
        if placement.numel() != num_experts:
            raise ValueError(f"placements[{layer}]: {placement.numel()} entries for {num_experts} experts")
        local = experts_of_device(placement, rank)
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(module, name)
                shard = full[local.to(full.device)].clone()
                setattr(module, name, nn.Parameter(shard, requires_grad=full.requires_grad))
        layer_stats = stats.get(layer) if isinstance(stats, Mapping) else stats
        module.occult_ep = EPExpertsSpec(layer, placement, group, mode, backend, layer_stats)
    _select_implementation(model, list(experts_by_layer.values()))
    return model
