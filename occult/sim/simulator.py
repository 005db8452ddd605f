"""Trace-driven scale simulator of the EP MoE layer: bytes per device pair, then time (issue 6).

(a) Traffic. From a routing trace (`ids_NK`, global expert ids), a placement (expert → device)
and a dispatch mode, `traffic` counts per (source, destination) device the rows, the (token,
expert) pairs and the bytes on the wire, in the runtime's exact format (`occult.ep.layer`):

  * `dedup` (Occult, exact or N_d-pruned routing): one packed row per (token, device): the hidden
    vector (padded to 4 B) + 8 B per metadata slot (`slots` = most pairs any row carries), padded
    to 64 B; one returned row (hidden vector) per sent row. The static-shape plan (`-static`,
    `-graph`) sends a fixed T rows to every device (`static_traffic`).
  * `per_expert` (the same runtime, one row per (token, expert)): slots = 1, same padding.
  * `naive` (`occult.harness.baselines.naive`): one bare hidden vector per (token, expert), each way.

(b) Time, as the runtime spends it. GPU time G = expert kernels (the busiest device's pairs at
the measured kernel throughput for the call's work, plus its active experts' weight reads, never
below a latency floor) + the other GPU work (plan, pack, combine: per handled row for Occult, per
pair for the naive EP) + the all-to-alls (measured curve of bytes per rank) + the shared expert
(dense FLOPs). An eager layer is also host-bound:
the host spends `pre` before the layer's one blocking sync (the GPU idles: nothing big is queued
yet) and `post` launching what follows while the GPU works, so

    t = pre + max(post, G)        (eager: occult, -static, naive)      t = G   (`-graph`, `-compute`)

Parameters are measured apart from the validation points: kernels from `-compute` rows (fwd
curve, fwd+bwd scale) and their latency floor from graph replays smaller than any of them, the
grouped-GEMM curve (naive) and the all-to-all curve from commbench, Occult's other GPU work from
`-graph` rows, and the host terms (pre, post) per (method family,
pass, D) fitted on the declared calibration rows only (`simulate.calibration`). Every other
measured point validates. End-to-end = MoE layers × layer.

(c) Validation: every measured Occult / naive point of the given CSVs is predicted on its own
routing (the sweep's seeded `SyntheticRouter` + `greedy_occult` placement + pruning; uniform
routing; or, for a replayed trace the CPU does not hold, the row's recorded traffic facts) and
the table gives role, error, the model's terms, and the point's replicates (the same
computation measured again) so that noise the model cannot remove is visible.

(d) Predictions for D = 4 … 64 (single node, then several) and the issue-8 table for D = 4, 8.

Routing traces are regenerated on the CPU: the sweeps drew their hidden states from CUDA
generators, so the tokens differ but come from the same distribution; the placement (computed
on the CPU by the sweep) is the same. E[C_T] of the trace is written beside the measured one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from occult.method_names import FAMILIES, MethodNameError, MethodSpec, is_occult, parse_method
from occult.kernels.wire_format import META_BYTES_PER_PAIR, packed_row_layout
from occult.harness.baselines import MoEShape, get_shape
from occult.logs import ENV_LOG_JSON, progress, run_main

MIB = 2**20
# One MoE layer per transformer block (DeepSeek-MoE-16B: 28 blocks, the first dense).
MOE_LAYERS: types.MappingProxyType[str, int] = types.MappingProxyType(
    {"olmoe": 16, "qwen": 24, "deepseek": 27, "tiny": 2, "tiny-shared": 2})
# DESIGN.md, 2× H200 NV18, `all_to_all_single`: (whole buffer per rank, algbw GB/s = buffer / time).
DESIGN_ALLTOALL_2GPU = ((1 * MIB, 25.0), (16 * MIB, 308.0), (64 * MIB, 475.0), (256 * MIB, 560.0),
                        (1024 * MIB, 660.0))
MODES = ("dedup", "per_expert", "naive")
PASSES = ("fwd", "train")
EAGER_FAMILIES = ("occult", "occult-pe", "occult-static", "naive")
ROUTINGS = ("synthetic", "uniform", "trace")
# Bytes the naive EP's memory-bound ops move per (token, expert) pair, in units of d (`occult.harness.baselines.naive`):
# D = 1: gather x[token] 4 + y.float() 6 + × gate 8 + index_add 12 = 30; D > 1 adds the regrouping
# gathers x_RD[perm] and y[inverse] (4 + 4). The extra work is priced at the D = 1 rate.
NAIVE_BYTES_D1, NAIVE_BYTES_EP = 30.0, 38.0
MEASURED_COLUMNS = ("kind", "shape", "method", "D", "tokens_per_gpu", "median_ms", "status")
ALLTOALL_COLUMNS = ("D", "pattern", "bytes_remote_per_rank", "median_ms")
GEMM_COLUMNS = ("shape", "experts", "hidden", "ffn", "rows_per_expert", "pass", "tflops")   # pass: fwd | fwd+bwd
COMPONENTS = ("kernels_ms", "other_gpu_ms", "comm_ms", "shared_ms", "gpu_ms", "host_pre_ms", "host_post_ms",
              "host_shared_ms")
VALIDATION_COLUMNS = (
    "role", "kind", "shape", "method", "family", "routing", "D", "tokens_per_gpu", "batch", "measured_ms",
    "p10_ms", "p90_ms", "predicted_ms", "rel_err", "within_tolerance", "bound", *COMPONENTS, "host_scale",
    "replicates", "replicate_ratio", "reachable", "measured_ct", "trace_ct", "measured_bytes_sent",
    "trace_bytes_sent", "measured_pairs_max", "trace_pairs_max", "traffic_source", "source", "commit",
)
PREDICTION_COLUMNS = (
    "shape", "method", "kind", "D", "nodes", "gpus_per_node", "tokens_per_gpu", "batch", "moe_layers",
    "mean_devices_per_token", "load_max_over_mean", "dispatch_bytes_per_rank", "return_bytes_per_rank",
    "inter_node_bytes_per_rank", *COMPONENTS, "layer_ms", "model_ms", "speedup_vs_naive", "status",
)


class SimulateError(ValueError):
    """A simulator input is missing or malformed; the message names the file or field."""



# ----------------------------------------------------------------------------------------------
# (a) Traffic


def wire_row_bytes(mode: str, hidden: int, elem_bytes: int, slots: int) -> tuple[int, int]:
    """(bytes of one dispatched row, bytes of one returned row) in `mode`'s wire format."""
    if mode not in MODES:
        raise SimulateError(f"mode: {mode!r} is not one of {MODES}")
    vector = hidden * elem_bytes
    if mode == "naive":
        return vector, vector
    return packed_row_layout(hidden, elem_bytes, max(slots, 1))[1], vector


@dataclass(frozen=True)
class Traffic:
    """One layer's exchange among D devices; every [D, D] array is indexed [source, destination].

    Counts are floats so that a sampled trace can be scaled to another number of tokens.
    `return_bytes_SD[s, d]` is what device s sends back to d (its partial results for d's tokens).
    """

    mode: str
    rows_SD: np.ndarray
    pairs_SD: np.ndarray
    dispatch_bytes_SD: np.ndarray
    return_bytes_SD: np.ndarray
    tokens_per_source: float
    mean_devices_per_token: float
    slots: int
    active_experts_D: np.ndarray | None = None   # local experts with ≥ 1 pair per device (None: all)

    @property
    def num_devices(self) -> int:
        return self.rows_SD.shape[0]

    def scaled(self, factor: float) -> "Traffic":
        return dataclasses.replace(
            self, rows_SD=self.rows_SD * factor, pairs_SD=self.pairs_SD * factor,
            dispatch_bytes_SD=self.dispatch_bytes_SD * factor, return_bytes_SD=self.return_bytes_SD * factor,
            tokens_per_source=self.tokens_per_source * factor)

    @property
    def pairs_in_D(self) -> np.ndarray:
        """(token, expert) pairs each device computes."""
        return self.pairs_SD.sum(0)

    @property
    def row_work_D(self) -> np.ndarray:
        """Rows each device handles: mean of rows it sends (pack, combine) and receives (experts)."""
        return (self.rows_SD.sum(1) + self.rows_SD.sum(0)) / 2

    def remote(self, bytes_SD: np.ndarray) -> np.ndarray:
        return bytes_SD * (1 - np.eye(self.num_devices))

    def sweep_bytes_sent(self, hidden: int, elem_bytes: int) -> float:
        """Mean over ranks of `occult.harness.sweep`'s `bytes_sent` accounting (hidden vectors unpadded,
        8 B per remote pair for the runtime; bare vectors for naive), for comparison with a sweep."""
        off = 1 - np.eye(self.num_devices)
        rows_out = (self.rows_SD * off).sum(1)
        rows_back = (self.rows_SD * off).sum(0)
        meta = 0.0 if self.mode == "naive" else META_BYTES_PER_PAIR * (self.pairs_SD * off).sum(1)
        return float(np.mean((rows_out + rows_back) * hidden * elem_bytes + meta))


