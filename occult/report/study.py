"""Tables (pandas) and figures (matplotlib) that mirror the paper, from the results tree.

Inputs under `results/<run>/`: `placement/expected_ct.csv`, `placement/D*_*.json`,
`bench/ep_cpu.csv`, `evaluate/<variant>.json`, `model/pretrain_log.csv`; and the profile
(`work/<run>/profile/profile.npz`) for the co-activation heatmaps.
Outputs: `results/<run>/tables/{ct_ablation,accuracy,placement_summary}.csv` and
`figures/<run>/{ct_ablation,latency_vs_ct,accuracy,coactivation_heatmaps,expected_ct_vs_devices}.png`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from occult.config import Config  # noqa: E402
from occult.logs import log_event  # noqa: E402
from occult.provenance import atomic_path, provenance, write_csv  # noqa: E402

log = logging.getLogger(__name__)
ABLATION_ORDER = ["trivial", "placed-greedy", "placed-swap", "prune2", "prune1"]


def bench_by_case(bench: pd.DataFrame) -> pd.DataFrame:
    """Mean over layers per (case, mode, tokens): E[C_T], bytes sent (dispatch + return), times.

    `placed` rows are split by their placement method (`placed-greedy`, `placed-swap`).
    """
    b = bench.copy()
    b["case"] = np.where(b["case"] == "placed", "placed-" + b["placement"].astype(str), b["case"])
    b["expected_ct"] = b["mean_devices_per_token"]
    b["bytes_sent_per_rank"] = b["bytes_dispatch_remote_per_rank"] + b["bytes_combine_remote_per_rank"]
    b["fwdbwd_ms"] = b["fwd_bwd_ms"]
    cols = ["expected_ct", "bytes_sent_per_rank", "fwd_ms", "fwdbwd_ms"]
    return b.groupby(["case", "mode", "tokens_per_rank"], as_index=False)[cols].mean()


def _savefig(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=130, bbox_inches="tight", format="png")
    plt.close(fig)


def placement_summary(table: pd.DataFrame) -> pd.DataFrame:
    mean = table[table["layer"].astype(str) == "mean"].copy()
    cols = ["D", "method", "expected_ct_heldout", "expected_ct_calibration", "lower_bound", "upper_bound",
            "max_device_load_over_mean", "intra_device_pair_fraction"]
    return mean[[c for c in cols if c in mean.columns]].sort_values(["D", "method"]).reset_index(drop=True)


def ct_ablation(bench: pd.DataFrame) -> pd.DataFrame:
    """The paper's ablation at the largest measured batch: per-expert baseline, then Occult steps."""
    tokens = bench["tokens_per_rank"].max()
    b = bench[bench["tokens_per_rank"] == tokens]
    base = b[(b["case"] == "trivial") & (b["mode"] == "per_expert")].iloc[0]
    rows = [{"step": "per-expert dispatch, trivial placement", "case": "trivial", "mode": "per_expert",
             **_metrics(base, base)}]
    for case in [c for c in ABLATION_ORDER if c in set(b["case"])]:
        row = b[(b["case"] == case) & (b["mode"] == "dedup")]
        if len(row):
            rows.append({"step": f"dedup dispatch, {case}", "case": case, "mode": "dedup",
                         **_metrics(row.iloc[0], base)})
    out = pd.DataFrame(rows)
    out.insert(0, "tokens_per_rank", tokens)
    return out


def _metrics(row: pd.Series, base: pd.Series) -> dict:
    return {
        "expected_ct": row["expected_ct"],
        "bytes_sent_per_rank": row["bytes_sent_per_rank"],
        "fwd_ms": row["fwd_ms"],
        "fwdbwd_ms": row["fwdbwd_ms"],
        "fwd_speedup_vs_per_expert": base["fwd_ms"] / row["fwd_ms"],
        "bytes_ratio_vs_per_expert": row["bytes_sent_per_rank"] / base["bytes_sent_per_rank"],
    }


