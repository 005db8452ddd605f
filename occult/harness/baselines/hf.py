"""The HF row: transformers' own MoE experts module on one device, loaded with our weights.

The experts class is the model family's (`OlmoeExperts`, `Qwen2MoeExperts`, `DeepseekV2Experts`):
fused `gate_up_proj` [E, 2F, D] (gate rows first) and `down_proj` [E, D, F], our layout exactly.
Its forward is called with our routing (`top_k_index`, `top_k_weights`), so the router is not
part of the measurement. `implementation="eager"` (default) is transformers' loop over the hit
experts (one `nonzero` host sync per layer, one gather / two GEMMs / `index_add_` per expert):
the paper's HF baseline. Other names select transformers' experts-implementation registry
(`grouped_mm`, `batched_mm`, ...) where the installed version has it. D=1 only.
"""

from __future__ import annotations

import importlib
import types

import torch
import torch.distributed as dist

from occult.harness.baselines import ExpertWeights, Method, import_error_text
from occult.shapes import MoEShape

# family -> (module, experts class)
EXPERTS_CLASSES = types.MappingProxyType({
    "olmoe": ("transformers.models.olmoe.modeling_olmoe", "OlmoeExperts"),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeExperts"),
    "deepseek_v2": ("transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2Experts"),
})


def experts_class(family: str) -> type[torch.nn.Module]:
    if family not in EXPERTS_CLASSES:
        raise ValueError(f"hf_family: {family!r} is not one of {sorted(EXPERTS_CLASSES)}")
    module_name, class_name = EXPERTS_CLASSES[family]
    return getattr(importlib.import_module(module_name), class_name)


def experts_config(shape: MoEShape, implementation: str) -> types.SimpleNamespace:
    """The config fields the experts classes read (names differ between families: all are set)."""
    return types.SimpleNamespace(
        num_experts=shape.num_experts,
        num_local_experts=shape.num_experts,
        n_routed_experts=shape.num_experts,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        moe_intermediate_size=shape.ffn,
        hidden_act="silu",
        _experts_implementation=implementation,
    )


class HFExperts(Method):
    """transformers' experts module of the shape's family (see the module doc)."""

    name = "hf"

    def __init__(self, implementation: str = "eager") -> None:
        self.implementation = implementation

    def available(self) -> tuple[bool, str]:
        try:
            importlib.import_module("transformers")
        except Exception as err:  # noqa: BLE001
            return False, import_error_text(err)
        return True, ""

    def supports(self, shape: MoEShape, world: int, train: bool = False) -> str | None:
        if world != 1:
            return f"the HF experts module runs on one device (D=1), not D={world}"
        return None

    def setup(self, shape: MoEShape, group: dist.ProcessGroup | None, dtype: torch.dtype,
              device: torch.device, weights: ExpertWeights) -> None:
        cls = experts_class(shape.hf_family)
        module = cls(experts_config(shape, self.implementation))
        w_gate_up, w_down = weights.local(slice(None), dtype, device)
        if tuple(module.gate_up_proj.shape) != tuple(w_gate_up.shape) or \
                tuple(module.down_proj.shape) != tuple(w_down.shape):
            raise ValueError(
                f"hf: {cls.__name__} holds gate_up_proj {tuple(module.gate_up_proj.shape)} / down_proj "
                f"{tuple(module.down_proj.shape)}, expected {tuple(w_gate_up.shape)} / {tuple(w_down.shape)}"
            )
        module.gate_up_proj = torch.nn.Parameter(w_gate_up.detach())
        module.down_proj = torch.nn.Parameter(w_down.detach())
        self.module = module.to(device)

    def expert_parameters(self) -> list[torch.Tensor]:
        return [self.module.gate_up_proj, self.module.down_proj]

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return self.module(x_TD, ids_TK, weights_TK.to(x_TD.dtype))

    def bytes_sent(self, ids_TK: torch.Tensor) -> int | None:
        return 0
