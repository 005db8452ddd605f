"""Predictions of the calibrated model: D = 4 … 64 (single node, then several), the sweep's own
sizes at chosen D, and the layers of a recorded routing trace. End-to-end = MoE layers × layer."""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from occult.shapes import get_shape
from occult.logs import progress
from occult.sim.columns import PREDICTION_COLUMNS, SimulateError
from occult.sim.cost_model import (NAIVE_BYTES_D1, NAIVE_BYTES_EP, CostModel, LogLogCurve, method_spec, pass_of,
                                   shared_launches)
from occult.sim.traces import RecordedTraces, ShapeTraces, simulate_point
from occult.sim.traffic import PASSES


# One MoE layer per transformer block (DeepSeek-MoE-16B: 28 blocks, the first dense).
MOE_LAYERS: types.MappingProxyType[str, int] = types.MappingProxyType(
    {"olmoe": 16, "qwen": 24, "deepseek": 27, "tiny": 2, "tiny-shared": 2})


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
