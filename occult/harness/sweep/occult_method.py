"""Occult's EP layer as a sweep method (`OccultEP`, with the options of `OCCULT_OPTIONS`), and how the
sweep builds any method by name and decides whether it can run at a point."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.distributed as dist

from occult.harness.baselines import ExpertWeights, Method, import_error_text, make_method, world_and_rank
from occult.shapes import MoEShape
from occult.harness.sweep.inputs import routing_key
from occult.harness.sweep.settings import SweepError
from occult.method_names import OCCULT_OPTIONS, parse_method


class OccultEP(Method):
    """Occult's EP layer (`ep_moe`) with the options of `OCCULT_OPTIONS` (default: exact dedup
    dispatch, eager, on the collaboration-aware placement)."""

    name = "occult"

    def __init__(self, device_of_expert_E: torch.Tensor | None, backend: str, options: Sequence[str] = ()) -> None:
        unknown = set(options) - set(OCCULT_OPTIONS)
        if unknown:
            raise SweepError(f"methods: unknown occult option(s) {sorted(unknown)}")
        if "pe" in options and ({"static", "graph"} & set(options)):
            raise SweepError("methods: -pe (per_expert) has no static-shape plan; drop -static/-graph")
        self.device_of_expert_E = device_of_expert_E
        self.backend = backend
        self.options = frozenset(options)
        self.mode = "per_expert" if "pe" in self.options else "dedup"
        self.static = bool({"static", "graph"} & self.options)
        self.graphed = "graph" in self.options
        self.compute_only = "compute" in self.options
        self.checks_output = not self.compute_only
        self.phase_events: list[tuple[torch.cuda.Event, ...]] | None = None

    def available(self) -> tuple[bool, str]:
        try:
            from occult.ep.layer import get_backend

            get_backend(self.backend)
        except Exception as err:  # noqa: BLE001
            return False, import_error_text(err)
        return True, f"backend={self.backend}"

    def setup(self, shape: MoEShape, group: dist.ProcessGroup | None, dtype: torch.dtype,
              device: torch.device, weights: ExpertWeights) -> None:
        from occult.ep.layer import get_backend
        from occult.ep.plan import experts_of_device

        if self.device_of_expert_E is None:
            raise RuntimeError("occult: no placement was computed for this shape")
        if self.graphed and device.type != "cuda":
            raise RuntimeError("occult -graph: CUDA graphs need a GPU")
        self.group = group
        self.world, self.rank = world_and_rank(group)
        self.placement = self.device_of_expert_E.detach().cpu().long()
        self.w_gate_up, self.w_down = weights.local(experts_of_device(self.placement, self.rank), dtype, device)
        self.ops = get_backend(self.backend)
        self._graphs: dict[tuple, Any] = {}
        self._received: dict[tuple, Any] = {}

    def expert_parameters(self) -> list[torch.Tensor]:
        return [self.w_gate_up, self.w_down]

    def teardown(self) -> None:
        """Drop the graphs, received-row buffers and expert weights (a later method's `peak_mem_gib`
        must not count them)."""
        self._graphs, self._received = {}, {}
        super().teardown()

    def _layer(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, phase=None,
               stats=None) -> torch.Tensor:
        from occult.ep.layer import ep_moe

        capacity = x_TD.shape[0] if self.static else None
        return ep_moe(x_TD, ids_TK, weights_TK, self.placement, self.w_gate_up, self.w_down,
                      group=self.group, mode=self.mode, backend=self.ops, static_capacity=capacity,
                      phase=phase, stats=stats)

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        if self.compute_only:
            return self._compute_only(x_TD, ids_TK, weights_TK)
        if self.graphed:
            return self._graphed(x_TD, ids_TK, weights_TK)
        if self.phase_events is None or torch.is_grad_enabled():
            return self._layer(x_TD, ids_TK, weights_TK)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        events[0].record()
        marks = iter(events[1:])
        y = self._layer(x_TD, ids_TK, weights_TK, phase=lambda _name: next(marks).record())
        self.phase_events.append(tuple(events))
        return y

    def _graphed(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """Forward: one captured graph per input shape. Train: make_graphed_callables (fwd + bwd)."""
        train = torch.is_grad_enabled() and (x_TD.requires_grad or weights_TK.requires_grad)
        key = (train, tuple(x_TD.shape), tuple(ids_TK.shape))
        graph = self._graphs.get(key)
        if graph is None:
            self._graphs.clear()                     # one size at a time: free the last pool
            if train:
                layer = _StaticLayer(self)
                graph = torch.cuda.make_graphed_callables(
                    layer, (x_TD.detach().clone().requires_grad_(), ids_TK.clone(),
                            weights_TK.detach().clone().requires_grad_()))
            else:
                from occult.ep.graph import GraphedForward

                graph = GraphedForward(self._layer, x_TD, ids_TK, weights_TK)
            self._graphs[key] = graph
        return graph(x_TD, ids_TK, weights_TK)

    def _compute_only(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """The expert kernels on this GPU's received pairs; the dispatch runs once per input set."""
        from occult.ep.layer import dispatch_to_experts, expert_compute, placement_tables

        key = (x_TD.data_ptr(), tuple(x_TD.shape), ids_TK.data_ptr())
        received = self._received.get(key)
        if received is None:
            tables = placement_tables(self.placement, self.world, self.rank, x_TD.device)
            with torch.no_grad():
                received = dispatch_to_experts(x_TD, ids_TK, weights_TK, tables, self.group, "dedup", self.ops,
                                               None, self.world, self.rank)
            received.x_RD = received.x_RD.detach().clone().requires_grad_(torch.is_grad_enabled())
            received.pair_gate_M = received.pair_gate_M.detach().clone().requires_grad_(torch.is_grad_enabled())
            self._received[key] = received
        if self.graphed:
            return self._graphed_compute(key, received)
        return expert_compute(received, self.w_gate_up, self.w_down, self.ops)

    def _graphed_compute(self, key: tuple, received: Any) -> torch.Tensor:
        """`-compute-graph`: the same kernels on the same received pairs, replayed from a CUDA graph
        (forward: GraphedForward; train: make_graphed_callables). The graph's inputs are the held
        rows and gates themselves, so a replay copies nothing."""
        train = torch.is_grad_enabled()
        graph = self._graphs.get((train, *key))
        if graph is None:
            # one graph per input set (their routings differ), one (pass, size) at a time: free the others
            # (a graph's key is (train, x pointer, x shape, ids pointer))
            self._graphs = {k: g for k, g in self._graphs.items() if (k[0], k[2]) == (train, key[1])}
            module = _ComputeOnly(self, received)
            if train:
                graph = torch.cuda.make_graphed_callables(module, (received.x_RD, received.pair_gate_M))
            else:
                from occult.ep.graph import GraphedForward

                forward = GraphedForward(module, received.x_RD, received.pair_gate_M)
                graph = lambda _x, _gate: forward(*forward.inputs)   # noqa: E731 - inputs held in place
            self._graphs[(train, *key)] = graph
        return graph(received.x_RD, received.pair_gate_M)

    def traffic(self, ids_TK: torch.Tensor, x_TD: torch.Tensor, weights_TK: torch.Tensor) -> tuple[int, float, int]:
        """(bytes this rank puts on the wire per forward, as `EPStats` counts them: packed rows with
        their metadata slots and 64-B padding out, partial rows back; E[C_T]; most pairs any rank's
        experts compute)."""
        from occult.ep.layer import EPStats

        stats = EPStats()
        with torch.no_grad():
            self._layer(x_TD, ids_TK, weights_TK, stats=stats)
        most = torch.tensor([stats.pairs_received], dtype=torch.long, device=x_TD.device)
        if self.world > 1:
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return stats.bytes_remote, stats.mean_devices_per_token, int(most)

    def bytes_sent(self, ids_TK: torch.Tensor) -> int | None:
        return None