def accuracy_table(score_files: list[Path]) -> pd.DataFrame:
    records, chance = [], {}
    for path in score_files:
        summary = json.loads(Path(path).read_text())
        for s in summary["scores"]:
            records.append({"variant": summary["variant"], "task": s["task"], "acc": s["acc"],
                            "acc_stderr": s["acc_stderr"]})
            chance[s["task"]] = s["chance"]
    long = pd.DataFrame(records)
    acc = long.pivot(index="variant", columns="task", values="acc")
    acc["average"] = acc.mean(axis=1)
    chance_row = pd.Series({**chance, "average": float(np.mean(list(chance.values())))}, name="chance")
    acc = pd.concat([acc, chance_row.to_frame().T])
    order = [v for v in ["raw", "sft"] if v in acc.index] + sorted(
        v for v in acc.index if v not in ("raw", "sft", "chance")) + ["chance"]
    return acc.loc[order].reset_index(names="variant")


def plot_ablation(ablation: pd.DataFrame, path: Path) -> None:
    fig, ax1 = plt.subplots(figsize=(7, 3.6))
    x = np.arange(len(ablation))
    ax1.bar(x, ablation["expected_ct"], color="#4c72b0", width=0.55, label="E[C_T]")
    ax1.set_ylabel("E[C_T] (devices per token)")
    ax1.set_xticks(x, [s.replace(", ", "\n") for s in ablation["step"]], fontsize=7, rotation=25, ha="right")
    ax2 = ax1.twinx()
    ax2.plot(x, ablation["fwd_ms"], "o-", color="#dd8452", label="forward latency")
    ax2.set_ylabel("EP layer forward (ms)")
    ax1.set_title(f"E[C_T] ablation, {int(ablation['tokens_per_rank'].iloc[0])} tokens/rank")
    fig.legend(loc="upper right", fontsize=8)
    _savefig(fig, path)


def plot_latency_vs_ct(bench: pd.DataFrame, path: Path) -> dict:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    fits = {}
    for tokens, group in bench.groupby("tokens_per_rank"):
        dedup = group[group["mode"] == "dedup"]
        line = ax.plot(dedup["expected_ct"], dedup["fwd_ms"], "o", label=f"dedup, {tokens} tok/rank")[0]
        per = group[group["mode"] == "per_expert"]
        ax.plot(per["expected_ct"], per["fwd_ms"], "x", color=line.get_color())
        if dedup["expected_ct"].nunique() >= 2:
            slope, icept = np.polyfit(dedup["expected_ct"], dedup["fwd_ms"], 1)
            pred = slope * dedup["expected_ct"] + icept
            ss_res = float(((dedup["fwd_ms"] - pred) ** 2).sum())
            ss_tot = float(((dedup["fwd_ms"] - dedup["fwd_ms"].mean()) ** 2).sum()) or float("nan")
            fits[int(tokens)] = {"slope_ms": slope, "intercept_ms": icept, "r2": 1 - ss_res / ss_tot}
            xs = np.linspace(dedup["expected_ct"].min(), dedup["expected_ct"].max(), 10)
            ax.plot(xs, slope * xs + icept, "-", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("E[C_T]")
    ax.set_ylabel("EP layer forward (ms)")
    ax.set_title("latency vs E[C_T] (x: per-expert dispatch)")
    ax.legend(fontsize=7)
    _savefig(fig, path)
    return fits


def plot_accuracy(acc: pd.DataFrame, path: Path) -> None:
    tasks = [c for c in acc.columns if c not in ("variant",)]
    variants = acc[acc["variant"] != "chance"]
    chance = acc[acc["variant"] == "chance"].iloc[0]
    fig, ax = plt.subplots(figsize=(max(6, len(tasks) * 1.1), 3.8))
    width = 0.8 / max(1, len(variants))
    x = np.arange(len(tasks))
    for i, (_, row) in enumerate(variants.iterrows()):
        ax.bar(x + i * width, [row[t] for t in tasks], width, label=row["variant"])
    for j, t in enumerate(tasks):
        ax.hlines(chance[t], j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="dashed", lw=1)
    ax.set_xticks(x + 0.4 - width / 2, tasks, rotation=30, fontsize=8)
    ax.set_ylabel("accuracy (dashed: chance)")
    ax.legend(fontsize=7, ncol=3)
    _savefig(fig, path)


def plot_heatmaps(coact_EE: np.ndarray, device_of_expert: np.ndarray, layer: int, path: Path) -> None:
    order = np.argsort(device_of_expert, kind="stable")
    off = coact_EE.astype(float).copy()
    np.fill_diagonal(off, 0)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.8))
    for ax, mat, title in [(axes[0], off, "experts by index"), (axes[1], off[np.ix_(order, order)], "grouped by placement")]:
        im = ax.imshow(mat, cmap="viridis")
        ax.set_title(f"layer {layer}: {title}", fontsize=9)
    per = len(order) // (device_of_expert.max() + 1)
    for b in range(1, device_of_expert.max() + 1):
        axes[1].axhline(b * per - 0.5, color="w", lw=0.8)
        axes[1].axvline(b * per - 0.5, color="w", lw=0.8)
    fig.colorbar(im, ax=axes, shrink=0.8, label="co-activations")
    _savefig(fig, path)


