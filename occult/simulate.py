"""Trace-driven scale simulator of the EP MoE layer: bytes per device pair, then time (issue 6).

(a) Traffic. From a routing trace (`ids_NK`, global expert ids), a placement (expert → device)
and a dispatch mode, `traffic` counts per (source, destination) device the rows, the (token,
expert) pairs and the bytes on the wire, in the runtime's exact format (`occult.ep.layer`):

  * `dedup` (Occult, exact or N_d-pruned routing): one packed row per (token, device): the hidden
    vector (padded to 4 B) + 8 B per metadata slot (`slots` = most pairs any row carries), padded
    to 64 B; one returned row (hidden vector) per sent row.
  * `per_expert` (the same runtime, one row per (token, expert)): slots = 1, same padding.
  * `naive` (`occult.baselines.naive`): one bare hidden vector per (token, expert), each way.

(b) Time. Per layer and device: a fixed overhead + a per-row cost × rows handled + expert GEMM
FLOPs / throughput (at the device's own pairs: the busiest device sets the pace) + the shared
expert; plus the all-to-alls, timed from a bandwidth curve (interpolated in log-log between
measured sizes; NVLink inside a node of `gpus_per_node`, a network of `inter_node_gbps` per GPU
plus a latency between nodes; the two run concurrently). The fixed and per-row terms are fitted
on a declared calibration subset of measured points (D ∈ `calibration_devices`, default D=1: no
communication) and never on the points they are checked against. End-to-end = MoE layers × layer.

(c) Validation: every measured Occult / naive point of the given sweep CSVs is predicted on the
sweep's own routing (its seeded `SyntheticRouter`, its `greedy_occult` placement, its pruning),
and the table says which points were calibration and which validation, with the relative error.

(d) Predictions for D = 4 … 64 (single node, then several) and the issue-8 table for D = 4, 8.

Routing traces are regenerated on the CPU: the sweeps drew their hidden states from CUDA
generators, so the tokens differ but come from the same distribution; the placement (computed
on the CPU by the sweep) is the same. E[C_T] of the trace is written beside the measured one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from occult.baselines import MoEShape, get_shape

MIB = 2**20
# One MoE layer per transformer block (DeepSeek-MoE-16B: 28 blocks, the first dense).
MOE_LAYERS: types.MappingProxyType[str, int] = types.MappingProxyType(
    {"olmoe": 16, "qwen": 24, "deepseek": 27, "tiny": 2, "tiny-shared": 2})
# DESIGN.md, 2× H200 NV18, `all_to_all_single`: (whole buffer per rank, algbw GB/s = buffer / time).
DESIGN_ALLTOALL_2GPU = ((1 * MIB, 25.0), (16 * MIB, 308.0), (64 * MIB, 475.0), (256 * MIB, 560.0),
                        (1024 * MIB, 660.0))
OCCULT_REF_ROWS_PER_EXPERT = 4096   # profile_v2b's expert-only point: OLMoE, 2^14 tokens × k=8 on 32 experts
META_BYTES_PER_PAIR = 8
ROW_ALIGN_BYTES = 64
MODES = ("dedup", "per_expert", "naive")
PASSES = ("fwd", "train")
MEASURED_COLUMNS = ("kind", "shape", "method", "D", "tokens_per_gpu", "median_ms", "status")
ALLTOALL_COLUMNS = ("D", "pattern", "bytes_remote_per_rank", "median_ms")
GEMM_COLUMNS = ("shape", "rows_per_expert", "pass", "tflops")      # pass: fwd | fwd+bwd
VALIDATION_COLUMNS = (
    "role", "kind", "shape", "method", "D", "tokens_per_gpu", "batch", "measured_ms", "predicted_ms",
    "rel_err", "within_tolerance", "measured_ct", "trace_ct", "measured_bytes_sent", "trace_bytes_sent",
    "fixed_ms", "row_ms", "compute_ms", "shared_ms", "comm_ms", "source",
)
PREDICTION_COLUMNS = (
    "shape", "method", "kind", "D", "nodes", "gpus_per_node", "tokens_per_gpu", "batch", "moe_layers",
    "mean_devices_per_token", "load_max_over_mean", "dispatch_bytes_per_rank", "return_bytes_per_rank",
    "inter_node_bytes_per_rank", "fixed_ms", "row_ms", "compute_ms", "shared_ms", "comm_ms", "layer_ms",
    "model_ms", "speedup_vs_naive", "status",
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
    packed = -(-vector // 4) * 4 + META_BYTES_PER_PAIR * max(slots, 1)
    return -(-packed // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES, vector


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
        """Mean over ranks of `occult.sweep`'s `bytes_sent` accounting (hidden vectors unpadded,
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
    return Traffic(
        mode=mode, rows_SD=rows_SD, pairs_SD=pairs_SD, dispatch_bytes_SD=rows_SD * sent_row,
        return_bytes_SD=rows_SD.T * back_row, tokens_per_source=num_tokens / num_devices,
        mean_devices_per_token=float(hit_ND.sum(1).mean()) if num_tokens else float("nan"), slots=slots)


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


