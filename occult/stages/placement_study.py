"""Placement study: every placement method on held-out routing, over device counts and traces.

`run_study` places each layer of each trace (calibration split) with each method for each D
that divides E, and measures on the held-out split: E[C_T], its bounds, E[C_T] in nodes, the
intra-device pair share, max/mean device load, the predicted layer time (on both splits) and the
time taken. Every row also carries how far the layer's held-out routing follows the expert groups
of virtual-group upcycling (expert j in group j mod E/k: `occult.routing.inheritance`), the
groups a token spans and the share in its main group beside their random-routing values, and the
inheritance index; for a model without initial groups these are a control near the random value.
With `latency` it also writes the search's trade-off path (E[C_T] against load, with
every start marked) and the latency placement with R = 0, 1, 2 spare slots per device
(`occult.stages.placement_latency`). `sensitivity` measures how
E[C_T] on held-out text depends on the calibration size (prefixes of the calibration trace) and
on domain shift (calibrate on one corpus source, evaluate on another). The CLI runs both on a
profile directory (our model) and on the synthetic OLMoE, Qwen-MoE and DeepSeek-MoE presets:

    python -m occult.stages.placement_study --profile-dir results/tiny/profile --out results/tiny/placement_study.csv

Run this way it is a logged stage (`occult.logs.run_main`): `--log-json PATH` gives JSON-lines
logs ending in one `done` or `failed` record, and a failure exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from occult.config import config_hash
from occult.routing.inheritance import virtual_group_summary
from occult.routing.latency import DEFAULT_TOKENS_PER_GPU, latency_search
from occult.logs import ENV_LOG_JSON, progress, run_main
from occult.routing.splits import RoutingSplits
from occult.routing.placement import (
    contiguous,
    ct_bounds,
    expected_ct,
    greedy_occult,
    swap_search,
    trace_metrics,
)
from occult.routing.placement_methods import (
    SYNTHETIC_SHAPES,
    coactivation_matrix,
    eplb_load_only,
    expected_node_ct,
    expert_load,
    hierarchical,
    load_aware_swap,
    metis_partition,
    pair_greedy,
    synthetic_preset,
)
from occult.provenance import provenance, write_csv
from occult.stages.placement_latency import (
    heldout_gain_interval,
    latency_summary,
    layer_cost_at,
    replica_rows,
    trace_shape,
    tradeoff_rows,
)

STUDY_METHODS = ("contiguous", "greedy", "pair_greedy", "swap", "load_aware", "hierarchical", "metis", "eplb", "latency")
SENSITIVITY_METHODS = ("greedy", "pair_greedy", "swap")
MAX_DEVICES = 64


@dataclass(frozen=True)
class SearchConfig:
    """Knobs of the search-based methods."""

    swap_rounds: int = 20
    kicks: int = 8            # perturb-and-descend restarts of the swap searches
    eps: float = 0.1          # load_aware: max device load <= (1 + eps) * mean
    gpus_per_node: int = 4    # hierarchical (and the node-level metric of every method, and latency's links)
    tokens_per_gpu: int = DEFAULT_TOKENS_PER_GPU   # latency: the batch per GPU it prices (forward)
    latency_kicks: int = 4    # latency: perturb-and-descend restarts
    replica_slots: tuple[int, ...] = (1, 2)        # latency with R spare slots per device (R = 0 always)
    replica_devices: tuple[int, ...] = (2, 4, 8)   # the D with replica rows
    replica_rounds: int = 1   # passes of the copy moves
    replica_tokens: int = 8192   # calibration tokens the copies are placed on (all are measured)


def as_splits(name: str, value: RoutingSplits | tuple[np.ndarray, np.ndarray]) -> RoutingSplits:
    """A `RoutingSplits` from one, or from a (calibration, held-out) pair (E = largest id + 1)."""
    if hasattr(value, "calib_LNK"):          # a RoutingSplits (also of this module run as __main__)
        splits = value
    else:
        try:
            calib, heldout = value
        except (TypeError, ValueError):
            raise ValueError(f"trace {name!r}: expected (calib_ids_LNK, heldout_ids_LNK)") from None
        calib, heldout = np.asarray(calib), np.asarray(heldout)
        top = max(int(calib.max(initial=-1)), int(heldout.max(initial=-1))) + 1
        splits = RoutingSplits(calib, heldout, top)
    calib, heldout = splits.calib_LNK, splits.heldout_LNK
    if calib.ndim != 3 or heldout.ndim != 3 or calib.shape[0] != heldout.shape[0] or calib.shape[2] != heldout.shape[2]:
        raise ValueError(f"trace {name!r}: calibration {calib.shape} and held-out {heldout.shape} must be "
                         "[L, N, k] with the same L and k")
    if calib.shape[1] == 0 or heldout.shape[1] == 0:
        raise ValueError(f"trace {name!r}: a split has no tokens")
    if not splits.layers:
        splits = dataclasses.replace(splits, layers=tuple(range(calib.shape[0])))
    return splits


def default_devices(num_experts: int, candidates: Sequence[int] | None = None) -> list[int]:
    """The D studied for E experts: candidates dividing E (default: even D ≤ 64 dividing E)."""
    if candidates is None:
        candidates = range(2, MAX_DEVICES + 1, 2)
    return [d for d in candidates if 1 <= d <= num_experts and num_experts % d == 0]


def gpus_per_node_for(num_devices: int, preferred: int) -> int:
    """The largest divisor of D that is ≤ the preferred GPUs per node."""
    return max(g for g in range(1, min(preferred, num_devices) + 1) if num_devices % g == 0)


# ----------------------------------------------------------------------------------------------
# One layer, one D, one method


class _LayerPlacer:
    """Places one layer for one D; caches every placement (load_aware starts from swap, latency from
    all of them) and the latency search's result."""

    def __init__(self, calib_NK: np.ndarray, num_experts: int, num_devices: int, search: SearchConfig, seed: int,
                 layer_cost: Any = None):
        self.calib_NK = calib_NK
        self.num_experts = num_experts
        self.num_devices = num_devices
        self.search = search
        self.seed = seed
        self.layer_cost = layer_cost
        self.coact_EE = coactivation_matrix(calib_NK, num_experts)
        self._swap: tuple[np.ndarray, float] | None = None
        self._placed: dict[str, tuple[np.ndarray, float]] = {}
        self.latency = None

    def swap(self) -> tuple[np.ndarray, float]:
        if self._swap is None:
            start = time.perf_counter()
            init = greedy_occult(self.coact_EE, self.num_devices)
            placed = swap_search(self.calib_NK, self.num_devices, init, self.search.swap_rounds, self.seed,
                                 kicks=self.search.kicks)
            self._swap = placed, time.perf_counter() - start
        return self._swap

    def place(self, method: str) -> tuple[np.ndarray, float]:
        """(device_of_expert, seconds); load_aware's seconds include the swap search it starts from,
        latency's every placement it starts from."""
        if method not in self._placed:
            self._placed[method] = self._place(method)
        return self._placed[method]

    def _place(self, method: str) -> tuple[np.ndarray, float]:
        E, D, s = self.num_experts, self.num_devices, self.search
        if method == "latency":
            if self.layer_cost is None:
                raise ValueError("placement method 'latency' needs a layer cost")
            for name in STUDY_METHODS[:-1]:
                try:
                    self.place(name)
                except ImportError:
                    continue                # METIS without pymetis: not a start
            starts = {name: placed for name, (placed, _) in self._placed.items()}
            self.latency = latency_search(self.calib_NK, D, self.layer_cost, starts, s.swap_rounds, self.seed,
                                          kicks=s.latency_kicks)
            start_seconds = sum(seconds for _, seconds in self._placed.values())
            return self.latency.device_of_expert, self.latency.seconds + start_seconds
        if method == "swap":
            return self.swap()
        if method == "load_aware":
            init, swap_seconds = self.swap()
            start = time.perf_counter()
            placed = load_aware_swap(self.calib_NK, D, init, s.eps, s.swap_rounds, self.seed, kicks=s.kicks)
            return placed, swap_seconds + time.perf_counter() - start
        builders: dict[str, Callable[[], np.ndarray]] = {
            "contiguous": lambda: contiguous(E, D),
            "greedy": lambda: greedy_occult(self.coact_EE, D),
            "pair_greedy": lambda: pair_greedy(self.coact_EE, D),
            "metis": lambda: metis_partition(self.coact_EE, D, self.seed),
            "eplb": lambda: eplb_load_only(expert_load(self.calib_NK, E), D),
            "hierarchical": lambda: hierarchical(
                self.calib_NK, D // gpus_per_node_for(D, s.gpus_per_node), gpus_per_node_for(D, s.gpus_per_node),
                E, rounds=s.swap_rounds, seed=self.seed, kicks=s.kicks).device_of_expert,
        }
        if method not in builders:
            raise ValueError(f"placement method {method!r} is not one of {', '.join(STUDY_METHODS)}")
        start = time.perf_counter()
        placed = builders[method]()
        return placed, time.perf_counter() - start


