"""Latency sweeps of one MoE layer: Occult against MegaBlocks, Tutel, a naive EP, HF and FSDP.

Launch on GPUs (one process per GPU, D = GPUs):

    torchrun --nproc_per_node=2 -m occult.harness.sweep --kind prefill --shapes olmoe qwen deepseek

and on the CPU (gloo ranks forked here, tiny shapes) for smoke tests:

    python -m occult.harness.sweep --device cpu --dtype float32 --D 2 --kind prefill --shapes tiny --sizes 16 32

Kinds and sizes (`--sizes`, per GPU): `prefill` — forward of N tokens (default 2^10 … 2^16);
`decode` — forward of one step of a batch of B sequences, N = B tokens (B ∈ 1, 8, 64, 512);
`train` — forward + backward of B sequences of `--seq-len` 512 tokens (B ∈ 1, 2, 4, 8, 16).

Routing. Each shape gets a seeded low-rank router (logits = (x U) V + b, rank 4: experts whose
columns of V are close are picked together, so co-activation has structure). Every input set
is fresh random hidden states x routed by it: ids = top-k of softmax(logits), weights = their
probabilities. All methods receive the SAME (x, ids, weights) at a given point; the router
itself is not timed. Occult's placement is `occult.routing.placement.greedy_occult` on the co-activation
of a separate calibration batch (computed on rank 0, broadcast). `occult-nd<N>` routes with
`occult.routing.pruning.prune_router_score` (at most N devices per token) on that placement.

Methods: `occult` (exact, dedup dispatch, `occult.ep.layer.ep_moe`), `occult-nd2`, `occult-nd1`,
and the baselines of `occult.harness.baselines` (`megablocks`, `tutel`, `naive`, `hf`, `fsdp`,
`deepspeed`). The shape's shared expert (if any) is one replicated SwiGLU added by the harness to
every method's output, timed with it.

Per (shape, method): set up the method with the shape's seeded global weights, then check its
output (and, for `train`, dL/dx) on a small batch against `occult.kernels.reference.moe_dense_ref`
(max relative error over ranks; above the dtype's tolerance the method is `failed` and not timed).
Per size: `--input-sets` input sets are generated and rotated over `warmup + repeats` steps; each
step is timed with CUDA events (perf_counter on CPU) after a barrier; the per-step time is the max
over ranks; the row gets its median, p10 and p90, and `host_ms`, the median host time until the
step's call returns (a sync inside the call included, GPU work still queued excluded: a layer is
host-bound where host_ms is close to median_ms), and two host probes run just before each timed
block, their medians: `host_probe_us`, a fixed pure-Python loop (`host_probe_us()`: the host CPU's
speed at that moment, which on the lent H200 machines moves up to 2x within seconds), and
`host_launch_us`, issuing `HOST_LAUNCHES` tiny ops on the device (`host_launch_us()`: the launch
path an eager layer spends its host time in). Peak memory = max over ranks of
`torch.cuda.max_memory_allocated` during the timed loop. Bytes sent per rank come from each
method's own accounting (rows, metadata, padding). A method that raises gets `status="error: ..."`
(traceback on stderr) and the sweep goes on; one whose library is missing gets
`status="unavailable: ..."`, never a substitute. The CSV (rank 0, atomic, rewritten after every
row) has a `.meta.json` provenance sidecar; a short table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import re
import statistics
import sys
import time
import traceback
import zlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from occult.method_names import BALANCE_EPS, OCCULT_OPTIONS, MethodNameError, parse_method  # noqa: F401
from occult.harness.baselines import (
    METHOD_CLASSES,
    ExpertWeights,
    Method,
    MoEShape,
    get_shape,
    import_error_text,
    make_method,
    world_and_rank,
)

KINDS = ("prefill", "decode", "train")
DEFAULT_SIZES = {
    "prefill": tuple(2**p for p in range(10, 17)),
    "decode": (1, 8, 64, 512),
    "train": (1, 2, 4, 8, 16),
}
DEFAULT_METHODS = ("occult", "occult-nd2", "occult-nd1", "megablocks", "tutel", "naive", "hf", "fsdp", "deepspeed")
ROUTINGS = ("synthetic", "uniform", "trace")
# step: the GPU drained before each timed step (one layer call from an idle GPU, host time before
# its first kernel included); stream: blocks of steps issued back to back, as consecutive layers of a
# model issue them, so host time hides behind queued GPU work unless a method syncs with the host
TIMINGS = ("step", "stream")
STREAM_BLOCKS = 5
REL_TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
VERSION_PACKAGES = ("torch", "triton", "transformers", "megablocks", "grouped_gemm", "stanford-stk", "tutel", "deepspeed")
ROUTER_RANK = 4
CALIBRATION_TOKENS = 8192
REF_CHUNK_TOKENS = 16
COLUMNS = (
    "machine", "commit", "command", "kind", "shape", "method", "D", "tokens_per_gpu", "batch", "seq_len",
    "dtype", "median_ms", "p10_ms", "p90_ms", "peak_mem_gib", "bytes_sent", "mean_devices_per_token",
    "max_rel_err", "status", "routing", "pairs_received_max", "dispatch_ms", "experts_ms", "combine_ms", "host_ms",
    "host_probe_us", "host_launch_us", "repeats", "warmup", "timer", "timing", "num_experts", "top_k", "hidden", "ffn",
    "shared_ffn", *(f"version_{name.replace('-', '_')}" for name in VERSION_PACKAGES),
)


class SweepError(ValueError):
    """A sweep argument is invalid; the message names it."""


@dataclass(frozen=True)
class SweepSettings:
    """Everything a rank needs (inherited by forked CPU ranks, passed to `run_sweep` on GPUs)."""

    kind: str
    shapes: tuple[str, ...]
    methods: tuple[str, ...]
    world: int
    sizes: tuple[int, ...]
    out_csv: str
    repeats: int = 20
    warmup: int = 5
    device: str = "cuda"
    dtype: str = "bfloat16"
    seed: int = 0
    seq_len: int = 512
    input_sets: int = 3
    check_tokens: int = 64
    occult_backend: str = "auto"
    include_shared: bool = True
    command: str = ""
    routing: str = "synthetic"
    trace: str = ""
    host_profile: str = ""
    timing: str = "step"

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise SweepError(f"kind: {self.kind!r} is not one of {KINDS}")
        for name in self.shapes:
            try:
                get_shape(name)
            except ValueError as err:
                raise SweepError(f"shapes: {err}") from None
        for name in self.methods:
            try:
                spec = parse_method(name)
            except MethodNameError as err:
                raise SweepError(f"methods: {err}") from None
            if not spec.is_occult and name not in METHOD_CLASSES:
                raise SweepError(f"methods: {name!r} has no adapter; expected one of {sorted(METHOD_CLASSES)}")
        if self.world < 1:
            raise SweepError(f"D: must be at least 1, got {self.world}")
        if not self.sizes or min(self.sizes) < 1:
            raise SweepError(f"sizes: need positive sizes, got {self.sizes}")
        for field in ("repeats", "input_sets", "check_tokens", "seq_len"):
            if getattr(self, field) < 1:
                raise SweepError(f"{field}: must be at least 1, got {getattr(self, field)}")
        if self.routing not in ROUTINGS:
            raise SweepError(f"routing: {self.routing!r} is not one of {ROUTINGS}")
        if self.timing not in TIMINGS:
            raise SweepError(f"timing: {self.timing!r} is not one of {TIMINGS}")
        if self.routing == "trace" and not Path(self.trace).is_file():
            raise SweepError(f"trace: routing=trace needs a routing_*.npz file, got {self.trace!r}")
        if self.warmup < 0:
            raise SweepError(f"warmup: must be >= 0, got {self.warmup}")
        if self.dtype not in DTYPES:
            raise SweepError(f"dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.device not in ("cuda", "cpu"):
            raise SweepError(f"device: {self.device!r} is not cuda or cpu")
        if self.occult_backend not in ("auto", "torch", "triton"):
            raise SweepError(f"occult_backend: {self.occult_backend!r} is not auto, torch or triton")

    def tokens_per_gpu(self, size: int) -> int:
        return size * self.seq_len if self.kind == "train" else size

    def batch(self, size: int) -> int | None:
        return None if self.kind == "prefill" else size


# ----------------------------------------------------------------------------------------------
# Occult as a method


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
        """Drop the graphs, received-row buffers and expert weights. Up to `sweeps_v39` the weights
        stayed referenced, so every later method's `peak_mem_gib` counted one more copy of them."""
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


