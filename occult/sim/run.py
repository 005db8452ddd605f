"""Trace-driven scale simulator of the EP MoE layer: bytes per device pair, then time.

Reads the measured runs that the results tree names (occult.sim.inputs: every run's
simulator.yaml), calibrates the cost model on the declared calibration rows
(occult.sim.calibration), validates it on every other measured point (occult.sim.validation),
and predicts larger D (occult.sim.predict); docs/simulator.md.
The pipeline calls `occult simulate`; `python -m occult.sim.run` is the same for direct use.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Sequence

from occult.shapes import get_shape
from occult.logs import ENV_LOG_JSON, run_main
from occult.sim.builtin_alltoall import BUILTIN_ALLTOALL_SOURCE
from occult.sim.calibration import build_cost_model
from occult.sim.cost_model_json import cost_model_source, write_cost_model
from occult.sim.figures import plot_speedup, plot_validation, print_summary
from occult.sim.inputs import HEADLINE, read_sets, simulator_settings
from occult.sim.predict import RecordedRequest, cost_summary, predict, predict_recorded, sweep_points
from occult.sim.traces import ShapeTraces, trace_key
from occult.sim.validation import history_tables, validate


def run_simulate(settings: Any, seed: int, out_dir: Path, figures_dir: Path | None,
                 config_hash: str | None = None, recorded: RecordedRequest | None = None) -> dict[str, Path]:
    """Validation table, scale predictions and the sweep's sizes at `prediction_devices` (+ figures), the
    calibrated model (`cost_model.json`), and with `recorded` the predictions on a recorded trace, with the
    same calibrated model; returns the paths. `settings`: a `SimulatorSettings` (occult.sim.inputs)."""
    from occult.provenance import provenance, seed_everything, write_csv

    seed_everything(seed)
    measured = read_sets(settings)
    keys = {(s, "synthetic") for s in settings.shapes}
    for frame in measured.values():
        keys |= {(s, r) for s, r in zip(frame["shape"], frame["routing"]) if r != "trace"}
    traces = {trace_key(s, r): ShapeTraces(get_shape(s), settings.pool_tokens, seed, r) for s, r in sorted(keys)}
    table, cost = validate(settings, traces, build_cost_model(settings), measured.pop(HEADLINE))
    history, history_costs = history_tables(settings, traces, measured)
    targets = {name: traces[name] for name in settings.shapes}
    prefill = [("prefill", tokens, None) for tokens in settings.tokens_per_gpu]
    predictions = predict(targets, settings.methods, settings.devices, prefill, cost, "predict D")
    at_sweep_sizes = predict(targets, settings.methods, settings.prediction_devices,
                             sweep_points(("prefill", "decode", "train")), cost, "predict sweep sizes")

    meta = provenance(config_hash, seed, stage="simulate", settings=dataclasses.asdict(settings),
                      calibrated=cost_summary(cost),
                      calibrated_history={name: cost_summary(c) for name, c in history_costs.items()},
                      alltoall_source=settings.alltoall_csv or BUILTIN_ALLTOALL_SOURCE,
                      gemm_source=settings.gemm_csv or "none (naive EP uncalibrated)")
    paths = {"validation": out_dir / "validation.csv", "history": out_dir / "validation_history.csv",
             "predictions": out_dir / "predictions.csv", "predictions_D4_D8": out_dir / "predictions_D4_D8.csv"}
    write_csv(paths["validation"], table, meta=meta)
    write_csv(paths["history"], history, meta=meta)
    write_csv(paths["predictions"], predictions, meta=meta)
    write_csv(paths["predictions_D4_D8"], at_sweep_sizes, meta=meta)
    paths["cost_model"] = out_dir / "cost_model.json"
    write_cost_model(paths["cost_model"], cost, cost_model_source(settings, meta))
    if recorded is not None:
        paths["trace"] = recorded.out
        write_csv(recorded.out, predict_recorded(recorded.profile_dir, recorded.name, recorded.shape, recorded.layers,
                                                 settings.methods, settings.devices, settings.tokens_per_gpu, cost, seed),
                  meta={**meta, "stage": "simulate_trace", "trace": {
                      "profile_dir": str(recorded.profile_dir), "name": recorded.name, "shape": recorded.shape,
                      "layers": None if recorded.layers is None else list(recorded.layers)}})
    if figures_dir is not None:
        paths["fig_speedup"] = figures_dir / "simulate_speedup.png"
        paths["fig_validation"] = figures_dir / "simulate_validation.png"
        plot_speedup(predictions, paths["fig_speedup"])
        plot_validation(table, settings.tolerance, paths["fig_validation"])
    print_summary(table, cost)
    for name, rows in history.groupby("set", sort=False):
        print(f"history set {name}:")
        print_summary(rows, history_costs[name], terms=False)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """Bad inputs raise `ConfigError` / `SimulateError` (ValueErrors naming their field or file);
    run as a module (`run_main`) they become one error line and a `failed` JSON record, exit 1."""
    from occult.config import ConfigError, load_config

    parser = argparse.ArgumentParser(prog="python -m occult.sim.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, type=Path, help="directory of the three CSVs")
    parser.add_argument("--figures", type=Path, default=None)
    parser.add_argument("--results", type=Path, default=None,
                        help="the results tree whose simulator.yaml files name the measured runs "
                             "(default: ./results where it holds an index, else the repository's)")
    parser.add_argument("--trace", type=Path, metavar="PROFILE_DIR",
                        help="also predict on this recorded routing (routing_*.npz or a GPU run's *_sample.npz)")
    parser.add_argument("--trace-name", default="trace", help="its name in the CSV")
    parser.add_argument("--trace-shape", default="olmoe", help="the layer shape its routing is mapped onto")
    parser.add_argument("--trace-layers", type=int, nargs="+", help="its layers to use (default: all)")
    parser.add_argument("--trace-out", type=Path, help="predictions on the trace (default: <out>/predictions_trace.csv)")
    parser.add_argument("--log-json", metavar="PATH",
                        help=f"append JSON-lines logs here (default: ${ENV_LOG_JSON}); read by the entry point")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    if cfg.simulate is None:
        raise ConfigError("simulate: the configuration has no simulate section")
    recorded = None if args.trace is None else RecordedRequest(
        args.trace, args.trace_name, args.trace_shape, args.trace_layers,
        args.trace_out or args.out / "predictions_trace.csv")
    run_simulate(simulator_settings(cfg.simulate, args.results), cfg.seed, args.out, args.figures, cfg.hash(), recorded)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("simulate", main, output_flags=("--out", "--figures")))