def _measure(heldout_NK: np.ndarray, placed: np.ndarray, num_devices: int, gpus_per_node: int,
             placer: _LayerPlacer) -> dict[str, float]:
    metrics = trace_metrics(heldout_NK, placed, num_devices)
    out = {
        "expected_ct_heldout": metrics["expected_ct"],
        "inter_node_ct_heldout": expected_node_ct(heldout_NK, placed, gpus_per_node),
        "intra_device_pair_fraction": metrics["intra_device_pair_fraction"],
        "max_device_load_over_mean": metrics["max_device_load_over_mean"],
    }
    if placer.layer_cost is not None:
        out["predicted_ms_heldout"] = placer.layer_cost.predict(heldout_NK, placed, num_devices).predicted_ms
        out["predicted_ms_calibration"] = placer.layer_cost.predict(placer.calib_NK, placed, num_devices).predicted_ms
    return out


# ----------------------------------------------------------------------------------------------
# The study


@dataclass
class StudyTables:
    """The study's tables: `study` (long rows), `tradeoff` (the latency search's path and the
    methods it started from) and `replicas` (latency with spare slots); the last two are empty
    without `latency` among the methods."""

    study: pd.DataFrame
    tradeoff: pd.DataFrame
    replicas: pd.DataFrame


def study_rows(traces: Mapping[str, RoutingSplits | tuple[np.ndarray, np.ndarray]],
               devices: Sequence[int] | None, methods: Sequence[str], seed: int,
               search: SearchConfig = SearchConfig(), cost: Any = None) -> pd.DataFrame:
    """Long rows (trace, layer, D, method, metrics, seconds, status), plus layer="mean" rows
    (`study_tables(...).study`)."""
    return study_tables(traces, devices, methods, seed, search, cost).study