def prune_routing(logits_TE: torch.Tensor, top_k: int, device_of_expert_E: torch.Tensor,
                  max_devices: int, num_devices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) of router-score pruning to `max_devices` devices (`occult.routing.pruning`, gates kept)."""
    from occult.routing.pruning import prune_router_score

    weights_TK, ids_TK = prune_router_score(logits_TE, top_k, device_of_expert_E, max_devices,
                                            num_devices=num_devices)
    return ids_TK.long(), weights_TK.float()


# ----------------------------------------------------------------------------------------------
# Inputs


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


@dataclass(frozen=True)
class TraceRouter:
    """Routing replayed from a measured trace (`occult.routing.profiling`'s routing_*.npz of our model),
    widened to the shape: each of the trace's E_t experts becomes E/E_t sub-experts and each of a
    token's k_t experts k/k_t of its sub-experts (drawn per token with a fixed seed), so the
    co-activation between the trace's experts is kept. Tokens of all layers are pooled. The
    calibration file (routing_calibration.npz beside it, if present) places; the given file times.
    Logits put 8 on the token's chosen ids (plus N(0, 0.1) noise) and N(0, 1) elsewhere, so top-k
    returns the trace and router-score pruning sees a ranking."""

    ids_NK: torch.Tensor              # int64 [N, k] widened held-out trace
    calibration_NK: torch.Tensor      # int64 [N', k] widened calibration trace
    num_experts: int

    @classmethod
    def load(cls, path: str | Path, shape: MoEShape, seed: int) -> "TraceRouter":
        import numpy as np

        path = Path(path)
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
                raise SweepError(
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


def make_router(settings: "SweepSettings", shape: MoEShape):
    """The router of `settings.routing` for `shape` (module docstring)."""
    if settings.routing == "uniform":
        return UniformRouter(shape.num_experts)
    if settings.routing == "trace":
        return TraceRouter.load(settings.trace, shape, settings.seed)
    return SyntheticRouter.make(shape, settings.seed)


def derive_seed(*parts: Any) -> int:
    """A stable 31-bit seed from any parts (same in every process, unlike `hash`)."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


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


def occult_placement(shape: MoEShape, router: Any, world: int, seed: int, balanced: bool = False) -> torch.Tensor:
    """greedy_occult on the co-activation of a calibration batch (rank 0 computes, all receive).
    `balanced`: then repaired and swap-searched on the same batch so that the busiest device
    carries at most (1 + BALANCE_EPS) x the mean pairs (greedy_occult ignores load: on a skewed
    router it can put most pairs on one device)."""
    _, rank = world_and_rank(None)
    holder: list[Any] = [None]
    if rank == 0:
        gen = torch.Generator().manual_seed(derive_seed(seed, "calibration", shape.name))
        ids = router.calibration_ids(CALIBRATION_TOKENS, shape.top_k, gen)
        holder[0] = placement_from_calibration(ids, shape, world, seed, balanced).tolist()
    if world_and_rank(None)[0] > 1:
        dist.broadcast_object_list(holder, src=0)
    return torch.tensor(holder[0], dtype=torch.long)


def placement_from_calibration(ids_NK: torch.Tensor, shape: MoEShape, world: int, seed: int,
                               balanced: bool = False) -> torch.Tensor:
    """`greedy_occult` on the co-activation of calibration routing `ids_NK`; `balanced`: then the
    load-aware swap search to (1 + BALANCE_EPS) x the mean load (`occult_placement`; the simulator
    places a recorded trace with it too)."""
    from occult.routing.placement import greedy_occult

    ids_NK = torch.as_tensor(ids_NK, dtype=torch.long)
    hits_NE = torch.zeros(ids_NK.shape[0], shape.num_experts).scatter_(1, ids_NK, 1.0)
    placement = greedy_occult((hits_NE.t() @ hits_NE).numpy(), world)
    if balanced and world > 1:
        from occult.routing.placement_methods import load_aware_swap

        placement = load_aware_swap(ids_NK.numpy(), world, placement, BALANCE_EPS, rounds=4,
                                    seed=derive_seed(seed, "balanced", shape.name))
    return torch.tensor([int(device) for device in placement], dtype=torch.long)


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


# ----------------------------------------------------------------------------------------------
# Measurement


def agree(error: str | None, world: int) -> str | None:
    """The first rank's error (or None) on every rank, so that all ranks take the same branch."""
    if world == 1:
        return error
    errors: list[str | None] = [None] * world
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)