def plot_placement(summary: pd.DataFrame, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for method, g in summary.groupby("method"):
        ax.plot(g["D"], g["expected_ct_heldout"], "o-", label=method)
    bounds = summary.drop_duplicates("D")
    ax.plot(bounds["D"], bounds["lower_bound"], "k:", label="lower bound ⌈kD/E⌉")
    ax.plot(bounds["D"], bounds["upper_bound"], "k--", label="upper bound min(k, D)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices D")
    ax.set_ylabel("held-out E[C_T]")
    ax.legend(fontsize=7)
    _savefig(fig, path)


def plot_placement_study(study: pd.DataFrame, path: Path) -> None:
    """Per trace: held-out E[C_T] (top) and max/mean device load (bottom) against D, per method."""
    mean = study[(study["layer"].astype(str) == "mean") & (study["status"] == "ok")]
    traces = sorted(set(mean["trace"]))
    fig, axes = plt.subplots(2, len(traces), figsize=(4 * len(traces), 6.4), squeeze=False)
    for j, trace in enumerate(traces):
        part = mean[mean["trace"] == trace]
        for method, g in part.groupby("method"):
            g = g.sort_values("D")
            axes[0][j].plot(g["D"], g["expected_ct_heldout"], "o-", ms=3, label=method)
            axes[1][j].plot(g["D"], g["max_device_load_over_mean"], "o-", ms=3, label=method)
        bounds = part.drop_duplicates("D").sort_values("D")
        axes[0][j].plot(bounds["D"], bounds["lower_bound"], "k:", lw=1)
        axes[0][j].plot(bounds["D"], bounds["upper_bound"], "k--", lw=1)
        axes[0][j].set_title(trace, fontsize=9)
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("devices D", fontsize=8)
        axes[0][j].set_ylabel("held-out E[C_T]", fontsize=8)
        axes[1][j].set_ylabel("max / mean device load", fontsize=8)
    axes[0][0].legend(fontsize=6)
    _savefig(fig, path)


TRADEOFF_MARKERS = {"contiguous": "s", "greedy": "^", "swap": "v", "load_aware": "D", "eplb": "P", "latency": "*"}


def plot_latency_tradeoff(tradeoff: pd.DataFrame, path: Path, devices=(2, 4, 8)) -> None:
    """Per trace (rows) and D (columns), the first layer: E[C_T] against the busiest device's load over
    the mean for the candidates the latency search visited (colour: predicted ms), each method marked
    and labelled with its predicted layer time (calibration split)."""
    traces = list(dict.fromkeys(tradeoff["trace"]))
    chosen = [d for d in devices if d in set(tradeoff["D"])] or sorted(set(tradeoff["D"]))[:3]
    fig, axes = plt.subplots(len(traces), len(chosen), figsize=(4.2 * len(chosen), 3.4 * len(traces)), squeeze=False)
    for i, trace in enumerate(traces):
        part = tradeoff[tradeoff["trace"] == trace]
        first = str(part["layer"].astype(str).iloc[0])
        for j, num_devices in enumerate(chosen):
            ax = axes[i][j]
            rows = part[(part["D"] == num_devices) & (part["layer"].astype(str) == first)]
            if rows.empty:
                ax.set_visible(False)
                continue
            walk = rows[rows["kind"] == "path"]
            dots = ax.scatter(walk["max_device_load_over_mean"], walk["expected_ct"], c=walk["predicted_ms"], s=6,
                              cmap="viridis", alpha=0.6)
            fig.colorbar(dots, ax=ax, shrink=0.85).set_label("predicted ms", fontsize=7)
            marked = rows[(rows["kind"] == "method") & rows["method"].isin(list(TRADEOFF_MARKERS))]
            for row in marked.itertuples():
                ax.scatter(row.max_device_load_over_mean, row.expected_ct, marker=TRADEOFF_MARKERS.get(row.method, "o"),
                           s=70 if row.method == "latency" else 36, edgecolor="k", facecolor="none" if
                           row.method != "latency" else "#d62728", label=f"{row.method} {row.predicted_ms:.2f} ms")
            ax.set_title(f"{trace}, layer {first}, D={num_devices}", fontsize=8)
            ax.set_xlabel("busiest device's load / mean", fontsize=8)
            ax.set_ylabel("E[C_T] (calibration)", fontsize=8)
            ax.legend(fontsize=5.5, loc="best")
    fig.tight_layout()
    _savefig(fig, path)


def make_report(cfg: Config, results_dir: Path, figures_dir: Path, profile_npz: Path | None = None) -> None:
    meta = provenance(cfg.hash(), cfg.seed, stage="report")
    with atomic_path(results_dir / "config.yaml") as tmp:
        import yaml

        tmp.write_text(f"# resolved configuration, hash {cfg.hash()}\n" + yaml.safe_dump(cfg.raw, sort_keys=False))
    table = pd.read_csv(results_dir / "placement" / "expected_ct.csv")
    summary = placement_summary(table)
    write_csv(results_dir / "tables" / "placement_summary.csv", summary, meta)
    plot_placement(summary, figures_dir / "expected_ct_vs_devices.png")
    plot_placement_study(pd.read_csv(results_dir / "placement" / "study.csv"),
                         figures_dir / "placement_study.png")

    bench = bench_by_case(pd.read_csv(results_dir / "bench" / "ep_cpu.csv"))
    ablation = ct_ablation(bench)
    fits = plot_latency_vs_ct(bench, figures_dir / "latency_vs_ct.png")
    write_csv(results_dir / "tables" / "ct_ablation.csv", ablation, {**meta, "linear_fits": fits})
    plot_ablation(ablation, figures_dir / "ct_ablation.png")

    scores = sorted((results_dir / "evaluate").glob("*.json"))
    acc = accuracy_table([s for s in scores if s.stem in cfg.finetune.variants])
    write_csv(results_dir / "tables" / "accuracy.csv", acc, meta)
    plot_accuracy(acc, figures_dir / "accuracy.png")

    from occult.routing.placement import load_placement_layers
    from occult.routing.profiling import load_profile
    from occult.routing.variants import placement_file

    prof = load_profile(profile_npz or Path("work") / cfg.run / "profile" / "profile.npz")
    layers, placement_LE = load_placement_layers(placement_file(cfg, results_dir / "placement"))
    plot_heatmaps(prof.coactivation[0], np.asarray(placement_LE[0]), int(layers[0]),
                  figures_dir / "coactivation_heatmaps.png")
    tables = sorted(str(p) for p in (results_dir / "tables").glob("*.csv"))
    figures = sorted(str(p) for p in Path(figures_dir).glob("*.png"))
    log_event("report", f"report written to {results_dir / 'tables'} and {figures_dir}", logger=log,
              tables=tables, figures=figures)
