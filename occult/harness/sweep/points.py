"""The points of a sweep: per (routing, shape) the inputs every method shares (`ShapeRun`), per size
the methods in a seeded random order, and per (method, size) one point: the method built and set
up, its output checked against the dense reference, its steps timed, the method freed."""

from __future__ import annotations

import gc
import random
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from occult.harness.baselines import ExpertWeights, Method, world_and_rank
from occult.shapes import MoEShape
from occult.harness.sweep.check import agree, error_text, reference_outputs, relative_error
from occult.harness.sweep.inputs import (InputSet, TraceShapeError, make_inputs, make_router, occult_placement, routing_key)
from occult.shapes import SharedExpert
from occult.provenance import derive_seed
from occult.harness.sweep.occult_method import OccultEP, build_method, method_skip_reason
from occult.harness.sweep.settings import REL_TOLERANCE, SweepSettings
from occult.harness.sweep.timing import (
    phase_medians, profile_host, quantile, synchronize, time_steps, time_stream, train_step,
)
from occult.method_names import parse_method

Emit = Callable[[dict[str, Any]], None]


def order_seed(seed: int, routing: str, shape: str, size: int) -> int:
    """The seed of the method order at one point (recorded in its rows as `order_seed`), from the
    sweep's order seed (`SweepSettings.order_base_seed`)."""
    return derive_seed(seed, "order", routing, shape, size)


def method_order(methods: tuple[str, ...] | list[str], seed: int) -> list[str]:
    """`methods` shuffled by `seed`: the order they run in at a point. The same seed gives the
    same order on every rank and in every rerun, so a row's `order_seed` reproduces it."""
    return random.Random(seed).sample(list(methods), len(methods))


@dataclass
class ShapeRun:
    """What every point of one (routing, shape) shares: the weights, shared expert, router,
    placements, the correctness-check inputs and their dense references."""

    settings: SweepSettings
    shape: MoEShape
    routing: str
    device: torch.device
    dtype: torch.dtype
    backend: str
    weights: ExpertWeights
    shared: SharedExpert | None
    router: Any
    placement: torch.Tensor | None
    balanced: torch.Tensor | None
    check: InputSet
    references: dict[int | None, tuple[torch.Tensor, torch.Tensor | None]]
    latency: torch.Tensor | None = None

    def placement_of(self, name: str) -> torch.Tensor | None:
        """The placement method `name` runs on (`MethodSpec.placement`; -trivial's is made from it)."""
        return {"balanced": self.balanced, "latency": self.latency}.get(parse_method(name).placement, self.placement)

    @property
    def train(self) -> bool:
        return self.settings.kind == "train"


