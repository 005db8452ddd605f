"""The pre-registered check: measured sweeps at D ≥ 4 against the simulator's predictions made before them.

Every ok, step-timed row of the measured `occult.harness.sweep` CSVs is joined with the prediction for the
same (shape, method, kind, D, tokens_per_gpu) in each predictions file (`predictions_D4_D8.csv`
columns). Per point the table gives the time error, the routing facts side by side (E[C_T]; the
busiest device's (token, expert) pairs over the mean) and the speedup over the naive EP, measured
and predicted. Rows the simulator does not model (MegaBlocks, Tutel, ...) keep their measured time
and speedup with status `not simulated`, so the table is also the run's comparison of methods.

The measured sweeps are those that simulator.yaml files of the results tree name under
`prediction_check` (occult.sim.inputs). Two kinds of predictions file are meant: the one committed
before the run (`simulate.prediction_check.predictions`, the pre-registered numbers) and the one
today's calibration writes (`results/<run>/simulate/predictions_D4_D8.csv`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from occult.shapes import get_shape
from occult.logs import ENV_LOG_JSON, run_main
from occult.sim.columns import MEASURED_COLUMNS, PREDICTION_COLUMNS, SimulateError
from occult.sim.figures import identity_axes
from occult.sim.measured import is_simulated_method, read_table

KEY = ("shape", "method", "kind", "D", "tokens_per_gpu")
CHECK_COLUMNS = (
    "predictions", "shape", "method", "kind", "D", "tokens_per_gpu", "batch", "measured_ms", "p10_ms", "p90_ms",
    "predicted_ms", "rel_err", "within_tolerance", "measured_ct", "predicted_ct", "ct_rel_err", "measured_load",
    "predicted_load", "load_rel_err", "measured_speedup_vs_naive", "predicted_speedup_vs_naive", "status", "source", "commit",
)
SUMMARY_COLUMNS = ("predictions", "kind", "D", "method", "points", "within_tolerance", "median_abs_err",
                   "max_abs_err", "median_abs_ct_err", "median_abs_load_err")


def read_sweeps(paths: Sequence[str | Path], field: str):
    """Every ok, step-timed row of the sweep CSVs, with its `source`; one error naming a bad file."""
    import pandas as pd

    frames = []
    for path in paths:
        frame = read_table(path, MEASURED_COLUMNS, field)
        frame = frame[frame["status"] == "ok"].copy()
        if "timing" in frame.columns:   # predictions price a call from a drained GPU (--timing step)
            frame = frame[frame["timing"].fillna("step") == "step"]
        for column in ("batch", "p10_ms", "p90_ms", "mean_devices_per_token", "pairs_received_max", "top_k", "commit"):
            if column not in frame.columns:
                frame[column] = np.nan
        frame["source"] = str(path)
        frames.append(frame)
    if not frames or all(f.empty for f in frames):
        raise SimulateError(f"{field}: no ok, step-timed row in {', '.join(map(str, paths)) or 'no file'}")
    return pd.concat([f for f in frames if not f.empty], ignore_index=True)


def read_predictions(path: str | Path, field: str):
    """A predictions table (`occult.sim.columns.PREDICTION_COLUMNS`) with one row per point."""
    frame = read_table(path, PREDICTION_COLUMNS, field)
    duplicated = frame.duplicated(list(KEY))
    if duplicated.any():
        first = frame[duplicated].iloc[0]
        raise SimulateError(f"{field}: {path} holds ({', '.join(str(first[k]) for k in KEY)}) twice")
    return frame


def measured_load(rows) -> np.ndarray:
    """Busiest device's pairs over the mean (tokens per GPU × top-k), from the sweep's `pairs_received_max`."""
    top_k = np.array([k if np.isfinite(k) else get_shape(s).top_k
                      for k, s in zip(rows["top_k"].astype(float), rows["shape"])])
    return rows["pairs_received_max"].astype(float).to_numpy() / (rows["tokens_per_gpu"].to_numpy() * top_k)


def naive_ms(measured) -> dict[tuple, float]:
    """(shape, kind, D, tokens_per_gpu) -> the naive EP's measured time (median over replicates)."""
    naive = measured[measured["method"] == "naive"]
    return {key: float(rows["median_ms"].median())
            for key, rows in naive.groupby(["shape", "kind", "D", "tokens_per_gpu"])}


