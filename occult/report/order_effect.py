"""Does a method's median move with its place in the order of a point? `order_effect.csv` and a
figure from order-check CSVs (`occult.harness.sweep.order_check`) or ordinary sweep CSVs.

A cell is one method at one point (kind, D, routing, shape, size). Its replicates are its rows:
one per `replicate` of a file (a file without the column is one replicate), each file its own. Per
cell: the median over replicates of `median_ms`, their min and max and relative half-range
(`range_pct`, (max - min) / 2 / median, in %), first vs last (the mean over the replicates where the
method ran first, order_position 0, and where it ran last, the point's last position), and the
run-to-run spread `spread_pct`: the relative half-range of the replicates with the fitted order
effect taken out (each at its value for position 0), so that an order effect does not pass for noise.

A method's place is its `point_position` (how many of the point's methods ran before it, over every
process of `occult.harness.sweep.parts`) where the file has it, else its `order_position` in its
process. The order effect per (kind, D, method): least squares of log(median_ms) on that place with a
fixed effect per cell (at the order check's one size and routing: per shape), as % change per
position with a 95% interval (Student t). Where no cell of a (kind, D) has two positions (an
ordinary sweep: one order per point), the fixed effects are per point and per method instead, with
a slope per method (column `model`). `verdict`: `order effect within spread` where the fitted
change over the method's range of positions (first to last, `effect_over_range_pct`) is smaller than
the change between the cell's fastest and slowest replicate (2 x `spread_pct`), else `order moves
the median`; `order not varied` where the method took one position only, `too few rows to fit` where no degree of freedom is left for the fit's error, `no
replicates` where the cell has one row.

    python -m occult.report.order_effect results/<machine>/sweeps_<v>/order_check_prefill_D1.csv \\
        [--out .../order_effect.csv] [--figure figures/.../order_effect.png]
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

REQUIRED = ("kind", "D", "shape", "tokens_per_gpu", "method", "status", "median_ms", "order_position")
POINT = ("kind", "D", "routing", "shape", "tokens_per_gpu")
CELL = (*POINT, "method")
DEFAULT_ROUTING = "synthetic"          # rows of files written before the sweep had the column
WITHIN, MOVES, NOT_VARIED, TOO_FEW, NO_REPLICATES = ("order effect within spread", "order moves the median",
                                                     "order not varied", "too few rows to fit", "no replicates")
CELL_FE, ADDITIVE_FE = "cell", "point + method"


class OrderEffectError(ValueError):
    """An input cannot be read; the message names the file (and the column)."""


def read_runs(paths: Sequence[str | Path]) -> pd.DataFrame:
    """The ok rows of every file with a `run` (file, replicate) and `routing`, `batch` filled in."""
    frames = []
    for index, path in enumerate(paths):
        try:
            frame = pd.read_csv(path)
        except FileNotFoundError:
            raise OrderEffectError(f"{path}: no such file") from None
        except pd.errors.EmptyDataError:
            raise OrderEffectError(f"{path}: empty file (no header)") from None
        missing = [column for column in REQUIRED if column not in frame.columns]
        if missing:
            raise OrderEffectError(f"{path}: no column {missing[0]!r}" + (f" (nor {missing[1:]})" if missing[1:] else ""))
        if frame.empty:
            raise OrderEffectError(f"{path}: no rows")
        if "point_position" in frame and frame["point_position"].notna().any():
            frame["order_position"] = frame["point_position"]     # the place over every process of the point
        replicate = frame["replicate"].astype(str) if "replicate" in frame else "0"
        frame = frame.assign(run=f"{index}:" + replicate)
        frame["routing"] = frame["routing"].fillna(DEFAULT_ROUTING) if "routing" in frame else DEFAULT_ROUTING
        frame["batch"] = frame["batch"] if "batch" in frame else np.nan
        frames.append(frame)
    if not frames:
        raise OrderEffectError("no input files")
    rows = pd.concat(frames, ignore_index=True)
    ok = rows[(rows["status"] == "ok") & (rows["median_ms"] > 0) & rows["order_position"].notna()].copy()
    if ok.empty:
        raise OrderEffectError(f"{', '.join(map(str, paths))}: no ok rows with median_ms and order_position")
    ok["order_position"] = ok["order_position"].astype(int)
    ok["last_position"] = ok.groupby([*POINT, "run"])["order_position"].transform("max")
    return ok.reset_index(drop=True)


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, dof: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with `dof` degrees of freedom (its density integrated)."""
    scale = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)

    def cdf(x: float) -> float:
        grid = np.linspace(0.0, x, 20001)
        return 0.5 + float(np.trapezoid(scale * (1 + grid**2 / dof) ** (-(dof + 1) / 2), grid))

    low, high = 0.0, 1000.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < p else (low, middle)
    return (low + high) / 2