def study_tables(traces: Mapping[str, RoutingSplits | tuple[np.ndarray, np.ndarray]],
                 devices: Sequence[int] | None, methods: Sequence[str], seed: int,
                 search: SearchConfig = SearchConfig(), cost: Any = None) -> StudyTables:
    """Every table of the study (`StudyTables`).

    A method that cannot run (METIS without `pymetis`) gives status "unavailable: ..." and empty
    metrics; nothing is substituted. Layer i is placed with seed + i. Every placement is priced
    by `cost` (an `occult.sim.cost_model.CostModel`; None: the shipped one) on the trace's layer
    shape, at `search.tokens_per_gpu`, with nodes of `gpus_per_node` GPUs.
    """
    for method in methods:
        if method not in STUDY_METHODS:
            raise ValueError(f"methods: {method!r} is not one of {', '.join(STUDY_METHODS)}")
    if cost is None:
        from occult.sim.cost_model_json import builtin_cost_model

        cost = builtin_cost_model()[0]
    all_splits = {name: as_splits(name, value) for name, value in traces.items()}
    jobs = [(name, i, d) for name, sp in all_splits.items()
            for d in default_devices(sp.num_experts, devices) for i in range(sp.calib_LNK.shape[0])]
    rows: list[dict[str, Any]] = []
    tradeoff: list[dict[str, Any]] = []
    replicas: list[dict[str, Any]] = []
    group_columns: dict[tuple[str, int], dict[str, float]] = {}
    with progress(len(jobs) * len(methods), desc="placement study", unit="placement") as bar:
        for name, i, num_devices in jobs:
            sp = all_splits[name]
            calib_NK = sp.calib_LNK[i].astype(np.int64)
            heldout_NK = sp.heldout_LNK[i].astype(np.int64)
            top_k = calib_NK.shape[1]
            lower, upper = ct_bounds(sp.num_experts, top_k, num_devices)
            gpus = gpus_per_node_for(num_devices, search.gpus_per_node)
            layer_cost = layer_cost_at(cost, trace_shape(name, sp.num_experts, top_k, sp.shape), search.tokens_per_gpu,
                                       gpus)
            placer = _LayerPlacer(calib_NK, sp.num_experts, num_devices, search, seed + i, layer_cost)
            placed_here: dict[str, np.ndarray] = {}
            if (name, i) not in group_columns:
                group_columns[name, i] = virtual_group_summary(heldout_NK, sp.num_experts)
            groups = group_columns[name, i]
            for method in methods:
                row: dict[str, Any] = {
                    "trace": name, "layer": str(sp.layers[i]), "D": num_devices, "method": method,
                    "num_experts": sp.num_experts, "top_k": top_k, "gpus_per_node": gpus,
                    "lower_bound": lower, "upper_bound": upper, **groups,
                }
                try:
                    placed, seconds = placer.place(method)
                except ImportError as err:
                    row.update(status=f"unavailable: {err}")
                else:
                    row.update(_measure(heldout_NK, placed, num_devices, gpus, placer),
                               expected_ct_calibration=expected_ct(calib_NK, placed),
                               seconds=seconds, status="ok")
                    if method == "latency":
                        row.update(search_seconds=placer.latency.seconds, start_method=placer.latency.start_method)
                    placed_here[method] = placed
                rows.append(row)
                bar.update(1)
            if "latency" in placed_here:
                others = {m: p for m, p in placed_here.items() if m != "latency"}
                low, high = heldout_gain_interval(heldout_NK, placed_here["latency"], others, layer_cost,
                                                  num_devices, seed + i)
                next(r for r in reversed(rows) if r["method"] == "latency").update(
                    gain_heldout_low=low, gain_heldout_high=high)
            if placer.latency is not None:
                tradeoff += tradeoff_rows(name, str(sp.layers[i]), num_devices, placer.latency)
                if num_devices in search.replica_devices:
                    replicas += replica_rows(name, str(sp.layers[i]), calib_NK, heldout_NK,
                                             placer.latency.device_of_expert, num_devices, layer_cost,
                                             search.replica_slots, search.replica_rounds, search.replica_tokens)
    frame = pd.DataFrame(rows)
    study = pd.concat([frame, _mean_rows(frame)], ignore_index=True)
    return StudyTables(study, pd.DataFrame(tradeoff), pd.DataFrame(replicas))


