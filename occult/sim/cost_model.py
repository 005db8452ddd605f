"""Time of one EP MoE layer call, as the runtime spends it, from measured parameters.

GPU time G = expert kernels (the busiest device's pairs at the measured kernel throughput for the
call's work, plus its active experts' weight reads, never below a latency floor) + the other GPU
work (plan, pack, combine: per handled row for Occult, per pair for the naive EP) + the
all-to-alls (measured curve of bytes per rank) + the shared expert (dense FLOPs). An eager layer
is also host-bound: the host spends `pre` before the layer's one blocking sync (the GPU idles:
nothing big is queued yet) and `post` launching what follows while the GPU works, so

    t = pre + max(post, G)        (eager: occult, -static, naive)      t = G   (`-graph`, `-compute`)

`CostModel` holds every parameter; `occult.sim.calibration` fills the fitted ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from occult.shapes import MoEShape
from occult.method_names import FAMILIES, MethodNameError, MethodSpec, parse_method
from occult.sim.builtin_alltoall import builtin_alltoall_table
from occult.sim.columns import SimulateError
from occult.sim.traffic import Traffic

EAGER_FAMILIES = ("occult", "occult-pe", "occult-static", "naive")
# Bytes the naive EP's memory-bound ops move per (token, expert) pair, in units of d (`occult.harness.baselines.naive`):
# D = 1: gather x[token] 4 + y.float() 6 + × gate 8 + index_add 12 = 30; D > 1 adds the regrouping
# gathers x_RD[perm] and y[inverse] (4 + 4). The extra work is priced at the D = 1 rate.
NAIVE_BYTES_D1, NAIVE_BYTES_EP = 30.0, 38.0


@dataclass(frozen=True)
class LogLogCurve:
    """y(x) interpolated linearly in (log x, log y) between measured points; held flat below the
    first point (a latency floor) and extended at the last point's ratio above the last
    (`extend="proportional"`: time ∝ bytes at the best measured bandwidth) or flat (`"flat"`)."""

    x: np.ndarray
    y: np.ndarray
    extend: str = "proportional"

    def __post_init__(self) -> None:
        if len(self.x) < 1 or len(self.x) != len(self.y) or np.any(np.diff(self.x) <= 0):
            raise SimulateError("curve: need ≥1 point with strictly increasing sizes")
        if np.any(np.asarray(self.x) <= 0) or np.any(np.asarray(self.y) <= 0):
            raise SimulateError("curve: sizes and values must be positive")

    def __call__(self, value: float) -> float:
        if value <= self.x[0]:
            return float(self.y[0])
        if value >= self.x[-1]:
            return float(self.y[-1] * (value / self.x[-1] if self.extend == "proportional" else 1.0))
        return float(np.exp(np.interp(np.log(value), np.log(self.x), np.log(self.y))))

    def many(self, values: np.ndarray) -> np.ndarray:
        """`self(v)` for every element of `values` (any shape), vectorised."""
        values = np.asarray(values, dtype=np.float64)
        inside = np.exp(np.interp(np.log(np.clip(values, self.x[0], self.x[-1])), np.log(self.x), np.log(self.y)))
        above = self.y[-1] * (values / self.x[-1] if self.extend == "proportional" else 1.0)
        return np.where(values >= self.x[-1], above, inside)


def builtin_alltoall_curve() -> LogLogCurve:
    """The shipped 2-GPU table (`occult.sim.builtin_alltoall`) as time vs remote bytes per rank
    (half of each buffer is remote)."""
    table = builtin_alltoall_table()
    remote = np.array([size / 2 for size, _ in table], dtype=np.float64)
    ms = np.array([size / (gbps * 1e9) * 1e3 for size, gbps in table])
    return LogLogCurve(remote, ms)


@dataclass(frozen=True)
class LinkModel:
    """All-to-all time: NVLink curves by measured D (remote bytes per rank → ms) inside a node of
    `gpus_per_node`; between nodes `latency + bytes / bandwidth` per GPU; the two concurrently."""

    curves: dict[int, LogLogCurve]
    gpus_per_node: int
    inter_node_bytes_per_ms: float
    inter_node_latency_ms: float

    def curve_for(self, num_devices: int) -> LogLogCurve:
        measured = sorted(self.curves)
        below = [d for d in measured if d <= num_devices]
        return self.curves[below[-1] if below else measured[0]]

    def alltoall_ms(self, bytes_SD: np.ndarray) -> float:
        num_devices = bytes_SD.shape[0]
        if num_devices == 1:
            return 0.0
        node_D = np.arange(num_devices) // self.gpus_per_node
        same_node = node_D[:, None] == node_D[None, :]
        intra = bytes_SD * (same_node & ~np.eye(num_devices, dtype=bool))
        inter = bytes_SD * ~same_node
        intra_D = np.maximum(intra.sum(1), intra.sum(0))
        inter_D = np.maximum(inter.sum(1), inter.sum(0))
        curve = self.curve_for(min(num_devices, self.gpus_per_node))
        worst = 0.0
        for intra_bytes, inter_bytes in zip(intra_D, inter_D):
            t_intra = curve(intra_bytes) if intra_bytes > 0 else 0.0
            t_inter = self.inter_node_latency_ms + inter_bytes / self.inter_node_bytes_per_ms if inter_bytes > 0 else 0.0
            worst = max(worst, t_intra, t_inter)
        return worst

    def latency_ms(self, num_devices: int) -> float:
        """A tiny all-to-all (the split-size exchange)."""
        return 0.0 if num_devices == 1 else self.curve_for(min(num_devices, self.gpus_per_node))(1.0)


def method_spec(name: str) -> MethodSpec:
    """The spec of a simulated method: `naive` or an Occult name (`occult.method_names`)."""
    try:
        spec = parse_method(name)
    except MethodNameError as err:
        raise SimulateError(f"method: {err}") from None
    if spec.family not in FAMILIES:
        raise SimulateError(f"method: {name!r} is not simulated (only naive and occult[-...] are)")
    return spec


def mode_of(method: str) -> tuple[str, int | None]:
    """(dispatch mode, N_d) of a method name."""
    spec = method_spec(method)
    return spec.mode, spec.max_devices


def pass_of(kind: str) -> str:
    return "train" if kind == "train" else "fwd"


@dataclass(frozen=True)
class HostTerms:
    """Host time of one eager layer call: `pre_ms` before its blocking sync, `post_ms` after it."""

    pre_ms: float
    post_ms: float
    points: int
    source: str                 # "fit on N points" or where the terms were borrowed from


@dataclass(frozen=True)
class OtherGpuTerms:
    """Occult's GPU work besides kernels and NCCL (plan, pack, combine): fixed + per handled row.
    fwd+bwd: its own fixed + per-row terms where the calibration holds fwd+bwd graph rows of ≥ 2
    sizes (the backward's row-gradient combine and gate-gradient scatter are per-row work),
    else `train_factor` × forward (one size measures only a ratio)."""

    fixed_ms: float
    per_row_ns: float
    train_factor: float | None      # None: no fwd+bwd graph row calibrated it
    points: int
    train_fixed_ms: float | None = None
    train_per_row_ns: float | None = None

    def train_known(self) -> bool:
        return self.train_per_row_ns is not None or self.train_factor is not None

    def at(self, rows: np.ndarray, train: bool, per_row_ns: float | None = None) -> np.ndarray:
        """ms of other GPU work for `rows` handled rows (`per_row_ns` overrides the forward rate)."""
        rate = self.per_row_ns if per_row_ns is None else per_row_ns
        if not train:
            return self.fixed_ms + rows * rate * 1e-6
        if self.train_per_row_ns is not None:       # another forward rate (per_expert) shifts the forward part
            return (self.train_fixed_ms or 0.0) + rows * (self.train_per_row_ns + rate - self.per_row_ns) * 1e-6
        factor = float("nan") if self.train_factor is None else self.train_factor
        return (self.fixed_ms + rows * rate * 1e-6) * factor


def calibrated_d(known: Sequence[int], num_devices: int) -> int | None:
    """`num_devices` where calibrated, else the largest calibrated D below it, else None."""
    below = [d for d in known if d <= num_devices]
    return max(below) if below else None


@dataclass(frozen=True)
class CostModel:
    """Every measured parameter of the time model; host/other-GPU terms are filled by `calibrate`."""

    link: LinkModel
    kernel_tflops: LogLogCurve | None           # Occult kernels, fwd TFLOP/s vs the call's forward GFLOP
    kernel_train_scale: float | None            # Occult kernels, fwd+bwd time / fwd time (same pairs)
    grouped_tflops: dict[tuple[str, str], LogLogCurve]   # (pass, shape) -> naive grouped GEMM TFLOP/s vs GFLOP
    dense_tflops: float
    hbm_bytes_per_ms: float = math.inf                  # weight reads of small batches (None in config: no floor)
    kernel_floor_ms: float = 0.0                # Occult expert kernels' latency floor above their weight reads
    # the rate at which latency-bound (small) Occult expert calls stream their weights
    # (simulate.kernel_stream_gbps; inf: at hbm_bytes_per_ms)
    kernel_stream_bytes_per_ms: float = math.inf
    other_gpu: OtherGpuTerms | None = None
    naive_ns_per_pair: dict[str, float] = dataclasses.field(default_factory=dict)   # pass -> ns at D = 1
    pe_per_row_ns: float | None = None          # per_expert rows' other GPU work (None: the dedup rate)
    host: dict[tuple[str, str, int], HostTerms] = dataclasses.field(default_factory=dict)
    # fwd+bwd kernels' own curve (forward GFLOP per ms of fwd+bwd time vs the call's forward GFLOP),
    # where the calibration's fwd+bwd `-compute` rows span >= 2 sizes; else the one scale above
    kernel_train_tflops: LogLogCurve | None = None
    # the same two curves per expert width F, where the calibration's `-compute` rows span >= 2 widths
    # (a grouped GEMM's rate depends on its tile shapes, not only on its work); other widths use the
    # pooled curves above
    kernel_tflops_by_ffn: dict[int, LogLogCurve] = dataclasses.field(default_factory=dict)
    kernel_train_tflops_by_ffn: dict[int, LogLogCurve] = dataclasses.field(default_factory=dict)
    # pass -> the shared expert's measured time over `shared_expert_ms` at scale 1 (`shared_scales`;
    # a pass without A/B rows: 1)
    shared_scale: dict[str, float] = dataclasses.field(default_factory=dict)
    # pass -> host ms per op the shared expert launches (`shared_host_per_launch`; none measured: 0)
    shared_host_per_launch_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    # pass -> shape name -> the shared expert's host ms as measured for that shape (`shared_host_per_launch`)
    shared_host_by_shape_ms: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    # (pass, D) -> host ms of launching a CUDA-graph replay, before its GPU work starts
    # (`graph_replay_host`; no `host_ms` in the calibration: 0)
    graph_host_ms: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    # (family, kind, D, shape name) -> that shape's host ms above (or below) its family's eager terms
    # at the same D, at the typical host speed (`calibrate_shape_host`; not calibrated: 0)
    host_shape_ms: dict[tuple[str, str, int, str], float] = dataclasses.field(default_factory=dict)

    def graph_host_for(self, pass_: str, num_devices: int) -> float:
        """The replay launch's host ms at this D, else at the largest calibrated D below it, else 0."""
        d = calibrated_d([d for p, d in self.graph_host_ms if p == pass_], num_devices)
        return 0.0 if d is None else self.graph_host_ms[(pass_, d)]

    def host_shape_for(self, family: str, kind: str, num_devices: int, shape: str) -> float:
        """The shape's host offset at the D whose family terms `host_for` uses (none: 0)."""
        d = calibrated_d([d for f, p, d in self.host if f == family and p == pass_of(kind)], num_devices)
        return 0.0 if d is None else self.host_shape_ms.get((family, kind, d, shape), 0.0)

    @property
    def stream_bytes_per_ms(self) -> float:
        """Weight-streaming rate of latency-bound expert calls: measured, else the HBM rate."""
        return self.kernel_stream_bytes_per_ms if math.isfinite(self.kernel_stream_bytes_per_ms) else self.hbm_bytes_per_ms

    def shared_host_ms(self, shape: MoEShape, pass_: str) -> float:
        """Host time of launching the shared expert(s) of `shape` eagerly (after the layer's sync): as
        measured for this shape where the A/B has it, else its launches × the pass's ms per launch."""
        if not shape.shared_ffn:
            return 0.0
        measured = self.shared_host_by_shape_ms.get(pass_, {})
        if shape.name in measured:
            return measured[shape.name]
        return shared_launches(shape, pass_) * self.shared_host_per_launch_ms.get(pass_, 0.0)

    def shared_ms(self, shape: MoEShape, tokens_per_gpu: float, pass_: str) -> float:
        """The shared expert(s) of `shape` at this size and pass, as the layer is priced."""
        return shared_expert_ms(shape, tokens_per_gpu, pass_, self.dense_tflops, self.hbm_bytes_per_ms,
                                self.shared_scale.get(pass_, 1.0))

    def kernel_curve(self, ffn: int, train: bool = False) -> LogLogCurve | None:
        """The Occult kernels' curve for experts of width `ffn`: forward, or fwd+bwd (None where
        fwd+bwd has no curve of its own and is priced as a scale of the forward)."""
        if train:
            return self.kernel_train_tflops_by_ffn.get(ffn, self.kernel_train_tflops)
        return self.kernel_tflops_by_ffn.get(ffn, self.kernel_tflops)

    def host_for(self, family: str, pass_: str, num_devices: int) -> HostTerms | None:
        """The calibrated terms at this D, else at the largest calibrated D below it (documented
        assumption for D > 2: the same collectives and one sync per call), else None."""
        d = calibrated_d([d for f, p, d in self.host if f == family and p == pass_], num_devices)
        if d is None:
            return None
        terms = self.host[(family, pass_, d)]
        return terms if d == num_devices else dataclasses.replace(terms, source=f"D={d} terms ({terms.source})")

    def missing(self, spec: MethodSpec, pass_: str, num_devices: int) -> str | None:
        """None, or which measured parameter this method lacks."""
        if spec.family == "naive":
            if pass_ not in self.naive_ns_per_pair:
                return f"uncalibrated: no naive {pass_} points in simulate.calibration"
            if not self.grouped_tflops:
                return "uncalibrated: simulate.gemm_csv (grouped-GEMM curve) is not set"
        else:
            if self.kernel_tflops is None or (pass_ == "train" and self.kernel_train_scale is None):
                return f"uncalibrated: no occult-compute {pass_} rows in simulate.calibration"
            if spec.family != "occult-compute" and (self.other_gpu is None or (
                    pass_ == "train" and not self.other_gpu.train_known())):
                return f"uncalibrated: no occult-graph {pass_} rows in simulate.calibration"
        if spec.family in EAGER_FAMILIES and self.host_for(spec.family, pass_, num_devices) is None:
            return f"uncalibrated: no {spec.family} {pass_} points at D ≤ {num_devices} in simulate.calibration"
        return None


def expert_flops_per_pair(shape: MoEShape) -> float:
    """SwiGLU expert FLOPs of one (token, expert) pair, forward: 2·d·2F + 2·F·d."""
    return 2.0 * 3.0 * shape.hidden * shape.ffn


# Passes over an expert's weights per layer call: forward reads them; fwd+bwd reads them again for
# dx and writes dW (in the activation dtype).
WEIGHT_PASSES = types.MappingProxyType({"fwd": 1.0, "train": 3.0})


def expert_weight_bytes(shape: MoEShape, ffn: int | None = None, elem_bytes: int = 2) -> float:
    """Bytes of one SwiGLU expert's weights (gate, up, down)."""
    return 3.0 * shape.hidden * (shape.ffn if ffn is None else ffn) * elem_bytes


def weight_read_ms(experts: float, shape: MoEShape, pass_: str, hbm_bytes_per_ms: float,
                   ffn: int | None = None) -> float:
    """The memory floor of `experts` experts' GEMMs: each weight byte crosses HBM at least once
    per pass, however few rows use it (decode: the kernels wait on weights, not FLOPs)."""
    return experts * expert_weight_bytes(shape, ffn) * WEIGHT_PASSES[pass_] / hbm_bytes_per_ms


def shared_elementwise_bytes(shape: MoEShape, tokens_per_gpu: float, elem_bytes: int = 2) -> float:
    """HBM bytes of the shared expert's unfused element-wise passes in one forward (occult.harness.sweep's
    `SharedExpert`, torch ops): silu of the gate half (read, write) and its product with the up half
    (two reads, a write) over [T, shared_ffn]; the sigmoid gate's product (read, write) and the sum
    into the layer output (two reads, a write) over [T, d]."""
    if not shape.shared_ffn:
        return 0.0
    per_token = 5.0 * shape.shared_ffn + (2.0 if shape.shared_gate else 0.0) * shape.hidden + 3.0 * shape.hidden
    return per_token * tokens_per_gpu * elem_bytes


def shared_expert_ms(shape: MoEShape, tokens_per_gpu: float, pass_: str, dense_tflops: float,
                     hbm_bytes_per_ms: float = math.inf, scale: float = 1.0) -> float:
    """The shared expert(s): a dense SwiGLU of width `shared_ffn` on every local token: its GEMMs'
    FLOPs (or their weight reads where those take longer) plus its element-wise passes over HBM
    (x 3 in fwd+bwd, as the GEMMs), times `scale` (the module's measured time over this count,
    `shared_scales`)."""
    passes = 3.0 if pass_ == "train" else 1.0
    flops = 2.0 * 3.0 * shape.hidden * shape.shared_ffn * tokens_per_gpu * passes
    floor = weight_read_ms(1.0, shape, pass_, hbm_bytes_per_ms, shape.shared_ffn) if shape.shared_ffn else 0.0
    elementwise = shared_elementwise_bytes(shape, tokens_per_gpu) * passes / hbm_bytes_per_ms
    return scale * (max(flops / (dense_tflops * 1e12) * 1e3, floor) + elementwise)


def gpu_components(traffic_: Traffic, shape: MoEShape, spec: MethodSpec, pass_: str, cost: CostModel,
                   tokens_per_gpu: float) -> dict[str, float]:
    """GPU time of one layer call split into kernels, other GPU work, all-to-alls and shared expert (ms).

    Kernels and other work are per device and the busiest device counts; the all-to-alls are
    collective (the slowest rank sets their time)."""
    num_devices = traffic_.num_devices
    local_experts = shape.num_experts / num_devices
    train = pass_ == "train"
    flops_D = traffic_.pairs_in_D * expert_flops_per_pair(shape)
    gflop_D = np.maximum(flops_D / 1e9, 1e-9)       # curve abscissa: the call's work (tiles to fill the GPU)
    active_D = (np.full(num_devices, local_experts) if traffic_.active_experts_D is None
                else traffic_.active_experts_D)
    floor_D = np.array([weight_read_ms(a, shape, pass_, cost.hbm_bytes_per_ms) for a in active_D])
    stream_D = np.array([weight_read_ms(a, shape, pass_, cost.stream_bytes_per_ms) for a in active_D])
    if spec.family == "naive":
        curve = cost.grouped_tflops.get((pass_, shape.name))
        if curve is None:
            raise SimulateError(f"simulate.gemm_csv: no grouped-GEMM {pass_} rows for shape {shape.name}")
        kernels_D = np.array([f * (3.0 if train else 1.0) / (curve(g) * 1e12) * 1e3
                              for f, g in zip(flops_D, gflop_D)])
        kernels_D = np.maximum(kernels_D, floor_D)
        bytes_factor = (NAIVE_BYTES_EP if num_devices > 1 else NAIVE_BYTES_D1) / NAIVE_BYTES_D1
        pairs_handled_D = (traffic_.pairs_SD.sum(1) + traffic_.pairs_SD.sum(0)) / 2
        other_D = pairs_handled_D * cost.naive_ns_per_pair.get(pass_, 0.0) * 1e-6 * bytes_factor
    else:
        if cost.kernel_tflops is None:
            raise SimulateError("simulate.calibration: no occult-compute rows give the kernel throughput")
        # math at the curve's throughput for the call's work, plus the weight reads, which a call with
        # few rows per expert does not hide behind its math (the curve is fitted net of them)
        train_curve = cost.kernel_curve(shape.ffn, train=True) if train else None
        if train_curve is not None:
            kernels_D = np.array([f / (train_curve(g) * 1e12) * 1e3 for f, g in zip(flops_D, gflop_D)])
        else:
            curve = cost.kernel_curve(shape.ffn)
            kernels_D = np.array([f / (curve(g) * 1e12) * 1e3 for f, g in zip(flops_D, gflop_D)])
            if train:
                kernels_D = kernels_D * (cost.kernel_train_scale or float("nan"))
        kernels_D = kernels_D + floor_D
        # below the smallest measured call the chain of expert kernels is latency-bound: weights
        # streamed at the small calls' measured rate plus a fixed floor (fitted on graph replays
        # smaller than any `-compute` row)
        kernels_D = np.maximum(kernels_D, stream_D + cost.kernel_floor_ms * WEIGHT_PASSES[pass_])
        terms = cost.other_gpu or OtherGpuTerms(0.0, 0.0, 1.0, 0)
        per_row_ns = cost.pe_per_row_ns if spec.mode == "per_expert" and cost.pe_per_row_ns is not None else None
        other_D = terms.at(traffic_.row_work_D, train, per_row_ns)
        if spec.family == "occult-compute":
            other_D = np.zeros_like(kernels_D)
    busiest = int(np.argmax(kernels_D + other_D))
    shared_ms = cost.shared_ms(shape, tokens_per_gpu, pass_)
    comm = 0.0
    if spec.family != "occult-compute":
        link = cost.link
        comm = 0.0 if spec.static else link.latency_ms(num_devices)        # split sizes (counts)
        comm += link.alltoall_ms(traffic_.dispatch_bytes_SD) + link.alltoall_ms(traffic_.return_bytes_SD)
        if train:
            # backward: row gradients out (transposed return) and back (transposed dispatch)
            comm += link.alltoall_ms(traffic_.return_bytes_SD.T) + link.alltoall_ms(traffic_.dispatch_bytes_SD.T)
            if traffic_.mode != "naive":                                  # gate gradients: fp32 per slot
                comm += link.alltoall_ms(traffic_.rows_SD.T * 4.0 * traffic_.slots)
    parts = {"kernels_ms": float(kernels_D[busiest]), "other_gpu_ms": float(other_D[busiest]), "comm_ms": comm,
             "shared_ms": shared_ms}
    parts["gpu_ms"] = sum(parts.values())
    return parts


def layer_time(gpu_ms: float, spec: MethodSpec, pass_: str, num_devices: int, cost: CostModel,
               shared_host_ms: float = 0.0, host_scale: float = 1.0, shape: str | None = None,
               kind: str | None = None) -> dict[str, float]:
    """`t = s·(pre + h) + max(s·(post + S), G)` for eager layers (S: launching the shared expert, which
    the sweep runs eagerly after the layer; h: the host offset of `shape` in sweeps of `kind`,
    `calibrate_shape_host`, 0 where either is None; where h < −pre, pre is 0 and post takes the rest;
    s: the host's slowness when the point ran, 1 = the typical
    host, `host_scale_column`); `t = s·r + max(s·S, G)` for a graph replay (r: launching the replay,
    on the critical path before its GPU work; the shared expert is launched eagerly after it);
    `t = G` for the kernels alone."""
    if spec.family == "occult-compute":
        return {"host_pre_ms": 0.0, "host_post_ms": 0.0, "host_shared_ms": 0.0, "layer_ms": gpu_ms}
    if spec.family == "occult-graph":
        pre, shared = host_scale * cost.graph_host_for(pass_, num_devices), host_scale * shared_host_ms
        return {"host_pre_ms": pre, "host_post_ms": 0.0, "host_shared_ms": shared, "layer_ms": pre + max(shared, gpu_ms)}
    host = cost.host_for(spec.family, pass_, num_devices)
    if host is None:
        return {"host_pre_ms": float("nan"), "host_post_ms": float("nan"), "host_shared_ms": float("nan"),
                "layer_ms": float("nan")}
    offset = 0.0 if shape is None or kind is None else cost.host_shape_for(spec.family, kind, num_devices, shape)
    pre = host.pre_ms + offset          # a negative offset larger than pre takes the rest from post
    post = max(host.post_ms + min(pre, 0.0), 0.0)
    pre, post, shared = host_scale * max(pre, 0.0), host_scale * post, host_scale * shared_host_ms
    return {"host_pre_ms": pre, "host_post_ms": post, "host_shared_ms": shared,
            "layer_ms": pre + max(post + shared, gpu_ms)}


def fit_host(gpu_ms: np.ndarray, measured_ms: np.ndarray, shared_host_ms: np.ndarray | None = None,
             host_scale: np.ndarray | None = None) -> tuple[float, float, float]:
    """(pre, post, mean squared relative error) of `s·pre + max(s·(post + S), G)` ≥ 0 against
    `measured_ms` (S: each point's shared-expert launches, known, default 0; s: each point's host
    slowness, default 1), by grid search (coarse 20 µs, then 2 µs around the best). Ties go to the
    smallest terms. The relative error of a point is that of `pre + max(post + S, G/s)` against
    measured/s, which is how it is searched."""
    scale = np.ones(len(np.atleast_1d(gpu_ms))) if host_scale is None else np.asarray(host_scale, float)
    gpu_ms, measured_ms = np.asarray(gpu_ms, float) / scale, np.asarray(measured_ms, float) / scale
    offset = np.zeros_like(gpu_ms) if shared_host_ms is None else np.asarray(shared_host_ms, float)
    top = float(measured_ms.max())

    def search(pre_grid: np.ndarray, post_grid: np.ndarray) -> tuple[float, float, float]:
        best = (0.0, 0.0, math.inf)
        for pre in pre_grid:
            pred_PN = pre + np.maximum(post_grid[:, None] + offset[None, :], gpu_ms[None, :])
            loss_P = np.mean(((pred_PN - measured_ms) / measured_ms) ** 2, axis=1)
            i = int(np.argmin(loss_P))
            if loss_P[i] < best[2] - 1e-15:
                best = (float(pre), float(post_grid[i]), float(loss_P[i]))
        return best

    pre, post, _ = search(np.arange(0.0, top + 0.02, 0.02), np.arange(0.0, top + 0.02, 0.02))
    fine = lambda centre: np.clip(np.arange(centre - 0.03, centre + 0.0301, 0.002), 0.0, None)  # noqa: E731
    return search(np.unique(fine(pre)), np.unique(fine(post)))


@functools.lru_cache(maxsize=None)
def shared_launches(shape: MoEShape, pass_: str) -> int:
    """ATen ops that the sweep's shared expert (`occult.shapes.SharedExpert`, with the sum into the
    layer's output) adds to one call: forward, or forward and backward for `train`. Counted on a
    tiny copy on the CPU (the count does not depend on the sizes); 0 without a shared expert."""
    if not shape.shared_ffn:
        return 0
    from torch.utils._python_dispatch import TorchDispatchMode

    from occult.shapes import SharedExpert

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.ops += 1
            return func(*args, **(kwargs or {}))

    module = SharedExpert(dataclasses.replace(shape, hidden=8, shared_ffn=8), 0, torch.device("cpu"), torch.float32)
    train = pass_ == "train"
    counts = []
    for with_shared in (True, False):
        x = torch.randn(4, 8, requires_grad=train)
        with torch.set_grad_enabled(train):
            layer_out = x * 2.0                  # stands in for the routed experts' output
            with Count() as count:
                y = layer_out + module(x) if with_shared else layer_out
                if train:
                    y.backward(torch.ones_like(y))
        counts.append(count.ops)
    return counts[0] - counts[1]
