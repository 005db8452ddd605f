"""Figures and tables from committed GPU results (runs on a CPU machine).

Sweeps (`--run-dir results/<machine>/sweeps_<v>`): reads `sweep_<kind>_D<D>*.csv` (written by
`occult.harness.sweep` on the GPU machine) and writes to `figures/<machine>/sweeps_<v>/`: latency vs
tokens per shape (prefill), step time vs batch (train), latency vs batch (decode), one row of panels
per routing, and speedup bars of Occult against MegaBlocks, Tutel and the naive EP at each kind's
reference point (prefill 2^14 tokens/GPU, training batch 8, decode batch 64); plus `speedups.csv`.
Rows without a routing (files written before the sweep had the column) ran its default, synthetic
routing.

EP benchmark (`--ep`, `--run-dir results/<machine>/ep_<v>`, from `workflow/scripts/gpu_ep_bench.sh`):
reads `ep_<kind>_<routing>_D<D>.csv` and `peak.csv`; writes `summary.csv` (per method and size:
phases, expert TFLOP/s and % of the measured bf16 peak, wire bytes, the NCCL time of those bytes),
`targets.csv` (the runtime's performance targets at 2^14 tokens/GPU, measured ratio and verdict)
and figures (latency vs tokens, phase breakdown at 2^14).

Kernel benchmark (`--kernels`, `--run-dir results/<machine>/kernels_<v>`, from
`workflow/scripts/gpu_kernels.sh`): reads `kernels*.csv` of `occult.harness.kernel_bench` (with its
cuBLAS peak rows); writes `summary.csv` (forward TFLOP/s per op, implementation and routing, as % of
the sustained and of the burst peak of the same run, min/median/max over the run's repeats) and
`kernels.png` (forward rate of each implementation beside the peaks and the 80% target).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import pandas as pd  # noqa: E402

from occult.method_names import BASELINE_SETTINGS, MethodNameError, is_occult, parse_method  # noqa: E402
from occult.provenance import atomic_path, write_csv  # noqa: E402
from occult.sim.builtin_alltoall import BUILTIN_ALLTOALL_SOURCE, builtin_alltoall_table  # noqa: E402

SIZE_COLUMN = {"prefill": "tokens_per_gpu", "decode": "batch", "train": "batch"}
XLABEL = {"prefill": "tokens per GPU", "decode": "sequences per GPU (one token each)",
          "train": "batch (sequences of 512 tokens) per GPU"}
REFERENCE_TOKENS = 16384
# One colour per method in every sweep figure (tab20 pairs: an Occult variant and its balanced twin share
# a hue); methods not listed take the colours left over, in name order.
METHOD_ORDER = ("occult", "occult-balanced", "occult-graph", "occult-graph-balanced", "occult-nd2", "occult-nd1",
                "megablocks", "tutel", "deepspeed", "naive", "hf", "fsdp")
TAB20_INDEX = (0, 1, 2, 3, 4, 5, 6, 8, 10, 14, 12, 16)
# The sweep's routings in panel order (occult.harness.sweep.settings.ROUTINGS); rows without one ran
# the default.
ROUTING_ORDER = ("synthetic", "uniform", "trace")
DEFAULT_ROUTING = "synthetic"
# Line styles of a baseline's settings, in the order of `_setting_rank` (its defaults first).
SETTING_STYLES = ("--x", "-.^", ":s", "--v", "-.d", ":P")


def _baseline_system(method: str) -> str | None:
    """The baseline a method name runs (None: Occult, or a name outside the grammar)."""
    try:
        spec = parse_method(method)
    except MethodNameError:
        return None
    return None if spec.is_occult else spec.system


def method_colors(methods) -> dict[str, tuple]:
    """A fixed colour per method name, the same in every panel and run; a baseline's settings
    (`megablocks:grouped_gemm=cutlass`) share its colour."""
    palette = plt.get_cmap("tab20").colors
    colors = {m: palette[i] for m, i in zip(METHOD_ORDER, TAB20_INDEX)}
    variants = {m: _baseline_system(m) for m in set(methods) - set(colors)}
    variants = {m: system for m, system in variants.items() if system in colors}
    spare = [c for i, c in enumerate(palette) if i not in TAB20_INDEX]
    for k, method in enumerate(sorted(set(methods) - set(colors) - set(variants))):
        colors[method] = spare[k % len(spare)]
    colors.update({method: colors[system] for method, system in variants.items()})
    return colors


def _setting_rank(method: str) -> tuple:
    """Sort key of a baseline's settings: its defaults first, then the chosen values' positions in
    `BASELINE_SETTINGS`."""
    spec = parse_method(method)
    table = BASELINE_SETTINGS.get(spec.system, {})
    return tuple(table[key].index(value) for key, value in spec.settings)


def method_labels(frame: pd.DataFrame) -> dict[str, str]:
    """Legend text per method of `frame`: the name, except a baseline run in several settings, which
    reads `<baseline> (<its settings>)`, the settings the run recorded (`baseline_config`) or else
    the name's own (`megablocks:grouped_gemm=cutlass` -> `megablocks (grouped_gemm=cutlass)`)."""
    methods = list(dict.fromkeys(frame["method"]))
    systems = {m: _baseline_system(m) for m in methods}
    count = pd.Series([s for s in systems.values() if s]).value_counts()
    configs = {}
    if "baseline_config" in frame.columns:
        recorded = frame.dropna(subset=["baseline_config"])
        configs = recorded.groupby("method")["baseline_config"].first().astype(str).to_dict()
    labels = {}
    for method in methods:
        system = systems[method]
        if system is None or count[system] == 1 and method == system:
            labels[method] = method
            continue
        chosen = configs.get(method) or method.partition(":")[2] or "defaults"
        labels[method] = f"{system} ({chosen.replace(',', ', ')})"
    repeated = pd.Series(list(labels.values())).value_counts()
    return {m: text if repeated[text] == 1 else f"{text} [{m}]" for m, text in labels.items()}


