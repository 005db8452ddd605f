"""A calibrated `CostModel` as JSON, and the model shipped with the package.

The simulate stage writes its calibrated model to `cost_model.json` (`write_cost_model`), so that
other stages (the latency placement, `occult place-trace`) price a layer without calibrating
again. `builtin_cost_model` reads the copy shipped as package data
(`occult/sim/data/cost_model_default.json`); its `source` block says which run and commit made it.

Format: `{"format": 1, "source": {...}, "model": {...}}`; curves are `{"x": [...], "y": [...],
"extend": ...}`, dictionaries with tuple keys are lists of `{"key": [...], "value": ...}` and an
infinite rate is `null`.
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from occult.sim.columns import SimulateError
from occult.sim.cost_model import CostModel, HostTerms, LinkModel, LogLogCurve, OtherGpuTerms

FORMAT = 1
BUILTIN_COST_MODEL_FILE = "data/cost_model_default.json"
BUILTIN_COST_MODEL_SOURCE = f"occult/sim/{BUILTIN_COST_MODEL_FILE} (built in)"


def _curve(curve: LogLogCurve | None) -> dict[str, Any] | None:
    if curve is None:
        return None
    return {"x": [float(v) for v in curve.x], "y": [float(v) for v in curve.y], "extend": curve.extend}


def _read_curve(doc: dict[str, Any] | None) -> LogLogCurve | None:
    if doc is None:
        return None
    return LogLogCurve(np.asarray(doc["x"], dtype=np.float64), np.asarray(doc["y"], dtype=np.float64),
                       doc.get("extend", "proportional"))


def _rate(value: float) -> float | None:
    return None if math.isinf(value) else float(value)


def _entries(table: dict, encode=lambda v: v) -> list[dict[str, Any]]:
    return [{"key": list(k) if isinstance(k, tuple) else k, "value": encode(v)} for k, v in table.items()]


def _read_entries(items: list[dict[str, Any]], decode=lambda v: v, tuple_key: bool = True) -> dict:
    return {(tuple(item["key"]) if tuple_key else item["key"]): decode(item["value"]) for item in items}


def _plain(value: Any) -> Any:
    """numpy scalars as Python numbers (json's fallback)."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def cost_model_to_dict(cost: CostModel) -> dict[str, Any]:
    """Every field of `cost` in JSON types (the inverse of `cost_model_from_dict`)."""
    link = cost.link
    return {
        "link": {"curves": _entries({int(d): c for d, c in link.curves.items()}, _curve),
                 "gpus_per_node": link.gpus_per_node, "inter_node_bytes_per_ms": link.inter_node_bytes_per_ms,
                 "inter_node_latency_ms": link.inter_node_latency_ms},
        "kernel_tflops": _curve(cost.kernel_tflops),
        "kernel_train_scale": cost.kernel_train_scale,
        "grouped_tflops": _entries(cost.grouped_tflops, _curve),
        "dense_tflops": cost.dense_tflops,
        "hbm_bytes_per_ms": _rate(cost.hbm_bytes_per_ms),
        "kernel_floor_ms": cost.kernel_floor_ms,
        "kernel_stream_bytes_per_ms": _rate(cost.kernel_stream_bytes_per_ms),
        "other_gpu": None if cost.other_gpu is None else vars(cost.other_gpu).copy(),
        "naive_ns_per_pair": dict(cost.naive_ns_per_pair),
        "pe_per_row_ns": cost.pe_per_row_ns,
        "host": _entries(cost.host, lambda h: vars(h).copy()),
        "kernel_train_tflops": _curve(cost.kernel_train_tflops),
        "kernel_tflops_by_ffn": _entries({int(f): c for f, c in cost.kernel_tflops_by_ffn.items()}, _curve),
        "kernel_train_tflops_by_ffn": _entries({int(f): c for f, c in cost.kernel_train_tflops_by_ffn.items()}, _curve),
        "shared_scale": dict(cost.shared_scale),
        "shared_host_per_launch_ms": dict(cost.shared_host_per_launch_ms),
        "shared_host_by_shape_ms": {p: dict(v) for p, v in cost.shared_host_by_shape_ms.items()},
        "graph_host_ms": _entries(cost.graph_host_ms),
        "host_shape_ms": _entries(cost.host_shape_ms),
    }


def cost_model_from_dict(doc: dict[str, Any]) -> CostModel:
    """The `CostModel` of `cost_model_to_dict`'s output; KeyError/TypeError/ValueError when malformed."""
    link = doc["link"]
    inf = lambda v: math.inf if v is None else float(v)  # noqa: E731
    other = doc["other_gpu"]
    return CostModel(
        link=LinkModel(curves=_read_entries(link["curves"], _read_curve, tuple_key=False),
                       gpus_per_node=int(link["gpus_per_node"]),
                       inter_node_bytes_per_ms=float(link["inter_node_bytes_per_ms"]),
                       inter_node_latency_ms=float(link["inter_node_latency_ms"])),
        kernel_tflops=_read_curve(doc["kernel_tflops"]),
        kernel_train_scale=doc["kernel_train_scale"],
        grouped_tflops=_read_entries(doc["grouped_tflops"], _read_curve),
        dense_tflops=float(doc["dense_tflops"]),
        hbm_bytes_per_ms=inf(doc["hbm_bytes_per_ms"]),
        kernel_floor_ms=float(doc["kernel_floor_ms"]),
        kernel_stream_bytes_per_ms=inf(doc["kernel_stream_bytes_per_ms"]),
        other_gpu=None if other is None else OtherGpuTerms(**other),
        naive_ns_per_pair=dict(doc["naive_ns_per_pair"]),
        pe_per_row_ns=doc["pe_per_row_ns"],
        host=_read_entries(doc["host"], lambda h: HostTerms(**h)),
        kernel_train_tflops=_read_curve(doc["kernel_train_tflops"]),
        kernel_tflops_by_ffn=_read_entries(doc["kernel_tflops_by_ffn"], _read_curve, tuple_key=False),
        kernel_train_tflops_by_ffn=_read_entries(doc["kernel_train_tflops_by_ffn"], _read_curve, tuple_key=False),
        shared_scale=dict(doc["shared_scale"]),
        shared_host_per_launch_ms=dict(doc["shared_host_per_launch_ms"]),
        shared_host_by_shape_ms={p: dict(v) for p, v in doc["shared_host_by_shape_ms"].items()},
        graph_host_ms=_read_entries(doc["graph_host_ms"]),
        host_shape_ms=_read_entries(doc["host_shape_ms"]),
    )


def cost_model_source(settings: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """Where a simulate stage's model comes from: its commit and config, and the measured files it
    was calibrated on (`settings`: the `simulate` section; `meta`: the stage's provenance)."""
    return {"commit": meta.get("commit"), "config_hash": meta.get("config_hash"), "created": meta.get("created"),
            "made_by": "occult.sim.run (rule simulate_scale): calibrate on simulate.calibration",
            "calibration": list(getattr(settings, "calibration", ())),
            "folders": dict(getattr(settings, "folders", None) or {}),
            **{key: getattr(settings, key, None) for key in ("alltoall_csv", "gemm_csv", "gpus_per_node",
                                                             "inter_node_gbps", "inter_node_latency_us")}}


def write_cost_model(path: str | Path, cost: CostModel, source: dict[str, Any]) -> None:
    """`cost` and where it came from (`source`: commit, config, calibration files) as JSON, atomically."""
    from occult.provenance import atomic_path

    text = json.dumps({"format": FORMAT, "source": source, "model": cost_model_to_dict(cost)}, indent=1,
                      allow_nan=False, default=_plain)
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(text + "\n")


def parse_cost_model(text: str, name: str) -> tuple[CostModel, dict[str, Any]]:
    """(model, source) of a cost-model JSON text; one SimulateError naming `name` when malformed."""
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SimulateError(f"{name}: not valid JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("model"), dict):
        raise SimulateError(f"{name}: not a cost-model file of format {FORMAT} (keys format, source, model)")
    try:
        return cost_model_from_dict(doc["model"]), dict(doc.get("source") or {})
    except (KeyError, TypeError, ValueError) as err:
        raise SimulateError(f"{name}: malformed cost model ({type(err).__name__}: {err})") from None


def read_cost_model(path: str | Path) -> tuple[CostModel, dict[str, Any]]:
    """(model, source) of a `cost_model.json`; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise SimulateError(f"{path}: cost-model file does not exist")
    return parse_cost_model(path.read_text(encoding="utf-8"), str(path))


@functools.lru_cache(maxsize=None)
def builtin_cost_model() -> tuple[CostModel, dict[str, Any]]:
    """(model, source) of the cost model shipped with the package."""
    text = resources.files("occult.sim").joinpath(BUILTIN_COST_MODEL_FILE).read_text(encoding="utf-8")
    return parse_cost_model(text, BUILTIN_COST_MODEL_SOURCE)