@dataclass(frozen=True)
class Throughput:
    """Expert GEMM TFLOP/s of a method, by rows per expert (flat without a measured curve)."""

    level_tflops: float
    curve: LogLogCurve | None = None
    reference_rows: float | None = None   # curve is relative to its value here (None: absolute)

    def tflops(self, rows_per_expert: float) -> float:
        if self.curve is None:
            return self.level_tflops
        if self.reference_rows is None:
            return self.curve(max(rows_per_expert, 1.0))
        return self.level_tflops * self.curve(max(rows_per_expert, 1.0)) / self.curve(self.reference_rows)


@dataclass(frozen=True)
class Overheads:
    """Fitted per (method family, pass): fixed ms per layer call and µs per handled row."""

    fixed_ms: float
    per_row_us: float
    points: int


def family_of(method: str) -> str:
    return "naive" if method == "naive" else "occult"


def mode_of(method: str) -> tuple[str, int | None]:
    """(dispatch mode, N_d) of a simulated method name."""
    if method == "naive":
        return "naive", None
    if method == "per_expert":
        return "per_expert", None
    if method == "occult":
        return "dedup", None
    if method.startswith("occult-nd") and method[len("occult-nd"):].isdigit():
        return "dedup", int(method[len("occult-nd"):])
    raise SimulateError(f"method: {method!r} is not occult, occult-nd<N>, per_expert or naive")


@dataclass(frozen=True)
class CostModel:
    link: LinkModel
    throughput: dict[tuple[str, str, str], Throughput]   # (family, pass, shape) -> throughput
    dense_tflops: float
    overheads: dict[tuple[str, str], Overheads] = dataclasses.field(default_factory=dict)


def layer_components(traffic_: Traffic, shape: MoEShape, family: str, pass_: str, cost: CostModel,
                     tokens_per_gpu: float) -> dict[str, float]:
    """Per-layer time split into fixed, row, compute, shared and comm terms (ms).

    The device terms (rows + GEMM) are evaluated per device and the busiest device counts; the
    all-to-alls are collective (the slowest rank sets their time).
    """
    local_experts = shape.num_experts / traffic_.num_devices
    throughput = cost.throughput[(family, pass_, shape.name)]
    gemm_passes = 3.0 if pass_ == "train" else 1.0
    flops_per_pair = 2.0 * 3.0 * shape.hidden * shape.ffn * gemm_passes
    compute_D = np.array([
        pairs * flops_per_pair / (throughput.tflops(pairs / local_experts) * 1e12) * 1e3
        for pairs in traffic_.pairs_in_D])
    overheads = cost.overheads.get((family, pass_), Overheads(0.0, 0.0, 0))
    row_D = traffic_.row_work_D * overheads.per_row_us * 1e-3
    busiest = int(np.argmax(compute_D + row_D))
    shared_flops = 2.0 * 3.0 * shape.hidden * shape.shared_ffn * tokens_per_gpu * gemm_passes
    shared_ms = shared_flops / (cost.dense_tflops * 1e12) * 1e3
    link = cost.link
    comm = link.latency_ms(traffic_.num_devices)                     # split sizes (counts)
    comm += link.alltoall_ms(traffic_.dispatch_bytes_SD) + link.alltoall_ms(traffic_.return_bytes_SD)
    if pass_ == "train":
        # backward: row gradients out (transposed return) and back (transposed dispatch)
        comm += link.alltoall_ms(traffic_.return_bytes_SD.T) + link.alltoall_ms(traffic_.dispatch_bytes_SD.T)
        if traffic_.mode != "naive":                                  # gate gradients: fp32 per slot
            comm += link.alltoall_ms(traffic_.rows_SD.T * 4.0 * traffic_.slots)
    return {"fixed_ms": overheads.fixed_ms, "row_ms": float(row_D[busiest]),
            "compute_ms": float(compute_D[busiest]), "shared_ms": shared_ms, "comm_ms": comm}


