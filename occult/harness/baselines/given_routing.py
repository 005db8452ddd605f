"""What the Tutel and DeepSpeed adapters share: a library's MoE layer fed our routing.

Both libraries compute softmax(logits) of their own gate, take its top-k and renormalise those k
gates. Their gate is given logits of log(weight) at our k experts and -inf elsewhere
(`given_routing_logits`), so they pick exactly our experts with gates weight / sum(weights), and the
layer's output is multiplied by sum(weights) per token (`GivenRoutingMethod.forward`), which
restores sum_j weights[t, j] * expert_j(x[t]) for weights that do or do not sum to one. Both pad
every expert to the largest expert load over the group (dropless), which `bytes_sent` counts.
"""

from __future__ import annotations

import importlib
from importlib import metadata

import torch
import torch.distributed as dist

from occult.harness.baselines import Method, import_error_text

TINY_WEIGHT = 1e-30   # a zero gate weight still has to win the library's top-k over the -inf logits


def given_routing_logits(ids_TK: torch.Tensor | None, weights_TK: torch.Tensor | None, num_experts: int,
                         x_TD: torch.Tensor, who: str) -> torch.Tensor:
    """[T, E] fp32 logits: log(weight) at each token's experts, -inf elsewhere (`who` names the gate
    in the error raised when no routing, or one of another size, was given)."""
    if ids_TK is None or weights_TK is None:
        raise RuntimeError(f"{who}: route(ids_TK, weights_TK) was not called before the layer")
    if ids_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"{who}: routing has {ids_TK.shape[0]} tokens, input {x_TD.shape[0]}")
    logits_TE = torch.full((x_TD.shape[0], num_experts), float("-inf"), dtype=torch.float32, device=x_TD.device)
    return logits_TE.scatter(1, ids_TK, torch.log(weights_TK.float().clamp_min(TINY_WEIGHT)))


class GivenRoutingMethod(Method):
    """A library layer behind a given-routing gate. Subclasses set `modules` (imported by
    `available`) and `distribution` (its version), and in `setup`: `layer`, `gate` (with
    `route(ids, weights)`), `group`, `world`, `num_experts`, `hidden`, `element_size`."""

    modules: tuple[str, ...] = ()
    distribution = ""

    def available(self) -> tuple[bool, str]:
        try:
            for module in self.modules:
                importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - any import failure is the reason
            return False, import_error_text(err)
        try:
            version = metadata.version(self.distribution)
        except metadata.PackageNotFoundError:
            version = "unknown version"
        return True, f"{self.distribution} {version}"

    def run_layer(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The library layer's output for `x_TD` (the gate already holds the routing)."""
        return self.layer(x_TD)

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        self.gate.route(ids_TK, weights_TK)
        try:
            y_TD = self.run_layer(x_TD)
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
        return 2 * remote_experts * int(load_max) * self.hidden * self.element_size