def _mean_rows(frame: pd.DataFrame) -> pd.DataFrame:
    keys = ["trace", "D", "method"]
    ok = frame[frame["status"] == "ok"]
    if ok.empty:
        return ok
    numeric = [c for c in ok.columns if c not in keys + ["layer", "status", "start_method"]]
    means = ok.groupby(keys, sort=False)[numeric].mean().reset_index()
    for column in ("seconds", "search_seconds"):
        if column in ok.columns:
            means[column] = ok.groupby(keys, sort=False)[column].sum(min_count=1).to_numpy()
    means["layer"] = "mean"
    means["status"] = "ok"
    return means


def run_study(traces: Mapping[str, RoutingSplits | tuple[np.ndarray, np.ndarray]],
              devices: Sequence[int] | None, methods: Sequence[str], out_csv: str | Path, seed: int,
              search: SearchConfig = SearchConfig(), cost: Any = None, cost_source: Any = None,
              tradeoff_csv: str | Path | None = None, replicas_csv: str | Path | None = None,
              summary_csv: str | Path | None = None) -> pd.DataFrame:
    """`study_tables` written to `out_csv` and, where given, the trade-off path, the replica rows and
    `latency_summary` to theirs (each with a `.meta.json` provenance sidecar naming the cost
    model's source); returns the study frame."""
    tables = study_tables(traces, devices, methods, seed, search, cost)
    if cost_source is None and cost is None:
        from occult.sim.cost_model_json import builtin_cost_model

        cost_source = builtin_cost_model()[1]
    meta = _meta("placement_study", traces, devices, methods, seed, search, cost_model=cost_source)
    write_csv(out_csv, tables.study, meta=meta)
    for path, frame in ((tradeoff_csv, tables.tradeoff), (replicas_csv, tables.replicas),
                        (summary_csv, latency_summary(tables.study) if summary_csv else None)):
        if path is not None:
            write_csv(path, frame, meta=meta)
    return tables.study