def total_ms(parts: dict[str, float]) -> float:
    return parts["fixed_ms"] + parts["row_ms"] + parts["compute_ms"] + parts["shared_ms"] + parts["comm_ms"]


def fit_overheads(known_ms: np.ndarray, row_work: np.ndarray, measured_ms: np.ndarray) -> tuple[float, float]:
    """(fixed ms, µs per row) ≥ 0 minimising the squared RELATIVE error of known + fixed + rate·rows."""
    weights = 1.0 / measured_ms
    target = (measured_ms - known_ms) * weights
    design = np.stack([weights, row_work * 1e-3 * weights], axis=1)
    (fixed, rate), *_ = np.linalg.lstsq(design, target, rcond=None)
    if rate < 0:
        fixed, rate = float(np.sum(target * weights) / np.sum(weights**2)), 0.0
    if fixed < 0:
        column = design[:, 1]
        fixed, rate = 0.0, float(max(np.sum(target * column) / max(np.sum(column**2), 1e-30), 0.0))
    return float(fixed), float(rate)


# ----------------------------------------------------------------------------------------------
# Traces: the sweep's synthetic routing


class ShapeTraces:
    """A pool of routed tokens of one shape, with the sweep's placement and pruning per D.

    Memoises placements and pruned routings per (D, N_d) on the instance.
    """

    def __init__(self, shape: MoEShape, pool_tokens: int, seed: int) -> None:
        from occult.sweep import SyntheticRouter, derive_seed, make_inputs

        self.shape, self.seed = shape, seed
        self.router = SyntheticRouter.make(shape, seed)
        inputs = make_inputs(shape, self.router, pool_tokens, derive_seed(seed, "simulate", shape.name),
                             torch.device("cpu"), torch.bfloat16, [None], None, with_grad_output=False)
        self.logits_NE = self.router.logits(inputs.x_TD)
        self.ids_NK = inputs.routes[None][0]
        self._coact_EE: np.ndarray | None = None
        self._placements: dict[int, torch.Tensor] = {}
        self._routes: dict[tuple[int, int | None], torch.Tensor] = {}

    def support(self, method: str, num_devices: int) -> str | None:
        """None, or why `method` cannot run this shape on `num_devices`."""
        shape = self.shape
        if shape.num_experts % num_devices:
            return f"unsupported: {shape.num_experts} experts are not divisible by D={num_devices}"
        _, nd = mode_of(method)
        if nd is not None and nd * shape.num_experts // num_devices < shape.top_k:
            return f"unsupported: N_d*E/D = {nd}*{shape.num_experts}/{num_devices} < top_k {shape.top_k}"
        return None

    def placement(self, method: str, num_devices: int) -> torch.Tensor:
        if method == "naive":
            return torch.arange(self.shape.num_experts) // (self.shape.num_experts // num_devices)
        if num_devices not in self._placements:
            self._placements[num_devices] = sweep_placement(self.shape, self.router, num_devices, self.seed,
                                                            coact_EE=self._coactivation())
        return self._placements[num_devices]

    def ids(self, method: str, num_devices: int) -> torch.Tensor:
        from occult.sweep import prune_routing

        _, nd = mode_of(method)
        if nd is None:
            return self.ids_NK
        key = (num_devices, nd)
        if key not in self._routes:
            placement = self.placement(method, num_devices)
            self._routes[key] = prune_routing(self.logits_NE, self.shape.top_k, placement, nd, num_devices)[0]
        return self._routes[key]

    def _coactivation(self) -> np.ndarray:
        if self._coact_EE is None:
            self._coact_EE = calibration_coactivation(self.shape, self.router, self.seed)
        return self._coact_EE

    def traffic_at(self, method: str, num_devices: int, tokens_per_gpu: int, elem_bytes: int = 2,
                   max_chunks: int = 8) -> list[Traffic]:
        """Traffic of D devices × `tokens_per_gpu` tokens: disjoint chunks of the pool when it holds
        them (so small batches keep their sampling noise), else the whole pool scaled up."""
        mode, _ = mode_of(method)
        ids = self.ids(method, num_devices)
        placement = self.placement(method, num_devices)
        pool = ids.shape[0]
        chunk = num_devices * tokens_per_gpu
        if chunk <= pool:
            count = min(pool // chunk, max_chunks)
            return [traffic(ids[i * chunk:(i + 1) * chunk], placement, num_devices, mode, self.shape.hidden,
                            elem_bytes) for i in range(count)]
        whole = traffic(ids, placement, num_devices, mode, self.shape.hidden, elem_bytes)
        return [whole.scaled(chunk / pool)]


def calibration_coactivation(shape: MoEShape, router: Any, seed: int) -> np.ndarray:
    """The co-activation matrix `occult.sweep.occult_placement` places from (same seed, CPU)."""
    from occult.sweep import CALIBRATION_TOKENS, derive_seed

    gen = torch.Generator().manual_seed(derive_seed(seed, "calibration", shape.name))
    x = torch.randn(CALIBRATION_TOKENS, shape.hidden, generator=gen)
    ids = router.logits(x).topk(shape.top_k, dim=-1).indices
    hits_NE = torch.zeros(CALIBRATION_TOKENS, shape.num_experts).scatter_(1, ids, 1.0)
    return (hits_NE.t() @ hits_NE).numpy()


def sweep_placement(shape: MoEShape, router: Any, num_devices: int, seed: int,
                    coact_EE: np.ndarray | None = None) -> torch.Tensor:
    """`occult.sweep.occult_placement` without a process group (same calibration batch and
    `greedy_occult`, so the same placement the GPU sweeps used)."""
    from occult.placement import greedy_occult

    coact_EE = calibration_coactivation(shape, router, seed) if coact_EE is None else coact_EE
    return torch.tensor(greedy_occult(coact_EE, num_devices).tolist(), dtype=torch.long)


def simulate_point(traces: ShapeTraces, method: str, num_devices: int, tokens_per_gpu: int, pass_: str,
                   cost: CostModel) -> dict[str, float]:
    """Predicted components of one layer (mean over trace chunks) and traffic facts."""
    chunks = traces.traffic_at(method, num_devices, tokens_per_gpu)
    parts = [layer_components(t, traces.shape, family_of(method), pass_, cost, tokens_per_gpu) for t in chunks]
    out = {key: float(np.mean([p[key] for p in parts])) for key in parts[0]}
    out["layer_ms"] = total_ms(out)
    pairs = np.stack([t.pairs_in_D for t in chunks])
    out["mean_devices_per_token"] = float(np.mean([t.mean_devices_per_token for t in chunks]))
    out["load_max_over_mean"] = float(np.mean(pairs.max(1) / np.maximum(pairs.mean(1), 1e-30)))
    out["dispatch_bytes_per_rank"] = float(np.mean([t.remote(t.dispatch_bytes_SD).sum(1).mean() for t in chunks]))
    out["return_bytes_per_rank"] = float(np.mean([t.remote(t.return_bytes_SD).sum(1).mean() for t in chunks]))
    node_D = np.arange(num_devices) // traces_link_nodes(cost, num_devices)
    other_node = node_D[:, None] != node_D[None, :]
    out["inter_node_bytes_per_rank"] = float(np.mean([
        ((t.dispatch_bytes_SD + t.return_bytes_SD) * other_node).sum(1).mean() for t in chunks]))
    out["trace_bytes_sent"] = float(np.mean([t.sweep_bytes_sent(traces.shape.hidden, 2) for t in chunks]))
    out["row_work"] = float(np.mean([t.row_work_D.max() for t in chunks]))
    return out


def traces_link_nodes(cost: CostModel, num_devices: int) -> int:
    return max(1, min(cost.link.gpus_per_node, num_devices))


# ----------------------------------------------------------------------------------------------
# Inputs: measured files


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


def throughputs(settings: Any, shapes: Sequence[MoEShape]) -> dict[tuple[str, str, str], Throughput]:
    """Expert-GEMM throughput per (family, pass, shape): flat levels from the config, shaped by
    commbench's grouped-GEMM curve of the shape when `gemm_csv` is given."""
    levels = {("occult", "fwd"): settings.occult_tflops_fwd, ("occult", "train"): settings.occult_tflops_train,
              ("naive", "fwd"): settings.naive_tflops_fwd, ("naive", "train"): settings.naive_tflops_train}
    frame = read_table(settings.gemm_csv, GEMM_COLUMNS, "simulate.gemm_csv") if settings.gemm_csv else None
    out = {}
    for shape in shapes:
        for (family, pass_), level in levels.items():
            curve = None
            if frame is not None:
                gemm_pass = "fwd+bwd" if pass_ == "train" else "fwd"
                rows = frame[(frame["shape"] == shape.name) & (frame["pass"] == gemm_pass)]
                if not rows.empty:
                    by_rows = rows.groupby("rows_per_expert")["tflops"].median().sort_index()
                    curve = LogLogCurve(by_rows.index.to_numpy(float), by_rows.to_numpy(float), extend="flat")
            reference = OCCULT_REF_ROWS_PER_EXPERT if family == "occult" else None
            out[(family, pass_, shape.name)] = Throughput(level, curve, reference)
    return out


def read_measured(paths: Sequence[str], methods: Sequence[str]):
    """Measured sweep rows (ok status) of the simulated methods, with their source file."""
    import pandas as pd

    frames = []
    for path in paths:
        frame = read_table(path, MEASURED_COLUMNS, "simulate.measured")
        frame = frame[(frame["status"] == "ok") & frame["method"].isin(list(methods))].copy()
        frame["source"] = str(path)
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=[*MEASURED_COLUMNS, "source"])
    return pd.concat(frames, ignore_index=True)


