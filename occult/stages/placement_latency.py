"""The latency placement in the placement study: layer shapes of the traces, the trade-off path, the
rows with replicas, the comparison with the best other method, and the sweep's router as a trace.

The study (`occult.stages.placement_study`) prices every placement with a `LayerCost` per trace:
the synthetic presets take the paper model's layer shape, a profile trace the shape given with it
(else an OLMoE-sized layer of its E and k). `latency_summary` turns a study table into the
comparison of `latency` with the best other method per (trace, layer, D): predicted time on the
calibration split (what the search minimises: never worse, by construction) and on the held-out one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import numpy as np
import pandas as pd

from occult.routing.latency import LatencyResult, LayerCost
from occult.routing.replicas import add_replicas, predict_replicated, replica_search

# synthetic preset trace -> the paper model whose layer shape prices it (occult.harness.baselines)
PRESET_SHAPES = {"synthetic_olmoe": "olmoe", "synthetic_qwen_moe": "qwen", "synthetic_deepseek_moe": "deepseek"}
DEFAULT_HIDDEN, DEFAULT_FFN = 2048, 1024        # a trace of unknown shape: an OLMoE-sized layer


def trace_shape(name: str, num_experts: int, top_k: int, shape: Any = None):
    """The layer shape that prices trace `name`: `shape` when given, a preset's model, else an
    OLMoE-sized layer (hidden 2048, expert width 1024) with the trace's E and k."""
    from occult.shapes import MoEShape, get_shape

    if shape is not None:
        if (shape.num_experts, shape.top_k) != (num_experts, top_k):
            raise ValueError(f"trace {name!r}: routes top-{top_k} of {num_experts} experts, its layer shape "
                             f"{shape.name} has top-{shape.top_k} of {shape.num_experts}")
        return shape
    if name in PRESET_SHAPES:
        return get_shape(PRESET_SHAPES[name])
    return MoEShape(name, num_experts, top_k, DEFAULT_HIDDEN, DEFAULT_FFN)


def layer_cost_at(cost: Any, shape: Any, tokens_per_gpu: float, gpus_per_node: int) -> LayerCost:
    """A `LayerCost` whose link groups the devices into nodes of `gpus_per_node` (the study's nodes)."""
    link = dataclasses.replace(cost.link, gpus_per_node=gpus_per_node)
    return LayerCost(dataclasses.replace(cost, link=link), shape, tokens_per_gpu)


def tradeoff_rows(trace: str, layer: str, num_devices: int, result: LatencyResult) -> list[dict[str, Any]]:
    """The search's thinned path and every start and the result, each as (E[C_T], busiest device's
    load over the mean, predicted ms) on the calibration split."""
    base = {"trace": trace, "layer": layer, "D": num_devices}
    path = result.path
    rows = [{**base, "kind": "path", "method": "latency", "step": i, "expected_ct": float(ct),
             "max_device_load_over_mean": float(load), "predicted_ms": float(ms), "accepted": bool(acc)}
            for i, (ct, load, ms, acc) in enumerate(zip(path.get("expected_ct", ()), path.get("max_load_over_mean", ()),
                                                         path.get("predicted_ms", ()), path.get("accepted", ())))]
    marked = {**result.starts, "latency": result.final}
    for method, pred in marked.items():
        rows.append({**base, "kind": "method", "method": method, "step": None, "expected_ct": pred.expected_ct,
                     "max_device_load_over_mean": pred.max_load_over_mean, "predicted_ms": pred.predicted_ms,
                     "accepted": method == result.start_method})
    return rows


def replica_rows(trace: str, layer: str, calib_NK: np.ndarray, heldout_NK: np.ndarray, placed: np.ndarray,
                 num_devices: int, cost: LayerCost, slots: Sequence[int], rounds: int,
                 tokens: int | None = None) -> list[dict[str, Any]]:
    """The latency placement with R = 0 and each R in `slots` spare slots per device: copies of the
    hottest experts, moved where that lowers the predicted time of the first `tokens` calibration
    tokens (None: all; `occult.routing.replicas`); E[C_T], load and predicted time on both splits."""
    rows = []
    sample_NK = calib_NK[:tokens]
    for slots_per_device in (0, *slots):
        begun = time.perf_counter()
        replicated = add_replicas(sample_NK, placed, num_devices, slots_per_device)
        if slots_per_device:
            replicated = replica_search(sample_NK, replicated, cost, rounds)[0]
        seconds = time.perf_counter() - begun
        calib = predict_replicated(calib_NK, replicated, cost)
        held = predict_replicated(heldout_NK, replicated, cost)
        rows.append({"trace": trace, "layer": layer, "D": num_devices, "method": "latency",
                     "slots_per_device": slots_per_device, "copies": len(replicated.copy_expert),
                     "expected_ct_heldout": held.expected_ct, "max_device_load_over_mean": held.max_load_over_mean,
                     "predicted_ms_heldout": held.predicted_ms, "expected_ct_calibration": calib.expected_ct,
                     "predicted_ms_calibration": calib.predicted_ms, "seconds": seconds})
    return rows


HELDOUT_BLOCKS = 16        # the held-out split cut into runs of consecutive tokens ...
HELDOUT_RESAMPLES = 200    # ... drawn with replacement this many times for the gain's interval