# ----------------------------------------------------------------------------------------------
# Sensitivity: calibration size and domain shift


def sensitivity(traces: Mapping[str, RoutingSplits | tuple[np.ndarray, np.ndarray]],
                devices: Sequence[int] | None, methods: Sequence[str], fractions: Sequence[float],
                seed: int, search: SearchConfig = SearchConfig(), min_source_tokens: int = 200) -> pd.DataFrame:
    """Held-out E[C_T] against the calibration set: its size, and its corpus source.

    `calibration_size`: place from the first `fraction` of the calibration tokens, evaluate on the
    whole held-out split. `domain_shift` (traces with ≥ 2 sources): place from the calibration
    tokens of source A, cut to the size of the smallest source so all calibrations are equal,
    evaluate on the held-out tokens of source B, for every pair (A = B is the in-domain reference).
    Sources with fewer than `min_source_tokens` tokens in either split are left out.
    """
    for method in methods:
        if method not in STUDY_METHODS:
            raise ValueError(f"methods: {method!r} is not one of {', '.join(STUDY_METHODS)}")
    for fraction in fractions:
        if not 0 < fraction <= 1:
            raise ValueError(f"fractions: {fraction} must lie in (0, 1]")
    cases: list[tuple[str, int, int, dict[str, Any], np.ndarray, np.ndarray]] = []
    for name, value in traces.items():
        sp = as_splits(name, value)
        for num_devices in default_devices(sp.num_experts, devices):
            for i in range(sp.calib_LNK.shape[0]):
                calib_NK, heldout_NK = sp.calib_LNK[i], sp.heldout_LNK[i]
                for fraction in fractions:
                    tokens = max(1, int(round(fraction * len(calib_NK))))
                    cases.append((name, i, num_devices, {"study": "calibration_size", "calib_fraction": fraction,
                                                         "calib_tokens": tokens}, calib_NK[:tokens], heldout_NK))
                for info, calib_part, heldout_part in _domain_cases(sp, i, min_source_tokens):
                    cases.append((name, i, num_devices, info, calib_part, heldout_part))
    rows = []
    all_splits = {name: as_splits(name, value) for name, value in traces.items()}
    for name, i, num_devices, info, calib_NK, heldout_NK in progress(cases, desc="placement sensitivity", unit="case"):
        sp = all_splits[name]
        placer = _LayerPlacer(calib_NK.astype(np.int64), sp.num_experts, num_devices, search, seed + i)
        for method in methods:
            row = {"trace": name, "layer": str(sp.layers[i]), "D": num_devices, "method": method, **info,
                   "heldout_tokens": len(heldout_NK)}
            try:
                placed, seconds = placer.place(method)
            except ImportError as err:
                row["status"] = f"unavailable: {err}"
            else:
                row.update(expected_ct_heldout=expected_ct(heldout_NK.astype(np.int64), placed),
                           seconds=seconds, status="ok")
            rows.append(row)
    return pd.DataFrame(rows)