def pass_of(kind: str) -> str:
    return "train" if kind == "train" else "fwd"


# ----------------------------------------------------------------------------------------------
# (c) Validation and (d) predictions


def build_cost_model(settings: Any, shapes: Sequence[MoEShape]) -> CostModel:
    link = LinkModel(
        curves=alltoall_curves(settings.alltoall_csv),
        gpus_per_node=settings.gpus_per_node,
        inter_node_bytes_per_ms=settings.inter_node_gbps / 8 * 1e9 / 1e3,
        inter_node_latency_ms=settings.inter_node_latency_us * 1e-3,
    )
    return CostModel(link, throughputs(settings, shapes), settings.dense_tflops)


def validate(settings: Any, traces: dict[str, ShapeTraces], cost: CostModel, measured) -> tuple[Any, CostModel]:
    """Fit overheads on the calibration rows, predict every measured row; (table, fitted cost model).

    `traces` must hold every shape of `measured`."""
    import pandas as pd
    from tqdm import tqdm

    points = []
    for row in tqdm(list(measured.itertuples(index=False)), desc="measured points", unit="point", file=sys.stderr):
        shape_traces = traces[row.shape]
        why = shape_traces.support(row.method, int(row.D))
        if why:
            continue
        parts = simulate_point(shape_traces, row.method, int(row.D), int(row.tokens_per_gpu), pass_of(row.kind), cost)
        points.append((row, parts))

    overheads = {}
    for family in ("occult", "naive"):
        for pass_ in PASSES:
            chosen = [(r, p) for r, p in points if family_of(r.method) == family and pass_of(r.kind) == pass_
                      and int(r.D) in settings.calibration_devices and r.kind != "decode"]
            if not chosen:
                continue
            known = np.array([total_ms({**p, "fixed_ms": 0.0, "row_ms": 0.0}) for _, p in chosen])
            work = np.array([p["row_work"] for _, p in chosen])
            measured_ms = np.array([float(r.median_ms) for r, _ in chosen])
            fixed, rate = fit_overheads(known, work, measured_ms)
            overheads[(family, pass_)] = Overheads(fixed, rate, len(chosen))
    fitted = dataclasses.replace(cost, overheads=overheads)

    rows = []
    for row, parts in points:
        pass_ = pass_of(row.kind)
        over = fitted.overheads.get((family_of(row.method), pass_))
        calibration = int(row.D) in settings.calibration_devices and row.kind != "decode"
        row_ms = parts["row_work"] * over.per_row_us * 1e-3 if over else float("nan")
        final = {**parts, "fixed_ms": over.fixed_ms if over else float("nan"), "row_ms": row_ms}
        predicted = total_ms(final)
        err = (predicted - float(row.median_ms)) / float(row.median_ms)
        rows.append({
            "role": "calibration" if calibration else "validation", "kind": row.kind, "shape": row.shape,
            "method": row.method, "D": int(row.D), "tokens_per_gpu": int(row.tokens_per_gpu),
            "batch": getattr(row, "batch", None), "measured_ms": float(row.median_ms), "predicted_ms": predicted,
            "rel_err": err, "within_tolerance": bool(abs(err) <= settings.tolerance),
            "measured_ct": getattr(row, "mean_devices_per_token", None), "trace_ct": parts["mean_devices_per_token"],
            "measured_bytes_sent": getattr(row, "bytes_sent", None), "trace_bytes_sent": parts["trace_bytes_sent"],
            **{k: final[k] for k in ("fixed_ms", "row_ms", "compute_ms", "shared_ms", "comm_ms")},
            "source": row.source,
        })
    return pd.DataFrame(rows, columns=list(VALIDATION_COLUMNS)), fitted


