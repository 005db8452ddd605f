"""The place stage: every profiled layer placed on D devices by each configured method.

`place` is one layer's placement by method name (`occult.routing.placement.METHODS`);
`run_placement` places every layer of a profiled model for each D and method and writes the
placements (`D{D}_{method}.json`, the format `occult.ep.hf.use_ep` reads) and their held-out table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from occult.config import Config
from occult.logs import progress
from occult.provenance import provenance, write_csv, write_json
from occult.routing.latency import default_starts, latency_search
from occult.routing.placement import (METHODS, PlacementFileError, contiguous, ct_bounds, expected_ct, greedy_occult,
                                      load_profile_coactivation, load_routing, swap_search, trace_metrics)


def place(method: str, coact_EE: np.ndarray, ids_calib_NK: np.ndarray, num_devices: int,
          swap_rounds: int, seed: int, layer: Any = None) -> np.ndarray:
    """One layer's placement by method name: `contiguous`, `greedy`, `swap` (from greedy), or `latency`
    (priced by `layer`, an `occult.routing.latency.LayerCost`; from the best of the others, load_aware
    and EPLB-style)."""
    num_experts = np.asarray(coact_EE).shape[0]
    if method == "contiguous":
        return contiguous(num_experts, num_devices)
    if method == "greedy":
        return greedy_occult(coact_EE, num_devices)
    if method == "swap":
        return swap_search(ids_calib_NK, num_devices, greedy_occult(coact_EE, num_devices), swap_rounds, seed)
    if method == "latency":
        if layer is None:
            raise ValueError("placement method 'latency' needs the layer's cost (a LayerCost)")
        starts = default_starts(ids_calib_NK, num_experts, num_devices, swap_rounds, seed)
        return latency_search(ids_calib_NK, num_devices, layer, starts, swap_rounds, seed).device_of_expert
    raise ValueError(f"placement method {method!r} is not one of {', '.join(METHODS)}")


def run_placement(cfg: Config, profile_dir: Path, out_dir: Path, table_csv: Path,
                  cost_model: Path | None = None) -> None:
    """Place every profiled layer for each D in `cfg.placement.devices` and each method.

    Reads `profile.npz`, `routing_calibration.npz` and `routing_heldout.npz` from `profile_dir`;
    writes `out_dir/D{D}_{method}.json` and the long table `table_csv` (+ `.meta.json` sidecar),
    one row per (D, method, layer) and a `layer = "mean"` row per (D, method). Placements see the
    calibration data only (co-activation counts; the calibration trace for `swap`). Load balance
    (busiest device's expert assignments over the mean) and the intra-device pair share are
    measured on the held-out trace, like `expected_ct_heldout`. Layer i's swap search is seeded
    with `cfg.seed + i`. `latency` prices the model's layer shape with `cost_model` (a simulate
    stage's `cost_model.json`; None: the model shipped with the package).
    """
    import pandas as pd

    profile_dir, out_dir = Path(profile_dir), Path(out_dir)
    coact_LEE, layers = load_profile_coactivation(profile_dir / "profile.npz")
    num_experts = coact_LEE.shape[1]
    calib_LNK = load_routing(profile_dir / "routing_calibration.npz", layers, num_experts)
    heldout_LNK = load_routing(profile_dir / "routing_heldout.npz", layers, num_experts)
    top_k = calib_LNK.shape[2]
    if heldout_LNK.shape[2] != top_k:
        raise PlacementFileError(
            f"{profile_dir / 'routing_heldout.npz'}: top-k {heldout_LNK.shape[2]} differs from the "
            f"calibration trace's {top_k}")
    if (num_experts, top_k) != (cfg.num_experts, cfg.top_k):
        raise PlacementFileError(
            f"{profile_dir / 'profile.npz'}: profiled E={num_experts}, k={top_k} but the model config "
            f"has E={cfg.num_experts}, k={cfg.top_k}")
    pcfg = cfg.placement
    for method in pcfg.methods:
        if method not in METHODS:
            raise ValueError(f"placement.methods: {method!r} is not one of {', '.join(METHODS)}")

    layer_cost = model_layer_cost(cfg, cost_model) if "latency" in pcfg.methods else None
    meta = provenance(cfg.hash(), cfg.seed, stage="placement")
    rows: list[dict[str, Any]] = []
    jobs = [(d, m) for d in pcfg.devices for m in pcfg.methods]
    with progress(len(jobs) * len(layers), desc="placement", unit="layer") as bar:
        for num_devices, method in jobs:
            lower, upper = ct_bounds(num_experts, top_k, num_devices)
            placements = []
            method_rows = []
            for i, layer in enumerate(layers):
                device_of_expert = place(method, coact_LEE[i], calib_LNK[i], num_devices,
                                         pcfg.swap_rounds, cfg.seed + i, layer_cost)
                placements.append(device_of_expert)
                heldout = trace_metrics(heldout_LNK[i], device_of_expert, num_devices)
                method_rows.append({
                    "D": num_devices, "method": method, "layer": str(layer),
                    "expected_ct_heldout": heldout["expected_ct"],
                    "expected_ct_calibration": expected_ct(calib_LNK[i], device_of_expert),
                    "lower_bound": lower, "upper_bound": upper,
                    "max_device_load_over_mean": heldout["max_device_load_over_mean"],
                    "intra_device_pair_fraction": heldout["intra_device_pair_fraction"],
                })
                bar.log(D=num_devices, method=method, layer=int(layer),
                        expected_ct_heldout=method_rows[-1]["expected_ct_heldout"])
                bar.update(1)
            frame = pd.DataFrame(method_rows)
            numeric = frame.drop(columns=["D", "method", "layer"]).mean()
            rows += method_rows + [{"D": num_devices, "method": method, "layer": "mean", **numeric.to_dict()}]
            write_json(out_dir / f"D{num_devices}_{method}.json", {
                "devices": num_devices,
                "method": method,
                "num_experts": num_experts,
                "top_k": top_k,
                "layers": [int(layer) for layer in layers],
                "device_of_expert": [p.tolist() for p in placements],
                "expected_ct_heldout": [r["expected_ct_heldout"] for r in method_rows],
                "provenance": meta,
            })
    write_csv(table_csv, pd.DataFrame(rows), meta=meta)


def model_layer_cost(cfg: Config, cost_model: Path | None = None):
    """The `LayerCost` of the configured model's MoE layer (E, k, hidden size, expert width), at the
    latency objective's default batch, by `cost_model` (None: the shipped model)."""
    from occult.shapes import MoEShape
    from occult.routing.latency import LayerCost
    from occult.sim.cost_model_json import builtin_cost_model, read_cost_model

    m = cfg.model
    cost = (builtin_cost_model() if cost_model is None else read_cost_model(cost_model))[0]
    return LayerCost(cost, MoEShape(cfg.run, m.num_experts, m.top_k, m.hidden_size, m.expert_ffn))