def _domain_cases(sp: RoutingSplits, layer: int, min_tokens: int):
    """(info, calibration part, held-out part) for every usable (calibration source, eval source)."""
    if sp.calib_sources is None or sp.heldout_sources is None or len(sp.source_names) < 2:
        return
    calib_count = np.bincount(sp.calib_sources, minlength=len(sp.source_names))
    heldout_count = np.bincount(sp.heldout_sources, minlength=len(sp.source_names))
    usable = [s for s in range(len(sp.source_names)) if min(calib_count[s], heldout_count[s]) >= min_tokens]
    if len(usable) < 2:
        return
    tokens = int(min(calib_count[s] for s in usable))
    for a in usable:
        calib_part = sp.calib_LNK[layer][sp.calib_sources == a][:tokens]
        for b in usable:
            yield ({"study": "domain_shift", "calib_tokens": tokens, "calib_source": sp.source_names[a],
                    "eval_source": sp.source_names[b]},
                   calib_part, sp.heldout_LNK[layer][sp.heldout_sources == b])


def run_sensitivity(traces: Mapping[str, RoutingSplits | tuple[np.ndarray, np.ndarray]],
                    devices: Sequence[int] | None, methods: Sequence[str], fractions: Sequence[float],
                    out_csv: str | Path, seed: int, search: SearchConfig = SearchConfig()) -> pd.DataFrame:
    """`sensitivity` written to `out_csv` with a provenance sidecar; returns the frame."""
    frame = sensitivity(traces, devices, methods, fractions, seed, search)
    write_csv(out_csv, frame, meta=_meta("placement_sensitivity", traces, devices, methods, seed, search,
                                         fractions=list(fractions)))
    return frame


def _meta(stage: str, traces: Mapping[str, Any], devices: Sequence[int] | None, methods: Sequence[str],
          seed: int, search: SearchConfig, **extra: Any) -> dict[str, Any]:
    settings = {"traces": sorted(traces), "devices": None if devices is None else list(devices),
                "methods": list(methods), "seed": seed, "search": dataclasses.asdict(search), **extra}
    shapes = {name: list(as_splits(name, v).calib_LNK.shape) for name, v in traces.items()}
    return provenance(config_hash(settings), seed, stage=stage, settings=settings, calibration_shapes=shapes)


# ----------------------------------------------------------------------------------------------
# Inputs


def load_profile_splits(profile_dir: str | Path, max_tokens: int | None = None, shape: Any = None) -> RoutingSplits:
    """Our model's routing from a profile directory: routing_{calibration,heldout}.npz, or where
    those are absent the samples a GPU run returns (routing_{calibration,heldout}_sample.npz,
    `occult.routing.profiling.sample_routing`); `max_tokens` keeps that many of each split, in runs
    spread over it (`occult.routing.profiling.spread_indices`)."""
    from occult.routing.profiling import load_profile, load_routing, spread_indices

    profile_dir = Path(profile_dir)

    def split_file(split: str) -> Path:
        full, sample = profile_dir / f"routing_{split}.npz", profile_dir / f"routing_{split}_sample.npz"
        return sample if not full.is_file() and sample.is_file() else full

    calib = load_routing(split_file("calibration"))
    heldout = load_routing(split_file("heldout"))
    if calib.source_names != heldout.source_names or not np.array_equal(calib.layers, heldout.layers):
        raise ValueError(f"{profile_dir}: calibration and held-out routing differ in layers or source names")
    profile_file = profile_dir / "profile.npz"
    if profile_file.is_file():
        num_experts = load_profile(profile_file).num_experts
    else:
        num_experts = int(max(calib.ids.max(), heldout.ids.max())) + 1
    def kept(total: int) -> slice | np.ndarray:
        return slice(None) if max_tokens is None or max_tokens >= total else spread_indices(total, max_tokens)

    calib_cut, heldout_cut = kept(calib.ids.shape[1]), kept(heldout.ids.shape[1])
    return RoutingSplits(
        calib_LNK=calib.ids[:, calib_cut].astype(np.int64), heldout_LNK=heldout.ids[:, heldout_cut].astype(np.int64),
        num_experts=num_experts, layers=tuple(int(layer) for layer in calib.layers),
        calib_sources=calib.sources[calib_cut].astype(np.int64),
        heldout_sources=heldout.sources[heldout_cut].astype(np.int64),
        source_names=calib.source_names, shape=shape,
    )


