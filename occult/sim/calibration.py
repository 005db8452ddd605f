"""Calibration: every fitted parameter of the cost model, from the declared calibration rows only.

Kernels from `-compute` rows (fwd curve, fwd+bwd scale or curve) and their latency floor from
graph replays smaller than any of them; Occult's other GPU work from `-graph` rows; the naive EP's
per-pair cost; the host terms (pre, post) per (method family, pass, D) and each shape's offset
from them; the shared expert's scale and host time from A/B files (`shared_ab`, occult.sim.inputs). The
all-to-all and grouped-GEMM curves come from commbench (`build_cost_model`). Every other
measured point validates (`occult.sim.validation`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from occult.shapes import MoEShape, get_shape
from occult.logs import progress
from occult.method_names import MethodSpec
from occult.sim.columns import SimulateError
from occult.sim.cost_model import (EAGER_FAMILIES, CostModel, HostTerms, LinkModel, LogLogCurve, OtherGpuTerms,
                                   expert_flops_per_pair, fit_host, method_spec, pass_of, shared_expert_ms,
                                   shared_launches, weight_read_ms)
from occult.sim.measured import (alltoall_curves, fit_weight_streaming, grouped_gemm_curves, host_scale_of_set,
                                 read_table, with_host_scales)
from occult.sim.traces import ShapeTraces, point_components, trace_key
from occult.sim.traffic import PASSES, Traffic, recorded_traffic, static_traffic, traffic


SHARED_AB_COLUMNS = ("kind", "shape", "method", "D", "tokens_per_gpu", "status", "shared_ffn")
SHARED_AB_METHOD = "occult-graph"      # graph replays: GPU time only, no host time in the difference
SHARED_AB_MIN_TOKENS = 4096            # smaller calls are a latency-bound chain of small kernels


def shared_ab_table(pairs: Sequence[Sequence[str]], value: str, min_tokens: int = 0, host_speed: str = "none"):
    """Per (kind, shape, D, tokens_per_gpu) measured both with and without the shared experts: the
    median `value` of the `occult-graph` rows (status ok) over the files with them (column `shared`)
    and over the files without (`noshared`); points of ≥ `min_tokens` tokens/GPU.

    Each pair is (file with the shapes' shared experts, file without), run on one machine start, in
    two processes. With `host_speed` other than `none`, each row's `value` (a host time) is divided
    by its host slowness over the pair's two files (`host_scale_of_set`; rows without probes: 1), so
    that the difference is not the two processes' host speeds."""
    import pandas as pd

    key = ["kind", "shape", "D", "tokens_per_gpu"]
    frames: dict[str, list] = {"shared": [], "noshared": []}
    for i, pair in enumerate(pairs):
        field = f"shared_ab[{i}]"
        if isinstance(pair, (str, bytes)) or len(pair) != 2:
            raise SimulateError(f"{field}: expected [file with shared experts, file without], got {pair!r}")
        for role, path in zip(("shared", "noshared"), pair):
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
        raise SimulateError(f"shared_ab: no (kind, shape, D, tokens/GPU){sizes} is measured both with "
                            "and without the shared experts")
    return both


def shared_scales(pairs: Sequence[Sequence[str]], dense_tflops: float, hbm_bytes_per_ms: float
                  ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The shared expert's measured time over its modelled time, per pass (median over points):
    the A/B difference of graph replays (`shared_ab_table`) at ≥ `SHARED_AB_MIN_TOKENS` tokens/GPU.
    Also returns the points (for the sidecar)."""
    points = []
    for row in shared_ab_table(pairs, "median_ms", SHARED_AB_MIN_TOKENS).itertuples(index=False):
        pass_ = pass_of(row.kind)
        modelled = shared_expert_ms(get_shape(row.shape), float(row.tokens_per_gpu), pass_, dense_tflops, hbm_bytes_per_ms)
        points.append({"pass": pass_, "shape": row.shape, "D": int(row.D), "tokens_per_gpu": int(row.tokens_per_gpu),
                       "measured_ms": row.shared - row.noshared, "modelled_ms": modelled,
                       "ratio": (row.shared - row.noshared) / modelled})
    return per_pass_median(points, "ratio"), points


def shared_host_per_launch(pairs: Sequence[Sequence[str]], host_speed: str = "none"
                           ) -> tuple[dict[str, float], dict[str, dict[str, float]], list[dict[str, Any]]]:
    """The shared expert's host time from the A/B difference of the graph replays' host time
    (`host_ms`: the replay is one launch, the shared expert runs eagerly after it), at every size,
    each row at its host's speed when `host_speed` is not `none`: per pass, ms per op it launches
    (`shared_launches`; median over points), and per pass and shape, its ms (median over the shape's
    points). Also returns the points. Ops of one shape cost different host times (a linear more than
    an add), so a measured shape takes its own time and the per-op rate prices the others."""
    points = []
    for row in shared_ab_table(pairs, "host_ms", 0, host_speed).itertuples(index=False):
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
    if stream is None and stream_csv is not None:      # a rate the config sets wins over the fit
        stream = float(np.median([fit["rate_gbps"] for fit in fit_weight_streaming(stream_csv)]))
    stream_bytes_per_ms = math.inf if stream is None else stream * 1e9 / 1e3
    pairs = getattr(settings, "shared_ab", ())
    scale = shared_scales(pairs, settings.dense_tflops, hbm_bytes_per_ms)[0] if pairs else {}
    host_speed = getattr(settings, "host_speed", "auto")
    per_launch, by_shape, _ = shared_host_per_launch(pairs, host_speed) if pairs else ({}, {}, [])
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
            raise SimulateError(f"calibration: {p.row.source}: {p.row.method} at {p.row.tokens_per_gpu} "
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