def check(predictions: dict[str, Any], measured, tolerance: float, routing_only: bool = False):
    """One row per (predictions file, measured row): see the module docstring for the columns.

    `routing_only`: the rows were timed on other hardware than the predictions' (a CPU run of the
    same code): only E[C_T] and the load are compared, each point's status says so."""
    import pandas as pd

    measured = measured.copy()
    measured["D"] = measured["D"].astype(int)
    measured["tokens_per_gpu"] = measured["tokens_per_gpu"].astype(int)
    load = measured_load(measured)
    naive = naive_ms(measured)
    rows = []
    for name, table in predictions.items():
        by_key = {tuple(r[k] for k in KEY): r for r in table.to_dict("records")}
        for i, row in enumerate(measured.to_dict("records")):
            key = tuple(row[k] for k in KEY)
            base_ms = naive.get((row["shape"], row["kind"], row["D"], row["tokens_per_gpu"]))
            out = {"predictions": name, **{k: row[k] for k in KEY}, "batch": row["batch"],
                   "measured_ms": row["median_ms"], "p10_ms": row["p10_ms"], "p90_ms": row["p90_ms"],
                   "measured_ct": row["mean_devices_per_token"], "measured_load": load[i],
                   "measured_speedup_vs_naive": base_ms / row["median_ms"] if base_ms else np.nan,
                   "source": row["source"], "commit": row["commit"]}
            predicted = by_key.get(key)
            if not is_simulated_method(row["method"]):
                out["status"] = "not simulated"
            elif predicted is None:
                out["status"] = "no prediction at this point"
            elif predicted["status"] != "ok":
                out["status"] = f"predicted: {predicted['status']}"
            else:
                ct, load_ = predicted["mean_devices_per_token"], predicted["load_max_over_mean"]
                out.update(predicted_ct=ct, predicted_load=load_, ct_rel_err=(ct - out["measured_ct"]) / out["measured_ct"],
                           load_rel_err=(load_ - out["measured_load"]) / out["measured_load"],
                           status="routing only" if routing_only else "ok")
                if not routing_only:
                    err = (predicted["layer_ms"] - row["median_ms"]) / row["median_ms"]
                    out.update(predicted_ms=predicted["layer_ms"], rel_err=err,
                               within_tolerance=bool(abs(err) <= tolerance),
                               predicted_speedup_vs_naive=predicted["speedup_vs_naive"])
            rows.append(out)
    frame = pd.DataFrame(rows, columns=list(CHECK_COLUMNS))
    frame["within_tolerance"] = frame["within_tolerance"].astype("boolean")
    return frame


def summary(table):
    """Per (predictions, kind, D, method): predicted points, how many within tolerance, |error| of
    the time, of E[C_T] and of the load (time columns empty for routing-only rows)."""
    import pandas as pd

    ok = table[table["status"].isin(["ok", "routing only"])]
    rows = []
    for (name, kind, num_devices, method), group in ok.groupby(["predictions", "kind", "D", "method"], sort=True):
        errors = group["rel_err"].abs()
        timed = errors.notna().any()
        rows.append({"predictions": name, "kind": kind, "D": num_devices, "method": method, "points": len(group),
                     "within_tolerance": int(group["within_tolerance"].fillna(False).sum()) if timed else np.nan,
                     "median_abs_err": float(errors.median()) if timed else np.nan,
                     "max_abs_err": float(errors.max()) if timed else np.nan,
                     "median_abs_ct_err": float(group["ct_rel_err"].abs().median()),
                     "median_abs_load_err": float(group["load_rel_err"].abs().median())})
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))