def predict(traces: dict[str, ShapeTraces], methods: Sequence[str], devices: Sequence[int],
            points: Sequence[tuple[str, int, int | None]], cost: CostModel, desc: str = "predict"):
    """Rows of PREDICTION_COLUMNS for every shape × method × D × (kind, tokens/GPU, batch)."""
    import pandas as pd
    from tqdm import tqdm

    rows = []
    total = len(traces) * len(methods) * len(devices) * len(points)
    bar = tqdm(total=total, desc=desc, unit="point", file=sys.stderr)
    for shape_name, shape_traces in traces.items():
        shape = shape_traces.shape
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
                    status = shape_traces.support(method, num_devices)
                    if status is None and (family_of(method), pass_) not in cost.overheads:
                        status = f"uncalibrated: no calibration points for {family_of(method)} {pass_}"
                    if status is not None:
                        rows.append({**base, "status": status})
                        continue
                    parts = simulate_point(shape_traces, method, num_devices, tokens, pass_, cost)
                    layer = parts["layer_ms"]
                    if method == "naive":
                        baseline = layer
                    rows.append({**base, **{k: parts[k] for k in PREDICTION_COLUMNS if k in parts},
                                 "model_ms": layer * base["moe_layers"],
                                 "speedup_vs_naive": baseline / layer if baseline else None, "status": "ok"})
    bar.close()
    return pd.DataFrame(rows, columns=list(PREDICTION_COLUMNS))