def _dummies(codes: np.ndarray, drop_first: bool) -> np.ndarray:
    matrix = np.eye(codes.max() + 1)[codes]
    return matrix[:, 1:] if drop_first else matrix


def fit(rows: pd.DataFrame, fixed: Sequence[Sequence[str]], slopes: Sequence[str]) -> tuple[dict, np.ndarray]:
    """log(median_ms) on order_position, one slope per method of `slopes`, fixed effects per group of each
    key list in `fixed`. Returns {method: (slope, standard error, dof)} (NaN where not identified) and
    each row's partial residual: log(median_ms) less its fitted fixed effects."""
    y = np.log(rows["median_ms"].to_numpy(float))
    effects = [_dummies(rows.groupby(list(keys), sort=False).ngroup().to_numpy(), drop_first=k > 0)
               for k, keys in enumerate(fixed)]
    position = rows["order_position"].to_numpy(float)
    slope_columns = [np.where(rows["method"].to_numpy() == m, position, 0.0) for m in slopes]
    fe = np.hstack(effects)
    design = np.hstack([fe, np.column_stack(slope_columns)])
    beta, *_ = np.linalg.lstsq(design, y, rcond=None)
    dof = len(y) - np.linalg.matrix_rank(design)
    residual = y - design @ beta
    covariance = (residual @ residual / dof if dof > 0 else np.nan) * np.linalg.pinv(design.T @ design)
    fe_rank = np.linalg.matrix_rank(fe)
    out = {}
    for k, method in enumerate(slopes):
        column = fe.shape[1] + k
        identified = dof > 0 and np.linalg.matrix_rank(np.column_stack([fe, slope_columns[k]])) > fe_rank
        out[method] = (beta[column], math.sqrt(covariance[column, column]), dof) if identified else (np.nan, np.nan, dof)
    return out, y - fe @ beta[:fe.shape[1]]


