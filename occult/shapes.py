"""MoE layer shapes: the paper's three models (one MoE layer each), CPU smoke shapes, and the
shape's shared expert as a module. The sweep, the baselines, the simulator and the latency
placement all price or run these shapes."""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from occult.provenance import derive_seed


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer shape. `shared_ffn` is the total width of the shared expert(s) (0 = none)."""

    name: str
    num_experts: int
    top_k: int
    hidden: int
    ffn: int
    shared_ffn: int = 0
    shared_gate: bool = False     # Qwen1.5-MoE: sigmoid(x . w) scales the shared expert
    hf_family: str = "olmoe"      # transformers experts class for the HF method

    def __post_init__(self) -> None:
        for field in ("num_experts", "top_k", "hidden", "ffn"):
            if getattr(self, field) < 1:
                raise ValueError(f"shape {self.name}: {field} must be positive, got {getattr(self, field)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"shape {self.name}: top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.shared_ffn < 0:
            raise ValueError(f"shape {self.name}: shared_ffn must be >= 0, got {self.shared_ffn}")


SHAPES: types.MappingProxyType[str, MoEShape] = types.MappingProxyType({
    # The paper's three models (one MoE layer each).
    "olmoe": MoEShape("olmoe", 64, 8, 2048, 1024, hf_family="olmoe"),
    "qwen": MoEShape("qwen", 60, 4, 2048, 1408, shared_ffn=5632, shared_gate=True, hf_family="qwen2_moe"),
    "deepseek": MoEShape("deepseek", 64, 6, 2048, 1408, shared_ffn=2 * 1408, hf_family="deepseek_v2"),
    # CPU smoke shapes.
    "tiny": MoEShape("tiny", 8, 2, 32, 16, hf_family="olmoe"),
    "tiny-shared": MoEShape("tiny-shared", 8, 3, 32, 16, shared_ffn=24, shared_gate=True, hf_family="qwen2_moe"),
})


def get_shape(name: str) -> MoEShape:
    if name not in SHAPES:
        raise ValueError(f"shape: {name!r} is not one of {sorted(SHAPES)}")
    return SHAPES[name]


class SharedExpert(torch.nn.Module):
    """The shape's shared expert(s) as one SwiGLU of width shared_ffn, optionally sigmoid-gated."""

    def __init__(self, shape: MoEShape, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(derive_seed(seed, "shared", shape.name))
        d, f = shape.hidden, shape.shared_ffn
        self.ffn = f
        self.gate_up = torch.nn.Parameter((torch.randn(2 * f, d, generator=gen) / d**0.5).to(device, dtype))
        self.down = torch.nn.Parameter((torch.randn(d, f, generator=gen) / f**0.5).to(device, dtype))
        self.gate = (torch.nn.Parameter((torch.randn(1, d, generator=gen) / d**0.5).to(device, dtype))
                     if shape.shared_gate else None)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x_TD, self.gate_up)
        y = F.linear(F.silu(gate_up[:, : self.ffn]) * gate_up[:, self.ffn :], self.down)
        if self.gate is not None:
            y = torch.sigmoid(F.linear(x_TD, self.gate)) * y
        return y