def synthetic_splits(names: Sequence[str], num_tokens: int, num_layers: int, seed: int) -> dict[str, RoutingSplits]:
    """The named synthetic presets as `RoutingSplits` (trace names `synthetic_<preset>`)."""
    out = {}
    for name in names:
        calib, heldout = synthetic_preset(name, num_tokens, num_layers, seed)
        out[f"synthetic_{name}"] = RoutingSplits(calib, heldout, SYNTHETIC_SHAPES[name][0])
    return out


def plot_main(argv: Sequence[str]) -> None:
    """`python -m occult.stages.placement_study --plot STUDY_CSV --figure PNG`: the study's figure from its
    CSV (e.g. a committed study of a GPU run's routing sample)."""
    from occult.report.study import plot_placement_study

    parser = argparse.ArgumentParser(prog="python -m occult.stages.placement_study --plot")
    parser.add_argument("--plot", type=Path, required=True, metavar="STUDY_CSV")
    parser.add_argument("--figure", type=Path, required=True)
    parser.add_argument("--log-json", metavar="PATH")
    args = parser.parse_args(argv)
    if not args.plot.is_file():
        raise FileNotFoundError(f"{args.plot}: no such study CSV")
    plot_placement_study(pd.read_csv(args.plot), args.figure)


def _profile_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The profile trace's layer shape from --model-shape, or --hidden/--ffn with its E and k (None: default)."""
    from occult.shapes import MoEShape, get_shape

    if args.model_shape is not None:
        if args.hidden is not None or args.ffn is not None:
            parser.error("--model-shape or --hidden/--ffn, not both")
        try:
            return get_shape(args.model_shape)
        except ValueError as err:
            parser.error(f"--model-shape: {err}")
    if (args.hidden is None) != (args.ffn is None):
        parser.error("--hidden and --ffn go together")
    if args.hidden is None:
        return None
    splits = load_profile_splits(args.profile_dir, 1)
    return MoEShape(args.trace_name, splits.num_experts, splits.calib_LNK.shape[2], args.hidden, args.ffn)