def order_effects(rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per (kind, D, method): the fitted order effect (see the module doc); and `rows` with their
    partial residual `relative_pct` (100 * (exp(residual) - 1), for the figure) and `adjusted_ms`
    (median_ms less the fitted order effect: its value at position 0)."""
    table, parts = [], []
    for (kind, world), group in rows.groupby(["kind", "D"], sort=True):
        varied = group.groupby(list(CELL))["order_position"].nunique().max() > 1
        if varied:
            fits, residuals = {}, pd.Series(index=group.index, dtype=float)
            for method, own in group.groupby("method"):
                found, residual = fit(own, [CELL], [method])
                fits.update(found)
                residuals[own.index] = residual
        else:
            methods = sorted(group["method"].unique())
            fits, residual = fit(group, [POINT, ("method",)], methods)
            residuals = pd.Series(residual, index=group.index)
        slopes = group["method"].map({m: fitted[0] for m, fitted in fits.items()}).fillna(0.0)
        parts.append(group.assign(relative_pct=100 * np.expm1(residuals),
                                  adjusted_ms=group["median_ms"] * np.exp(-slopes * group["order_position"])))
        for method, (slope, se, dof) in fits.items():
            positions = group.loc[group["method"] == method, "order_position"]
            half = t_quantile(0.975, dof) * se if dof > 0 and se == se else np.nan
            table.append({"kind": kind, "D": world, "method": method, "model": CELL_FE if varied else ADDITIVE_FE,
                          "effect_pct_per_position": 100 * math.expm1(slope),
                          "effect_low_pct": 100 * math.expm1(slope - half),
                          "effect_high_pct": 100 * math.expm1(slope + half),
                          "position_range": int(positions.max() - positions.min()),
                          "effect_over_range_pct": 100 * math.expm1(slope * (positions.max() - positions.min()))})
    return pd.DataFrame(table), pd.concat(parts)


def _half_range_pct(values: pd.Series) -> float:
    return 100 * (values.max() - values.min()) / 2 / values.median() if len(values) > 1 else np.nan


def summarise(rows: pd.DataFrame, effects: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: spread over replicates, first vs last, the method's order effect, the verdict
    (`rows` and `effects` as `order_effects` gives them)."""
    grouped = rows.groupby(list(CELL), sort=True)
    cells = grouped.agg(batch=("batch", "first"), replicates=("run", "nunique"),
                        positions=("order_position", "nunique"), median_ms=("median_ms", "median"),
                        min_ms=("median_ms", "min"), max_ms=("median_ms", "max"),
                        range_pct=("median_ms", _half_range_pct), spread_pct=("adjusted_ms", _half_range_pct)
                        ).reset_index()
    first = rows[rows["order_position"] == 0].groupby(list(CELL))["median_ms"].mean().rename("first_ms")
    last = rows[rows["order_position"] == rows["last_position"]].groupby(list(CELL))["median_ms"].mean().rename("last_ms")
    cells = cells.join(first, on=list(CELL)).join(last, on=list(CELL))
    cells["first_vs_last_pct"] = 100 * (cells["last_ms"] / cells["first_ms"] - 1)
    cells = cells.merge(effects, on=["kind", "D", "method"], how="left")
    size = cells["effect_over_range_pct"].abs()
    cells["verdict"] = np.select(
        [cells["position_range"] == 0, cells["effect_pct_per_position"].isna(), cells["spread_pct"].isna(),
         size < 2 * cells["spread_pct"]], [NOT_VARIED, TOO_FEW, NO_REPLICATES, WITHIN], MOVES)
    return cells


def plot(rows: pd.DataFrame, effects: pd.DataFrame, path: Path) -> None:
    """One panel per (kind, D, shape): each replicate's median_ms relative to its cell's fitted level at
    position 0, against its order position, per method, and the fitted order effect as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.provenance import atomic_path
    from occult.report.gpu_runs import method_colors

    panels = list(rows.groupby(["kind", "D", "shape"], sort=True))
    colors = method_colors(rows["method"].unique())
    methods = sorted(rows["method"].unique())
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False, sharey=True)
    for ax, ((kind, world, shape), panel) in zip(axes[0], panels):
        for k, method in enumerate(methods):
            own = panel[panel["method"] == method]
            if own.empty:
                continue
            offset = (k - (len(methods) - 1) / 2) * 0.06
            ax.plot(own["order_position"] + offset, own["relative_pct"], "o", ms=3.5, alpha=0.6, color=colors[method])
            effect = effects[(effects["kind"] == kind) & (effects["D"] == world) & (effects["method"] == method)]
            slope = math.log1p(effect["effect_pct_per_position"].iloc[0] / 100) if len(effect) else np.nan
            x = np.array([own["order_position"].min(), own["order_position"].max()], dtype=float)
            label = f"{method}: {effect['effect_pct_per_position'].iloc[0]:+.1f}%/position" if slope == slope else method
            ax.plot(x + offset, 100 * np.expm1(slope * x), "-", color=colors[method], label=label)
        ax.axhline(0, color="0.6", lw=0.8)
        ax.set_title(f"{kind} D={world} {shape}", fontsize=9)
        ax.set_xlabel("order position (0 = first)")
        ax.xaxis.get_major_locator().set_params(integer=True)
    legend = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels())}
    axes[0][-1].legend(legend.values(), legend.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    axes[0][0].set_ylabel("median_ms vs the cell's level at position 0 (%)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    plt.close(fig)


def make_order_effect(paths: Sequence[str | Path], out: Path, figure: Path) -> pd.DataFrame:
    """Read, fit, then write `out` and `figure` (nothing is written if any input is bad)."""
    from occult.provenance import write_csv

    rows = read_runs(paths)
    effects, rows = order_effects(rows)
    table = summarise(rows, effects)
    write_csv(out, table)
    plot(rows, effects, figure)
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult.report.order_effect", description=__doc__.split("\n\n")[0])
    parser.add_argument("csvs", nargs="+", type=Path, help="order_check_*.csv or sweep_*.csv files")
    parser.add_argument("--out", type=Path, default=None, help="default: order_effect.csv beside the first CSV")
    parser.add_argument("--figure", type=Path, default=None, help="default: --out with .png")
    parser.add_argument("--log-json", metavar="PATH", help="append JSON-lines logs here (default: $OCCULT_LOG_JSON)")
    args = parser.parse_args(argv)
    out = args.out or args.csvs[0].parent / "order_effect.csv"
    table = make_order_effect(args.csvs, out, args.figure or out.with_suffix(".png"))
    shown = ["kind", "D", "shape", "method", "replicates", "median_ms", "spread_pct", "first_vs_last_pct",
             "effect_pct_per_position", "effect_low_pct", "effect_high_pct", "verdict"]
    print(table[shown].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


if __name__ == "__main__":
    from occult.logs import run_main

    sys.exit(run_main("order-effect", main))
