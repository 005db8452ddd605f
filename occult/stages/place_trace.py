"""Placements of a user's own routing trace: `occult place-trace`.

The trace is an .npz with two arrays of top-k expert ids, shape [layers, tokens, k]: `calib` (the
placements see only it) and `heldout` (every placement is measured on it); an optional `layers`
[layers] names the model's MoE layers (default 0 … L−1). For each method and D the output folder
gets `D{D}_{method}.json` (the placement stage's format: `load_placement_layers`, and
`occult.ep.hf.placements_from_json` for `use_ep`) and `placement.csv`: per (layer, D, method) the
held-out E[C_T], the busiest device's load over the mean, the predicted layer time (the calibrated
cost model on the given layer shape) and the seconds the placement took. The folder is written
whole or not at all (a temporary sibling, renamed).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from occult.routing.placement import PlacementFileError, _load_npz, ct_bounds

TRACE_METHODS = ("contiguous", "greedy", "swap", "load_aware", "eplb", "latency")
CSV_COLUMNS = ("layer", "D", "method", "expected_ct_heldout", "max_device_load_over_mean", "predicted_ms",
               "seconds", "expected_ct_calibration", "predicted_ms_calibration", "start_method")


@dataclass(frozen=True)
class TraceRequest:
    """What to place: the trace file, D values, methods, expert count, layer shape and search knobs."""

    trace: Path
    devices: tuple[int, ...]
    methods: tuple[str, ...]
    shape: Any                       # occult.shapes.MoEShape of the layer (its E, k from the trace)
    num_experts: int | None = None   # None: largest id + 1
    tokens_per_gpu: int = 16384
    swap_rounds: int = 20
    seed: int = 0


def read_trace(path: Path, num_experts: int | None) -> tuple[np.ndarray, np.ndarray, list[int], int]:
    """(calib [L, N, k], heldout [L, N', k], layers, E) of a trace file; one PlacementFileError naming
    the file and the array for anything malformed."""
    path = Path(path)
    arrays = _load_npz(path, ("calib", "heldout"))
    for name, ids in arrays.items():
        if ids.ndim != 3:
            raise PlacementFileError(f"{path}: '{name}' must have shape [layers, tokens, k], got {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise PlacementFileError(f"{path}: '{name}' must hold integer expert ids, got {ids.dtype}")
        if ids.shape[0] == 0 or ids.shape[1] == 0 or ids.shape[2] == 0:
            raise PlacementFileError(f"{path}: '{name}' is empty (shape {ids.shape}): every split needs layers, "
                                     "tokens and k >= 1")
        if ids.min() < 0:
            raise PlacementFileError(f"{path}: '{name}' holds negative expert ids")
    calib, heldout = arrays["calib"], arrays["heldout"]
    if calib.shape[0] != heldout.shape[0] or calib.shape[2] != heldout.shape[2]:
        raise PlacementFileError(f"{path}: 'calib' {calib.shape} and 'heldout' {heldout.shape} must have the same "
                                 "layers and k")
    top = int(max(calib.max(), heldout.max())) + 1
    experts = top if num_experts is None else num_experts
    if calib.shape[2] > experts:
        raise PlacementFileError(f"{path}: 'calib' has k={calib.shape[2]} experts per token, more than E={experts}")
    for name, ids in arrays.items():
        if ids.max() >= experts:
            raise PlacementFileError(f"{path}: '{name}' holds expert id {int(ids.max())} >= --experts {experts}")
        if (np.diff(np.sort(ids, axis=2), axis=2) == 0).any():
            raise PlacementFileError(f"{path}: '{name}' lists one expert twice for a token")
    layers = list(range(calib.shape[0]))
    with np.load(path, allow_pickle=False) as archive:
        if "layers" in archive.files:
            given = archive["layers"]
            if given.shape != (calib.shape[0],) or not np.issubdtype(given.dtype, np.integer):
                raise PlacementFileError(f"{path}: 'layers' must be {calib.shape[0]} integers, got {given.dtype} "
                                         f"{given.shape}")
            layers = [int(v) for v in given]
    return calib.astype(np.int64), heldout.astype(np.int64), layers, experts


def place_trace(request: TraceRequest, out_dir: Path, cost: Any = None, cost_source: Any = None) -> Path:
    """Every (method, D) placement of the trace into `out_dir` (module docstring); returns the CSV path.

    `cost`: an `occult.sim.cost_model.CostModel` (None: the shipped one)."""
    import pandas as pd

    from occult.provenance import provenance, write_csv, write_json
    from occult.routing.latency import LayerCost

    unknown = [m for m in request.methods if m not in TRACE_METHODS]
    if unknown or not request.methods:
        raise ValueError(f"--methods: {unknown or 'none'} not among {', '.join(TRACE_METHODS)}")
    calib, heldout, layers, experts = read_trace(request.trace, request.num_experts)
    top_k = calib.shape[2]
    shape = request.shape
    if (shape.num_experts, shape.top_k) != (experts, top_k):
        raise ValueError(f"shape: {shape.name} has top-{shape.top_k} of {shape.num_experts} experts, the trace "
                         f"top-{top_k} of {experts}")
    for num_devices in request.devices:
        if num_devices < 1 or experts % num_devices:
            raise ValueError(f"--devices: D={num_devices} does not divide the {experts} experts")
    if cost is None:
        from occult.sim.cost_model_json import builtin_cost_model

        cost, cost_source = builtin_cost_model()
    layer_cost = LayerCost(cost, shape, request.tokens_per_gpu)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    meta = provenance(None, request.seed, stage="place_trace", trace=str(request.trace), devices=list(request.devices),
                      methods=list(request.methods), shape=vars(shape), tokens_per_gpu=request.tokens_per_gpu,
                      cost_model=cost_source)
    rows: list[dict[str, Any]] = []
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for num_devices in request.devices:
            placed = {m: [] for m in request.methods}
            for i, layer in enumerate(layers):
                for method, (placement, seconds, start) in _place_layer(calib[i], experts, num_devices, request,
                                                                        layer_cost, i).items():
                    held = layer_cost.predict(heldout[i], placement, num_devices)
                    own = layer_cost.predict(calib[i], placement, num_devices)
                    placed[method].append(placement)
                    rows.append({"layer": layer, "D": num_devices, "method": method,
                                 "expected_ct_heldout": held.expected_ct,
                                 "max_device_load_over_mean": held.max_load_over_mean,
                                 "predicted_ms": held.predicted_ms, "seconds": seconds,
                                 "expected_ct_calibration": own.expected_ct,
                                 "predicted_ms_calibration": own.predicted_ms, "start_method": start})
            lower, upper = ct_bounds(experts, top_k, num_devices)
            for method, tables in placed.items():
                write_json(tmp / f"D{num_devices}_{method}.json", {
                    "devices": num_devices, "method": method, "num_experts": experts, "top_k": top_k,
                    "layers": layers, "device_of_expert": [p.tolist() for p in tables],
                    "expected_ct_heldout": [r["expected_ct_heldout"] for r in rows
                                            if r["D"] == num_devices and r["method"] == method],
                    "ct_bounds": [lower, upper], "provenance": meta,
                })
        write_csv(tmp / "placement.csv", pd.DataFrame(rows, columns=list(CSV_COLUMNS)), meta=meta)
        _replace_dir(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir / "placement.csv"


def _place_layer(calib_NK: np.ndarray, experts: int, num_devices: int, request: TraceRequest, layer_cost: Any,
                 index: int) -> dict[str, tuple[np.ndarray, float, str | None]]:
    """{method: (placement, seconds, start method)}; latency starts from every other method computed."""
    from occult.routing.latency import latency_search
    from occult.routing.placement import contiguous, greedy_occult, swap_search
    from occult.routing.placement_methods import coactivation_matrix, eplb_load_only, expert_load, load_aware_swap

    seed = request.seed + index
    coact_EE = coactivation_matrix(calib_NK, experts)
    done: dict[str, tuple[np.ndarray, float, str | None]] = {}

    def timed(method: str, build) -> np.ndarray:
        if method not in done:
            begun = time.perf_counter()
            placement = build()
            done[method] = (placement, time.perf_counter() - begun, None)
        return done[method][0]

    builders = {
        "contiguous": lambda: contiguous(experts, num_devices),
        "greedy": lambda: greedy_occult(coact_EE, num_devices),
        "swap": lambda: swap_search(calib_NK, num_devices, timed("greedy", builders["greedy"]), request.swap_rounds,
                                    seed),
        "load_aware": lambda: load_aware_swap(calib_NK, num_devices, timed("swap", builders["swap"]), 0.1,
                                              request.swap_rounds, seed),
        "eplb": lambda: eplb_load_only(expert_load(calib_NK, experts), num_devices),
    }
    wanted = [m for m in request.methods if m != "latency"]
    if "latency" in request.methods:
        wanted = list(dict.fromkeys([*wanted, *builders]))
    for method in wanted:
        timed(method, builders[method])
    if "latency" in request.methods:
        result = latency_search(calib_NK, num_devices, layer_cost, {m: done[m][0] for m in builders},
                                request.swap_rounds, seed)
        starts = sum(done[m][1] for m in builders)
        done["latency"] = (result.device_of_expert, result.seconds + starts, result.start_method)
    return {m: done[m] for m in request.methods}


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Put the finished `tmp` where `out_dir` is (an older `out_dir` is removed only after)."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{time.monotonic_ns()}")
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old is not None:
        shutil.rmtree(old)


def shape_from_args(trace: Path, experts: int | None, shape_name: str | None, hidden: int | None,
                    ffn: int | None):
    """The layer shape: a named paper shape (E and k must match the trace) or the trace's E and k with
    `hidden` and `ffn`."""
    from occult.shapes import MoEShape, get_shape

    if shape_name is not None and (hidden is not None or ffn is not None):
        raise ValueError("--shape or --hidden/--ffn, not both")
    if shape_name is not None:
        return get_shape(shape_name)
    if hidden is None or ffn is None:
        raise ValueError("the cost model needs the layer shape: --shape olmoe|qwen|deepseek, or --hidden and --ffn")
    calib, _, _, num_experts = read_trace(trace, experts)
    return MoEShape(Path(trace).stem, num_experts, calib.shape[2], hidden, ffn)


def add_arguments(parser) -> None:
    parser.add_argument("--trace", required=True, type=Path, help="npz with calib and heldout [layers, tokens, k]")
    parser.add_argument("--devices", required=True, type=int, nargs="+", help="D values (each dividing E)")
    parser.add_argument("--methods", nargs="+", default=list(TRACE_METHODS), help=", ".join(TRACE_METHODS))
    parser.add_argument("--out", required=True, type=Path, help="output folder (placements and placement.csv)")
    parser.add_argument("--experts", type=int, help="expert count E (default: largest id + 1)")
    parser.add_argument("--shape", choices=("olmoe", "qwen", "deepseek"), help="a paper model's layer shape")
    parser.add_argument("--hidden", type=int, help="hidden size (with --ffn): the layer shape of the trace")
    parser.add_argument("--ffn", type=int, help="expert width (with --hidden)")
    parser.add_argument("--cost-model", type=Path, help="a simulate stage's cost_model.json (default: shipped)")
    parser.add_argument("--tokens-per-gpu", type=int, default=16384, help="the batch the predicted times are for")
    parser.add_argument("--swap-rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> Path:
    """`occult place-trace` from parsed arguments."""
    cost = source = None
    if args.cost_model is not None:
        from occult.sim.cost_model_json import read_cost_model

        cost, source = read_cost_model(args.cost_model)
    shape = shape_from_args(args.trace, args.experts, args.shape, args.hidden, args.ffn)
    request = TraceRequest(args.trace, tuple(args.devices), tuple(args.methods), shape, args.experts,
                           args.tokens_per_gpu, args.swap_rounds, args.seed)
    return place_trace(request, args.out, cost, source)


def main(argv: Sequence[str] | None = None) -> Path:
    import argparse

    parser = argparse.ArgumentParser(prog="occult place-trace", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
