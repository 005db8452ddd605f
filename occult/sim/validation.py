"""Validation: every measured Occult / naive point predicted on its own routing (the sweep's
seeded `SyntheticRouter` + `greedy_occult` placement + pruning; uniform routing; or, for a
replayed trace the CPU does not hold, the row's recorded traffic facts). The table gives role,
error, the model's terms and the point's replicates (the same computation measured again), so
that noise the model cannot remove is visible."""

from __future__ import annotations

import sys
from typing import Any, Sequence

import numpy as np

from occult.shapes import get_shape
from occult.sim.calibration import MeasuredPoint, build_cost_model, calibrate, measured_points
from occult.sim.columns import COMPONENTS, VALIDATION_COLUMNS
from occult.sim.cost_model import EAGER_FAMILIES, CostModel, method_spec
from occult.sim.traces import ShapeTraces


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
