"""Baselines for the latency sweeps, behind one interface (see docs/baselines.md).

Every method runs the same MoE layer: E experts, each a SwiGLU of width F on hidden size D
(`w_gate_up_E2FD` [E, 2F, D], gate rows first; `w_down_EDF` [E, D, F]), applied to the SAME
routing (`ids_TK`, `weights_TK`) on every rank of an EP group of D ranks:

  y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])

A method is a small object with

  available()                     -> (ok, reason): can its library be imported on this machine?
  supports(shape, world, train)   -> None, or why this shape / group size (/ training) is out of its reach;
  config                          -> the library settings it runs with, as `key=value,...` (or "");
  setup(shape, group, dtype, device, weights)    takes its shard of the global `ExpertWeights`;
  forward(x_TD, ids_TK, weights_TK) -> y_TD      differentiable w.r.t. x, weights, expert weights;
  expert_parameters()             -> the expert weight tensors it trains;
  bytes_sent(ids_TK)              -> bytes this rank sends for one forward (or None = unknown);
  teardown()                      drops its tensors.

`make_method(name)` builds one by name, importing its module (and through it the third-party
library) only then. A library that cannot be imported is reported by `available()`, never
replaced by another implementation.
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from occult.shapes import MoEShape


class MethodUnavailable(RuntimeError):
    """The method's library is missing on this machine; the message says why."""




@dataclass(frozen=True)
class ExpertWeights:
    """The global expert weights every method shares (any device; methods copy their shard)."""

    w_gate_up_E2FD: torch.Tensor
    w_down_EDF: torch.Tensor

    def __post_init__(self) -> None:
        e, two_f, d = self.w_gate_up_E2FD.shape
        if self.w_down_EDF.shape != (e, d, two_f // 2) or two_f % 2:
            raise ValueError(
                f"ExpertWeights: w_gate_up_E2FD {tuple(self.w_gate_up_E2FD.shape)} and w_down_EDF "
                f"{tuple(self.w_down_EDF.shape)} are not [E, 2F, D] and [E, D, F]"
            )

    @classmethod
    def random(cls, shape: MoEShape, seed: int, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> "ExpertWeights":
        """Seeded weights scaled so that expert outputs stay O(1) (same values on every rank)."""
        gen = torch.Generator(device=device).manual_seed(seed)
        e, f, d = shape.num_experts, shape.ffn, shape.hidden
        w_gate_up = torch.randn(e, 2 * f, d, generator=gen, device=device, dtype=torch.float32) / d**0.5
        w_down = torch.randn(e, d, f, generator=gen, device=device, dtype=torch.float32) / f**0.5
        return cls(w_gate_up.to(dtype), w_down.to(dtype))

    @property
    def num_experts(self) -> int:
        return self.w_gate_up_E2FD.shape[0]

    def local(self, experts: torch.Tensor | slice, dtype: torch.dtype, device: torch.device | str,
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Trainable copies (leaf tensors) of the given experts' weights on `device`."""
        w_gate_up = self.w_gate_up_E2FD[experts].to(device=device, dtype=dtype).contiguous()
        w_down = self.w_down_EDF[experts].to(device=device, dtype=dtype).contiguous()
        return w_gate_up.requires_grad_(), w_down.requires_grad_()


def contiguous_experts(num_experts: int, world: int, rank: int) -> slice:
    """The experts standard EP puts on `rank`: a contiguous block of E/D."""
    if num_experts % world:
        raise ValueError(f"{num_experts} experts are not divisible by {world} ranks")
    per_rank = num_experts // world
    return slice(rank * per_rank, (rank + 1) * per_rank)


def world_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(D, rank) of `group`; no initialised process group = one device."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def import_error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".strip()


class Method:
    """Base of every method (see the module doc). Subclasses set `name`."""

    name = "method"

    @property
    def config(self) -> str:
        """The library settings this instance runs with (`key=value,...`; empty: none to choose)."""
        return ""

    def available(self) -> tuple[bool, str]:
        return True, ""

    def supports(self, shape: MoEShape, world: int, train: bool = False) -> str | None:
        if shape.num_experts % world:
            return f"{shape.num_experts} experts are not divisible by D={world}"
        return None

    def setup(self, shape: MoEShape, group: dist.ProcessGroup | None, dtype: torch.dtype,
              device: torch.device, weights: ExpertWeights) -> None:
        raise NotImplementedError

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def expert_parameters(self) -> list[torch.Tensor]:
        return []

    def bytes_sent(self, ids_TK: torch.Tensor) -> int | None:
        return None

    def teardown(self) -> None:
        for key, value in list(vars(self).items()):
            if isinstance(value, (torch.Tensor, torch.nn.Module)):
                setattr(self, key, None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# name -> (module, class); imported only when the method is made.
METHOD_CLASSES: types.MappingProxyType[str, tuple[str, str]] = types.MappingProxyType({
    "megablocks": ("occult.harness.baselines.megablocks", "MegaBlocksMoE"),
    "tutel": ("occult.harness.baselines.tutel", "TutelMoE"),
    "naive": ("occult.harness.baselines.naive", "NaiveEP"),
    "fsdp": ("occult.harness.baselines.naive", "FSDPMoE"),
    "hf": ("occult.harness.baselines.hf", "HFExperts"),
    "deepspeed": ("occult.harness.baselines.deepspeed", "DeepSpeedMoE"),
})


def make_method(name: str, **options: Any) -> Method:
    """A fresh baseline by name (importing only its module; its library is imported in setup);
    `options` are its settings (`occult.method_names.BASELINE_SETTINGS`)."""
    if name not in METHOD_CLASSES:
        raise ValueError(f"method: {name!r} is not one of {sorted(METHOD_CLASSES)}")
    module_name, class_name = METHOD_CLASSES[name]
    return getattr(importlib.import_module(module_name), class_name)(**options)