def main(argv: Sequence[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if "--plot" in argv:
        return plot_main(argv)
    parser = argparse.ArgumentParser(prog="python -m occult.stages.placement_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile-dir", type=Path, help="profile directory of our model (routing_*.npz)")
    parser.add_argument("--trace-name", default="model", help="name of the profile's trace in the CSVs")
    parser.add_argument("--out", type=Path, required=True, help="study CSV (long rows)")
    parser.add_argument("--sensitivity-out", type=Path, help="sensitivity CSV (default: <out>_sensitivity.csv)")
    parser.add_argument("--devices", type=int, nargs="+", help="candidate D (default: even D <= 64 dividing E)")
    parser.add_argument("--methods", nargs="+", default=list(STUDY_METHODS), choices=STUDY_METHODS)
    parser.add_argument("--synthetic", nargs="*", default=list(SYNTHETIC_SHAPES), choices=list(SYNTHETIC_SHAPES))
    parser.add_argument("--synthetic-tokens", type=int, default=6000, help="tokens per split and layer")
    parser.add_argument("--synthetic-layers", type=int, default=2)
    parser.add_argument("--max-profile-tokens", type=int,
                        help="cap on each split of the profile traces (16 runs of consecutive tokens spread over it)")
    parser.add_argument("--sensitivity-methods", nargs="*", default=list(SENSITIVITY_METHODS), choices=STUDY_METHODS)
    parser.add_argument("--sensitivity-devices", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.2, 0.5, 1.0])
    parser.add_argument("--swap-rounds", type=int, default=SearchConfig.swap_rounds)
    parser.add_argument("--kicks", type=int, default=SearchConfig.kicks)
    parser.add_argument("--eps", type=float, default=SearchConfig.eps)
    parser.add_argument("--gpus-per-node", type=int, default=SearchConfig.gpus_per_node)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-model", type=Path, metavar="JSON",
                        help="latency: a simulate stage's cost_model.json (default: the model shipped with the package)")
    parser.add_argument("--tokens-per-gpu", type=int, default=SearchConfig.tokens_per_gpu,
                        help="latency: the batch per GPU the predicted times are for")
    parser.add_argument("--model-shape", help="layer shape of the profile's trace: olmoe, qwen or deepseek ...")
    parser.add_argument("--hidden", type=int, help="... or its hidden size and expert width (with --ffn)")
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--sweep-routers", nargs="*", default=[], metavar="SHAPE",
                        help="also the sweep's synthetic router of these shapes (traces sweep_<shape>)")
    parser.add_argument("--replica-slots", type=int, nargs="*", default=list(SearchConfig.replica_slots))
    parser.add_argument("--replica-devices", type=int, nargs="*", default=list(SearchConfig.replica_devices))
    parser.add_argument("--tradeoff-out", type=Path, help="latency: the search's path and the methods, CSV")
    parser.add_argument("--replicas-out", type=Path, help="latency with spare slots per device, CSV")
    parser.add_argument("--summary-out", type=Path, help="latency against the best other method, CSV")
    parser.add_argument("--tradeoff-figure", type=Path, help="figure of the trade-off CSV")
    parser.add_argument("--log-json", metavar="PATH",
                        help=f"append JSON-lines logs here (default: ${ENV_LOG_JSON}); read by the entry point")
    args = parser.parse_args(argv)

    traces: dict[str, RoutingSplits] = {}
    if args.profile_dir is not None:
        traces[args.trace_name] = load_profile_splits(args.profile_dir, args.max_profile_tokens,
                                                      _profile_shape(parser, args))
    traces.update(synthetic_splits(args.synthetic, args.synthetic_tokens, args.synthetic_layers, args.seed))
    if args.sweep_routers:
        from occult.stages.placement_latency import sweep_router_splits

        traces.update(sweep_router_splits(args.sweep_routers, args.synthetic_tokens, args.seed))
    if not traces:
        parser.error("nothing to study: give --profile-dir or at least one --synthetic preset")
    search = SearchConfig(args.swap_rounds, args.kicks, args.eps, args.gpus_per_node, args.tokens_per_gpu,
                          replica_slots=tuple(args.replica_slots), replica_devices=tuple(args.replica_devices))
    cost = source = None
    if args.cost_model is not None:
        from occult.sim.cost_model_json import read_cost_model

        cost, source = read_cost_model(args.cost_model)
        source = {"file": str(args.cost_model), **source}
    run_study(traces, args.devices, args.methods, args.out, args.seed, search, cost, source,
              args.tradeoff_out, args.replicas_out, args.summary_out)
    if args.tradeoff_figure is not None and args.tradeoff_out is not None:
        from occult.report.study import plot_latency_tradeoff

        plot_latency_tradeoff(pd.read_csv(args.tradeoff_out), args.tradeoff_figure)
    sensitivity_out = args.sensitivity_out or args.out.with_name(f"{args.out.stem}_sensitivity.csv")
    if args.sensitivity_methods:
        run_sensitivity(traces, args.sensitivity_devices, args.sensitivity_methods, args.fractions,
                        sensitivity_out, args.seed, search)


if __name__ == "__main__":
    sys.exit(run_main("placement_study", main, output_flags=("--out", "--sensitivity-out", "--figure", "--tradeoff-out",
                                                              "--replicas-out", "--summary-out", "--tradeoff-figure")))
