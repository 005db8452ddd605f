"""Figures (predicted speedups, measured vs predicted) and the printed summary of a calibration."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from occult.sim.cost_model import CostModel


def plot_speedup(predictions, out: Path) -> None:
    """Predicted speedup over per-expert dispatch (naive) vs D, one panel per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.provenance import atomic_path

    ok = predictions[(predictions["status"] == "ok") & (predictions["method"] != "naive")]
    shapes = list(dict.fromkeys(predictions["shape"]))
    fig, axes = plt.subplots(1, max(len(shapes), 1), figsize=(4.2 * max(len(shapes), 1), 3.6), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, shape in zip(axes[0], shapes):
        part = ok[ok["shape"] == shape]
        for (method, tokens), rows in part.groupby(["method", "tokens_per_gpu"]):
            style = styles[sorted(part["tokens_per_gpu"].unique()).index(tokens) % len(styles)]
            ax.plot(rows["D"], rows["speedup_vs_naive"], style, marker="o", ms=3,
                    label=f"{method}, {tokens} tok/GPU")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(shape)
        ax.set_xlabel("devices D")
        ax.set_ylabel("predicted speedup vs per-expert dispatch")
    if shapes:
        axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def identity_axes(ax, values: np.ndarray, tolerance: float | None, log: bool) -> None:
    """y = x over the range of `values` (with a ±tolerance band if given), log axes if `log`, legend."""
    low, high = float(np.nanmin(values)), float(np.nanmax(values))
    line = np.geomspace(low * 0.8, high * 1.25, 50) if log else np.linspace(low * 0.9, high * 1.1, 50)
    ax.plot(line, line, color="black", lw=0.8)
    if tolerance is not None:
        ax.fill_between(line, line * (1 - tolerance), line * (1 + tolerance), color="grey", alpha=0.2,
                        label=f"±{tolerance:.0%}")
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.legend(fontsize=6)


def plot_validation(table, tolerance: float, out: Path) -> None:
    """Measured vs predicted per point; calibration and validation points apart; ±tolerance band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.provenance import atomic_path

    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    markers = {"occult": "o", "occult-static": "s", "occult-graph": "^", "occult-compute": "v", "naive": "x"}
    table = table[np.isfinite(table["predicted_ms"])]
    for (role, family), rows in table.groupby(["role", "family"]):
        ax.scatter(rows["measured_ms"], rows["predicted_ms"], marker=markers.get(family, "."), s=14,
                   color="tab:blue" if role == "calibration" else "tab:red", alpha=0.7, label=f"{role}: {family}")
    if not table.empty:
        identity_axes(ax, table[["measured_ms", "predicted_ms"]].to_numpy(), tolerance, log=True)
    ax.set_xlabel("measured ms per layer")
    ax.set_ylabel("predicted ms per layer")
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def print_summary(table, cost: CostModel, terms: bool = True) -> None:
    """Calibrated terms (if `terms`), then points within tolerance per role and method family."""
    for (family, pass_, num_devices), host in sorted(cost.host.items() if terms else ()):
        print(f"host {family:>13} {pass_:<5} D={num_devices}: pre {host.pre_ms:.2f} ms, post {host.post_ms:.2f} ms "
              f"({host.source})")
    if terms and cost.other_gpu is not None:
        other = cost.other_gpu
        train = (f"fwd+bwd {other.train_fixed_ms:.3f} ms + {other.train_per_row_ns:.2f} ns/row"
                 if other.train_per_row_ns is not None else f"fwd+bwd x{other.train_factor}")
        print(f"occult other GPU work: {other.fixed_ms:.3f} ms + {other.per_row_ns:.2f} ns/row, {train}")
    if terms and cost.kernel_floor_ms:
        print(f"occult expert kernels' latency floor: {cost.kernel_floor_ms:.3f} ms above their weight reads")
    if terms and cost.pe_per_row_ns is not None:
        print(f"per_expert other GPU work: {cost.pe_per_row_ns:.2f} ns/row")
    for pass_, rate in sorted(cost.naive_ns_per_pair.items() if terms else ()):
        print(f"naive memory-bound ops {pass_}: {rate:.1f} ns/pair at D=1")
    for (role, family), rows in table.groupby(["role", "family"]):
        errors = rows["rel_err"].abs()
        print(f"{role:>11} {family:>14}: {len(rows):3d} points, {int(rows['within_tolerance'].sum()):3d} within "
              f"tolerance, median |err| {errors.median():.1%}, max {errors.max():.1%}")
    sys.stdout.flush()