def prepare_shape(settings: SweepSettings, shape: MoEShape, routing: str, device: torch.device,
                  dtype: torch.dtype, backend: str) -> ShapeRun:
    """The shared inputs of (routing, shape); raises TraceShapeError where the trace does not fit."""
    world, rank = world_and_rank(None)
    train = settings.kind == "train"
    router = make_router(settings, shape, routing)
    weights = ExpertWeights.random(shape, derive_seed(settings.seed, "experts", shape.name), device, dtype)
    # On the host (so that no method's peak memory counts them), pinned: every point copies its shard in.
    host = (lambda t: t.cpu().pin_memory()) if device.type == "cuda" else (lambda t: t.cpu())  # noqa: E731
    weights = ExpertWeights(host(weights.w_gate_up_E2FD), host(weights.w_down_EDF))
    shared = (SharedExpert(shape, settings.seed, device, dtype)
              if settings.include_shared and shape.shared_ffn else None)
    specs = [parse_method(m) for m in settings.methods]
    placement = (occult_placement(shape, router, world, settings.seed)
                 if any(s.is_occult for s in specs) and shape.num_experts % world == 0 else None)
    balanced = (occult_placement(shape, router, world, settings.seed, balanced=True)
                if placement is not None and any(s.balanced for s in specs) else None)
    latency = (occult_placement(shape, router, world, settings.seed, latency=True)
               if placement is not None and any(s.latency for s in specs) else None)
    routes = sorted({s.max_devices for s in specs if s.max_devices is not None and placement is not None
                     and s.max_devices * shape.num_experts // world >= shape.top_k})
    check = make_inputs(shape, router, settings.check_tokens, derive_seed(settings.seed, "check", shape.name, rank),
                        device, dtype, routes, placement, with_grad_output=train)
    references = {nd: reference_outputs(check, nd, weights, device, with_grad=train) for nd in (None, *routes)}
    return ShapeRun(settings, shape, routing, device, dtype, backend, weights, shared, router, placement,
                    balanced, check, references, latency)


def shape_fields(shape: MoEShape, settings: SweepSettings) -> dict[str, Any]:
    with_shared = settings.include_shared and shape.shared_ffn
    return {"shape": shape.name, "num_experts": shape.num_experts, "top_k": shape.top_k, "hidden": shape.hidden,
            "ffn": shape.ffn, "shared_ffn": shape.shared_ffn if with_shared else 0}


def sweep_shape(settings: SweepSettings, shape: MoEShape, routing: str, device: torch.device, dtype: torch.dtype,
                backend: str, fixed: dict[str, Any], emit: Emit, bar, skip: frozenset[tuple] = frozenset()) -> None:
    """Every (size, method) point of one routing and shape, the methods in a seeded order per size;
    points in `skip` ((routing, shape, tokens_per_gpu, method), written by an earlier process) are left out."""
    base = {**fixed, **shape_fields(shape, settings), "routing": routing}
    todo = {(size, name) for size in settings.sizes for name in settings.methods
            if (routing, shape.name, settings.tokens_per_gpu(size), name) not in skip}
    bar.update(len(settings.sizes) * len(settings.methods) - len(todo))
    if not todo:
        return
    try:
        run = prepare_shape(settings, shape, routing, device, dtype, backend)
    except TraceShapeError as err:
        for size, name in sorted(todo, key=lambda point: (settings.sizes.index(point[0]), settings.methods.index(point[1]))):
            emit({**base, **_size_fields(settings, size), "method": name,
                  "baseline_config": build_method(name, None, backend).config,
                  "status": f"unsupported: routing trace: {err}"})
            bar.update(1)
        return
    for size in settings.sizes:
        seed = order_seed(settings.order_base_seed, routing, shape.name, size)
        for position, name in enumerate(method_order(settings.methods, seed)):
            if (size, name) not in todo:
                continue
            row = {**base, **_size_fields(settings, size), "method": name, "order_seed": seed,
                   "order_position": position, "point_position": position}
            row.update(run_point(run, name, size))
            emit(row)
            bar.log(routing=routing, shape=shape.name, method=name, size=size, status=row.get("status"),
                    median_ms=row.get("median_ms"))
            bar.update(1)


def _size_fields(settings: SweepSettings, size: int) -> dict[str, Any]:
    return {"tokens_per_gpu": settings.tokens_per_gpu(size), "batch": settings.batch(size)}


def run_point(run: ShapeRun, name: str, size: int) -> dict[str, Any]:
    """One method at one size: built, checked and timed, then freed (its leftovers would count in
    the next method's peak memory). Returns the row's status, check and measured columns."""
    world, _ = world_and_rank(None)
    method = build_method(name, run.placement_of(name), run.backend)
    out: dict[str, Any] = {"baseline_config": method.config, "max_rel_err": None}
    status = method_skip_reason(name, method, run.shape, world, run.train)
    if status is None:
        status = _setup_and_check(run, name, method, out)
    if status is None:
        out.update(measure(run, name, method, size))
    else:
        out["status"] = status
    method.teardown()
    del method
    # The collection also frees make_graphed_callables' graphs, which sit in reference cycles; NCCL
    # keeps communicators alive while a graph that captured them exists.
    gc.collect()
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _setup_and_check(run: ShapeRun, name: str, method: Method, out: dict[str, Any]) -> str | None:
    """Set the method up and compare it with the dense reference; the failing status, or None."""
    world, _ = world_and_rank(None)
    error = None
    try:
        method.setup(run.shape, None, run.dtype, run.device, run.weights)
    except Exception as err:  # noqa: BLE001 - recorded in the row and on stderr
        error = error_text(err)
    error = agree(error, world)
    if error:
        return f"error: setup: {error}"
    if not getattr(method, "checks_output", True):
        return None
    nd = routing_key(name)
    try:
        out["max_rel_err"] = relative_error(method, run.check, nd, run.references[nd], world)
    except Exception as err:  # noqa: BLE001
        error = error_text(err)
    error = agree(error, world)
    if error:
        return f"error: check: {error}"
    tolerance = REL_TOLERANCE[run.settings.dtype]
    if not out["max_rel_err"] <= tolerance:
        return f"failed: max_rel_err {out['max_rel_err']:.3g} > {tolerance:g}"
    return None


def measure(run: ShapeRun, name: str, method: Method, size: int) -> dict[str, Any]:
    """Time one method at one size; returns the measured columns and the status."""
    settings, device, shared = run.settings, run.device, run.shared
    world, rank = world_and_rank(None)
    tokens = settings.tokens_per_gpu(size)
    nd = routing_key(name)
    out: dict[str, Any] = {}
    error = None
    sets: list[InputSet] = []
    try:
        sets = [make_inputs(run.shape, run.router, tokens,
                            derive_seed(settings.seed, settings.kind, run.shape.name, tokens, index, rank),
                            device, run.dtype, [nd], run.placement, with_grad_output=run.train)
                for index in range(settings.input_sets)]
        first_ids, first_weights = sets[0].routes[nd]
        if isinstance(method, OccultEP):
            out["bytes_sent"], out["mean_devices_per_token"], out["pairs_received_max"] = method.traffic(
                first_ids, sets[0].x_TD, first_weights)
            phases = device.type == "cuda" and not run.train and not (method.graphed or method.compute_only)
            method.phase_events = [] if phases else None
        else:
            out["bytes_sent"] = method.bytes_sent(first_ids)
        params = method.expert_parameters() + (list(shared.parameters()) if shared is not None else [])

        def step(i: int) -> None:
            inputs = sets[i % len(sets)]
            ids, gate = inputs.routes[nd]
            if run.train:
                train_step(method, inputs.x_TD, ids, gate, shared, inputs.dy_TD, params)
            else:
                with torch.no_grad():
                    y = method.forward(inputs.x_TD, ids, gate)
                    if shared is not None:
                        y = y + shared(inputs.x_TD)

        if device.type == "cuda":
            synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        host_times: list[float] = []
        host_probes: list[tuple[float, float]] = []
        timer = time_stream if settings.timing == "stream" else time_steps
        times = timer(step, settings.repeats, settings.warmup, device, world, host_times, host_probes)
        if settings.host_profile:
            label = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
            profile_host(step, settings.repeats, device, world, rank, Path(settings.host_profile)
                         / f"host_{settings.kind}_{run.shape.name}_{label}_{size}.txt")
        out.update(median_ms=statistics.median(times), p10_ms=quantile(times, 0.1), p90_ms=quantile(times, 0.9),
                   host_ms=statistics.median(host_times),
                   host_probe_us=statistics.median(p for p, _ in host_probes),
                   host_launch_us=statistics.median(q for _, q in host_probes))
        if isinstance(method, OccultEP) and method.phase_events:
            out.update(phase_medians(method.phase_events[settings.warmup:], device, world))
        if device.type == "cuda":
            peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
            if world > 1:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            out["peak_mem_gib"] = float(peak)
    except Exception as err:  # noqa: BLE001 - recorded in the row and on stderr
        error = error_text(err)
    finally:
        del sets
    error = agree(error, world)
    out["status"] = f"error: {error}" if error else "ok"
    return out