def traffic(ids_NK: np.ndarray | torch.Tensor, device_of_expert_E: np.ndarray | torch.Tensor, num_devices: int,
            mode: str, hidden: int, elem_bytes: int = 2, source_N: np.ndarray | None = None) -> Traffic:
    """Rows, pairs and bytes between every pair of devices for one layer's routing trace.

    `source_N[n]` is the device token n starts on (default: D equal contiguous blocks).
    """
    ids_NK = np.asarray(ids_NK.cpu() if isinstance(ids_NK, torch.Tensor) else ids_NK, dtype=np.int64)
    placement_E = np.asarray(device_of_expert_E.cpu() if isinstance(device_of_expert_E, torch.Tensor)
                             else device_of_expert_E, dtype=np.int64)
    if ids_NK.ndim != 2:
        raise SimulateError(f"ids_NK: expected [N, k], got shape {ids_NK.shape}")
    if placement_E.ndim != 1 or (placement_E.size and (placement_E.min() < 0 or placement_E.max() >= num_devices)):
        raise SimulateError(f"device_of_expert_E: expected devices in [0, {num_devices}), got {placement_E}")
    if ids_NK.size and (ids_NK.min() < 0 or ids_NK.max() >= placement_E.size):
        raise SimulateError(f"ids_NK: expert ids must lie in [0, {placement_E.size})")
    num_tokens = ids_NK.shape[0]
    if source_N is None:
        source_N = np.arange(num_tokens) * num_devices // max(num_tokens, 1)
    source_N = np.asarray(source_N, dtype=np.int64)
    if source_N.shape != (num_tokens,) or (num_tokens and (source_N.min() < 0 or source_N.max() >= num_devices)):
        raise SimulateError(f"source_N: expected {num_tokens} devices in [0, {num_devices})")
    dev_NK = placement_E[ids_NK]
    pairs_ND = np.zeros((num_tokens, num_devices), dtype=np.int64)
    np.add.at(pairs_ND, (np.repeat(np.arange(num_tokens), ids_NK.shape[1]), dev_NK.reshape(-1)), 1)
    hit_ND = pairs_ND > 0
    rows_ND = hit_ND.astype(np.int64) if mode == "dedup" else pairs_ND
    slots = int(pairs_ND.max(initial=1)) if mode == "dedup" else 1

    def by_source(values_ND: np.ndarray) -> np.ndarray:
        out_SD = np.zeros((num_devices, num_devices), dtype=np.float64)
        np.add.at(out_SD, source_N, values_ND.astype(np.float64))
        return out_SD

    rows_SD, pairs_SD = by_source(rows_ND), by_source(pairs_ND)
    sent_row, back_row = wire_row_bytes(mode, hidden, elem_bytes, slots)
    hit_E = np.bincount(ids_NK.reshape(-1), minlength=placement_E.size) > 0
    return Traffic(
        mode=mode, rows_SD=rows_SD, pairs_SD=pairs_SD, dispatch_bytes_SD=rows_SD * sent_row,
        return_bytes_SD=rows_SD.T * back_row, tokens_per_source=num_tokens / num_devices,
        mean_devices_per_token=float(hit_ND.sum(1).mean()) if num_tokens else float("nan"), slots=slots,
        active_experts_D=np.bincount(placement_E[hit_E], minlength=num_devices).astype(np.float64))


def static_traffic(base: Traffic, hidden: int, elem_bytes: int = 2) -> Traffic:
    """The static-shape plan's exchange (`ep_moe(static_capacity=T)`): every source sends a fixed
    T rows (one per token, empty or not) to every device and gets T rows back; pairs unchanged."""
    num_devices = base.num_devices
    capacity = base.tokens_per_source
    rows_SD = np.full((num_devices, num_devices), capacity, dtype=np.float64)
    sent_row, back_row = wire_row_bytes("dedup", hidden, elem_bytes, base.slots)
    return dataclasses.replace(base, rows_SD=rows_SD, dispatch_bytes_SD=rows_SD * sent_row,
                               return_bytes_SD=rows_SD.T * back_row)


def recorded_traffic(num_devices: int, tokens_per_gpu: float, mode: str, shape: MoEShape, bytes_sent: float,
                     mean_devices_per_token: float, pairs_received_max: float) -> Traffic:
    """A symmetric exchange rebuilt from a measured row's own accounting (for routing the CPU cannot
    regenerate): `bytes_sent` per rank (remote rows out + their returns, `EPStats`), E[C_T] and
    the busiest rank's pairs, which every device is given (the busiest sets the pace)."""
    values = (tokens_per_gpu, bytes_sent, mean_devices_per_token, pairs_received_max)
    if num_devices < 2 or not all(np.isfinite(v) and v >= 0 for v in values):
        raise SimulateError("recorded traffic: need D ≥ 2 and finite bytes_sent, mean_devices_per_token, "
                            "pairs_received_max")
    slots = shape.top_k if mode == "dedup" else 1
    sent_row, back_row = wire_row_bytes(mode, shape.hidden, 2, slots)
    rows_per_source = tokens_per_gpu * (mean_devices_per_token if mode == "dedup" else shape.top_k)
    remote = min(bytes_sent / (sent_row + back_row), rows_per_source)
    rows_SD = np.full((num_devices, num_devices), remote / (num_devices - 1))
    np.fill_diagonal(rows_SD, rows_per_source - remote)
    pairs_SD = np.full((num_devices, num_devices), pairs_received_max / num_devices)
    return Traffic(mode=mode, rows_SD=rows_SD, pairs_SD=pairs_SD, dispatch_bytes_SD=rows_SD * sent_row,
                   return_bytes_SD=rows_SD.T * back_row, tokens_per_source=float(tokens_per_gpu),
                   mean_devices_per_token=float(mean_devices_per_token), slots=slots)


# ----------------------------------------------------------------------------------------------
# (b) Time model


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


def design_alltoall_curve() -> LogLogCurve:
    """DESIGN.md's 2-GPU table as time vs remote bytes per rank (half of each buffer is remote)."""
    remote = np.array([size / 2 for size, _ in DESIGN_ALLTOALL_2GPU], dtype=np.float64)
    ms = np.array([size / (gbps * 1e9) * 1e3 for size, gbps in DESIGN_ALLTOALL_2GPU])
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


# ----------------------------------------------------------------------------------------------
# Traces: the sweep's routing