def sweep_points(kinds: Sequence[str], seq_len: int = 512) -> list[tuple[str, int, int | None]]:
    """(kind, tokens per GPU, batch) of `occult.sweep`'s default sizes."""
    from occult.sweep import DEFAULT_SIZES

    points = []
    for kind in kinds:
        for size in DEFAULT_SIZES[kind]:
            tokens = size * seq_len if kind == "train" else size
            points.append((kind, tokens, None if kind == "prefill" else size))
    return points


def run_simulate(settings: Any, seed: int, out_dir: Path, figures_dir: Path | None,
                 config_hash: str | None = None) -> dict[str, Path]:
    """Validation table, scale predictions and the issue-8 table (+ figures); returns the paths."""
    from occult.provenance import provenance, seed_everything, write_csv

    seed_everything(seed)
    shapes = [get_shape(name) for name in settings.shapes]
    measured = read_measured(settings.measured, settings.methods)
    measured_shapes = [get_shape(n) for n in sorted(set(measured["shape"]) - set(settings.shapes))]
    cost = build_cost_model(settings, [*shapes, *measured_shapes])
    traces = {shape.name: ShapeTraces(shape, settings.pool_tokens, seed) for shape in [*shapes, *measured_shapes]}
    table, cost = validate(settings, traces, cost, measured)
    traces = {name: traces[name] for name in settings.shapes}
    prefill = [("prefill", tokens, None) for tokens in settings.tokens_per_gpu]
    predictions = predict(traces, settings.methods, settings.devices, prefill, cost, "predict D")
    issue8 = predict(traces, settings.methods, settings.issue8_devices,
                     sweep_points(("prefill", "decode", "train")), cost, "predict issue 8")

    meta = provenance(config_hash, seed, stage="simulate", settings=dataclasses.asdict(settings),
                      overheads={f"{f}/{p}": dataclasses.asdict(o) for (f, p), o in cost.overheads.items()},
                      alltoall_source=settings.alltoall_csv or "DESIGN.md 2-GPU table (built in)",
                      gemm_source=settings.gemm_csv or "flat throughputs from the config")
    paths = {"validation": out_dir / "validation.csv", "predictions": out_dir / "predictions.csv",
             "issue8": out_dir / "predictions_D4_D8.csv"}
    write_csv(paths["validation"], table, meta=meta)
    write_csv(paths["predictions"], predictions, meta=meta)
    write_csv(paths["issue8"], issue8, meta=meta)
    if figures_dir is not None:
        paths["fig_speedup"] = figures_dir / "simulate_speedup.png"
        paths["fig_validation"] = figures_dir / "simulate_validation.png"
        plot_speedup(predictions, paths["fig_speedup"])
        plot_validation(table, settings.tolerance, paths["fig_validation"])
    print_summary(table, cost)
    return paths


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