def heldout_gain_interval(heldout_NK: np.ndarray, latency: np.ndarray, others: dict[str, np.ndarray],
                          layer_cost: LayerCost, num_devices: int, seed: int,
                          resamples: int = HELDOUT_RESAMPLES, blocks: int = HELDOUT_BLOCKS) -> tuple[float, float]:
    """95% interval of latency's held-out gain over the best other method (the fastest of `others`
    on each resample), from a block bootstrap: the held-out split cut into `blocks` runs of
    consecutive tokens, `resamples` draws of as many runs with replacement. Its width is the
    sampling error of the held-out comparison; (nan, nan) where the split has fewer tokens than
    blocks or no other method is given."""
    if len(heldout_NK) < blocks or not others:
        return float("nan"), float("nan")
    runs = np.array_split(np.arange(len(heldout_NK)), blocks)
    rng = np.random.default_rng(seed)
    gains = []
    for _ in range(resamples):
        ids = heldout_NK[np.concatenate([runs[b] for b in rng.integers(blocks, size=blocks)])]
        best = min(layer_cost.predict(ids, p, num_devices).predicted_ms for p in others.values())
        gains.append(best / layer_cost.predict(ids, latency, num_devices).predicted_ms)
    low, high = np.quantile(gains, [0.025, 0.975])
    return float(low), float(high)


def heldout_verdict(low: float, high: float) -> str:
    """`faster` or `slower` where the whole interval of the gain lies above or below 1, else
    `within sampling error` (or `no interval`)."""
    if not (np.isfinite(low) and np.isfinite(high)):
        return "no interval"
    return "faster" if low > 1.0 else "slower" if high < 1.0 else "within sampling error"


def latency_summary(study: pd.DataFrame) -> pd.DataFrame:
    """Per (trace, layer, D): the other method of lowest predicted time on the calibration split,
    its time and latency's on both splits, latency's gain over it (> 1: faster), on the held-out
    split against the fastest other there with the interval of that gain (`heldout_gain_interval`,
    where the study measured it) and its verdict, and latency's search time."""
    ok = study[(study["status"] == "ok") & (study["layer"].astype(str) != "mean")]
    rows = []
    for (trace, layer, num_devices), group in ok.groupby(["trace", "layer", "D"], sort=False):
        mine = group[group["method"] == "latency"]
        others = group[group["method"] != "latency"]
        if mine.empty or others.empty:
            continue
        mine = mine.iloc[0]
        best = others.loc[others["predicted_ms_calibration"].idxmin()]
        best_held = others.loc[others["predicted_ms_heldout"].idxmin()]
        rows.append({
            "trace": trace, "layer": layer, "D": num_devices, "best_other": best["method"],
            "best_other_ms_calibration": best["predicted_ms_calibration"],
            "latency_ms_calibration": mine["predicted_ms_calibration"],
            "gain_calibration": best["predicted_ms_calibration"] / mine["predicted_ms_calibration"],
            "best_other_heldout": best_held["method"], "best_other_ms_heldout": best_held["predicted_ms_heldout"],
            "latency_ms_heldout": mine["predicted_ms_heldout"],
            "gain_heldout": best_held["predicted_ms_heldout"] / mine["predicted_ms_heldout"],
            "gain_heldout_low": mine.get("gain_heldout_low", np.nan),
            "gain_heldout_high": mine.get("gain_heldout_high", np.nan),
            "heldout_verdict": heldout_verdict(mine.get("gain_heldout_low", np.nan),
                                               mine.get("gain_heldout_high", np.nan)),
            "latency_expected_ct_heldout": mine["expected_ct_heldout"],
            "latency_max_device_load_over_mean": mine["max_device_load_over_mean"],
            "latency_seconds": mine["seconds"], "latency_search_seconds": mine.get("search_seconds", np.nan),
        })
    return pd.DataFrame(rows)


def sweep_router_splits(shape_names: Sequence[str], tokens: int, seed: int) -> dict[str, Any]:
    """The sweep's seeded `SyntheticRouter` of each shape as a study trace `sweep_<shape>`: its
    calibration batch (the one `occult_placement` places from) and a batch of hidden states routed
    the way the sweep's timed inputs are (`make_inputs`), `tokens` each."""
    import torch

    from occult.shapes import get_shape
    from occult.harness.sweep.inputs import CALIBRATION_TOKENS, SyntheticRouter, make_inputs
    from occult.provenance import derive_seed
    from occult.routing.splits import RoutingSplits

    out = {}
    for name in shape_names:
        shape = get_shape(name)
        router = SyntheticRouter.make(shape, seed)
        gen = torch.Generator().manual_seed(derive_seed(seed, "calibration", shape.name))
        calib = router.calibration_ids(max(tokens, CALIBRATION_TOKENS), shape.top_k, gen)[:tokens]
        inputs = make_inputs(shape, router, tokens, derive_seed(seed, "simulate", shape.name), torch.device("cpu"),
                             torch.bfloat16, [None], None, with_grad_output=False)
        heldout = inputs.routes[None][0]
        out[f"sweep_{name}"] = RoutingSplits(calib.numpy()[None].astype(np.int64),
                                             heldout.numpy()[None].astype(np.int64), shape.num_experts, shape=shape)
    return out
