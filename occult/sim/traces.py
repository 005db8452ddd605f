"""The sweep's routing regenerated on the CPU, and one layer's predicted terms on it.

The sweeps drew their hidden states from CUDA generators, so the tokens differ but come from the
same distribution; the placement (computed on the CPU by the sweep) is the same. E[C_T] of the
trace is written beside the measured one.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from occult.shapes import MoEShape
from occult.sim.columns import SimulateError
from occult.sim.cost_model import CostModel, gpu_components, layer_time, method_spec
from occult.sim.traffic import Traffic, static_traffic, traffic


class ShapeTraces:
    """A pool of routed tokens of one shape and routing (`synthetic`: the sweep's seeded
    `SyntheticRouter`; `uniform`: i.i.d. Gaussian logits), with placements and pruning per D.

    Memoises placements and pruned routings per (D, N_d, placement) on the instance.
    """

    def __init__(self, shape: MoEShape, pool_tokens: int, seed: int, routing: str = "synthetic") -> None:
        from occult.harness.sweep.inputs import SyntheticRouter, make_inputs
        from occult.provenance import derive_seed

        if routing not in ("synthetic", "uniform"):
            raise SimulateError(f"routing: {routing!r} cannot be regenerated on the CPU (synthetic, uniform)")
        self.shape, self.seed, self.routing = shape, seed, routing
        if routing == "uniform":
            self.router = None
            gen = torch.Generator().manual_seed(derive_seed(seed, "simulate-uniform", shape.name))
            self.logits_NE = torch.randn(pool_tokens, shape.num_experts, generator=gen)
            self.ids_NK = self.logits_NE.topk(shape.top_k, dim=-1).indices
        else:
            self.router = SyntheticRouter.make(shape, seed)
            inputs = make_inputs(shape, self.router, pool_tokens, derive_seed(seed, "simulate", shape.name),
                                 torch.device("cpu"), torch.bfloat16, [None], None, with_grad_output=False)
            self.logits_NE = self.router.logits(inputs.x_TD)
            self.ids_NK = inputs.routes[None][0]
        self._placements: dict[tuple[int, bool, bool, bool], torch.Tensor] = {}
        self._routes: dict[tuple[int, int, bool], torch.Tensor] = {}

    def support(self, method: str, num_devices: int) -> str | None:
        """None, or why `method` cannot run this shape on `num_devices`."""
        shape = self.shape
        if shape.num_experts % num_devices:
            return f"unsupported: {shape.num_experts} experts are not divisible by D={num_devices}"
        nd = method_spec(method).max_devices
        if nd is not None and nd * shape.num_experts // num_devices < shape.top_k:
            return f"unsupported: N_d*E/D = {nd}*{shape.num_experts}/{num_devices} < top_k {shape.top_k}"
        return None

    def placement(self, method: str, num_devices: int) -> torch.Tensor:
        """Contiguous for naive, `-trivial` and uniform routing (where placement does not matter);
        the sweep's load-aware placement for `-balanced`, its latency placement for `-latency`; else
        the sweep's `greedy_occult` placement."""
        spec = method_spec(method)
        contiguous = spec.contiguous or self.routing == "uniform"
        balanced = spec.balanced and not contiguous
        latency = spec.latency and not contiguous
        key = (num_devices, contiguous, balanced, latency)
        if key not in self._placements:
            if contiguous:
                self._placements[key] = torch.arange(self.shape.num_experts) // (self.shape.num_experts // num_devices)
            else:       # the sweep's own function: the same calibration batch, placement and seed
                from occult.harness.sweep.inputs import occult_placement

                self._placements[key] = occult_placement(self.shape, self.router, num_devices, self.seed, balanced,
                                                         latency)
        return self._placements[key]

    def ids(self, method: str, num_devices: int) -> torch.Tensor:
        from occult.harness.sweep.inputs import prune_routing

        spec = method_spec(method)
        if spec.max_devices is None:
            return self.ids_NK
        key = (num_devices, spec.max_devices, spec.contiguous)
        if key not in self._routes:
            placement = self.placement(method, num_devices)
            self._routes[key] = prune_routing(self.logits_NE, self.shape.top_k, placement, spec.max_devices,
                                              num_devices)[0]
        return self._routes[key]

    def traffic_at(self, method: str, num_devices: int, tokens_per_gpu: int, elem_bytes: int = 2,
                   max_chunks: int = 8) -> list[Traffic]:
        """Traffic of D devices × `tokens_per_gpu` tokens: disjoint chunks of the pool when it holds
        them (so small batches keep their sampling noise), else the whole pool scaled up."""
        spec = method_spec(method)
        ids = self.ids(method, num_devices)
        placement = self.placement(method, num_devices)
        pool = ids.shape[0]
        chunk = num_devices * tokens_per_gpu
        if chunk <= pool:
            count = min(pool // chunk, max_chunks)
            chunks = [traffic(ids[i * chunk:(i + 1) * chunk], placement, num_devices, spec.mode, self.shape.hidden,
                              elem_bytes) for i in range(count)]
        else:
            whole = traffic(ids, placement, num_devices, spec.mode, self.shape.hidden, elem_bytes)
            chunks = [whole.scaled(chunk / pool)]
        if spec.static:
            chunks = [static_traffic(t, self.shape.hidden, elem_bytes) for t in chunks]
        return chunks


class RecordedTraces(ShapeTraces):
    """One layer of a recorded routing trace (top-k expert ids without logits, e.g. a GPU run's
    `routing_*_sample.npz`) on a shape with the same E and k: the held-out split is routed, the
    calibration split places, the sweep's way (`greedy_occult` on its co-activation; `-balanced`
    then the load-aware swap search, `-latency` the latency placement). N_d pruning needs the router's logits, so those methods
    read unsupported rather than being approximated."""

    def __init__(self, shape: MoEShape, calib_NK: np.ndarray, heldout_NK: np.ndarray, seed: int) -> None:
        for name, ids in (("calibration", calib_NK), ("held-out", heldout_NK)):
            if ids.ndim != 2 or ids.shape[1] != shape.top_k or ids.shape[0] == 0:
                raise SimulateError(f"trace: the {name} ids have shape {tuple(ids.shape)}, not [tokens, "
                                    f"{shape.top_k}] (shape {shape.name}'s top-k)")
            if ids.min() < 0 or ids.max() >= shape.num_experts:
                raise SimulateError(f"trace: {name} expert ids outside [0, {shape.num_experts}) of shape {shape.name}")
        self.shape, self.seed, self.routing = shape, seed, "trace"
        self.router, self.logits_NE = None, None
        self.calib_NK = torch.as_tensor(np.asarray(calib_NK, dtype=np.int64))
        self.ids_NK = torch.as_tensor(np.asarray(heldout_NK, dtype=np.int64))
        self._placements: dict[tuple[int, bool, bool, bool], torch.Tensor] = {}
        self._routes: dict[tuple[int, int, bool], torch.Tensor] = {}

    def support(self, method: str, num_devices: int) -> str | None:
        why = super().support(method, num_devices)
        if why is None and method_spec(method).max_devices is not None:
            why = "unsupported: N_d pruning needs the router's logits; a recorded trace holds expert ids only"
        return why

    def placement(self, method: str, num_devices: int) -> torch.Tensor:
        from occult.harness.sweep.inputs import placement_from_calibration

        spec = method_spec(method)
        key = (num_devices, spec.contiguous, spec.balanced and not spec.contiguous,
               spec.latency and not spec.contiguous)
        if key not in self._placements:
            experts = self.shape.num_experts
            self._placements[key] = (torch.arange(experts) // (experts // num_devices) if spec.contiguous else
                                     placement_from_calibration(self.calib_NK, self.shape, num_devices, self.seed,
                                                                key[2], key[3]))
        return self._placements[key]


def point_components(chunks: Sequence[Traffic], shape: MoEShape, method: str, pass_: str, cost: CostModel,
                     tokens_per_gpu: float, link_gpus_per_node: int | None = None,
                     host_scale: float = 1.0, kind: str | None = None) -> dict[str, float]:
    """Predicted terms of one layer (mean over trace chunks) and the traffic facts (`kind`: the sweep
    kind, for the shape's host offset)."""
    spec = method_spec(method)
    num_devices = chunks[0].num_devices
    parts = [gpu_components(t, shape, spec, pass_, cost, tokens_per_gpu) for t in chunks]
    out = {key: float(np.mean([p[key] for p in parts])) for key in parts[0]}
    out.update(layer_time(out["gpu_ms"], spec, pass_, num_devices, cost, cost.shared_host_ms(shape, pass_), host_scale,
                          shape.name, kind))
    pairs = np.stack([t.pairs_in_D for t in chunks])
    out["mean_devices_per_token"] = float(np.mean([t.mean_devices_per_token for t in chunks]))
    out["load_max_over_mean"] = float(np.mean(pairs.max(1) / np.maximum(pairs.mean(1), 1e-30)))
    out["pairs_max"] = float(np.mean(pairs.max(1)))
    out["dispatch_bytes_per_rank"] = float(np.mean([t.remote(t.dispatch_bytes_SD).sum(1).mean() for t in chunks]))
    out["return_bytes_per_rank"] = float(np.mean([t.remote(t.return_bytes_SD).sum(1).mean() for t in chunks]))
    per_node = max(1, min(link_gpus_per_node or cost.link.gpus_per_node, num_devices))
    node_D = np.arange(num_devices) // per_node
    other_node = node_D[:, None] != node_D[None, :]
    out["inter_node_bytes_per_rank"] = float(np.mean([
        ((t.dispatch_bytes_SD + t.return_bytes_SD) * other_node).sum(1).mean() for t in chunks]))
    out["trace_bytes_sent"] = float(np.mean([t.sweep_bytes_sent(shape.hidden, 2) for t in chunks]))
    return out


def simulate_point(traces: ShapeTraces, method: str, num_devices: int, tokens_per_gpu: int, pass_: str,
                   cost: CostModel, kind: str | None = None) -> dict[str, float]:
    """Predicted terms and traffic facts of one layer of `method` on the trace."""
    chunks = traces.traffic_at(method, num_devices, tokens_per_gpu)
    return point_components(chunks, traces.shape, method, pass_, cost, tokens_per_gpu, kind=kind)


def trace_key(shape: str, routing: str) -> str:
    return shape if routing == "synthetic" else f"{shape}@{routing}"