def plot_validation(table, tolerance: float, out: Path) -> None:
    """Measured vs predicted per point; calibration and validation points apart; ±tolerance band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.provenance import atomic_path

    fig, ax = plt.subplots(figsize=(5, 5))
    markers = {"occult": "o", "occult-nd2": "s", "occult-nd1": "^", "naive": "x"}
    for (role, method), rows in table.groupby(["role", "method"]):
        ax.scatter(rows["measured_ms"], rows["predicted_ms"], marker=markers.get(method, "."), s=18,
                   color="tab:blue" if role == "calibration" else "tab:red", label=f"{role}: {method}")
    if not table.empty:
        low, high = table[["measured_ms", "predicted_ms"]].min().min(), table[["measured_ms", "predicted_ms"]].max().max()
        line = np.geomspace(low * 0.8, high * 1.25, 50)
        ax.plot(line, line, color="black", lw=0.8)
        ax.fill_between(line, line * (1 - tolerance), line * (1 + tolerance), color="grey", alpha=0.2,
                        label=f"±{tolerance:.0%}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=6)
    ax.set_xlabel("measured ms per layer")
    ax.set_ylabel("predicted ms per layer")
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def print_summary(table, cost: CostModel) -> None:
    for (family, pass_), over in sorted(cost.overheads.items()):
        print(f"calibrated {family:>6} {pass_:<5}: fixed {over.fixed_ms:.3f} ms, {over.per_row_us * 1e3:.2f} ns/row "
              f"({over.points} points)")
    for role, rows in table.groupby("role"):
        errors = rows["rel_err"].abs()
        print(f"{role}: {len(rows)} points, {int(rows['within_tolerance'].sum())} within tolerance, "
              f"median |err| {errors.median():.1%}, max {errors.max():.1%}")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------
# Command line (the pipeline calls `occult simulate`; this entry is for direct use)


def main(argv: Sequence[str] | None = None) -> int:
    from occult.config import ConfigError, load_config

    parser = argparse.ArgumentParser(prog="python -m occult.simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, type=Path, help="directory of the three CSVs")
    parser.add_argument("--figures", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        if cfg.simulate is None:
            raise ConfigError("simulate: the configuration has no simulate section")
        run_simulate(cfg.simulate, cfg.seed, args.out, args.figures, cfg.hash())
    except (ConfigError, SimulateError) as err:
        print(f"occult.simulate: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