def error_text(err: BaseException) -> str:
    traceback.print_exception(err, file=sys.stderr)
    return " ".join(f"{type(err).__name__}: {err}".split())[:500]


def reference_outputs(inputs: InputSet, nd: int | None, weights: ExpertWeights, device: torch.device,
                      with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """moe_dense_ref (fp32, token chunks) of the routed experts: output and, if asked, dL/dx."""
    from occult.kernels.reference import moe_dense_ref

    w_gate_up = weights.w_gate_up_E2FD.to(device=device, dtype=torch.float32)
    w_down = weights.w_down_EDF.to(device=device, dtype=torch.float32)
    ids, gate = inputs.routes[nd]
    x = inputs.x_TD.float().detach().requires_grad_(with_grad)
    outputs = []
    for start in range(0, x.shape[0], REF_CHUNK_TOKENS):
        part = slice(start, start + REF_CHUNK_TOKENS)
        y = moe_dense_ref(x[part], ids[part], gate[part].float(), w_gate_up, w_down)
        if with_grad:
            (y * inputs.dy_TD[part].float()).sum().backward()
        outputs.append(y.detach())
    return torch.cat(outputs), (x.grad if with_grad else None)


def relative_error(method: Method, inputs: InputSet, nd: int | None, reference: tuple[torch.Tensor, torch.Tensor | None],
                   world: int) -> float:
    """max |y - ref| / max |ref| over ranks (and the same for dL/dx when the reference has it)."""
    ids, gate = inputs.routes[nd]
    want_y, want_gx = reference
    x = inputs.x_TD.detach().requires_grad_(want_gx is not None)
    y = method.forward(x, ids, gate)
    stats = [(y.detach().float() - want_y).abs().max(), want_y.abs().max()]
    if want_gx is not None:
        y.backward(inputs.dy_TD)
        stats += [(x.grad.float() - want_gx).abs().max(), want_gx.abs().max()]
    for p in method.expert_parameters():
        p.grad = None
    values = torch.stack([s.float() for s in stats])
    if world > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    pairs = values.view(-1, 2).tolist()
    return max(err / max(scale, 1e-30) for err, scale in pairs)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


HOST_PROBE_ITERS = 4000     # ≈ 0.2 ms of pure Python on the lent H200 machines' CPUs


def host_probe_us(iters: int = HOST_PROBE_ITERS) -> float:
    """Microseconds of a fixed pure-Python loop (no torch, no GPU): the host CPU's single-thread speed
    now. On the lent H200 VMs it moved 1.0 -> 2.1 ms per 20k iterations within seconds, and an eager
    layer call's host time moved with it (`workflow/scripts/host_probe.py`,
    `results/nvidia-h200/host_probe_v1`); the simulator scales host terms by it (docs/simulator.md)."""
    begin = time.perf_counter()
    total = 0
    for i in range(iters):
        total += i * i % 7
    return 1e6 * (time.perf_counter() - begin)


HOST_LAUNCHES = 20
_LAUNCH_SCRATCH: dict[torch.device, torch.Tensor] = {}


def host_launch_us(device: torch.device, launches: int = HOST_LAUNCHES) -> float:
    """Microseconds to issue `launches` in-place adds on a one-element tensor of `device` (the ops
    are drained after the clock stops): the dispatcher and driver launch path at this moment."""
    scratch = _LAUNCH_SCRATCH.setdefault(device, torch.zeros(1, device=device))
    begin = time.perf_counter()
    for _ in range(launches):
        scratch.add_(1.0)
    elapsed = time.perf_counter() - begin
    synchronize(device)
    return 1e6 * elapsed


def _run_blocks(step: Callable[[int], None], blocks: Sequence[range], device: torch.device,
                world: int) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """Per block: the GPU drained and the ranks met, the host probed (`host_probe_us`,
    `host_launch_us`), then its steps issued back to back; returns each block's milliseconds per
    step (CUDA events; `perf_counter` on the CPU), host milliseconds per step (from the first call
    until the last returns: a sync inside a step counts, GPU work still queued at the end does not)
    and the probes' microseconds."""
    times: list[float] = []
    hosts: list[float] = []
    probes: list[tuple[float, float]] = []
    for block in blocks:
        synchronize(device)
        if world > 1:
            dist.barrier()
        probes.append((host_probe_us(), host_launch_us(device)))
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        begin = time.perf_counter()
        for i in block:
            step(i)
        host = 1e3 * (time.perf_counter() - begin)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = host
        times.append(elapsed / len(block))
        hosts.append(host / len(block))
    return times, hosts, probes


def _max_over_ranks(times: list[float], hosts: list[float], probes: list[tuple[float, float]], device: torch.device,
                    world: int, host_times: list[float] | None,
                    host_probes: list[tuple[float, float]] | None) -> list[float]:
    python_us, launch_us = zip(*probes) if probes else ((), ())
    values = torch.tensor([times, hosts, list(python_us), list(launch_us)], dtype=torch.float64,
                          device=device if device.type == "cuda" else "cpu")
    if world > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    if host_times is not None:
        host_times.extend(values[1].tolist())
    if host_probes is not None:
        host_probes.extend(zip(values[2].tolist(), values[3].tolist()))
    return values[0].tolist()


def time_steps(step: Callable[[int], None], steps: int, warmup: int, device: torch.device,
               world: int, host_times: list[float] | None = None,
               host_probes: list[tuple[float, float]] | None = None) -> list[float]:
    """Milliseconds of each timed step (after `warmup`), the GPU drained before every step, max over
    ranks. If `host_times` is given, it receives each timed step's host milliseconds (max over ranks);
    `host_probes`, the host probes' microseconds (Python loop, launches) before each timed step."""
    _run_blocks(step, [range(i, i + 1) for i in range(warmup)], device, world)
    times, hosts, probes = _run_blocks(step, [range(i, i + 1) for i in range(warmup, warmup + steps)], device, world)
    return _max_over_ranks(times, hosts, probes, device, world, host_times, host_probes)


def time_stream(step: Callable[[int], None], steps: int, warmup: int, device: torch.device,
                world: int, host_times: list[float] | None = None,
                host_probes: list[tuple[float, float]] | None = None) -> list[float]:
    """Milliseconds per step of `STREAM_BLOCKS` blocks of `steps` steps issued back to back (the GPU
    drained, and ranks met, only before each block; max over ranks): the steady rate of consecutive
    layer calls. `host_times` receives each block's host milliseconds per step, `host_probes` the
    host probes' microseconds before each block."""
    for i in range(warmup):
        step(i)
    blocks = [range(warmup + b * steps, warmup + (b + 1) * steps) for b in range(STREAM_BLOCKS)]
    times, hosts, probes = _run_blocks(step, blocks, device, world)
    return _max_over_ranks(times, hosts, probes, device, world, host_times, host_probes)


def interleaved_ab(steps: dict[tuple, Callable[[], None]], rounds: int, warmup: int, device: torch.device,
                   out_csv: Path, key_columns: Sequence[str], progress_every: int = 50) -> None:
    """Time several variants with the host's speed held fixed (one GPU, one process): warm each step up,
    then per round (the order reversed every other round, so that no variant is always first) time
    every step as `time_steps` does (the GPU drained, CUDA events around it, its own host time), after
    one launch probe (`host_launch_us`) per round. Writes `out_csv` (columns round, *key_columns,
    host_us, step_us, host_launch_us; one row per step) atomically."""
    import csv
    import time

    for step in steps.values():
        for _ in range(warmup):
            step()
    torch.cuda.synchronize(device)
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows, began = [], time.monotonic()
    for round_ in range(rounds):
        launch_us = host_launch_us(device)
        for key in (list(steps) if round_ % 2 == 0 else list(reversed(steps))):
            torch.cuda.synchronize(device)
            start_event.record()
            t0 = time.perf_counter()
            steps[key]()
            host_us = 1e6 * (time.perf_counter() - t0)
            end_event.record()
            end_event.synchronize()
            rows.append((round_, *key, round(host_us, 1), round(1e3 * start_event.elapsed_time(end_event), 1),
                         round(launch_us, 1)))
        if round_ % progress_every == 0:
            print(f"round {round_}/{rounds} ({time.monotonic() - began:.0f} s)", flush=True)
    tmp = out_csv.with_suffix(".tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["round", *key_columns, "host_us", "step_us", "host_launch_us"])
        writer.writerows(rows)
    tmp.replace(out_csv)


def train_step(method: Method, x_TD: torch.Tensor, ids_TK: torch.Tensor, gate_TK: torch.Tensor,
               shared: torch.nn.Module | None, dy_TD: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """One training step as the sweep times it: gradients cleared, the layer (plus the shared expert)
    forward on fresh leaves, backward from `dy_TD` (`-compute` returns the received rows' outputs
    [R, d]: any upstream gradient will do there)."""
    for p in params:
        p.grad = None
    x = x_TD.detach().requires_grad_()
    gate = gate_TK.detach().requires_grad_()
    y = method.forward(x, ids_TK, gate)
    if shared is not None:
        y = y + shared(x)
    y.backward(dy_TD if y.shape == dy_TD.shape else torch.ones_like(y))


def profile_host(step: Callable[[int], None], steps: int, device: torch.device, world: int, rank: int,
                 out_txt: Path, top: int = 40) -> None:
    """Run `steps` more steps under cProfile (the GPU drained before each, as in `time_steps`) and
    write rank 0's Python-side profile to `out_txt`: the `top` functions by own time, then by
    cumulative time. cProfile slows Python code, so the shares are what it is for, not the times."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    for i in range(steps):
        synchronize(device)
        if world > 1:
            dist.barrier()
        profiler.enable()
        step(i)
        profiler.disable()
    synchronize(device)
    if rank != 0:
        return
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"# {steps} steps, rank 0; host seconds per step = totals / {steps}\n")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    out_txt.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_txt.with_suffix(".tmp")
    tmp.write_text(text.getvalue())
    tmp.replace(out_txt)


def phase_medians(events: list[tuple[torch.cuda.Event, ...]], device: torch.device, world: int) -> dict[str, float]:
    """Median ms of dispatch (plan, counts, sync, pack, all-to-all, BRIM_1), expert kernels and
    return + combine over the timed steps, each the max over ranks of the rank's median."""
    torch.cuda.synchronize(device)
    spans = [[a.elapsed_time(b) for a, b in zip(ev[:-1], ev[1:])] for ev in events]
    medians = torch.tensor([statistics.median(col) for col in zip(*spans)], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(("dispatch_ms", "experts_ms", "combine_ms"), medians.tolist()))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# ----------------------------------------------------------------------------------------------
# Provenance


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def machine_name(device: torch.device, world: int) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} x{world}"
    return f"cpu {platform.machine()} x{world}"


def machine_slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def default_out_csv(kind: str, device: str, world: int) -> Path:
    from occult.provenance import REPO_ROOT

    if device == "cuda" and torch.cuda.is_available():
        name = machine_name(torch.device("cuda", torch.cuda.current_device()), world)
    else:
        name = machine_name(torch.device("cpu"), world) if device == "cpu" else f"{device} x{world}"
    return REPO_ROOT / "results" / machine_slug(name) / f"sweep_{kind}_D{world}.csv"


# ----------------------------------------------------------------------------------------------
# The sweep


def occult_options(name: str) -> frozenset[str]:
    """The `-option`s of a method name (empty for baselines)."""
    return parse_method(name).options


def build_method(name: str, placement: torch.Tensor | None, backend: str) -> Method:
    if parse_method(name).is_occult:
        options = occult_options(name)
        if "trivial" in options and placement is not None:
            from occult.ep.plan import contiguous_placement

            placement = contiguous_placement(placement.numel(), int(placement.max()) + 1)
        method = OccultEP(placement, backend, options)
        method.name = name
        return method
    return make_method(name)


def method_skip_reason(name: str, method: Method, shape: MoEShape, world: int) -> str | None:
    ok, reason = method.available()
    if not ok:
        return f"unavailable: {reason}"
    why = method.supports(shape, world)
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


def run_sweep(
    kind: str,
    shapes: Sequence[str],
    methods: Sequence[str],
    D: int,
    tokens_list: Sequence[int],
    out_csv: str | Path,
    repeats: int = 20,
    warmup: int = 5,
    **options: Any,
) -> list[dict[str, Any]]:
    """Run one sweep on every rank of the default process group (D ranks, or none for D=1).

    `tokens_list` are the sizes of the kind: tokens per GPU (prefill), batch = tokens per GPU
    (decode), batch of `seq_len`-token sequences (train). `options` are the other fields of
    `SweepSettings` (device, dtype, seed, seq_len, input_sets, check_tokens, occult_backend,
    include_shared, command). Rank 0 writes `out_csv` (+ `.meta.json`) and prints a table;
    every rank returns the rows.
    """
    settings = SweepSettings(kind=kind, shapes=tuple(shapes), methods=tuple(methods), world=D,
                             sizes=tuple(tokens_list), out_csv=str(out_csv), repeats=repeats, warmup=warmup,
                             **options)
    settings.validate()
    return _sweep(settings)


def _sweep(settings: SweepSettings) -> list[dict[str, Any]]:
    from occult.config import config_hash
    from occult.logs import progress
    from occult.provenance import git_commit, provenance, seed_everything

    world, rank = world_and_rank(None)
    if world != settings.world:
        raise SweepError(f"D: {settings.world} given but the process group has {world} ranks")
    if settings.device == "cuda":
        if not torch.cuda.is_available():
            raise SweepError("device: cuda requested but torch sees no GPU (use --device cpu)")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dtype = DTYPES[settings.dtype]
    backend = settings.occult_backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    seed_everything(settings.seed)

    machine = machine_name(device, world)
    fixed = {
        "machine": machine, "commit": git_commit(), "command": settings.command, "kind": settings.kind,
        "D": world, "seq_len": settings.seq_len if settings.kind == "train" else None, "dtype": settings.dtype,
        "repeats": settings.repeats, "warmup": settings.warmup,
        "timer": "cuda_events" if device.type == "cuda" else "perf_counter", "timing": settings.timing,
        **{f"version_{name.replace('-', '_')}": package_version(name) for name in VERSION_PACKAGES},
    }
    meta = provenance(config_hash(dataclasses.asdict(settings)), settings.seed, stage="sweep",
                      settings=dataclasses.asdict(settings), occult_backend=backend, machine=machine,
                      note="one row per (shape, method, size); times are per-step max over ranks")
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append({column: row.get(column) for column in COLUMNS})
        if rank == 0:
            import pandas as pd

            from occult.provenance import write_csv

            write_csv(settings.out_csv, pd.DataFrame(rows, columns=list(COLUMNS)), meta=meta)

    total = len(settings.shapes) * len(settings.methods) * len(settings.sizes)
    bar = progress(total, desc=f"sweep {settings.kind} D={world}", unit="point", disable=rank != 0, every_s=0)
    for shape_name in settings.shapes:
        shape = get_shape(shape_name)
        _sweep_shape(settings, shape, device, dtype, backend, fixed, emit, bar)
    bar.close()
    if rank == 0:
        print_table(rows)
    return rows


def _sweep_shape(settings: SweepSettings, shape: MoEShape, device: torch.device, dtype: torch.dtype,
                 backend: str, fixed: dict[str, Any], emit: Callable[[dict[str, Any]], None], bar) -> None:
    world, rank = world_and_rank(None)
    train = settings.kind == "train"
    weights = ExpertWeights.random(shape, derive_seed(settings.seed, "experts", shape.name), device, dtype)
    weights = ExpertWeights(weights.w_gate_up_E2FD.cpu(), weights.w_down_EDF.cpu())
    shared = (SharedExpert(shape, settings.seed, device, dtype)
              if settings.include_shared and shape.shared_ffn else None)
    router = make_router(settings, shape)
    wants_occult = any(parse_method(m).is_occult for m in settings.methods)
    placement = (occult_placement(shape, router, world, settings.seed)
                 if wants_occult and shape.num_experts % world == 0 else None)
    shape_fields = {"shape": shape.name, "num_experts": shape.num_experts, "top_k": shape.top_k,
                    "hidden": shape.hidden, "ffn": shape.ffn,
                    "shared_ffn": shape.shared_ffn if shared is not None else 0}

    balanced = (occult_placement(shape, router, world, settings.seed, balanced=True)
                if placement is not None and any("balanced" in occult_options(m) for m in settings.methods) else None)
    methods = {name: build_method(name, balanced if "balanced" in occult_options(name) else placement, backend)
               for name in settings.methods}
    skip = {name: method_skip_reason(name, m, shape, world) for name, m in methods.items()}
    routes = sorted({routing_key(n) for n in settings.methods if skip[n] is None} - {None})
    check = make_inputs(shape, router, settings.check_tokens,
                        derive_seed(settings.seed, "check", shape.name, rank), device, dtype,
                        routes, placement, with_grad_output=train)
    references = {nd: reference_outputs(check, nd, weights, device, with_grad=train)
                  for nd in (None, *routes)}
    tolerance = REL_TOLERANCE[settings.dtype]

    for name, method in methods.items():
        base = {**fixed, **shape_fields, "method": name, "routing": settings.routing}
        status = skip[name]
        max_rel_err = None
        if status is None:
            error = None
            try:
                method.setup(shape, None, dtype, device, weights)
            except Exception as err:  # noqa: BLE001 - recorded in the row and on stderr
                error = error_text(err)
            error = agree(error, world)
            if error:
                status = f"error: setup: {error}"
        if status is None and getattr(method, "checks_output", True):
            error = None
            try:
                max_rel_err = relative_error(method, check, routing_key(name), references[routing_key(name)], world)
            except Exception as err:  # noqa: BLE001
                error = error_text(err)
            error = agree(error, world)
            if error:
                status = f"error: check: {error}"
            elif not max_rel_err <= tolerance:
                status = f"failed: max_rel_err {max_rel_err:.3g} > {tolerance:g}"
        for size in settings.sizes:
            row = {**base, "tokens_per_gpu": settings.tokens_per_gpu(size), "batch": settings.batch(size),
                   "max_rel_err": max_rel_err}
            if status is None:
                row.update(_measure(settings, shape, name, method, shared, router, placement, size,
                                    device, dtype, world, rank))
            else:
                row["status"] = status
            emit(row)
            bar.log(shape=shape.name, method=name, size=size, status=row.get("status"),
                    median_ms=row.get("median_ms"))
            bar.update(1)
        method.teardown()
        # Free the method before the next is measured: its leftovers would count in the next peak memory.
        # The collection also frees make_graphed_callables' graphs, which sit in reference cycles; NCCL
        # keeps communicators alive while a graph that captured them exists, so the process group's
        # teardown waited on them until killed (results/nvidia-h200-x2/ep_v6, train kind with occult-graph).
        methods[name] = None
        del method
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _measure(settings: SweepSettings, shape: MoEShape, name: str, method: Method, shared: SharedExpert | None,
             router: Any, placement: torch.Tensor | None, size: int, device: torch.device,
             dtype: torch.dtype, world: int, rank: int) -> dict[str, Any]:
    """Time one method at one size; returns the measured columns and the status."""
    train = settings.kind == "train"
    tokens = settings.tokens_per_gpu(size)
    nd = routing_key(name)
    out: dict[str, Any] = {}
    error = None
    sets: list[InputSet] = []
    try:
        sets = [make_inputs(shape, router, tokens,
                            derive_seed(settings.seed, settings.kind, shape.name, tokens, index, rank),
                            device, dtype, [nd], placement, with_grad_output=train)
                for index in range(settings.input_sets)]
        first_ids, first_weights = sets[0].routes[nd]
        if isinstance(method, OccultEP):
            out["bytes_sent"], out["mean_devices_per_token"], out["pairs_received_max"] = method.traffic(
                first_ids, sets[0].x_TD, first_weights)
            phases = device.type == "cuda" and not train and not (method.graphed or method.compute_only)
            method.phase_events = [] if phases else None
        else:
            out["bytes_sent"] = method.bytes_sent(first_ids)
        params = method.expert_parameters() + (list(shared.parameters()) if shared is not None else [])

        def step(i: int) -> None:
            inputs = sets[i % len(sets)]
            ids, gate = inputs.routes[nd]
            if train:
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
            profile_host(step, settings.repeats, device, world, rank, Path(settings.host_profile)
                         / f"host_{settings.kind}_{shape.name}_{name}_{size}.txt")
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


def print_table(rows: list[dict[str, Any]]) -> None:
    """Median ms per (shape, method) × size, and the status of rows that did not run."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    if frame.empty:
        return
    size_col = "tokens_per_gpu" if frame["batch"].isna().all() else "batch"
    ok = frame[frame["status"] == "ok"]
    if not ok.empty:
        table = ok.pivot_table(index=["shape", "method"], columns=size_col, values="median_ms", aggfunc="first")
        print(f"\nmedian ms per step ({frame['kind'].iloc[0]}, D={frame['D'].iloc[0]}, columns = {size_col}):")
        print(table.to_string(float_format=lambda v: f"{v:.3f}"))
    others = frame[frame["status"] != "ok"].drop_duplicates(["shape", "method", "status"])
    for _, row in others.iterrows():
        print(f"{row['shape']:>12} {row['method']:<12} {row['status']}")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=KINDS, default="prefill")
    parser.add_argument("--shapes", nargs="+", default=["olmoe", "qwen", "deepseek"])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        help="occult, occult-nd<N>, or baselines: " + ", ".join(METHOD_CLASSES))
    parser.add_argument("--D", type=int, default=None, help="EP group size (default: torchrun's world size, else 1)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="tokens per GPU (prefill) or batch (decode, train); default per kind")
    parser.add_argument("--out", type=Path, default=None, help="CSV (default results/<machine>/sweep_<kind>_D<D>.csv)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence of the train kind")
    parser.add_argument("--input-sets", type=int, default=3, help="pre-generated input sets rotated over steps")
    parser.add_argument("--check-tokens", type=int, default=64, help="tokens per rank of the correctness check")
    parser.add_argument("--occult-backend", choices=("auto", "torch", "triton"), default="auto")
    parser.add_argument("--no-shared", action="store_true", help="leave out the shapes' shared experts")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout")
    parser.add_argument("--routing", choices=ROUTINGS, default="synthetic",
                        help="synthetic low-rank router, uniform, or a measured trace (--trace)")
    parser.add_argument("--trace", default="", help="routing_*.npz of occult.routing.profiling (routing=trace)")
    parser.add_argument("--timing", choices=TIMINGS, default="step",
                        help="step: the GPU drained before each timed step (default); stream: "
                             f"{STREAM_BLOCKS} blocks of --repeats steps issued back to back, ms per step")
    parser.add_argument("--host-profile", default="", metavar="DIR",
                        help="after each timed row, profile as many more steps with cProfile into "
                             "DIR/host_<kind>_<shape>_<method>_<size>.txt (rank 0)")
    parser.add_argument("--log-json", metavar="PATH",
                        help="append JSON-lines logs here (default: $OCCULT_LOG_JSON); read by the entry point")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from occult.harness.ranks import launched_by_torchrun, run_in_group

    args = build_parser().parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SweepError("device: cuda requested but torch sees no GPU (use --device cpu)")
    torchrun = launched_by_torchrun()
    if torchrun and args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))   # before any CUDA call
    world = args.D if args.D is not None else int(os.environ.get("WORLD_SIZE", "1"))
    launcher = f"torchrun(nproc={os.environ['WORLD_SIZE']}) " if torchrun else ""
    command = launcher + " ".join(["python -m occult.harness.sweep", *(argv if argv is not None else sys.argv[1:])])
    settings = SweepSettings(
        kind=args.kind, shapes=tuple(args.shapes), methods=tuple(args.methods), world=world,
        sizes=tuple(args.sizes or DEFAULT_SIZES[args.kind]),
        out_csv=str(args.out or default_out_csv(args.kind, args.device, world)),
        repeats=args.repeats, warmup=args.warmup, device=args.device, dtype=args.dtype, seed=args.seed,
        seq_len=args.seq_len, input_sets=args.input_sets, check_tokens=args.check_tokens,
        occult_backend=args.occult_backend, include_shared=not args.no_shared, command=command,
        routing=args.routing, trace=args.trace, host_profile=args.host_profile, timing=args.timing,
    )
    settings.validate()
    run_in_group(lambda: _sweep(settings), args.device, world, args.timeout_s, error=SweepError)
    return 0


if __name__ == "__main__":
    from occult.logs import run_main

    sys.exit(run_main("sweep", main))
