"""Measured inputs of the simulator: sweep CSVs (row selectors, calibration roles, host-speed
probes), commbench's all-to-all and grouped-GEMM curves and the weight-streaming fit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from occult.shapes import get_shape
from occult.method_names import is_occult
from occult.sim.columns import ALLTOALL_COLUMNS, GEMM_COLUMNS, MEASURED_COLUMNS, SimulateError
from occult.sim.cost_model import LogLogCurve, builtin_alltoall_curve, expert_weight_bytes, method_spec

ROUTINGS = ("synthetic", "uniform", "trace")


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
    the shipped 2-GPU table (`occult.sim.builtin_alltoall`) when `path` is None."""
    if path is None:
        return {2: builtin_alltoall_curve()}
    frame = read_table(path, ALLTOALL_COLUMNS, "alltoall")
    equal = frame[(frame["pattern"] == "equal") & (frame["D"] > 1) & (frame["bytes_remote_per_rank"] > 0)]
    if equal.empty:
        raise SimulateError(f"alltoall: {path} has no equal-split rows with D > 1")
    curves = {}
    for devices, rows in equal.groupby("D"):
        by_size = rows.groupby("bytes_remote_per_rank")["median_ms"].median().sort_index()
        curves[int(devices)] = LogLogCurve(by_size.index.to_numpy(float), by_size.to_numpy(float))
    return curves


def fit_weight_streaming(path: str | Path, max_tokens: int = 16,
                         field: str = "kernel_stream") -> list[dict[str, Any]]:
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
    frame = read_table(path, GEMM_COLUMNS, "gemm")
    curves = {}
    for (gemm_pass, shape), rows in frame.groupby(["pass", "shape"]):
        kept = rows[rows["rows_per_expert"] >= min_rows_per_expert]
        if kept.empty:
            raise SimulateError(f"gemm: {path} has no {shape} {gemm_pass} rows with ≥ "
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
    (every row where a selector is absent)."""

    path: Path
    methods: frozenset[str] | None
    tokens_per_gpu: frozenset[int] | None

    @classmethod
    def parse(cls, text: str, field: str) -> "FileEntry":
        path, *selectors = text.split("@")
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


def read_measured(paths: Sequence[str], calibration: Sequence[str] = (), field: str = "simulate"):
    """Every ok Occult / naive row the entries of `paths` select, with its source (the entry's file
    as written), routing, commit and role (`calibration` if an entry of `calibration` holds it, else
    `validation`)."""
    import pandas as pd

    measured = [FileEntry.parse(text, f"{field}.measured") for text in paths]
    entries = [FileEntry.parse(text, f"{field}.calibration") for text in calibration]
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
        path = text.partition("@")[0]
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
    host of typical speed. On the H200 machines measured so far both probes move between processes and within
    one, and host-bound layers with them (results/nvidia-h200/host_probe_v1, sweeps_v32, sweeps_v33)."""
    import pandas as pd

    probe = probe_us.astype(float)
    valid = probe[np.isfinite(probe) & (probe > 0)]
    if valid.empty:
        return pd.Series(1.0, index=probe.index)
    return (probe / float(valid.median())).where(np.isfinite(probe) & (probe > 0), 1.0)