def method_styles(methods) -> dict[str, str]:
    """Line style per method: Occult's variants solid with dots, a baseline dashed with crosses, its
    other settings in the other styles of `SETTING_STYLES` (defaults first)."""
    styles, by_system = {}, {}
    for method in methods:
        system = _baseline_system(method)
        if system is None:
            styles[method] = "-o" if is_occult(method) else "--x"
        else:
            by_system.setdefault(system, []).append(method)
    for system, members in by_system.items():
        for k, method in enumerate(sorted(members, key=_setting_rank)):
            styles[method] = SETTING_STYLES[k % len(SETTING_STYLES)]
    return styles


def _plot_order(method: str, rank: dict[str, int]) -> tuple:
    """Methods in `METHOD_ORDER`, a baseline's other settings right after its defaults."""
    base = _baseline_system(method) or method
    return rank.get(base, len(rank)), method != base, method


def with_routing(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows with a `routing` on each: those without one (files written before the sweep
    recorded it) ran the default, synthetic routing."""
    out = frame.copy()
    out["routing"] = out["routing"].fillna(DEFAULT_ROUTING) if "routing" in out.columns else DEFAULT_ROUTING
    return out


def _routing_rank(routing: str) -> tuple:
    return (ROUTING_ORDER.index(routing) if routing in ROUTING_ORDER else len(ROUTING_ORDER), routing)


def load_sweeps(run_dir: Path) -> pd.DataFrame:
    frames = [pd.read_csv(p) for p in sorted(run_dir.glob("sweep_*_D*.csv"))]
    if not frames:
        raise FileNotFoundError(f"{run_dir}: no sweep_*_D*.csv files")
    return pd.concat(frames, ignore_index=True)


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    plt.close(fig)


def replicate_medians(frame: pd.DataFrame, extra_keys: tuple[str, ...] = ()) -> pd.DataFrame:
    """One row per point (kind, shape, method, D, size, and `extra_keys`): the median of its
    replicates' `median_ms` (a run may hold several processes' files of the same sweep), with their
    min and max."""
    keys = [k for k in ("kind", *extra_keys, "shape", "method", "D", "tokens_per_gpu", "batch") if k in frame.columns]
    return (frame.groupby(keys, dropna=False, sort=False)["median_ms"]
            .agg(median_ms="median", low_ms="min", high_ms="max", replicates="size").reset_index())


def plot_kind(frame: pd.DataFrame, kind: str, path: Path) -> None:
    """One row of panels per routing, one panel per (shape, D): median latency per method against
    the sweep size (ok rows only); where a point has replicates, the line goes through their median
    and a bar spans them. Titles name the routing unless every row ran the default one."""
    rows = with_routing(frame[(frame["kind"] == kind) & (frame["status"] == "ok")])
    ok = replicate_medians(rows, extra_keys=("routing",))
    routings = sorted(set(ok["routing"]), key=_routing_rank) or [DEFAULT_ROUTING]
    panels = sorted(ok.groupby(["shape", "D"]).groups)
    width = max(1, len(panels))
    fig, axes = plt.subplots(len(routings), width, figsize=(4.2 * width, 3.6 * len(routings)), squeeze=False)
    colors = method_colors(ok["method"].unique())
    styles = method_styles(ok["method"].unique())
    labels = method_labels(rows)
    rank = {m: i for i, m in enumerate(METHOD_ORDER)}
    handles = {}
    for row_axes, routing in zip(axes, routings):
        for ax, (shape, devices) in zip(row_axes, panels):
            part = ok[(ok["routing"] == routing) & (ok["shape"] == shape) & (ok["D"] == devices)]
            if part.empty:
                ax.set_visible(False)
                continue
            for method, g in sorted(part.groupby("method"), key=lambda mg: _plot_order(mg[0], rank)):
                g = g.sort_values(SIZE_COLUMN[kind])
                line, = ax.plot(g[SIZE_COLUMN[kind]], g["median_ms"], styles[method], ms=3, color=colors[method],
                                label=labels[method])
                handles.setdefault(labels[method], line)
                spread = g[g["replicates"] > 1]
                if not spread.empty:
                    ax.vlines(spread[SIZE_COLUMN[kind]], spread["low_ms"], spread["high_ms"], color=colors[method],
                              lw=1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            named = "" if routings == [DEFAULT_ROUTING] else f", {routing} routing"
            ax.set_title(f"{kind}: {shape}, D={devices}{named}", fontsize=9)
            ax.set_xlabel(XLABEL[kind], fontsize=8)
            ax.grid(True, which="major", lw=0.3, alpha=0.5)
        row_axes[0].set_ylabel("median ms (one MoE layer)", fontsize=8)
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="upper center",
               ncol=min(len(handles), 7), bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(f"machine: {frame['machine'].iloc[0]}, commit {frame['commit'].iloc[0]}", fontsize=8)
    fig.tight_layout()
    _save(fig, path)


# The point of each sweep kind at which the speedup table compares the methods: (size column, value).
# The order check (occult.harness.sweep.order_check) times the same points.
REFERENCE_SIZES = {"prefill": ("tokens_per_gpu", REFERENCE_TOKENS), "train": ("batch", 8), "decode": ("batch", 64)}
SIZE_UNITS = {"tokens_per_gpu": "tokens/GPU", "batch": "sequences/GPU"}
SPEEDUP_COLUMNS = ("kind", "size_column", "size", "routing", "shape", "D", "occult", "baseline", "baseline_method",
                   "baseline_config", "configs_compared", "occult_ms", "baseline_ms", "speedup")


def speedups(frame: pd.DataFrame, sizes: dict[str, tuple[str, int]] = REFERENCE_SIZES) -> pd.DataFrame:
    """Each Occult variant's speedup over each baseline at each kind's reference point (`sizes`:
    prefill at 16384 tokens per GPU, training at batch 8, decode at batch 64), per routing, shape and
    D. A baseline run in several settings (methods `megablocks`, `megablocks:grouped_gemm=cutlass`,
    ...) is represented by its fastest setting at that point, named in `baseline_method` and
    `baseline_config`; `configs_compared` says among how many. Files without a `routing` column hold
    the synthetic routing (the sweep's default before it had one)."""
    rows = []
    for kind, (column, size) in sizes.items():
        if column not in frame.columns:
            continue
        at = (frame["kind"] == kind) & (frame["status"] == "ok") & (frame[column] == size)
        ok = with_routing(frame[at])
        configs = ok.groupby("method")["baseline_config"].first().fillna("") if "baseline_config" in ok.columns else {}
        ok = replicate_medians(ok, extra_keys=("routing",))
        for (routing, shape, devices), g in ok.groupby(["routing", "shape", "D"]):
            times = g.set_index("method")["median_ms"]
            baselines = pd.DataFrame({"method": [m for m in times.index if not is_occult(m)]})
            baselines["system"] = [parse_method(m).system for m in baselines["method"]]
            baselines["ms"] = [times[m] for m in baselines["method"]]
            for occult in [m for m in times.index if is_occult(m)]:
                for system, options in baselines.groupby("system", sort=True):
                    fastest = options.loc[options["ms"].idxmin()]
                    rows.append({"kind": kind, "size_column": column, "size": size, "routing": routing,
                                 "shape": shape, "D": devices, "occult": occult, "baseline": system,
                                 "baseline_method": fastest["method"],
                                 "baseline_config": configs.get(fastest["method"], "") if len(configs) else "",
                                 "configs_compared": len(options), "occult_ms": times[occult],
                                 "baseline_ms": fastest["ms"], "speedup": fastest["ms"] / times[occult]})
    return pd.DataFrame(rows, columns=list(SPEEDUP_COLUMNS))


SPEEDUP_BARS = {"occult": ("Occult exact, eager", "#4c72b0"), "occult-graph": ("Occult exact, CUDA graph", "#dd8452")}
SPEEDUP_BASELINES = ("megablocks", "tutel", "naive")


def plot_speedups(table: pd.DataFrame, path: Path) -> None:
    """One panel per sweep kind (at its reference point), one above the other, of horizontal bars:
    per (routing, shape, D, baseline) one bar for each Occult variant of SPEEDUP_BARS (against the
    baseline's fastest setting)."""
    sub = table[table["occult"].isin(list(SPEEDUP_BARS)) & table["baseline"].isin(SPEEDUP_BASELINES)]
    present = set(sub["kind"])
    kinds = [kind for kind in REFERENCE_SIZES if kind in present] + sorted(present - set(REFERENCE_SIZES))
    panels = {kind: sorted(sub[sub["kind"] == kind].groupby(["routing", "shape", "D", "baseline"]).groups,
                           key=lambda key: (_routing_rank(key[0]), key[1], key[2], SPEEDUP_BASELINES.index(key[3])))
              for kind in kinds}
    variants = [v for v in SPEEDUP_BARS if v in set(sub["occult"])]
    height = 0.8 / max(1, len(variants))
    counts = [max(1, len(panels[kind])) for kind in kinds] or [1]
    fig, axes = plt.subplots(len(counts), 1, figsize=(7, 0.45 * sum(counts) + 1.2 * len(counts)), squeeze=False,
                             gridspec_kw={"height_ratios": counts})
    for ax, kind in zip(axes[:, 0], kinds):
        groups = panels[kind]
        at_kind = sub[sub["kind"] == kind]
        for offset, variant in enumerate(variants):
            label, color = SPEEDUP_BARS[variant]
            values = at_kind[at_kind["occult"] == variant].set_index(["routing", "shape", "D", "baseline"])["speedup"]
            ys = [index + (offset - (len(variants) - 1) / 2) * height for index in range(len(groups))]
            xs = [values.get(key, float("nan")) for key in groups]
            bars = ax.barh(ys, xs, height=height, color=color, label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=2)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(range(len(groups)), [_speedup_label(at_kind, key) for key in groups], fontsize=7)
        ax.set_ylim(len(groups) - 0.5, -0.5)
        column, size = at_kind["size_column"].iloc[0], at_kind["size"].iloc[0]
        ax.set_xlabel(f"{kind}: speedup over the baseline at {size} {SIZE_UNITS[column]} (>1: Occult faster)",
                      fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
    _save(fig, path)


def _speedup_label(table: pd.DataFrame, key: tuple) -> str:
    """`<routing>: <shape>, D=<D>, vs <baseline>`, and where several of its settings ran, the one that
    was fastest there (the one every bar of the row is measured against)."""
    routing, shape, world, base = key
    label = f"{routing}: {shape}, D={world}, vs {base}"
    if "configs_compared" not in table.columns:
        return label
    rows = table[(table["routing"] == routing) & (table["shape"] == shape) & (table["D"] == world)
                 & (table["baseline"] == base)]
    config = rows["baseline_config"].dropna().astype(str)
    if len(rows) and rows["configs_compared"].max() > 1 and len(config) and config.iloc[0]:
        label += f" ({config.iloc[0]}, fastest of {int(rows['configs_compared'].max())})"
    return label


def make_gpu_report(run_dir: Path, figures_dir: Path) -> None:
    frame = load_sweeps(run_dir)
    for kind in sorted(set(frame["kind"])):
        plot_kind(frame, kind, figures_dir / f"{kind}.png")
    table = speedups(frame)
    write_csv(run_dir / "speedups.csv", table)
    if len(table):
        plot_speedups(table, figures_dir / "speedups.png")


# ----------------------------------------------------------------------------------------------
# The EP runtime's benchmark

# `all_to_all_single` algbw (whole buffer / time) on 2×H200 NVLink: the table shipped with the simulator.
NCCL_ALLTOALL_2GPU = builtin_alltoall_table()
TARGETS = {"kernels_pct_peak": 0.80, "exact_over_per_expert": 1.4, "nd1_over_compute": 1.15}


def nccl_algbw_gbs(nbytes: float, curve=NCCL_ALLTOALL_2GPU) -> float:
    """Interpolated (log size) algbw in GB/s; clamped to the curve's ends."""
    import math

    sizes, rates = zip(*curve)
    if nbytes <= sizes[0]:
        return rates[0] * nbytes / sizes[0]       # latency-bound below the curve: time stays flat
    if nbytes >= sizes[-1]:
        return rates[-1]
    for (s0, r0), (s1, r1) in zip(curve[:-1], curve[1:]):
        if s0 <= nbytes <= s1:
            w = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return r0 + w * (r1 - r0)
    return rates[-1]


def load_ep(run_dir: Path) -> tuple[pd.DataFrame, float]:
    frames = [pd.read_csv(p).assign(run=p.stem) for p in sorted(run_dir.glob("ep_*_D*.csv"))]
    if not frames:
        raise FileNotFoundError(f"{run_dir}: no ep_*_D*.csv files")
    peak_file = run_dir / "peak.csv"
    if not peak_file.is_file():
        raise FileNotFoundError(f"{peak_file}: the bf16 peak of the same GPU is missing")
    return pd.concat(frames, ignore_index=True), float(pd.read_csv(peak_file)["tflops"].iloc[0])


def measured_alltoall_curve(run_dir: Path) -> tuple[tuple[tuple[float, float], ...], str]:
    """(curve, source): the newest `results/<machine>/comm_*/alltoall.csv` of the same machine
    (equal splits, bf16, D=2: (bytes per rank, algbw GB/s)), else the shipped 2xH200 table."""
    for csv in sorted(run_dir.parent.glob("comm_*/alltoall.csv"), reverse=True):
        table = pd.read_csv(csv)
        rows = table[(table["pattern"] == "equal") & (table["dtype"] == "bfloat16") & (table["D"] == 2)]
        rows = rows.groupby("bytes_per_rank", as_index=False)["algbw_gbps"].median()
        if len(rows) >= 2:
            return tuple(zip(rows["bytes_per_rank"].astype(float), rows["algbw_gbps"].astype(float))), str(csv)
    return NCCL_ALLTOALL_2GPU, BUILTIN_ALLTOALL_SOURCE


def ep_summary(frame: pd.DataFrame, peak_tflops: float,
               curve: tuple[tuple[float, float], ...] = NCCL_ALLTOALL_2GPU) -> pd.DataFrame:
    """Per (kind, routing, method, tokens): times, expert TFLOP/s (experts phase, or the whole step
    for `-compute`), % of peak, wire bytes and their NCCL time on the measured algbw `curve`."""
    ok = frame[frame["status"] == "ok"].copy()
    passes = ok["kind"].map({"train": 3.0}).fillna(1.0)              # fwd+bwd = 3 GEMM passes
    flops = 2.0 * ok["pairs_received_max"] * 3 * ok["hidden"] * ok["ffn"] * passes
    compute_only = ok["method"].str.contains(r"-compute(?:-|$)")       # -compute, -compute-graph
    expert_ms = ok["experts_ms"].where(~compute_only, ok["median_ms"])
    ok["expert_tflops"] = flops / expert_ms / 1e9
    ok["pct_of_peak"] = ok["expert_tflops"] / peak_tflops
    ok["flop_floor_ms"] = flops / peak_tflops / 1e9
    devices = ok["D"].clip(lower=2)
    # bytes_sent = remote bytes of both directions; the NCCL buffer also holds the local share.
    buffer_each_way = ok["bytes_sent"] / 2 * devices / (devices - 1)
    ok["nccl_comm_ms"] = [2 * b / nccl_algbw_gbs(b, curve) / 1e6 if b > 0 else 0.0 for b in buffer_each_way]
    keep = ["run", "kind", "routing", "method", "D", "tokens_per_gpu", "batch", "median_ms", "dispatch_ms", "experts_ms",
            "combine_ms", "bytes_sent", "nccl_comm_ms", "mean_devices_per_token", "pairs_received_max",
            "expert_tflops", "pct_of_peak", "flop_floor_ms", "max_rel_err", "peak_mem_gib"]
    return ok[keep].sort_values(["run", "method", "tokens_per_gpu"]).reset_index(drop=True)


def ep_targets(summary: pd.DataFrame, tokens: int = REFERENCE_TOKENS) -> pd.DataFrame:
    """The runtime's three performance targets at `tokens` per GPU, per run file (one CSV = one
    torchrun: every ratio compares methods measured side by side in the same run)."""
    rows = []
    for (run, kind, routing), g in summary[summary["tokens_per_gpu"] == tokens].groupby(["run", "kind", "routing"]):
        t = g.set_index("method")["median_ms"]
        pct = g.set_index("method")["pct_of_peak"]

        def add(target: str, value: float | None, goal: float, how: str, higher_is_better: bool = True) -> None:
            if value is None or pd.isna(value):
                return
            met = value >= goal if higher_is_better else value <= goal
            rows.append({"run": run, "kind": kind, "routing": routing, "tokens_per_gpu": tokens, "target": target,
                         "measured": value, "goal": goal, "met": bool(met), "how": how})

        if "occult-compute" in pct:
            add("expert kernels, fraction of bf16 peak", pct["occult-compute"], TARGETS["kernels_pct_peak"],
                "occult-compute: the grouped kernels alone on each GPU's received pairs")
        for exact in ("occult", "occult-graph"):
            if exact in t and "occult-pe" in t:
                add(f"{exact} speedup over per_expert dispatch", t["occult-pe"] / t[exact],
                    TARGETS["exact_over_per_expert"], f"occult-pe (eager) / {exact}")
        for nd1 in ("occult-nd1", "occult-nd1-graph"):
            if nd1 in t and "occult-compute" in t:
                add(f"{nd1} over the expert-compute floor", t[nd1] / t["occult-compute"],
                    TARGETS["nd1_over_compute"], f"{nd1} / occult-compute", higher_is_better=False)
    return pd.DataFrame(rows)


def plot_ep(summary: pd.DataFrame, figures_dir: Path) -> None:
    prefill = summary[summary["kind"] == "prefill"]
    routings = sorted(set(prefill["routing"]))
    if not routings:
        return
    fig, axes = plt.subplots(1, len(routings), figsize=(5 * len(routings), 3.8), squeeze=False)
    for ax, routing in zip(axes[0], routings):
        part = prefill[prefill["routing"] == routing].drop_duplicates(["method", "tokens_per_gpu"])
        for method, g in part.groupby("method"):
            ax.plot(g["tokens_per_gpu"], g["median_ms"], "--x" if method.endswith("-compute") else "-o", ms=3,
                    label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"OLMoE layer, D=2, routing={routing}", fontsize=9)
        ax.set_xlabel("tokens per GPU", fontsize=8)
        ax.set_ylabel("median ms (forward)", fontsize=8)
    axes[0][0].legend(fontsize=7)
    _save(fig, figures_dir / "ep_latency.png")

    at = prefill[(prefill["tokens_per_gpu"] == REFERENCE_TOKENS) & prefill["dispatch_ms"].notna()]
    if at.empty:
        return
    fig, axes = plt.subplots(1, len(routings), figsize=(5 * len(routings), 3.8), squeeze=False)
    for ax, routing in zip(axes[0], routings):
        g = at[at["routing"] == routing].drop_duplicates("method").set_index("method")
        bottom = pd.Series(0.0, index=g.index)
        for phase, color in (("dispatch_ms", "#dd8452"), ("experts_ms", "#4c72b0"), ("combine_ms", "#55a868")):
            ax.bar(g.index, g[phase], bottom=bottom, color=color, label=phase.removesuffix("_ms"))
            bottom = bottom + g[phase]
        ax.set_title(f"phases at {REFERENCE_TOKENS} tokens/GPU, routing={routing}", fontsize=9)
        ax.set_ylabel("ms (GPU time between events)", fontsize=8)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    axes[0][0].legend(fontsize=7)
    _save(fig, figures_dir / "ep_phases.png")


def make_ep_report(run_dir: Path, figures_dir: Path) -> None:
    frame, peak = load_ep(run_dir)
    curve, source = measured_alltoall_curve(run_dir)
    summary = ep_summary(frame, peak, curve).assign(nccl_curve=source)
    write_csv(run_dir / "summary.csv", summary)
    write_csv(run_dir / "targets.csv", ep_targets(summary))
    figures_dir.mkdir(parents=True, exist_ok=True)
    plot_ep(summary, figures_dir)


KERNEL_OPS = ("expert_ffn", "grouped_swiglu", "grouped_down_reduce")
KERNEL_IMPLS = ("triton", "triton_row_table", "triton_pointers", "grouped_mm", "grouped_mm_sorted", "dense_mm")


def load_kernels(run_dir: Path) -> pd.DataFrame:
    """Every bench_kernels CSV of the run (`kernels.csv`, repeats `kernels_*.csv`), a column `file`
    naming its source; each file must carry its own cuBLAS peak rows (`matmul_8192`)."""
    frames = []
    for csv in sorted(run_dir.glob("kernels*.csv")):
        frame = pd.read_csv(csv)
        if not {"pct_of_peak", "pct_of_burst_peak"} <= set(frame.columns):
            raise ValueError(f"{csv}: no peak columns (pct_of_peak, pct_of_burst_peak): bench_kernels before "
                             "d8112ee did not measure the peak in the same run")
        frames.append(frame.assign(file=csv.name))
    if not frames:
        raise FileNotFoundError(f"{run_dir}: no kernels*.csv")
    return pd.concat(frames, ignore_index=True)


def kernels_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Forward rate per (routing, op, impl): min / median / max over the run's files."""
    peaks = frame[frame["op"] == "matmul_8192"].pivot_table(index="file", columns="impl", values="tflops")
    forward = frame[(frame["pass"] == "fwd") & frame["op"].isin(KERNEL_OPS) & frame["impl"].isin(KERNEL_IMPLS)]
    grouped = forward.groupby(["routing", "op", "impl"])
    summary = grouped.agg(files=("file", "nunique"), median_ms=("median_ms", "median"),
                          tflops_min=("tflops", "min"), tflops=("tflops", "median"), tflops_max=("tflops", "max"),
                          pct_of_peak=("pct_of_peak", "median"), pct_of_peak_min=("pct_of_peak", "min"),
                          pct_of_peak_max=("pct_of_peak", "max"), pct_of_burst_peak=("pct_of_burst_peak", "median"))
    summary = summary.reset_index()
    # Where the run also timed impls in a burst (pass fwd_burst, bench_kernels since this column):
    # their rate against the burst peak, the like-for-like pair of the two timings.
    bursts = frame[(frame["pass"] == "fwd_burst") & frame["op"].isin(KERNEL_OPS)]
    burst = bursts.groupby(["routing", "op", "impl"]).agg(
        burst_median_ms=("median_ms", "median"), burst_pct_of_burst_peak=("pct_of_burst_peak", "median"))
    summary = summary.merge(burst.reset_index(), on=["routing", "op", "impl"], how="left")
    return summary.assign(peak_tflops=peaks["cublas"].median(), burst_peak_tflops=peaks["cublas_burst"].median())


def plot_kernels(summary: pd.DataFrame, path: Path) -> None:
    routings = sorted(summary["routing"].unique())
    fig, axes = plt.subplots(1, len(routings), figsize=(6.5 * len(routings), 4.2), squeeze=False, sharey=True)
    impls = [i for i in KERNEL_IMPLS if i in set(summary["impl"])]
    width = 0.8 / len(impls)
    for ax, routing in zip(axes[0], routings):
        part = summary[summary["routing"] == routing]
        for j, impl in enumerate(impls):
            rows = part[part["impl"] == impl].set_index("op").reindex(list(KERNEL_OPS))
            xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(KERNEL_OPS))]
            err = [rows["tflops"] - rows["tflops_min"], rows["tflops_max"] - rows["tflops"]]
            ax.bar(xs, rows["tflops"], width, yerr=err, label=impl, capsize=2)
        peak, burst = part["peak_tflops"].iloc[0], part["burst_peak_tflops"].iloc[0]
        ax.axhline(peak, color="black", lw=1, label=f"cuBLAS 8192³, sustained ({peak:.0f})")
        ax.axhline(burst, color="black", lw=1, ls=":", label=f"cuBLAS 8192³, 40 ms burst ({burst:.0f})")
        ax.axhline(0.8 * peak, color="red", lw=1, ls="--", label="80% of sustained")
        ax.set_xticks(range(len(KERNEL_OPS)), ["expert FFN", "gate/up + SwiGLU", "down + reduce"])
        ax.set_title(f"forward, {routing} routing")
        ax.set_ylabel("TFLOP/s (bf16)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=5, bbox_to_anchor=(0.5, -0.1))
    fig.suptitle("Expert kernels at the OLMoE shape, 2^14 tokens × 2 ranks' pairs on one H200", fontsize=10)
    _save(fig, path)


def make_kernels_report(run_dir: Path, figures_dir: Path) -> None:
    summary = kernels_summary(load_kernels(run_dir))
    write_csv(run_dir / "summary.csv", summary)
    figures_dir.mkdir(parents=True, exist_ok=True)
    plot_kernels(summary, figures_dir / "kernels.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-dir", type=Path, required=True, help="results/<machine>/<run>")
    p.add_argument("--figures", type=Path, required=True, help="figures/<machine>/<run>")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--ep", action="store_true", help="the run is an EP benchmark (ep_*.csv), not sweeps")
    kind.add_argument("--kernels", action="store_true", help="the run is a kernel benchmark (kernels*.csv)")
    args = p.parse_args(argv)
    if args.kernels:
        make_kernels_report(args.run_dir, args.figures)
    elif args.ep:
        make_ep_report(args.run_dir, args.figures)
    else:
        make_gpu_report(args.run_dir, args.figures)
    return 0


if __name__ == "__main__":
    from occult.logs import run_main

    raise SystemExit(run_main("gpu_report", main, output_flags=("--figures",)))
