"""The inputs every method of a sweep point receives: routers (seeded low-rank, uniform, a measured
trace), the input sets (hidden states, routing, pruned routings), Occult's placement on a calibration
batch, and the shape's shared expert."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from occult.harness.baselines import world_and_rank
from occult.provenance import derive_seed
from occult.shapes import MoEShape
from occult.harness.sweep.settings import SweepError, SweepSettings
from occult.method_names import BALANCE_EPS, parse_method

ROUTER_RANK = 4
CALIBRATION_TOKENS = 8192


def prune_routing(logits_TE: torch.Tensor, top_k: int, device_of_expert_E: torch.Tensor,
                  max_devices: int, num_devices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) of router-score pruning to `max_devices` devices (`occult.routing.pruning`, gates kept)."""
    from occult.routing.pruning import prune_router_score

    weights_TK, ids_TK = prune_router_score(logits_TE, top_k, device_of_expert_E, max_devices,
                                            num_devices=num_devices)
    return ids_TK.long(), weights_TK.float()



@dataclass(frozen=True)
class SyntheticRouter:
    """logits_TE = (x_TD U_Dr) V_rE + b_E: a seeded low-rank router (CPU fp32 tensors)."""

    u_DR: torch.Tensor
    v_RE: torch.Tensor
    bias_E: torch.Tensor

    @classmethod
    def make(cls, shape: MoEShape, seed: int, rank: int = ROUTER_RANK) -> "SyntheticRouter":
        gen = torch.Generator().manual_seed(derive_seed(seed, "router", shape.name))
        u = torch.randn(shape.hidden, rank, generator=gen) / shape.hidden**0.5
        v = torch.randn(rank, shape.num_experts, generator=gen) * (2.0 / rank**0.5)
        bias = 0.5 * torch.randn(shape.num_experts, generator=gen)
        return cls(u, v, bias)

    def logits(self, x_TD: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        device = x_TD.device
        return (x_TD.float() @ self.u_DR.to(device)) @ self.v_RE.to(device) + self.bias_E.to(device)

    def calibration_ids(self, tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
        x = torch.randn(tokens, self.u_DR.shape[0], generator=gen)
        return self.logits(x).topk(top_k, dim=-1).indices


@dataclass(frozen=True)
class UniformRouter:
    """i.i.d. Gaussian logits per token: uniform routing, no co-activation structure (Occult's worst case)."""

    num_experts: int

    def logits(self, x_TD: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn(x_TD.shape[0], self.num_experts, generator=gen, device=x_TD.device)

    def calibration_ids(self, tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(tokens, self.num_experts, generator=gen).topk(top_k, dim=-1).indices


class TraceShapeError(SweepError):
    """A routing trace cannot be widened to a layer shape (its rows then say so)."""


@dataclass(frozen=True)
class TraceRouter:
    """Routing replayed from a measured trace (`occult.routing.profiling`'s routing_*.npz of our model),
    widened to the shape: each of the trace's E_t experts becomes E/E_t sub-experts and each of a
    token's k_t experts k/k_t of its sub-experts (drawn per token with a fixed seed), so the
    co-activation between the trace's experts is kept. Tokens of all layers are pooled. The
    calibration trace beside the given file (its name with `heldout` replaced by `calibration`, else
    routing_calibration.npz; the given file itself if neither exists) places; the given file times.
    Logits put 8 on the token's chosen ids (plus N(0, 0.1) noise) and N(0, 1) elsewhere, so top-k
    returns the trace and router-score pruning sees a ranking."""

    ids_NK: torch.Tensor              # int64 [N, k] widened held-out trace
    calibration_NK: torch.Tensor      # int64 [N', k] widened calibration trace
    num_experts: int

    @classmethod
    def load(cls, path: str | Path, shape: MoEShape, seed: int) -> "TraceRouter":
        import numpy as np

        path = Path(path)
        calibration = path.with_name(path.name.replace("heldout", "calibration"))
        if "heldout" not in path.name or not calibration.is_file():
            calibration = path.with_name("routing_calibration.npz")

        def widened(file: Path) -> torch.Tensor:
            with np.load(file, allow_pickle=False) as npz:
                if "ids" not in npz.files:
                    raise SweepError(f"trace: {file} has no 'ids' array (expected occult.routing.profiling's routing npz)")
                ids = torch.from_numpy(npz["ids"].astype("int64"))
            ids = ids.reshape(-1, ids.shape[-1])
            trace_experts = int(ids.max()) + 1
            split, reach = shape.num_experts // trace_experts, shape.top_k // ids.shape[1]
            trace_experts = shape.num_experts // split if split else trace_experts
            if split * trace_experts != shape.num_experts or reach * ids.shape[1] != shape.top_k or reach > split:
                raise TraceShapeError(
                    f"trace: {file} (top-{ids.shape[1]} of ≤{trace_experts} experts) cannot be widened to "
                    f"{shape.name} (E={shape.num_experts}, k={shape.top_k})")
            gen = torch.Generator().manual_seed(derive_seed(seed, "trace", file.name))
            pick = torch.rand(ids.shape[0], ids.shape[1], split, generator=gen).argsort(-1)[..., :reach]
            return (ids[..., None] * split + pick).reshape(ids.shape[0], -1)

        held = widened(path)
        return cls(held, widened(calibration) if calibration.is_file() else held, shape.num_experts)

    def logits(self, x_TD: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        tokens, device = x_TD.shape[0], x_TD.device
        start = int(torch.randint(0, self.ids_NK.shape[0], (1,), generator=gen, device=gen.device if gen else "cpu"))
        rows = (start + torch.arange(tokens)) % self.ids_NK.shape[0]
        ids = self.ids_NK[rows].to(device)
        logits = torch.randn(tokens, self.num_experts, generator=gen, device=device)
        noise = 0.1 * torch.randn(ids.shape, generator=gen, device=device)
        return logits.scatter(1, ids, 8.0 + noise)

    def calibration_ids(self, tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
        return self.calibration_NK[:tokens]


def make_router(settings: SweepSettings, shape: MoEShape, routing: str):
    """The router of `routing` (one of `settings.routings`) for `shape` (module docstring)."""
    if routing == "uniform":
        return UniformRouter(shape.num_experts)
    if routing == "trace":
        return TraceRouter.load(settings.trace, shape, settings.seed)
    return SyntheticRouter.make(shape, settings.seed)


def routing_key(method: str) -> int | None:
    """N_d of the routing a method uses (None = exact top-k)."""
    return parse_method(method).max_devices


@dataclass
class InputSet:
    x_TD: torch.Tensor
    dy_TD: torch.Tensor | None
    routes: dict[int | None, tuple[torch.Tensor, torch.Tensor]]   # N_d (None = exact) -> (ids, weights)


def make_inputs(shape: MoEShape, router: Any, tokens: int, seed: int, device: torch.device,
                dtype: torch.dtype, routes: Sequence[int | None], placement: torch.Tensor | None,
                with_grad_output: bool) -> InputSet:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(dtype)
    dy = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(dtype) if with_grad_output else None
    logits = router.logits(x, gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(shape.top_k, dim=-1)
    out: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {None: (ids, weights)}
    for nd in routes:
        if nd is not None:
            if placement is None:
                raise RuntimeError("pruned routing needs a placement")
            out[nd] = prune_routing(logits, shape.top_k, placement.to(device), nd, int(placement.max()) + 1)
    return InputSet(x, dy, out)


def occult_placement(shape: MoEShape, router: Any, world: int, seed: int, balanced: bool = False,
                     latency: bool = False) -> torch.Tensor:
    """greedy_occult on the co-activation of a calibration batch (rank 0 computes, all receive).
    `balanced`: then repaired and swap-searched on the same batch so that the busiest device
    carries at most (1 + BALANCE_EPS) x the mean pairs (greedy_occult ignores load: on a skewed
    router it can put most pairs on one device). `latency`: the latency placement on that batch
    (`placement_from_calibration`)."""
    _, rank = world_and_rank(None)
    holder: list[Any] = [None]
    if rank == 0:
        gen = torch.Generator().manual_seed(derive_seed(seed, "calibration", shape.name))
        ids = router.calibration_ids(CALIBRATION_TOKENS, shape.top_k, gen)
        holder[0] = placement_from_calibration(ids, shape, world, seed, balanced, latency).tolist()
    if world_and_rank(None)[0] > 1:
        dist.broadcast_object_list(holder, src=0)
    return torch.tensor(holder[0], dtype=torch.long)


def placement_from_calibration(ids_NK: torch.Tensor, shape: MoEShape, world: int, seed: int,
                               balanced: bool = False, latency: bool = False) -> torch.Tensor:
    """`greedy_occult` on the co-activation of calibration routing `ids_NK`; `balanced`: then the
    load-aware swap search to (1 + BALANCE_EPS) x the mean load; `latency`: the placement of lowest
    predicted layer time of `shape` (the shipped cost model, 2^14 tokens per GPU, forward) from the
    fastest of greedy, swap, load-aware and EPLB-style (`occult_placement`; the simulator places a
    recorded trace with it too)."""
    from occult.routing.placement import greedy_occult

    ids_NK = torch.as_tensor(ids_NK, dtype=torch.long)
    hits_NE = torch.zeros(ids_NK.shape[0], shape.num_experts).scatter_(1, ids_NK, 1.0)
    placement = greedy_occult((hits_NE.t() @ hits_NE).numpy(), world)
    if latency and world > 1:
        from occult.routing.latency import LayerCost, default_starts, latency_search
        from occult.sim.cost_model_json import builtin_cost_model

        layer_seed = derive_seed(seed, "latency", shape.name)
        starts = default_starts(ids_NK.numpy(), shape.num_experts, world, swap_rounds=4, seed=layer_seed,
                                eps=BALANCE_EPS, kicks=2)
        layer = LayerCost(builtin_cost_model()[0], shape)
        placement = latency_search(ids_NK.numpy(), world, layer, starts, rounds=4, seed=layer_seed, kicks=2,
                                   path_points=0).device_of_expert
    elif balanced and world > 1:
        from occult.routing.placement_methods import load_aware_swap

        placement = load_aware_swap(ids_NK.numpy(), world, placement, BALANCE_EPS, rounds=4,
                                    seed=derive_seed(seed, "balanced", shape.name))
    return torch.tensor([int(device) for device in placement], dtype=torch.long)


