"""Predictions of the placements' layer times at the sweep's own points, one file per routing.

For D = 2, 4 and 8, the sweep's prefill (2^10 … 2^16 tokens per GPU) and training sizes, the three
paper shapes, and the routings the GPU sweep runs (`synthetic`: its seeded low-rank router;
`uniform`; `trace`: the upcycled model's routing, widened by `TraceRouter`): Occult on the
contiguous (`-trivial`), greedy, load-aware (`-balanced`) and latency (`-latency`) placements, N_d
= 2 and 1 on the greedy one, and the naive EP, priced by a calibrated cost model (default: the one
shipped with the package). Each routing's table has the columns of `predictions_D4_D8.csv`
(`PREDICTION_COLUMNS`) and one row per (shape, method, kind, D, tokens_per_gpu), so `occult.sim.check`
joins a measured sweep of that routing with it.

    python -m occult.sim.placement_predictions --out-dir DIR --tag COMMIT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from occult.logs import ENV_LOG_JSON, run_main
from occult.sim.columns import PREDICTION_COLUMNS

METHODS = ("naive", "occult-trivial", "occult", "occult-balanced", "occult-latency", "occult-nd2", "occult-nd1")
ROUTINGS = ("synthetic", "uniform", "trace")
SHAPES = ("olmoe", "qwen", "deepseek")
DEVICES = (2, 4, 8)
KINDS = ("prefill", "train")
# the upcycled model's held-out routing the GPU sweep replays (workflow/rules/gpu_common.smk, EP_TRACE)
SWEEP_TRACE = "results/nvidia-h200/quality_upcycle_v4/profile/routing_heldout_sample.npz"


def trace_traces(shape: Any, path: Path, seed: int):
    """The sweep's `trace` routing of `shape` as the simulator's traces: `TraceRouter`'s widened
    held-out trace is routed, the first calibration batch of its calibration trace places (as
    `occult_placement` does); None with the reason where the trace does not widen to the shape."""
    from occult.harness.sweep.inputs import CALIBRATION_TOKENS, TraceRouter, TraceShapeError
    from occult.sim.traces import RecordedTraces

    try:
        router = TraceRouter.load(path, shape, seed)
    except TraceShapeError as err:
        return None, f"unsupported: routing trace: {err}"
    calib = router.calibration_NK[:CALIBRATION_TOKENS].numpy()
    return RecordedTraces(shape, calib, router.ids_NK.numpy(), seed), None


def routing_predictions(routing: str, cost: Any, shapes: Sequence[str] = SHAPES, devices: Sequence[int] = DEVICES,
                        kinds: Sequence[str] = KINDS, methods: Sequence[str] = METHODS, pool_tokens: int = 16384,
                        seed: int = 0, trace: Path = Path(SWEEP_TRACE)):
    """Rows of PREDICTION_COLUMNS for one routing (a shape the routing cannot serve: status rows)."""
    import pandas as pd

    from occult.shapes import get_shape
    from occult.sim.predict import MOE_LAYERS, predict, sweep_points
    from occult.sim.traces import ShapeTraces

    points = sweep_points(kinds)
    frames = []
    for name in shapes:
        shape = get_shape(name)
        if routing == "trace":
            traces, why = trace_traces(shape, trace, seed)
        else:
            traces, why = ShapeTraces(shape, pool_tokens, seed, routing), None
        if traces is None:
            frames.append(pd.DataFrame([
                {"shape": name, "method": method, "kind": kind, "D": num_devices, "tokens_per_gpu": tokens,
                 "batch": batch, "moe_layers": MOE_LAYERS.get(name, 1), "status": why}
                for num_devices in devices for kind, tokens, batch in points for method in methods],
                columns=list(PREDICTION_COLUMNS)))
            continue
        frames.append(predict({name: traces}, methods, devices, points, cost, f"predict {routing} {name}"))
    return pd.concat(frames, ignore_index=True)


def write_predictions(out_dir: Path, tag: str, cost: Any, cost_source: Any, seed: int = 0,
                      routings: Sequence[str] = ROUTINGS, **kwargs: Any) -> dict[str, Path]:
    """`predictions_placement_<routing>_<tag>.csv` per routing (+ provenance sidecars); returns the paths."""
    from occult.provenance import provenance, write_csv

    paths = {}
    for routing in routings:
        table = routing_predictions(routing, cost, seed=seed, **kwargs)
        meta = provenance(None, seed, stage="placement_predictions", routing=routing, cost_model=cost_source,
                          methods=list(kwargs.get("methods", METHODS)), devices=list(kwargs.get("devices", DEVICES)),
                          kinds=list(kwargs.get("kinds", KINDS)), trace=str(kwargs.get("trace", SWEEP_TRACE)))
        paths[routing] = Path(out_dir) / f"predictions_placement_{routing}_{tag}.csv"
        write_csv(paths[routing], table, meta=meta)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult.sim.placement_predictions",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--tag", required=True, help="the file names' suffix: the commit that makes them")
    parser.add_argument("--cost-model", type=Path, help="a simulate stage's cost_model.json (default: shipped)")
    parser.add_argument("--routings", nargs="+", default=list(ROUTINGS), choices=ROUTINGS)
    parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICES))
    parser.add_argument("--trace", type=Path, default=Path(SWEEP_TRACE))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-json", metavar="PATH",
                        help=f"append JSON-lines logs here (default: ${ENV_LOG_JSON}); read by the entry point")
    args = parser.parse_args(argv)
    from occult.sim.cost_model_json import builtin_cost_model, read_cost_model

    cost, source = builtin_cost_model() if args.cost_model is None else read_cost_model(args.cost_model)
    if args.cost_model is not None:
        source = {"file": str(args.cost_model), **source}
    np.random.seed(args.seed)
    write_predictions(args.out_dir, args.tag, cost, source, args.seed, args.routings, devices=tuple(args.devices),
                      trace=args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("placement_predictions", main, output_flags=("--out-dir",)))
