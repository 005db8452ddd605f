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
INT32_INDEX_LIMIT = 2**31   # Tutel's dispatch kernels index their [E * capacity, hidden] buffer with int


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


def padded_buffer_elements(ids_TK: torch.Tensor, num_experts: int, hidden: int,
                           group: dist.ProcessGroup | None = None, world: int = 1) -> tuple[int, int]:
    """(capacity, elements) of the dropless padded dispatch buffer [E * capacity, hidden], capacity
    being the largest expert load over the group."""
    load_max = torch.bincount(ids_TK.reshape(-1), minlength=num_experts).max()
    if world > 1:
        dist.all_reduce(load_max, op=dist.ReduceOp.MAX, group=group)
    capacity = int(load_max)
    return capacity, num_experts * capacity * hidden


def check_tutel_index_range(ids_TK: torch.Tensor, num_experts: int, hidden: int, group: dist.ProcessGroup | None,
                            world: int, who: str) -> None:
    """Raise where Tutel's fast dispatch kernels would index past 2^31: they address element j of
    a token's row as (expert * capacity + slot) * hidden + j in 32-bit ints, so a padded buffer of
    2^31 elements or more is read and written out of bounds (a CUDA illegal memory access)."""
    capacity, elements = padded_buffer_elements(ids_TK, num_experts, hidden, group, world)
    if elements >= INT32_INDEX_LIMIT:
        raise ValueError(f"{who}: Tutel's dispatch kernels index the padded [E x capacity, hidden] buffer with "
                         f"32-bit ints: {num_experts} x {capacity} x {hidden} = {elements} elements >= 2^31 "
                         "at this routing (capacity: the largest expert load)")


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

    uses_tutel_dispatch = False   # Tutel's fast dispatch kernels encode the tokens (`check_tutel_index_range`)

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        if self.uses_tutel_dispatch:
            checked = self.__dict__.setdefault("_checked_routings", set())
            routing = (ids_TK.data_ptr(), tuple(ids_TK.shape))
            if routing not in checked:      # once per routing tensor (it syncs the host): in the warm-up
                check_tutel_index_range(ids_TK, self.num_experts, self.hidden, self.group, self.world, self.name)
                checked.add(routing)
        self.gate.route(ids_TK, weights_TK)
        try:
            y_TD = self.run_layer(x_TD)
        finally:
            self.gate.route(None, None)
        scale_T1 = weights_TK.float().sum(dim=1, keepdim=True)
        return (y_TD.float() * scale_T1).to(x_TD.dtype)

    def bytes_sent(self, ids_TK: torch.Tensor) -> int | None:
        """Padded dispatch buffer [E, capacity, D]: the (D-1)/D of it bound elsewhere, out and back."""
        capacity, _ = padded_buffer_elements(ids_TK, self.num_experts, self.hidden, self.group, self.world)
        remote_experts = self.num_experts - self.num_experts // self.world
        return 2 * remote_experts * capacity * self.hidden * self.element_size
