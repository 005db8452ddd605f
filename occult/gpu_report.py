"""Figures and a speedup table from committed GPU sweep results (runs on a CPU machine).

Reads `results/<machine>/<run>/sweep_<kind>_D<D>.csv` (written by `occult.sweep` on the GPU
machine) and writes to `figures/<machine>/<run>/`: latency vs tokens per shape (prefill), step
time vs batch (train), latency vs batch (decode), and speedup bars of Occult against MegaBlocks
and Tutel at 2^14 tokens/GPU; plus `results/<machine>/<run>/speedups.csv`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from occult.provenance import atomic_path, write_csv  # noqa: E402

SIZE_COLUMN = {"prefill": "tokens_per_gpu", "decode": "batch", "train": "batch"}
XLABEL = {"prefill": "tokens per GPU", "decode": "sequences per GPU (one token each)",
          "train": "batch (sequences of 512 tokens) per GPU"}
OCCULT = ("occult", "occult-nd2", "occult-nd1")
REFERENCE_TOKENS = 16384


def load_sweeps(run_dir: Path) -> pd.DataFrame:
    frames = [pd.read_csv(p) for p in sorted(run_dir.glob("sweep_*_D*.csv"))]
    if not frames:
        raise FileNotFoundError(f"{run_dir}: no sweep_*_D*.csv files")
    return pd.concat(frames, ignore_index=True)


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    plt.close(fig)


def plot_kind(frame: pd.DataFrame, kind: str, path: Path) -> None:
    """One panel per (shape, D): median latency per method against the sweep size (ok rows only)."""
    ok = frame[(frame["kind"] == kind) & (frame["status"] == "ok")]
    panels = sorted(ok.groupby(["shape", "D"]).groups)
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.2 * max(1, len(panels)), 3.6), squeeze=False)
    for ax, (shape, devices) in zip(axes[0], panels):
        part = ok[(ok["shape"] == shape) & (ok["D"] == devices)]
        for method, g in part.groupby("method"):
            g = g.sort_values(SIZE_COLUMN[kind])
            style = "-o" if method in OCCULT else "--x"
            ax.plot(g[SIZE_COLUMN[kind]], g["median_ms"], style, ms=3, label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{kind}: {shape}, D={devices}", fontsize=9)
        ax.set_xlabel(XLABEL[kind], fontsize=8)
        ax.set_ylabel("median ms (one MoE layer)", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"machine: {frame['machine'].iloc[0]}, commit {frame['commit'].iloc[0]}", fontsize=8)
    _save(fig, path)


def speedups(frame: pd.DataFrame, tokens: int = REFERENCE_TOKENS) -> pd.DataFrame:
    """Occult's speedup over each baseline at `tokens` per GPU (prefill), per shape and D."""
    ok = frame[(frame["kind"] == "prefill") & (frame["status"] == "ok") & (frame["tokens_per_gpu"] == tokens)]
    rows = []
    for (shape, devices), g in ok.groupby(["shape", "D"]):
        times = g.set_index("method")["median_ms"]
        for occult in [m for m in OCCULT if m in times]:
            for base in [m for m in times.index if m not in OCCULT]:
                rows.append({"shape": shape, "D": devices, "tokens_per_gpu": tokens, "occult": occult,
                             "baseline": base, "occult_ms": times[occult], "baseline_ms": times[base],
                             "speedup": times[base] / times[occult]})
    return pd.DataFrame(rows)


def plot_speedups(table: pd.DataFrame, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    sub = table[(table["occult"] == "occult") & table["baseline"].isin(["megablocks", "tutel", "naive"])]
    labels = [f"{r.shape}\nD={r.D}\nvs {r.baseline}" for r in sub.itertuples()]
    ax.bar(range(len(sub)), sub["speedup"], color="#4c72b0")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(sub)), labels, fontsize=7)
    ax.set_ylabel(f"speedup of Occult exact at {REFERENCE_TOKENS} tokens/GPU")
    _save(fig, path)


def make_gpu_report(run_dir: Path, figures_dir: Path) -> None:
    frame = load_sweeps(run_dir)
    for kind in sorted(set(frame["kind"])):
        plot_kind(frame, kind, figures_dir / f"{kind}.png")
    table = speedups(frame)
    write_csv(run_dir / "speedups.csv", table)
    if len(table):
        plot_speedups(table, figures_dir / "speedups.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-dir", type=Path, required=True, help="results/<machine>/<run>")
    p.add_argument("--figures", type=Path, required=True, help="figures/<machine>/<run>")
    args = p.parse_args(argv)
    make_gpu_report(args.run_dir, args.figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