class _WithExpertWeights(torch.nn.Module):
    """A module holding an `OccultEP`'s expert weights as parameters (sharing their storage), so
    that `torch.cuda.make_graphed_callables` computes their gradients in the captured backward."""

    def __init__(self, method: OccultEP) -> None:
        super().__init__()
        self.method = method
        self.w_gate_up = torch.nn.Parameter(method.w_gate_up, requires_grad=method.w_gate_up.requires_grad)
        self.w_down = torch.nn.Parameter(method.w_down, requires_grad=method.w_down.requires_grad)


class _StaticLayer(_WithExpertWeights):
    """The static-shape layer as a module for `torch.cuda.make_graphed_callables`."""

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        from occult.ep.layer import ep_moe

        m = self.method
        return ep_moe(x_TD, ids_TK, weights_TK, m.placement, self.w_gate_up, self.w_down, group=m.group,
                      mode="dedup", backend=m.ops, static_capacity=x_TD.shape[0])


class _ComputeOnly(_WithExpertWeights):
    """The expert compute on fixed received pairs as a module of (rows, gates), for the CUDA-graph
    helpers (`-compute-graph`)."""

    def __init__(self, method: OccultEP, received: Any) -> None:
        super().__init__(method)
        self.received = received

    def forward(self, x_RD: torch.Tensor, pair_gate_M: torch.Tensor) -> torch.Tensor:
        from occult.ep.layer import expert_compute

        held = dataclasses.replace(self.received, x_RD=x_RD, pair_gate_M=pair_gate_M)
        return expert_compute(held, self.w_gate_up, self.w_down, self.method.ops)


def occult_options(name: str) -> frozenset[str]:
    """The `-option`s of a method name (empty for baselines)."""
    return parse_method(name).options


def build_method(name: str, placement: torch.Tensor | None, backend: str) -> Method:
    """The method `name` (an Occult variant on `placement`, or a baseline with its settings)."""
    spec = parse_method(name)
    if spec.is_occult:
        options = occult_options(name)
        if "trivial" in options and placement is not None:
            from occult.ep.plan import contiguous_placement

            placement = contiguous_placement(placement.numel(), int(placement.max()) + 1)
        method = OccultEP(placement, backend, options)
        method.name = name
        return method
    return make_method(spec.system, **dict(spec.settings))


def method_skip_reason(name: str, method: Method, shape: MoEShape, world: int, train: bool = False) -> str | None:
    """Why `method` does not run at this shape and D ("unavailable: ..." / "unsupported: ..."), or None."""
    ok, reason = method.available()
    if not ok:
        return f"unavailable: {reason}"
    why = method.supports(shape, world, train)
    if why:
        return f"unsupported: {why}"
    nd = routing_key(name)
    if nd is not None:
        try:
            import occult.routing.pruning  # noqa: F401
        except ImportError as err:
            return f"unavailable: {import_error_text(err)}"
        if nd * shape.num_experts // world < shape.top_k:
            return f"unsupported: N_d*E/D = {nd}*{shape.num_experts}/{world} < top_k {shape.top_k}"
    return None