class ShapeTraces:
    """A pool of routed tokens of one shape and routing (`synthetic`: the sweep's seeded
    `SyntheticRouter`; `uniform`: i.i.d. Gaussian logits), with placements and pruning per D.

    Memoises placements and pruned routings per (D, N_d, placement) on the instance.
    """

    def __init__(self, shape: MoEShape, pool_tokens: int, seed: int, routing: str = "synthetic") -> None:
        from occult.harness.sweep.inputs import SyntheticRouter, derive_seed, make_inputs

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
        self._placements: dict[tuple[int, bool], torch.Tensor] = {}
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
        the sweep's load-aware placement for `-balanced`; else the sweep's `greedy_occult` placement."""
        spec = method_spec(method)
        contiguous = spec.contiguous or self.routing == "uniform"
        balanced = spec.balanced and not contiguous
        key = (num_devices, contiguous, balanced)
        if key not in self._placements:
            if contiguous:
                self._placements[key] = torch.arange(self.shape.num_experts) // (self.shape.num_experts // num_devices)
            else:       # the sweep's own function: the same calibration batch, placement and seed
                from occult.harness.sweep.inputs import occult_placement

                self._placements[key] = occult_placement(self.shape, self.router, num_devices, self.seed, balanced)
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
    then the load-aware swap search). N_d pruning needs the router's logits, so those methods
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
        self._placements: dict[tuple[int, bool, bool], torch.Tensor] = {}
        self._routes: dict[tuple[int, int, bool], torch.Tensor] = {}

    def support(self, method: str, num_devices: int) -> str | None:
        why = super().support(method, num_devices)
        if why is None and method_spec(method).max_devices is not None:
            why = "unsupported: N_d pruning needs the router's logits; a recorded trace holds expert ids only"
        return why

    def placement(self, method: str, num_devices: int) -> torch.Tensor:
        from occult.harness.sweep.inputs import placement_from_calibration

        spec = method_spec(method)
        key = (num_devices, spec.contiguous, spec.balanced and not spec.contiguous)
        if key not in self._placements:
            experts = self.shape.num_experts
            self._placements[key] = (torch.arange(experts) // (experts // num_devices) if spec.contiguous else
                                     placement_from_calibration(self.calib_NK, self.shape, num_devices, self.seed,
                                                                key[2]))
        return self._placements[key]


def predict_recorded(profile_dir: Path, trace_name: str, shape_name: str, layers: Sequence[int] | None,
                     methods: Sequence[str], devices: Sequence[int], tokens_per_gpu: Sequence[int], cost: CostModel,
                     seed: int):
    """Scale predictions (prefill) on each layer of a recorded trace (`placement_study.load_profile_splits`:
    full traces or a GPU run's samples) mapped onto `shape_name`; rows of PREDICTION_COLUMNS plus
    `trace` and `layer`, and `layer = mean` rows averaging the layers."""
    import pandas as pd

    from occult.stages.placement_study import load_profile_splits

    shape = get_shape(shape_name)
    splits = load_profile_splits(profile_dir)
    if splits.num_experts != shape.num_experts:
        raise SimulateError(f"trace: {profile_dir} routes over {splits.num_experts} experts, shape {shape_name} "
                            f"has {shape.num_experts}")
    chosen = list(splits.layers) if layers is None else list(layers)
    missing = sorted(set(chosen) - set(splits.layers))
    if missing:
        raise SimulateError(f"trace_layers: {missing} are not layers of {profile_dir} ({list(splits.layers)})")
    frames = []
    for layer in chosen:
        i = list(splits.layers).index(layer)
        traces = {shape_name: RecordedTraces(shape, splits.calib_LNK[i], splits.heldout_LNK[i], seed)}
        rows = predict(traces, methods, devices, [("prefill", t, None) for t in tokens_per_gpu], cost,
                       f"predict trace layer {layer}")
        frames.append(rows.assign(trace=trace_name, layer=str(layer)))
    table = pd.concat(frames, ignore_index=True)
    keys = ["shape", "method", "kind", "D", "nodes", "gpus_per_node", "tokens_per_gpu", "moe_layers", "status"]
    numeric = [c for c in PREDICTION_COLUMNS if c not in keys and c != "batch"]
    ok = table[table["status"] == "ok"]
    mean = ok.groupby(keys, as_index=False)[numeric].mean()
    naive = mean[mean["method"] == "naive"].set_index(["D", "tokens_per_gpu"])["layer_ms"]
    mean["speedup_vs_naive"] = [naive.get((d, t), np.nan) / ms for d, t, ms
                                in zip(mean["D"], mean["tokens_per_gpu"], mean["layer_ms"])]
    mean["model_ms"] = mean["layer_ms"] * mean["moe_layers"]
    skipped = table[table["status"] != "ok"].drop_duplicates(["method", "D", "tokens_per_gpu"]).assign(layer="mean")
    return pd.concat([table, mean.assign(trace=trace_name, layer="mean"), skipped], ignore_index=True)


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


# ----------------------------------------------------------------------------------------------
# Inputs: measured files


HOST_MAX_MS = 12.0      # search bound of the host terms (eager layers measured so far: ≤ 9 ms of host)


def resolve_input(path: str | Path, field: str) -> Path:
    """A measured-input path as given, else relative to the repository (committed results)."""
    from occult.provenance import REPO_ROOT

    candidate = Path(path)
    if candidate.exists():
        return candidate
    if not candidate.is_absolute() and (REPO_ROOT / candidate).exists():
        return REPO_ROOT / candidate
    raise SimulateError(f"{field}: {path} does not exist")


def read_table(path: str | Path, columns: Sequence[str], field: str):
    """A CSV with at least `columns`, as a pandas frame; one clear error naming the file otherwise."""
    import pandas as pd

    resolved = resolve_input(path, field)
    try:
        frame = pd.read_csv(resolved)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise SimulateError(f"{field}: {resolved} is not a readable CSV ({err})") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise SimulateError(f"{field}: {resolved} lacks column(s) {', '.join(missing)}")
    return frame


def alltoall_curves(path: str | Path | None) -> dict[int, LogLogCurve]:
    """Time vs remote bytes per rank, by D, from commbench's `alltoall.csv` (equal splits), or
    DESIGN.md's 2-GPU table when `path` is None."""
    if path is None:
        return {2: design_alltoall_curve()}
    frame = read_table(path, ALLTOALL_COLUMNS, "simulate.alltoall_csv")
    equal = frame[(frame["pattern"] == "equal") & (frame["D"] > 1) & (frame["bytes_remote_per_rank"] > 0)]
    if equal.empty:
        raise SimulateError(f"simulate.alltoall_csv: {path} has no equal-split rows with D > 1")
    curves = {}
    for devices, rows in equal.groupby("D"):
        by_size = rows.groupby("bytes_remote_per_rank")["median_ms"].median().sort_index()
        curves[int(devices)] = LogLogCurve(by_size.index.to_numpy(float), by_size.to_numpy(float))
    return curves


def fit_weight_streaming(path: str | Path, max_tokens: int = 16,
                         field: str = "simulate.kernel_stream_csv") -> list[dict[str, Any]]:
    """Per shape, the rate at which decode-sized Occult expert calls stream their weights, from an
    `occult.harness.sweep` CSV of `occult-compute-graph` rows (the kernels alone) with uniform routing: each
    row's expected active experts under uniform top-k, E·(1 − (1 − k/E)^T), times an expert's weight
    bytes, and time = intercept + bytes / rate fitted over the rows of ≤ `max_tokens` tokens (before
    every expert is active). Rows: shape, rate_gbps, intercept_ms, rows."""
    frame = read_table(path, ("status", "method", "routing", "shape", "tokens_per_gpu", "median_ms"), field)
    frame = frame[(frame["status"] == "ok") & (frame["method"] == "occult-compute-graph")
                  & (frame["routing"] == "uniform") & (frame["tokens_per_gpu"] <= max_tokens)]
    if frame.empty:
        raise SimulateError(f"{field}: {path} has no ok occult-compute-graph rows with uniform routing "
                            f"at ≤ {max_tokens} tokens")
    fits = []
    for name, rows in frame.groupby("shape"):
        shape = get_shape(name)
        tokens = rows["tokens_per_gpu"].to_numpy(float)
        if len(np.unique(tokens)) < 2:
            raise SimulateError(f"{field}: {path} has {name} rows at one size only: no streaming rate")
        active = shape.num_experts * (1 - (1 - shape.top_k / shape.num_experts) ** tokens)
        slope, intercept = np.polyfit(active * expert_weight_bytes(shape, shape.ffn), rows["median_ms"].to_numpy(float), 1)
        if slope <= 0:
            raise SimulateError(f"{field}: {path}: {name}'s time does not grow with its weight bytes")
        fits.append({"shape": name, "rate_gbps": 1e-6 / slope, "intercept_ms": float(intercept), "rows": len(rows)})
    return fits


def grouped_gemm_curves(path: str | Path | None, min_rows_per_expert: int) -> dict[tuple[str, str], LogLogCurve]:
    """(pass, shape) -> grouped-GEMM TFLOP/s vs the call's forward GFLOP (experts × rows per expert ×
    2·3·d·F) from commbench's `gemm.csv`, from `min_rows_per_expert` up (smaller calls of the
    benchmark are launch-bound) and flat outside.

    The abscissa is the call's work, not its rows per expert: the benchmark runs 8 experts, a
    layer's device 16–64, and a grouped GEMM's throughput is set by how many output tiles it has to
    fill the GPU's SMs with (∝ rows × F summed over experts) once each expert has a full row tile."""
    if path is None:
        return {}
    frame = read_table(path, GEMM_COLUMNS, "simulate.gemm_csv")
    curves = {}
    for (gemm_pass, shape), rows in frame.groupby(["pass", "shape"]):
        kept = rows[rows["rows_per_expert"] >= min_rows_per_expert]
        if kept.empty:
            raise SimulateError(f"simulate.gemm_csv: {path} has no {shape} {gemm_pass} rows with ≥ "
                                f"{min_rows_per_expert} rows per expert")
        gflop = kept["experts"] * kept["rows_per_expert"] * 6.0 * kept["hidden"] * kept["ffn"] / 1e9
        by_work = kept.assign(gflop=gflop).groupby("gflop")["tflops"].median().sort_index()
        pass_ = "train" if gemm_pass == "fwd+bwd" else "fwd"
        curves[(pass_, str(shape))] = LogLogCurve(by_work.index.to_numpy(float), by_work.to_numpy(float), extend="flat")
    return curves


SELECTOR_KEYS = ("methods", "tokens_per_gpu")


@dataclass(frozen=True)
class FileEntry:
    """`path[@methods=a,b][@tokens_per_gpu=N,...]`: the file's rows of those methods and sizes
    (every row where a selector is absent). `$name` is replaced by `simulate.folders[name]`."""

    path: Path
    methods: frozenset[str] | None
    tokens_per_gpu: frozenset[int] | None

    @classmethod
    def parse(cls, text: str, field: str, folders: dict | None = None) -> "FileEntry":
        from occult.config import expand_folders

        path, *selectors = expand_folders(text, folders or {}, field).split("@")
        chosen: dict[str, Any] = {}
        usage = f"{field}: {text!r}: expected FILE[@methods=a,b][@tokens_per_gpu=N,...]"
        for selector in selectors:
            key, _, values = selector.partition("=")
            items = [v.strip() for v in values.split(",") if v.strip()]
            if key not in SELECTOR_KEYS or key in chosen or not items:
                raise SimulateError(usage)
            if key == "tokens_per_gpu":
                if not all(v.isdigit() for v in items):
                    raise SimulateError(usage)
                chosen[key] = frozenset(int(v) for v in items)
            else:
                for name in items:
                    try:
                        method_spec(name)
                    except SimulateError as err:
                        raise SimulateError(f"{field}: {text!r}: {err}") from None
                chosen[key] = frozenset(items)
        return cls(resolve_input(path, field).resolve(), chosen.get("methods"), chosen.get("tokens_per_gpu"))

    def holds(self, source: Path, method: str, tokens_per_gpu: int) -> bool:
        return (source == self.path and (self.methods is None or method in self.methods)
                and (self.tokens_per_gpu is None or tokens_per_gpu in self.tokens_per_gpu))


def is_simulated_method(name: str) -> bool:
    return name == "naive" or is_occult(name)


def read_measured(paths: Sequence[str], calibration: Sequence[str] = (), folders: dict | None = None,
                  field: str = "simulate"):
    """Every ok Occult / naive row the entries of `paths` select, with its source, routing, commit
    and role (`calibration` if an entry of `calibration` holds it, else `validation`)."""
    import pandas as pd

    from occult.config import expand_folders

    measured = [FileEntry.parse(text, f"{field}.measured", folders) for text in paths]
    entries = [FileEntry.parse(text, f"{field}.calibration", folders) for text in calibration]
    by_path = {}
    for entry, text in zip(measured, paths):
        if entry.path in by_path:
            raise SimulateError(f"{field}.measured: {entry.path} is listed twice (join its selectors in one entry)")
        by_path[entry.path] = (entry, text)
    for entry in entries:
        if entry.path not in by_path:
            raise SimulateError(f"{field}.calibration: {entry.path} is not one of {field}.measured")
    frames = []
    for resolved, (entry, text) in by_path.items():
        path = expand_folders(text, folders or {}, f"{field}.measured").partition("@")[0]
        frame = read_table(resolved, MEASURED_COLUMNS, f"{field}.measured")
        frame = frame[(frame["status"] == "ok") & frame["method"].map(is_simulated_method)].copy()
        if "timing" in frame.columns:   # the model prices a call from a drained GPU (occult.harness.sweep --timing step)
            frame = frame[frame["timing"].fillna("step") == "step"]
        for name in frame["method"].unique():
            try:
                method_spec(name)
            except SimulateError as err:
                raise SimulateError(f"{field}.measured: {path}: {err}") from None
        frame = frame[[entry.holds(resolved, m, int(t)) for m, t in zip(frame["method"], frame["tokens_per_gpu"])]]
        if frame.empty:
            raise SimulateError(f"{field}.measured: {text!r} selects no ok, step-timed Occult / naive row")
        for column in ("batch", "p10_ms", "p90_ms", "bytes_sent", "mean_devices_per_token", "pairs_received_max",
                       "shared_ffn", "commit", "host_ms", *HOST_PROBES.values()):
            if column not in frame.columns:
                frame[column] = np.nan
        if "routing" not in frame.columns:
            frame["routing"] = "synthetic"
        frame["routing"] = frame["routing"].fillna("synthetic")
        unknown = set(frame["routing"]) - set(ROUTINGS)
        if unknown:
            raise SimulateError(f"{field}.measured: {path}: unknown routing {sorted(unknown)}")
        frame["source"] = path
        frame["role"] = ["calibration" if any(e.holds(resolved, m, int(t)) for e in entries) else "validation"
                         for m, t in zip(frame["method"], frame["tokens_per_gpu"])]
        frames.append(frame)
    columns = [*MEASURED_COLUMNS, "batch", "p10_ms", "p90_ms", "bytes_sent", "mean_devices_per_token",
               "pairs_received_max", "shared_ffn", "commit", "host_ms", *HOST_PROBES.values(), "routing", "source",
               "role", *(f"host_scale_{name}" for name in HOST_PROBES)]
    if not frames:
        return pd.DataFrame(columns=columns)
    return with_host_scales(pd.concat(frames, ignore_index=True))[columns]


HOST_PROBES = {"launch": "host_launch_us", "python": "host_probe_us"}   # simulate.host_speed -> sweep column


def with_host_scales(frame):
    """`frame` with a `host_scale_<probe>` column per HOST_PROBES entry (`host_scale_column` over
    these rows; a probe column the rows lack is added as NaN, giving scale 1)."""
    for name, column in HOST_PROBES.items():
        if column not in frame:
            frame[column] = np.nan
        frame[f"host_scale_{name}"] = host_scale_column(frame[column])
    return frame


def host_scale_of_set(frame, host_speed: str):
    """The `host_scale` of a set's rows: 1 for `none` (every row on a typical host), the named probe's
    `host_scale_column`, or for `auto` the first probe of HOST_PROBES that some row of the set carries
    (the launch probe tracked the eager layer's host time best: docs/simulator.md)."""
    import pandas as pd

    typical = pd.Series(1.0, index=frame.index)
    if host_speed == "none":
        return typical
    if host_speed == "auto":
        carried = [name for name, column in HOST_PROBES.items() if frame[column].notna().any()]
        if not carried:
            return typical
        host_speed = carried[0]
    if host_speed not in HOST_PROBES:
        raise SimulateError(f"simulate.host_speed: {host_speed!r} is not one of auto, none, {', '.join(HOST_PROBES)}")
    return frame[f"host_scale_{host_speed}"]


def host_scale_column(probe_us):
    """Each row's host slowness: its host probe (occult.harness.sweep's `host_probe_us`, a fixed pure-Python
    loop, or `host_launch_us`, 20 tiny launches, each timed before every step: the host's speed then)
    over the median probe of the set's rows; 1 for a row without the probe (older sweeps), i.e. a
    host of typical speed. On the lent H200 machines both probes move between processes and within
    one, and host-bound layers with them (results/nvidia-h200/host_probe_v1, sweeps_v32, sweeps_v33)."""
    import pandas as pd

    probe = probe_us.astype(float)
    valid = probe[np.isfinite(probe) & (probe > 0)]
    if valid.empty:
        return pd.Series(1.0, index=probe.index)
    return (probe / float(valid.median())).where(np.isfinite(probe) & (probe > 0), 1.0)


# ----------------------------------------------------------------------------------------------
# (c) Calibration and validation


SHARED_AB_COLUMNS = ("kind", "shape", "method", "D", "tokens_per_gpu", "status", "shared_ffn")
SHARED_AB_METHOD = "occult-graph"      # graph replays: GPU time only, no host time in the difference
SHARED_AB_MIN_TOKENS = 4096            # smaller calls are a latency-bound chain of small kernels


def shared_ab_table(pairs: Sequence[Sequence[str]], value: str, min_tokens: int = 0, folders: dict | None = None,
                    host_speed: str = "none"):
    """Per (kind, shape, D, tokens_per_gpu) measured both with and without the shared experts: the
    median `value` of the `occult-graph` rows (status ok) over the files with them (column `shared`)
    and over the files without (`noshared`); points of ≥ `min_tokens` tokens/GPU.

    Each pair is (file with the shapes' shared experts, file without), run on one machine start, in
    two processes. With `host_speed` other than `none`, each row's `value` (a host time) is divided
    by its host slowness over the pair's two files (`host_scale_of_set`; rows without probes: 1), so
    that the difference is not the two processes' host speeds."""
    import pandas as pd

    from occult.config import expand_folders

    key = ["kind", "shape", "D", "tokens_per_gpu"]
    frames: dict[str, list] = {"shared": [], "noshared": []}
    for i, pair in enumerate(pairs):
        field = f"simulate.shared_ab[{i}]"
        if isinstance(pair, (str, bytes)) or len(pair) != 2:
            raise SimulateError(f"{field}: expected [file with shared experts, file without], got {pair!r}")
        for role, text in zip(("shared", "noshared"), pair):
            path = expand_folders(str(text), folders or {}, field)
            frame = read_table(path, (*SHARED_AB_COLUMNS, value), field)
            frame = frame[(frame["method"] == SHARED_AB_METHOD) & (frame["status"] == "ok")
                          & ((frame["shared_ffn"] > 0) == (role == "shared"))]   # shapes without one: neither
            if frame.empty:
                raise SimulateError(f"{field}: {path} has no {SHARED_AB_METHOD} rows "
                                    f"{'with' if role == 'shared' else 'without'} shared experts")
            frames[role].append(frame)
        if host_speed != "none":
            scaled = with_host_scales(pd.concat([frames["shared"][-1], frames["noshared"][-1]], ignore_index=True))
            scaled[value] = scaled[value] / host_scale_of_set(scaled, host_speed).to_numpy()
            n = len(frames["shared"][-1])
            frames["shared"][-1], frames["noshared"][-1] = scaled.iloc[:n], scaled.iloc[n:]
    both = pd.concat([pd.concat(frames[role]).groupby(key)[value].median().rename(role)
                      for role in ("shared", "noshared")], axis=1, join="inner").reset_index()
    both = both[both["tokens_per_gpu"] >= min_tokens]
    if both.empty:
        sizes = f" of >= {min_tokens} tokens/GPU" if min_tokens else ""
        raise SimulateError(f"simulate.shared_ab: no (kind, shape, D, tokens/GPU){sizes} is measured both with "
                            "and without the shared experts")
    return both


def shared_scales(pairs: Sequence[Sequence[str]], dense_tflops: float, hbm_bytes_per_ms: float,
                  folders: dict | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The shared expert's measured time over its modelled time, per pass (median over points):
    the A/B difference of graph replays (`shared_ab_table`) at ≥ `SHARED_AB_MIN_TOKENS` tokens/GPU.
    Also returns the points (for the sidecar)."""
    points = []
    for row in shared_ab_table(pairs, "median_ms", SHARED_AB_MIN_TOKENS, folders).itertuples(index=False):
        pass_ = pass_of(row.kind)
        modelled = shared_expert_ms(get_shape(row.shape), float(row.tokens_per_gpu), pass_, dense_tflops, hbm_bytes_per_ms)
        points.append({"pass": pass_, "shape": row.shape, "D": int(row.D), "tokens_per_gpu": int(row.tokens_per_gpu),
                       "measured_ms": row.shared - row.noshared, "modelled_ms": modelled,
                       "ratio": (row.shared - row.noshared) / modelled})
    return per_pass_median(points, "ratio"), points


def shared_host_per_launch(pairs: Sequence[Sequence[str]], folders: dict | None = None, host_speed: str = "none"
                           ) -> tuple[dict[str, float], dict[str, dict[str, float]], list[dict[str, Any]]]:
    """The shared expert's host time from the A/B difference of the graph replays' host time
    (`host_ms`: the replay is one launch, the shared expert runs eagerly after it), at every size,
    each row at its host's speed when `host_speed` is not `none`: per pass, ms per op it launches
    (`shared_launches`; median over points), and per pass and shape, its ms (median over the shape's
    points). Also returns the points. Ops of one shape cost different host times (a linear more than
    an add), so a measured shape takes its own time and the per-op rate prices the others."""
    points = []
    for row in shared_ab_table(pairs, "host_ms", 0, folders, host_speed).itertuples(index=False):
        pass_ = pass_of(row.kind)
        launches = shared_launches(get_shape(row.shape), pass_)
        points.append({"pass": pass_, "shape": row.shape, "D": int(row.D), "tokens_per_gpu": int(row.tokens_per_gpu),
                       "host_ms": row.shared - row.noshared, "launches": launches,
                       "ms_per_launch": (row.shared - row.noshared) / launches})
    by_shape = {p: {s: float(np.median([q["host_ms"] for q in points if q["pass"] == p and q["shape"] == s]))
                    for s in sorted({q["shape"] for q in points if q["pass"] == p})}
                for p in sorted({q["pass"] for q in points})}
    return per_pass_median(points, "ms_per_launch"), by_shape, points


def per_pass_median(points: Sequence[dict[str, Any]], field: str) -> dict[str, float]:
    return {p: float(np.median([q[field] for q in points if q["pass"] == p])) for p in sorted({q["pass"] for q in points})}


@functools.lru_cache(maxsize=None)
def shared_launches(shape: MoEShape, pass_: str) -> int:
    """ATen ops that the sweep's shared expert (`occult.harness.sweep.SharedExpert`, with the sum into the
    layer's output) adds to one call: forward, or forward and backward for `train`. Counted on a
    tiny copy on the CPU (the count does not depend on the sizes); 0 without a shared expert."""
    if not shape.shared_ffn:
        return 0
    from torch.utils._python_dispatch import TorchDispatchMode

    from occult.harness.sweep.inputs import SharedExpert

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


def build_cost_model(settings: Any) -> CostModel:
    """The measured curves (all-to-all, grouped GEMM, dense peak); kernels and host terms come from
    `calibrate`."""
    link = LinkModel(
        curves=alltoall_curves(settings.alltoall_csv),
        gpus_per_node=settings.gpus_per_node,
        inter_node_bytes_per_ms=settings.inter_node_gbps / 8 * 1e9 / 1e3,
        inter_node_latency_ms=settings.inter_node_latency_us * 1e-3,
    )
    hbm = getattr(settings, "hbm_gbps", None)
    hbm_bytes_per_ms = math.inf if hbm is None else hbm * 1e9 / 1e3
    stream = getattr(settings, "kernel_stream_gbps", None)
    stream_csv = getattr(settings, "kernel_stream_csv", None)
    if stream_csv is not None:
        stream = float(np.median([fit["rate_gbps"] for fit in fit_weight_streaming(stream_csv)]))
    stream_bytes_per_ms = math.inf if stream is None else stream * 1e9 / 1e3
    pairs = getattr(settings, "shared_ab", ())
    folders = getattr(settings, "folders", {})
    scale = shared_scales(pairs, settings.dense_tflops, hbm_bytes_per_ms, folders)[0] if pairs else {}
    host_speed = getattr(settings, "host_speed", "auto")
    per_launch, by_shape, _ = shared_host_per_launch(pairs, folders, host_speed) if pairs else ({}, {}, [])
    return CostModel(link, None, None, grouped_gemm_curves(settings.gemm_csv, settings.gemm_min_rows_per_expert),
                     settings.dense_tflops, hbm_bytes_per_ms=hbm_bytes_per_ms, shared_scale=scale,
                     kernel_stream_bytes_per_ms=stream_bytes_per_ms,
                     shared_host_per_launch_ms=per_launch, shared_host_by_shape_ms=by_shape)


@dataclass
class MeasuredPoint:
    """One measured row with its traffic (trace chunks or rebuilt from its own accounting)."""

    row: Any
    spec: MethodSpec
    shape: MoEShape
    pass_: str
    chunks: list[Traffic]
    traffic_source: str

    @property
    def num_devices(self) -> int:
        return int(self.row.D)

    @property
    def measured_ms(self) -> float:
        return float(self.row.median_ms)

    @property
    def host_scale(self) -> float:
        """The host's slowness when this row ran (1: typical, or not probed): `host_scale_column`."""
        value = float(getattr(self.row, "host_scale", 1.0))
        return value if math.isfinite(value) and value > 0 else 1.0

    @property
    def host_ms(self) -> float:
        """The row's measured host time per call (occult.harness.sweep's `host_ms`; NaN where not recorded)."""
        value = float(getattr(self.row, "host_ms", math.nan))
        return value if math.isfinite(value) else math.nan

    def graph_host_ms(self, cost: CostModel) -> float:
        """The replay launch's host time at this row's host speed (graph replays; else 0)."""
        if self.spec.family != "occult-graph":
            return 0.0
        return self.host_scale * cost.graph_host_for(self.pass_, self.num_devices)

    def kernel_gflop(self) -> float:
        """Forward GFLOP of the busiest device's expert call (the kernel curve's abscissa)."""
        return float(np.mean([t.pairs_in_D.max() for t in self.chunks])) * expert_flops_per_pair(self.shape) / 1e9

    def components(self, cost: CostModel) -> dict[str, float]:
        out = point_components(self.chunks, self.shape, self.spec.name, self.pass_, cost, int(self.row.tokens_per_gpu),
                               host_scale=self.host_scale, kind=self.row.kind)
        out["row_work"] = float(np.mean([t.row_work_D.max() for t in self.chunks]))
        return out


def trace_key(shape: str, routing: str) -> str:
    return shape if routing == "synthetic" else f"{shape}@{routing}"


def measured_points(measured, traces: dict[str, ShapeTraces]) -> tuple[list[MeasuredPoint], list[tuple[Any, str]]]:
    """(points with traffic, [(row, why) of rows the model cannot place: an unsupported D])."""
    points, skipped = [], []
    for row in progress(list(measured.itertuples(index=False)), desc="measured points", unit="point"):
        spec = method_spec(row.method)
        shape = get_shape(row.shape)
        if np.isfinite(row.shared_ffn) and int(row.shared_ffn) != shape.shared_ffn:   # e.g. run with --no-shared
            shape = dataclasses.replace(shape, shared_ffn=int(row.shared_ffn))
        num_devices, tokens = int(row.D), int(row.tokens_per_gpu)
        if row.routing == "trace":
            if num_devices == 1:
                chunks = [traffic(np.zeros((tokens, 0), dtype=np.int64), np.zeros(shape.num_experts, dtype=np.int64),
                                  1, spec.mode, shape.hidden)]
                chunks = [dataclasses.replace(chunks[0], pairs_SD=np.full((1, 1), float(tokens * shape.top_k)),
                                              active_experts_D=None)]
            else:
                base = recorded_traffic(num_devices, tokens, spec.mode, shape, float(row.bytes_sent),
                                        float(row.mean_devices_per_token), float(row.pairs_received_max))
                chunks = [static_traffic(base, shape.hidden) if spec.static else base]
            points.append(MeasuredPoint(row, spec, shape, pass_of(row.kind), chunks, "recorded"))
            continue
        shape_traces = traces[trace_key(row.shape, row.routing)]
        why = shape_traces.support(row.method, num_devices)
        if why:
            skipped.append((row, why))
            continue
        chunks = shape_traces.traffic_at(row.method, num_devices, tokens)
        points.append(MeasuredPoint(row, spec, shape, pass_of(row.kind), chunks, f"trace:{row.routing}"))
    return points, skipped


def point_weight_ms(p: "MeasuredPoint", pass_: str, hbm_bytes_per_ms: float) -> float:
    """Weight reads of the busiest device's active experts at a measured point (mean over chunks)."""
    local = p.shape.num_experts / p.num_devices
    active = [float(np.max(t.active_experts_D)) if t.active_experts_D is not None else local for t in p.chunks]
    return weight_read_ms(float(np.mean(active)), p.shape, pass_, hbm_bytes_per_ms)


def kernel_rows(points: Sequence[MeasuredPoint], pass_: str, cost: CostModel) -> list[tuple[float, float, MeasuredPoint]]:
    """(forward GFLOP of the call, TFLOP/s of its math, point) of the calibration `-compute` rows of
    a pass, from the busiest rank's recorded pairs (the trace's when the row has none); the math is
    the measured time less the shared expert and the experts' weight reads."""
    out = []
    for p in points:
        if p.row.role != "calibration" or p.spec.family != "occult-compute" or p.pass_ != pass_:
            continue
        pairs = float(p.row.pairs_received_max)
        if not np.isfinite(pairs):
            pairs = float(np.mean([t.pairs_in_D.max() for t in p.chunks]))
        ms = p.measured_ms - cost.shared_ms(p.shape, float(p.row.tokens_per_gpu), pass_)
        ms -= point_weight_ms(p, pass_, cost.hbm_bytes_per_ms)
        if ms <= 0:
            raise SimulateError(f"simulate.calibration: {p.row.source}: {p.row.method} at {p.row.tokens_per_gpu} "
                                "tokens/GPU is faster than its experts' weight reads (hbm_gbps too low?)")
        flops = pairs * expert_flops_per_pair(p.shape)
        out.append((flops / 1e9, flops / (ms * 1e-3) / 1e12, p))
    return out


def median_curve(samples: Sequence[tuple[float, float]]) -> LogLogCurve:
    """A log-log curve through the median y of each distinct x (6 significant digits), flat beyond."""
    by_x: dict[float, list[float]] = {}
    for x, y in samples:
        by_x.setdefault(float(f"{x:.6g}"), []).append(y)
    xs = np.array(sorted(by_x))
    return LogLogCurve(xs, np.array([np.median(by_x[x]) for x in xs]), extend="flat")


def curves_by_ffn(rows: Sequence[tuple[float, float, MeasuredPoint]]) -> dict[int, LogLogCurve]:
    """One median curve per expert width among `kernel_rows` output; empty when the rows have a
    single width (the pooled curve is then the same)."""
    widths = sorted({p.shape.ffn for _, _, p in rows})
    if len(widths) < 2:
        return {}
    return {f: median_curve([(g, t) for g, t, p in rows if p.shape.ffn == f]) for f in widths}


def calibrate(points: Sequence[MeasuredPoint], cost: CostModel) -> CostModel:
    """Fill the kernel curve, Occult's other GPU work, the naive per-pair cost and the host terms
    from the calibration points only (in that order: each step uses the ones before)."""
    calib = [p for p in points if p.row.role == "calibration"]
    # 1. kernels: forward TFLOP/s curve, fwd+bwd scale at the same pairs
    fwd = kernel_rows(calib, "fwd", cost)
    if fwd:
        cost = dataclasses.replace(cost, kernel_tflops=median_curve([(gflop, tflops) for gflop, tflops, _ in fwd]),
                                   kernel_tflops_by_ffn=curves_by_ffn(fwd))
        train = kernel_rows(calib, "train", cost)
        if train:
            scales = []
            for gflop, tflops, p in train:     # fwd+bwd math over forward math at the same call
                scales.append(cost.kernel_curve(p.shape.ffn)(gflop) / tflops)
            cost = dataclasses.replace(cost, kernel_train_scale=float(np.median(scales)))
            train_curve = median_curve([(gflop, tflops) for gflop, tflops, _ in train])
            if len(train_curve.x) >= 2:        # sizes apart: the backward's own curve, not one ratio
                by_ffn = {f: c for f, c in curves_by_ffn(train).items() if len(c.x) >= 2}
                cost = dataclasses.replace(cost, kernel_train_tflops=train_curve, kernel_train_tflops_by_ffn=by_ffn)
    # 2. Occult's other GPU work, from graph replays less their launch's host time
    cost = graph_replay_host(calib, cost)
    if cost.kernel_tflops is not None:
        graphs = [p for p in calib if p.spec.family == "occult-graph" and p.pass_ == "fwd"]
        measured_range = [p for p in graphs if p.kernel_gflop() >= cost.kernel_curve(p.shape.ffn).x[0] * (1 - 1e-9)]
        small = [p for p in graphs if p not in measured_range]
        graphs = measured_range or graphs
        if graphs:
            zero = dataclasses.replace(cost, other_gpu=OtherGpuTerms(0.0, 0.0, 1.0, 0))
            residual = np.array([p.measured_ms - p.graph_host_ms(cost) - p.components(zero)["gpu_ms"] for p in graphs])
            rows = np.array([p.components(zero)["row_work"] for p in graphs])
            measured = np.array([p.measured_ms for p in graphs])
            fixed, per_row_ms = fit_linear_nonnegative(residual, rows, measured)
            terms = OtherGpuTerms(fixed, per_row_ms * 1e6, None, len(graphs))
            trains = [p for p in calib if p.spec.family == "occult-graph" and p.pass_ == "train"]
            if trains and cost.kernel_train_scale is not None:
                zero_train = dataclasses.replace(cost, other_gpu=OtherGpuTerms(0.0, 0.0, 0.0, 0))
                residual = np.array([p.measured_ms - p.graph_host_ms(cost) - p.components(zero_train)["gpu_ms"]
                                     for p in trains])
                rows = np.array([p.components(zero_train)["row_work"] for p in trains])
                factors = residual / (fixed + rows * per_row_ms)
                terms = dataclasses.replace(terms, train_factor=max(float(np.median(factors)), 0.0))
                if len(np.unique(np.round(rows))) >= 2:       # sizes apart: fixed + per-row of fwd+bwd
                    t_fixed, t_rate = fit_linear_nonnegative(residual, rows, np.array([p.measured_ms for p in trains]))
                    terms = dataclasses.replace(terms, train_fixed_ms=t_fixed, train_per_row_ns=t_rate * 1e6,
                                                train_factor=None)
            cost = dataclasses.replace(cost, other_gpu=terms)
            if small and measured_range:
                cost = calibrate_kernel_floor(small, cost)
    # 3. naive: per-pair memory-bound cost (shared by every D of a pass) and host terms per D
    for pass_ in PASSES:
        naive = [p for p in calib if p.spec.family == "naive" and p.pass_ == pass_]
        if naive and cost.grouped_tflops:
            cost = calibrate_naive(naive, cost, pass_)
    # 4. per_expert rows: their own per-row GPU cost (plan with a sort, k-row combine, kernels
    #    without the pair reduction), fitted jointly with their forward host terms
    pe_fwd = [p for p in calib if p.spec.mode == "per_expert" and p.pass_ == "fwd"]
    if pe_fwd and cost.other_gpu is not None:
        cost = calibrate_per_expert(pe_fwd, cost)
    # 5. Occult eager host terms per (family, pass, D)
    host = dict(cost.host)
    for family in ("occult", "occult-pe", "occult-static"):
        for pass_ in PASSES:
            group = [p for p in calib if p.spec.family == family and p.pass_ == pass_]
            graph_spec = method_spec("occult-graph") if group else None   # its kernels and other GPU work
            if not group or cost.missing(graph_spec, pass_, group[0].num_devices):
                continue
            fits = {}
            for num_devices in sorted({p.num_devices for p in group}):
                chosen = [p for p in group if p.num_devices == num_devices]
                gpu = np.array([p.components(cost)["gpu_ms"] for p in chosen])
                shared = shared_host_array(chosen, cost)
                scale = host_scale_array(chosen)
                pre, post, _ = fit_host(gpu, np.array([p.measured_ms for p in chosen]), shared, scale)
                fits[num_devices] = (pre, post, gpu / scale - shared, len(chosen))
            host.update(host_terms(family, pass_, fits))
    # 6. each measured shape's own host offset from its family's terms
    return calibrate_shape_host(calib, dataclasses.replace(cost, host=host))


def calibrate_shape_host(calib: Sequence[MeasuredPoint], cost: CostModel) -> CostModel:
    """Per (family, sweep kind, D, shape): the median of (measured − predicted) / s over the shape's
    host-bound eager calibration rows (s·(post + S) ≥ G). The family terms are one fit over every
    shape, while each shape launches its own ops (results/nvidia-h200/host_probe_v2: the layer's host
    time alone differs by 12–63 µs between shapes); the offset adds to `pre`, which every eager
    point pays."""
    residuals: dict[tuple[str, str, int, str], list[float]] = {}
    for p in calib:
        if p.spec.family not in EAGER_FAMILIES or cost.host_for(p.spec.family, p.pass_, p.num_devices) is None:
            continue
        parts = p.components(cost)
        if parts["host_post_ms"] + parts["host_shared_ms"] < parts["gpu_ms"] * (1 - 1e-9):    # GPU-bound
            continue
        key = (p.spec.family, p.row.kind, p.num_devices, p.shape.name)
        residuals.setdefault(key, []).append((p.measured_ms - parts["layer_ms"]) / p.host_scale)
    return dataclasses.replace(cost, host_shape_ms={**cost.host_shape_ms,
                                                    **{k: float(np.median(v)) for k, v in residuals.items()}})


def graph_replay_host(calib: Sequence[MeasuredPoint], cost: CostModel) -> CostModel:
    """The host time of launching a graph replay per (pass, D): the median over the calibration's graph
    rows that recorded `host_ms` of host_ms / s − S (s: the row's host slowness; S: its shared
    expert's eager launches, which follow the replay). It precedes the replay's GPU work, so it adds
    to the step (results/nvidia-h200/sweeps_v33: OLMoE's replays took 0.05 ms longer in the process
    whose host_ms was 0.05 ms longer)."""
    found = {}
    for key in sorted({(p.pass_, p.num_devices) for p in calib if p.spec.family == "occult-graph" and p.pass_ == "fwd"}):
        values = [p.host_ms / p.host_scale - cost.shared_host_ms(p.shape, p.pass_) for p in calib
                  if p.spec.family == "occult-graph" and (p.pass_, p.num_devices) == key and math.isfinite(p.host_ms)]
        if values:
            found[key] = max(float(np.median(values)), 0.0)
    return dataclasses.replace(cost, graph_host_ms={**cost.graph_host_ms, **found})


def shared_host_array(points: Sequence[MeasuredPoint], cost: CostModel) -> np.ndarray:
    """Each point's known host time of launching its shared expert (0 without one)."""
    return np.array([cost.shared_host_ms(p.shape, p.pass_) for p in points])


def host_scale_array(points: Sequence[MeasuredPoint]) -> np.ndarray:
    """Each point's host slowness (`MeasuredPoint.host_scale`)."""
    return np.array([p.host_scale for p in points])


def calibrate_kernel_floor(points: Sequence[MeasuredPoint], cost: CostModel) -> CostModel:
    """The expert kernels' latency floor (ms above their weight reads): the median over forward
    graph replays smaller than every `-compute` calibration row of what the other terms leave. Rows
    of shapes without a shared expert are used where there are any: a replay followed by the shared
    expert's eager launches can be host-bound at these sizes, and its time then says nothing of G."""
    floors = []
    plain = [p for p in points if not p.shape.shared_ffn]
    for p in plain or points:
        parts = p.components(dataclasses.replace(cost, kernel_floor_ms=0.0))
        weights = point_weight_ms(p, "fwd", cost.stream_bytes_per_ms)
        floors.append(p.measured_ms - p.graph_host_ms(cost) - (parts["gpu_ms"] - parts["kernels_ms"]) - weights)
    return dataclasses.replace(cost, kernel_floor_ms=max(float(np.median(floors)), 0.0))


def host_terms(family: str, pass_: str, fits: dict[int, tuple[float, float, np.ndarray, int]]
               ) -> dict[tuple[str, str, int], HostTerms]:
    """HostTerms per D from (pre, post, G − S of the points, count) fits (S: shared-expert launches). Where every calibration point
    of a D is host-bound (post ≥ G), only pre + post is measured: the split is taken from the
    nearest D whose points do fix it (post kept ≥ the largest G), and the source says so."""
    identified = {d: f for d, f in fits.items() if f[2].size and f[1] < f[2].max() + 1e-9}
    out = {}
    for d, (pre, post, gpu, count) in fits.items():
        source = f"fit on {count} points"
        if d not in identified and identified:
            donor = min(identified, key=lambda other: (abs(other - d), other))
            d_pre, d_post = identified[donor][:2]
            total = pre + post
            share = d_pre / (d_pre + d_post) if d_pre + d_post > 0 else 0.0
            post = max(total * (1 - share), float(gpu.max()) if gpu.size else 0.0)
            pre = max(total - post, 0.0)
            source += f" (host-bound only: pre/post split of D={donor})"
        out[(family, pass_, d)] = HostTerms(pre, post, count, source)
    return out


def fit_linear_nonnegative(residual_ms: np.ndarray, rows: np.ndarray, measured_ms: np.ndarray) -> tuple[float, float]:
    """(fixed ms, ms per row) ≥ 0 minimising the squared relative error of fixed + rate·rows."""
    weights = 1.0 / measured_ms
    design = np.stack([weights, rows * weights], axis=1)
    target = residual_ms * weights
    (fixed, rate), *_ = np.linalg.lstsq(design, target, rcond=None)
    if rate < 0:
        fixed, rate = float(np.sum(target * weights) / np.sum(weights**2)), 0.0
    if fixed < 0:
        column = design[:, 1]
        fixed, rate = 0.0, float(max(np.sum(target * column) / max(np.sum(column**2), 1e-30), 0.0))
    return float(max(fixed, 0.0)), float(rate)


def calibrate_per_expert(points: Sequence[MeasuredPoint], cost: CostModel) -> CostModel:
    """ns per row of per_expert dispatch's other GPU work, by a log-spaced search in which each
    rate gets its best host terms per D (as `calibrate_naive`); the host terms are refitted after."""
    by_d = {d: [p for p in points if p.num_devices == d] for d in sorted({p.num_devices for p in points})}
    measured = {d: np.array([p.measured_ms for p in ps]) for d, ps in by_d.items()}

    def gpu(rate: float, d: int) -> np.ndarray:
        trial = dataclasses.replace(cost, pe_per_row_ns=rate)
        return np.array([p.components(trial)["gpu_ms"] for p in by_d[d]])

    base = {d: gpu(0.0, d) for d in by_d}
    unit = {d: gpu(1.0, d) - base[d] for d in by_d}
    shared = {d: shared_host_array(by_d[d], cost) for d in by_d}
    scale = {d: host_scale_array(by_d[d]) for d in by_d}

    def loss(rate: float) -> float:
        return sum(fit_host(base[d] + rate * unit[d], measured[d], shared[d], scale[d])[2] * len(by_d[d]) for d in by_d)

    rates = np.concatenate([[0.0], np.geomspace(0.25, 64.0, 25)])
    best = int(np.argmin([loss(r) for r in rates]))
    fine = np.linspace(rates[max(best - 1, 0)], rates[min(best + 1, len(rates) - 1)], 21)
    return dataclasses.replace(cost, pe_per_row_ns=float(min(fine, key=loss)))


def calibrate_naive(points: Sequence[MeasuredPoint], cost: CostModel, pass_: str) -> CostModel:
    """ns per pair of the naive EP's memory-bound ops and its host terms per D, jointly: a
    log-spaced search over the rate, host terms fitted per D for each rate."""
    by_d = {d: [p for p in points if p.num_devices == d] for d in sorted({p.num_devices for p in points})}
    base = {d: np.array([p.components(dataclasses.replace(cost, naive_ns_per_pair={pass_: 0.0}))["gpu_ms"]
                         for p in ps]) for d, ps in by_d.items()}
    unit = {d: np.array([p.components(dataclasses.replace(cost, naive_ns_per_pair={pass_: 1.0}))["gpu_ms"]
                         for p in ps]) - base[d] for d, ps in by_d.items()}
    measured = {d: np.array([p.measured_ms for p in ps]) for d, ps in by_d.items()}
    shared = {d: shared_host_array(ps, cost) for d, ps in by_d.items()}
    scale = {d: host_scale_array(ps) for d, ps in by_d.items()}

    def loss(rate: float) -> tuple[float, dict[int, tuple[float, float, float]]]:
        fits = {d: fit_host(base[d] + rate * unit[d], measured[d], shared[d], scale[d]) for d in by_d}
        total = sum(fits[d][2] * len(by_d[d]) for d in by_d)
        return total, fits

    rates = np.geomspace(0.5, 500.0, 31)
    scores = [loss(r)[0] for r in rates]
    best = int(np.argmin(scores))
    fine = np.geomspace(rates[max(best - 1, 0)], rates[min(best + 1, len(rates) - 1)], 21)
    rate = float(min(fine, key=lambda r: loss(r)[0]))
    _, fits = loss(rate)
    host = dict(cost.host)
    host.update(host_terms("naive", pass_, {d: (pre, post, (base[d] + rate * unit[d]) / scale[d] - shared[d], len(by_d[d]))
                                            for d, (pre, post, _) in fits.items()}))
    return dataclasses.replace(cost, naive_ns_per_pair={**cost.naive_ns_per_pair, pass_: rate}, host=host)


def replicate_key(row: Any) -> tuple:
    """Rows with the same key run the same computation: at D = 1 every eager Occult variant (pruning
    and placement do nothing); N_d ≥ D is exact routing; graph replays of them likewise. A row run
    without the shape's shared experts (`--no-shared`, `shared_ffn` 0) is another computation."""
    spec = method_spec(row.method)
    num_devices = int(row.D)
    nd = spec.max_devices if spec.max_devices is not None and spec.max_devices < num_devices else None
    contiguous = spec.contiguous and num_devices > 1
    shared = getattr(row, "shared_ffn", float("nan"))
    shared_ffn = int(shared) if np.isfinite(shared) else get_shape(row.shape).shared_ffn
    return (row.kind, row.shape, num_devices, int(row.tokens_per_gpu), row.routing, spec.family, spec.mode, nd,
            contiguous, shared_ffn)


def validation_table(points: Sequence[MeasuredPoint], cost: CostModel, tolerance: float):
    """One row per measured point: role, measured vs predicted, the model's terms, replicates."""
    import pandas as pd

    groups: dict[tuple, list[float]] = {}
    for p in points:
        groups.setdefault(replicate_key(p.row), []).append(p.measured_ms)
    reachable_ratio = (1 + tolerance) / (1 - tolerance)
    rows = []
    for p in points:
        row = p.row
        missing = cost.missing(p.spec, p.pass_, p.num_devices)
        parts = p.components(cost) if missing is None else {k: float("nan") for k in (*COMPONENTS, "layer_ms")}
        predicted = parts["layer_ms"] if missing is None else float("nan")
        err = (predicted - p.measured_ms) / p.measured_ms
        replicates = groups[replicate_key(row)]
        ratio = max(replicates) / min(replicates)
        eager = p.spec.family in EAGER_FAMILIES
        bound = ("host" if eager and parts["host_post_ms"] + parts["host_shared_ms"] > parts["gpu_ms"] else "gpu") if missing is None else missing
        rows.append({
            "role": row.role, "kind": row.kind, "shape": row.shape, "method": row.method, "family": p.spec.family,
            "routing": row.routing, "D": p.num_devices, "tokens_per_gpu": int(row.tokens_per_gpu),
            "batch": row.batch, "measured_ms": p.measured_ms, "p10_ms": row.p10_ms, "p90_ms": row.p90_ms,
            "predicted_ms": predicted, "rel_err": err, "within_tolerance": bool(abs(err) <= tolerance),
            "bound": bound, **{k: parts.get(k, float("nan")) for k in COMPONENTS}, "host_scale": p.host_scale,
            "replicates": len(replicates), "replicate_ratio": ratio, "reachable": bool(ratio <= reachable_ratio),
            "measured_ct": row.mean_devices_per_token, "trace_ct": parts.get("mean_devices_per_token"),
            "measured_bytes_sent": row.bytes_sent, "trace_bytes_sent": parts.get("trace_bytes_sent"),
            "measured_pairs_max": row.pairs_received_max, "trace_pairs_max": parts.get("pairs_max"),
            "traffic_source": p.traffic_source, "source": row.source, "commit": row.commit,
        })
    return pd.DataFrame(rows, columns=list(VALIDATION_COLUMNS))


def validate(settings: Any, traces: dict[str, ShapeTraces], cost: CostModel, measured) -> tuple[Any, CostModel]:
    """Calibrate on the calibration rows, predict every measured row; (table, calibrated cost model).

    `traces` must hold every (shape, routing) of `measured` that is regenerated on the CPU
    (keys from `trace_key`)."""
    points, skipped = measured_points(measured, traces)
    for row, why in skipped:
        print(f"simulate: not modelled: {row.kind} {row.shape} {row.method} D={row.D}: {why}", file=sys.stderr)
    fitted = calibrate(points, cost)
    return validation_table(points, fitted, settings.tolerance), fitted


# ----------------------------------------------------------------------------------------------
# (d) Predictions


def predict(traces: dict[str, ShapeTraces], methods: Sequence[str], devices: Sequence[int],
            points: Sequence[tuple[str, int, int | None]], cost: CostModel, desc: str = "predict"):
    """Rows of PREDICTION_COLUMNS for every shape × method × D × (kind, tokens/GPU, batch)."""
    import pandas as pd

    rows = []
    total = len(traces) * len(methods) * len(devices) * len(points)
    bar = progress(total, desc=desc, unit="point")
    for shape_name, shape_traces in traces.items():
        for num_devices in devices:
            nodes = math.ceil(num_devices / cost.link.gpus_per_node)
            for kind, tokens, batch in points:
                pass_ = pass_of(kind)
                baseline = None
                for method in sorted(methods, key=lambda m: m != "naive"):   # naive first: the reference
                    base = {"shape": shape_name, "method": method, "kind": kind, "D": num_devices, "nodes": nodes,
                            "gpus_per_node": min(cost.link.gpus_per_node, num_devices), "tokens_per_gpu": tokens,
                            "batch": batch, "moe_layers": MOE_LAYERS.get(shape_name, 1)}
                    bar.update(1)
                    status = shape_traces.support(method, num_devices) or cost.missing(method_spec(method), pass_,
                                                                                       num_devices)
                    if status is not None:
                        rows.append({**base, "status": status})
                        continue
                    parts = simulate_point(shape_traces, method, num_devices, tokens, pass_, cost, kind)
                    layer = parts["layer_ms"]
                    if method == "naive":
                        baseline = layer
                    rows.append({**base, **{k: parts[k] for k in PREDICTION_COLUMNS if k in parts},
                                 "model_ms": layer * base["moe_layers"],
                                 "speedup_vs_naive": baseline / layer if baseline else None, "status": "ok"})
    bar.close()
    return pd.DataFrame(rows, columns=list(PREDICTION_COLUMNS))


def sweep_points(kinds: Sequence[str], seq_len: int = 512) -> list[tuple[str, int, int | None]]:
    """(kind, tokens per GPU, batch) of `occult.harness.sweep`'s default sizes."""
    from occult.harness.sweep.settings import DEFAULT_SIZES

    points = []
    for kind in kinds:
        for size in DEFAULT_SIZES[kind]:
            tokens = size * seq_len if kind == "train" else size
            points.append((kind, tokens, None if kind == "prefill" else size))
    return points


def cost_summary(cost: CostModel) -> dict[str, Any]:
    """The calibrated parameters, for the sidecar."""
    def points(curve: LogLogCurve | None) -> dict[float, float] | None:
        return dict(zip(curve.x.tolist(), np.round(curve.y, 2).tolist())) if curve is not None else None

    return {
        "kernel_tflops_by_call_gflop": points(cost.kernel_tflops),
        "kernel_train_tflops_by_call_gflop": points(cost.kernel_train_tflops),
        "kernel_tflops_by_ffn": {f: points(c) for f, c in cost.kernel_tflops_by_ffn.items()},
        "kernel_train_tflops_by_ffn": {f: points(c) for f, c in cost.kernel_train_tflops_by_ffn.items()},
        "kernel_train_scale": cost.kernel_train_scale,
        "other_gpu": dataclasses.asdict(cost.other_gpu) if cost.other_gpu else None,
        "naive_ns_per_pair_D1": cost.naive_ns_per_pair,
        "per_expert_other_gpu_ns_per_row": cost.pe_per_row_ns,
        "kernel_floor_ms": cost.kernel_floor_ms,
        "kernel_stream_gbps": (cost.kernel_stream_bytes_per_ms * 1e3 / 1e9
                               if math.isfinite(cost.kernel_stream_bytes_per_ms) else None),
        "shared_expert_scale_by_pass": cost.shared_scale or None,
        "shared_expert_host_ms_per_launch_by_pass": cost.shared_host_per_launch_ms or None,
        "shared_expert_host_ms_by_pass_and_shape": cost.shared_host_by_shape_ms or None,
        "graph_replay_host_ms": {f"{p}/D={d}": v for (p, d), v in sorted(cost.graph_host_ms.items())} or None,
        "shared_expert_launches": {s: {p: shared_launches(get_shape(s), p) for p in PASSES}
                                   for s in ("qwen", "deepseek")},
        "hbm_gbps": cost.hbm_bytes_per_ms * 1e3 / 1e9 if math.isfinite(cost.hbm_bytes_per_ms) else None,
        "naive_bytes_factor_D_gt_1": NAIVE_BYTES_EP / NAIVE_BYTES_D1,
        "host": {f"{f}/{p}/D={d}": dataclasses.asdict(h) for (f, p, d), h in sorted(cost.host.items())},
        "host_offset_ms_by_shape": {f"{f}/{k}/D={d}/{s}": round(v, 4)
                                    for (f, k, d, s), v in sorted(cost.host_shape_ms.items())} or None,
    }


@dataclass(frozen=True)
class RecordedRequest:
    """Predictions on a recorded trace (`predict_recorded`), written to `out`."""

    profile_dir: Path
    name: str
    shape: str
    layers: Sequence[int] | None
    out: Path


def run_simulate(settings: Any, seed: int, out_dir: Path, figures_dir: Path | None,
                 config_hash: str | None = None, recorded: RecordedRequest | None = None) -> dict[str, Path]:
    """Validation table, scale predictions and the issue-8 table (+ figures), and with `recorded`
    the predictions on a recorded trace, with the same calibrated model; returns the paths."""
    from occult.provenance import provenance, seed_everything, write_csv

    seed_everything(seed)
    measured = {name: read_measured(files, calibration, settings.folders,
                                    "simulate" if name == "current" else f"simulate.history.{name}")
                for name, files, calibration in settings.sets()}
    for frame in measured.values():
        frame["host_scale"] = host_scale_of_set(frame, getattr(settings, "host_speed", "auto"))
    keys = {(s, "synthetic") for s in settings.shapes}
    for frame in measured.values():
        keys |= {(s, r) for s, r in zip(frame["shape"], frame["routing"]) if r != "trace"}
    traces = {trace_key(s, r): ShapeTraces(get_shape(s), settings.pool_tokens, seed, r) for s, r in sorted(keys)}
    table, cost = validate(settings, traces, build_cost_model(settings), measured.pop("current"))
    history, history_costs = history_tables(settings, traces, measured)
    targets = {name: traces[name] for name in settings.shapes}
    prefill = [("prefill", tokens, None) for tokens in settings.tokens_per_gpu]
    predictions = predict(targets, settings.methods, settings.devices, prefill, cost, "predict D")
    issue8 = predict(targets, settings.methods, settings.issue8_devices,
                     sweep_points(("prefill", "decode", "train")), cost, "predict issue 8")

    meta = provenance(config_hash, seed, stage="simulate", settings=dataclasses.asdict(settings),
                      calibrated=cost_summary(cost),
                      calibrated_history={name: cost_summary(c) for name, c in history_costs.items()},
                      alltoall_source=settings.alltoall_csv or "DESIGN.md 2-GPU table (built in)",
                      gemm_source=settings.gemm_csv or "none (naive EP uncalibrated)")
    paths = {"validation": out_dir / "validation.csv", "history": out_dir / "validation_history.csv",
             "predictions": out_dir / "predictions.csv", "issue8": out_dir / "predictions_D4_D8.csv"}
    write_csv(paths["validation"], table, meta=meta)
    write_csv(paths["history"], history, meta=meta)
    write_csv(paths["predictions"], predictions, meta=meta)
    write_csv(paths["issue8"], issue8, meta=meta)
    if recorded is not None:
        paths["trace"] = recorded.out
        write_csv(recorded.out, predict_recorded(recorded.profile_dir, recorded.name, recorded.shape, recorded.layers,
                                                 settings.methods, settings.devices, settings.tokens_per_gpu, cost, seed),
                  meta={**meta, "stage": "simulate_trace", "trace": {
                      "profile_dir": str(recorded.profile_dir), "name": recorded.name, "shape": recorded.shape,
                      "layers": None if recorded.layers is None else list(recorded.layers)}})
    if figures_dir is not None:
        paths["fig_speedup"] = figures_dir / "simulate_speedup.png"
        paths["fig_validation"] = figures_dir / "simulate_validation.png"
        plot_speedup(predictions, paths["fig_speedup"])
        plot_validation(table, settings.tolerance, paths["fig_validation"])
    print_summary(table, cost)
    for name, rows in history.groupby("set", sort=False):
        print(f"history set {name}:")
        print_summary(rows, history_costs[name], terms=False)
    return paths


def history_tables(settings: Any, traces: dict[str, "ShapeTraces"], measured: dict[str, Any]):
    """(validation rows of every history set, a `set` column first; {set: its calibrated model}):
    each older runtime calibrated on its own calibration rows, exactly as the current one."""
    import pandas as pd

    tables, costs = [], {}
    for name, frame in measured.items():
        table, costs[name] = validate(settings, traces, build_cost_model(settings), frame)
        tables.append(table.assign(set=name))
    columns = ["set", *VALIDATION_COLUMNS]
    return (pd.concat(tables, ignore_index=True)[columns] if tables else pd.DataFrame(columns=columns)), costs


# ----------------------------------------------------------------------------------------------
# Figures and summary


def plot_speedup(predictions, out: Path) -> None:
    """Predicted speedup over per-expert dispatch (naive) vs D, one panel per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.provenance import atomic_path

    ok = predictions[(predictions["status"] == "ok") & (predictions["method"] != "naive")]
    shapes = list(dict.fromkeys(predictions["shape"]))
    fig, axes = plt.subplots(1, max(len(shapes), 1), figsize=(4.2 * max(len(shapes), 1), 3.6), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, shape in zip(axes[0], shapes):
        part = ok[ok["shape"] == shape]
        for (method, tokens), rows in part.groupby(["method", "tokens_per_gpu"]):
            style = styles[sorted(part["tokens_per_gpu"].unique()).index(tokens) % len(styles)]
            ax.plot(rows["D"], rows["speedup_vs_naive"], style, marker="o", ms=3,
                    label=f"{method}, {tokens} tok/GPU")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(shape)
        ax.set_xlabel("devices D")
        ax.set_ylabel("predicted speedup vs per-expert dispatch")
    if shapes:
        axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def identity_axes(ax, values: np.ndarray, tolerance: float | None, log: bool) -> None:
    """y = x over the range of `values` (with a ±tolerance band if given), log axes if `log`, legend."""
    low, high = float(np.nanmin(values)), float(np.nanmax(values))
    line = np.geomspace(low * 0.8, high * 1.25, 50) if log else np.linspace(low * 0.9, high * 1.1, 50)
    ax.plot(line, line, color="black", lw=0.8)
    if tolerance is not None:
        ax.fill_between(line, line * (1 - tolerance), line * (1 + tolerance), color="grey", alpha=0.2,
                        label=f"±{tolerance:.0%}")
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.legend(fontsize=6)


def plot_validation(table, tolerance: float, out: Path) -> None:
    """Measured vs predicted per point; calibration and validation points apart; ±tolerance band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.provenance import atomic_path

    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    markers = {"occult": "o", "occult-static": "s", "occult-graph": "^", "occult-compute": "v", "naive": "x"}
    table = table[np.isfinite(table["predicted_ms"])]
    for (role, family), rows in table.groupby(["role", "family"]):
        ax.scatter(rows["measured_ms"], rows["predicted_ms"], marker=markers.get(family, "."), s=14,
                   color="tab:blue" if role == "calibration" else "tab:red", alpha=0.7, label=f"{role}: {family}")
    if not table.empty:
        identity_axes(ax, table[["measured_ms", "predicted_ms"]].to_numpy(), tolerance, log=True)
    ax.set_xlabel("measured ms per layer")
    ax.set_ylabel("predicted ms per layer")
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def print_summary(table, cost: CostModel, terms: bool = True) -> None:
    """Calibrated terms (if `terms`), then points within tolerance per role and method family."""
    for (family, pass_, num_devices), host in sorted(cost.host.items() if terms else ()):
        print(f"host {family:>13} {pass_:<5} D={num_devices}: pre {host.pre_ms:.2f} ms, post {host.post_ms:.2f} ms "
              f"({host.source})")
    if terms and cost.other_gpu is not None:
        other = cost.other_gpu
        train = (f"fwd+bwd {other.train_fixed_ms:.3f} ms + {other.train_per_row_ns:.2f} ns/row"
                 if other.train_per_row_ns is not None else f"fwd+bwd x{other.train_factor}")
        print(f"occult other GPU work: {other.fixed_ms:.3f} ms + {other.per_row_ns:.2f} ns/row, {train}")
    if terms and cost.kernel_floor_ms:
        print(f"occult expert kernels' latency floor: {cost.kernel_floor_ms:.3f} ms above their weight reads")
    if terms and cost.pe_per_row_ns is not None:
        print(f"per_expert other GPU work: {cost.pe_per_row_ns:.2f} ns/row")
    for pass_, rate in sorted(cost.naive_ns_per_pair.items() if terms else ()):
        print(f"naive memory-bound ops {pass_}: {rate:.1f} ns/pair at D=1")
    for (role, family), rows in table.groupby(["role", "family"]):
        errors = rows["rel_err"].abs()
        print(f"{role:>11} {family:>14}: {len(rows):3d} points, {int(rows['within_tolerance'].sum()):3d} within "
              f"tolerance, median |err| {errors.median():.1%}, max {errors.max():.1%}")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------
# Command line (the pipeline calls `occult simulate`; this entry is for direct use)


def main(argv: Sequence[str] | None = None) -> int:
    """Bad inputs raise `ConfigError` / `SimulateError` (ValueErrors naming their field or file);
    run as a module (`run_main`) they become one error line and a `failed` JSON record, exit 1."""
    from occult.config import ConfigError, load_config

    parser = argparse.ArgumentParser(prog="python -m occult.sim.simulator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, type=Path, help="directory of the three CSVs")
    parser.add_argument("--figures", type=Path, default=None)
    parser.add_argument("--trace", type=Path, metavar="PROFILE_DIR",
                        help="also predict on this recorded routing (routing_*.npz or a GPU run's *_sample.npz)")
    parser.add_argument("--trace-name", default="trace", help="its name in the CSV")
    parser.add_argument("--trace-shape", default="olmoe", help="the layer shape its routing is mapped onto")
    parser.add_argument("--trace-layers", type=int, nargs="+", help="its layers to use (default: all)")
    parser.add_argument("--trace-out", type=Path, help="predictions on the trace (default: <out>/predictions_trace.csv)")
    parser.add_argument("--log-json", metavar="PATH",
                        help=f"append JSON-lines logs here (default: ${ENV_LOG_JSON}); read by the entry point")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    if cfg.simulate is None:
        raise ConfigError("simulate: the configuration has no simulate section")
    recorded = None if args.trace is None else RecordedRequest(
        args.trace, args.trace_name, args.trace_shape, args.trace_layers,
        args.trace_out or args.out / "predictions_trace.csv")
    run_simulate(cfg.simulate, cfg.seed, args.out, args.figures, cfg.hash(), recorded)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("simulate", main, output_flags=("--out", "--figures")))