def plot(table, tolerance: float, out: Path) -> None:
    """Measured vs predicted: time per predictions file (where timed), then E[C_T] and the busiest
    device's load over the mean; colour by (kind, D)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.provenance import atomic_path

    compared = table[table["status"].isin(["ok", "routing only"])]
    timed = [n for n in dict.fromkeys(compared["predictions"]) if compared.loc[compared["predictions"] == n,
                                                                               "predicted_ms"].notna().any()]
    first = compared[compared["predictions"] == compared["predictions"].iloc[0]] if not compared.empty else compared
    panels = len(timed) + 2
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 4.5), squeeze=False)
    markers = {"prefill": "o", "decode": "s", "train": "^"}
    for ax, name in zip(axes[0], timed):
        rows = compared[(compared["predictions"] == name) & compared["predicted_ms"].notna()]
        for (kind, num_devices), group in rows.groupby(["kind", "D"]):
            inside = int(group["within_tolerance"].fillna(False).sum())
            ax.scatter(group["measured_ms"], group["predicted_ms"], marker=markers.get(kind, "."), s=16, alpha=0.7,
                       label=f"{kind} D={num_devices}: {inside}/{len(group)}")
        identity_axes(ax, rows[["measured_ms", "predicted_ms"]].to_numpy(), tolerance, log=True)
        ax.set_title(f"time, predictions: {name}", fontsize=9)
        ax.set_xlabel("measured ms per layer")
        ax.set_ylabel("predicted ms per layer")
    for ax, (what, label) in zip(axes[0][len(timed):], (("ct", "E[C_T] (devices per token)"),
                                                          ("load", "busiest device's pairs / mean"))):
        rows = first[first[f"measured_{what}"].notna() & first[f"predicted_{what}"].notna()]
        for (kind, num_devices), group in rows.groupby(["kind", "D"]):
            ax.scatter(group[f"measured_{what}"], group[f"predicted_{what}"], marker=markers.get(kind, "."), s=16,
                       alpha=0.7, label=f"{kind} D={num_devices}")
        if not rows.empty:
            identity_axes(ax, rows[[f"measured_{what}", f"predicted_{what}"]].to_numpy(), None, log=False)
        ax.set_title(f"{label}" + (f", predictions: {first['predictions'].iloc[0]}" if not first.empty else ""),
                     fontsize=9)
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted")
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def print_summary(frame) -> None:
    for row in frame.itertuples():
        timed = (f"{row.within_tolerance:>3.0f}/{row.points:<3} within; median |err| {row.median_abs_err:.1%}, "
                 f"max {row.max_abs_err:.1%}; " if np.isfinite(row.median_abs_err) else f"{row.points:>3} points; ")
        print(f"{row.predictions:>14} {row.kind:<7} D={row.D} {row.method:<22} {timed}"
              f"E[C_T] {row.median_abs_ct_err:.1%}, load {row.median_abs_load_err:.1%}")


def main(argv: Sequence[str] | None = None) -> int:
    """Bad inputs raise `ConfigError` / `SimulateError`, naming the field or file."""
    from occult.config import ConfigError, load_config
    from occult.provenance import provenance, write_csv
    from occult.sim.inputs import SPEC_NAME, discover

    parser = argparse.ArgumentParser(prog="python -m occult.sim.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="its simulate.prediction_check names the predictions, "
                        "simulate.tolerance the tolerance")
    parser.add_argument("--results", type=Path, default=None,
                        help=f"the results tree whose {SPEC_NAME} files name the measured sweeps under prediction_check "
                             "(default: ./results where it holds an index, else the repository's)")
    parser.add_argument("--current", type=Path, help="also check today's predictions_D4_D8.csv")
    parser.add_argument("--out", required=True, type=Path, help="directory of prediction_check.csv and its summary")
    parser.add_argument("--figure", type=Path, default=None)
    parser.add_argument("--routing-only", action="store_true",
                        help="the measured rows were timed on other hardware (a CPU run): compare E[C_T] and load only")
    parser.add_argument("--log-json", metavar="PATH",
                        help=f"append JSON-lines logs here (default: ${ENV_LOG_JSON}); read by the entry point")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    if cfg.simulate is None or cfg.simulate.prediction_check is None:
        raise ConfigError("simulate.prediction_check: the configuration names no pre-registered predictions")
    spec = cfg.simulate.prediction_check
    field = "simulate.prediction_check"
    files = discover(args.results).prediction_check
    if not files:
        raise SimulateError(f"prediction_check: no {SPEC_NAME} of the results tree names measured sweeps to check")
    measured = read_sweeps(files, "prediction_check")
    predictions = {"preregistered": read_predictions(spec["predictions"], f"{field}.predictions")}
    if args.current is not None:
        predictions["current"] = read_predictions(args.current, "--current")
    table = check(predictions, measured, cfg.simulate.tolerance, args.routing_only)
    totals = summary(table)
    meta = provenance(cfg.hash(), cfg.seed, stage="prediction_check", tolerance=cfg.simulate.tolerance,
                      predictions={"preregistered": spec["predictions"], "current": str(args.current)},
                      measured=list(files), routing_only=args.routing_only)
    write_csv(args.out / "prediction_check.csv", table, meta=meta)
    write_csv(args.out / "prediction_check_summary.csv", totals, meta=meta)
    if args.figure is not None:
        plot(table, cfg.simulate.tolerance, args.figure)
    print_summary(totals)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("prediction_check", main, output_flags=("--out", "--figure")))
