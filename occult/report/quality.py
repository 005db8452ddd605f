"""The quality study's tables (CPU): accuracy per arm, paired contrasts, claim verdicts, replicate
runs compared, and the accuracy figure. `python -m occult.stages.evaluate --summarise` and
`--replicates` (the rules plot_quality and quality_replicates) call these on committed results."""

from __future__ import annotations

import json
from pathlib import Path

from occult.config import parse_variant
from occult.provenance import provenance, write_json
from occult.stages.eval_tasks import NOT_AVAILABLE, UNAVAILABLE_TASKS



def arms_accuracy_table(eval_dir: Path) -> "pd.DataFrame":
    """One row per scored arm (file order of `quality_arms`-named JSONs): setting columns, `acc` and
    `acc_stderr` per task, `average` (unweighted over tasks) and its stderr (tasks independent),
    a chance row, and a column per benchmark of the paper that the offline data lacks
    (`UNAVAILABLE_TASKS`), reading "not available offline"."""
    import math

    import pandas as pd

    rows = []
    for path in sorted(Path(eval_dir).glob("*.json")):
        summary = json.loads(path.read_text())
        if "scores" not in summary:
            raise ValueError(f"{path}: not an evaluation summary (no 'scores')")
        setting = summary.get("setting", {})
        row = {"arm": summary.get("arm", path.stem), "variant": summary["variant"], **setting}
        errors = []
        for score in summary["scores"]:
            row[score["task"]] = score["acc"]
            row[f"{score['task']}_stderr"] = score["acc_stderr"]
            errors.append(score["acc_stderr"] or 0.0)
        tasks = [s["task"] for s in summary["scores"]]
        row["average"] = sum(row[t] for t in tasks) / len(tasks)
        row["average_stderr"] = math.sqrt(sum(e * e for e in errors)) / len(tasks)
        rows.append(row)
    if not rows:
        raise FileNotFoundError(f"{eval_dir}: no evaluation JSON files")
    rows.sort(key=_paper_order)
    chance = {s["task"]: s["chance"] for s in json.loads(next(Path(eval_dir).glob("*.json")).read_text())["scores"]}
    rows.append({"arm": "chance", "variant": "chance", **chance, "average": sum(chance.values()) / len(chance)})
    table = pd.DataFrame(rows)
    for task in UNAVAILABLE_TASKS:           # the paper's other benchmarks: said, not substituted
        table[task] = NOT_AVAILABLE
    return table


def _paper_order(row: dict) -> tuple:
    """raw, SFT, then pruned variants by D, N_d (descending) and method; ablations last."""
    variant = parse_variant(row["variant"])
    return (variant.trains, variant.max_devices is not None, row.get("gate_weights", "keep") != "keep",
            row.get("train_modules", "moe") != "moe", row.get("devices", 0), -(variant.max_devices or 0),
            variant.method or "", row["arm"])


def paired_contrast(terms: list[tuple[float, dict[str, str]]], tasks: list[str]) -> tuple[float, float] | None:
    """sum_j w_j * (task-averaged accuracy of arm j) for `terms` = [(w_j, per-document correctness of
    arm j)], and its standard error. All arms answered the same documents, so the error is that of
    the mean per-document contrast c_i = sum_j w_j x_ij: var(c) / n per task, tasks independent.
    None unless every arm has every task's documents, in the same number."""
    import numpy as np

    if not terms or not tasks:
        return None
    arms = [arm for _, arm in terms]
    if any(t not in arm or len(arm[t]) != len(arms[0].get(t, "")) for arm in arms for t in tasks):
        return None

    def bits(arm: dict[str, str], task: str) -> "np.ndarray":
        return (np.frombuffer(arm[task].encode(), dtype=np.uint8) - ord("0")).astype(np.float64)

    means, variances = [], []
    for task in tasks:
        c = sum(weight * bits(arm, task) for weight, arm in terms)
        means.append(c.mean())
        variances.append(c.var(ddof=1) / len(c) if len(c) > 1 else 0.0)
    return float(np.mean(means)), float(np.sqrt(np.sum(variances)) / len(tasks))


def paired_difference(pairs: list[tuple[dict[str, str], dict[str, str]]], tasks: list[str]) -> tuple[float, float] | None:
    """Mean over `pairs` of arm a's minus arm b's task-averaged accuracy, and its paired standard
    error (`paired_contrast`: the error of the mean per-document difference)."""
    if not pairs:
        return None
    share = 1.0 / len(pairs)
    return paired_contrast([(share, a) for a, _ in pairs] + [(-share, b) for _, b in pairs], tasks)


def claim_verdicts(table: "pd.DataFrame", per_doc: dict[str, dict[str, str]] | None = None) -> list[dict]:
    """A verdict per paper claim from the arms table: differences of task-averaged accuracy, "holds"
    needing 2 standard errors. The error is the paired one (`paired_difference`) where `per_doc`
    (arm -> task -> 0/1 per document) has both arms, else that of two independent averages."""
    import math

    by_arm = table.set_index("arm")
    tasks = [c[: -len("_stderr")] for c in table.columns if c.endswith("_stderr") and c != "average_stderr"]
    per_doc = per_doc or {}

    def avg(arm: str) -> tuple[float, float] | None:
        return (by_arm.at[arm, "average"], by_arm.at[arm, "average_stderr"]) if arm in by_arm.index else None

    def diff(a: str, b: str) -> dict | None:
        if avg(a) is None or avg(b) is None:
            return None
        (ma, sa), (mb, sb) = avg(a), avg(b)
        independent = math.sqrt(sa * sa + sb * sb)
        documents = a in per_doc and b in per_doc
        paired = paired_difference([(per_doc[a], per_doc[b])], tasks) if documents else None
        # the task that moves the difference most, and the difference without it: does one task decide?
        by_task = {t: by_arm.at[a, t] - by_arm.at[b, t] for t in tasks}
        decisive = max(by_task, key=lambda t: abs(by_task[t])) if len(tasks) > 1 else None
        rest = [t for t in tasks if t != decisive]
        without = paired_difference([(per_doc[a], per_doc[b])], rest) if documents and decisive else None
        return {"a": a, "b": b, "diff": ma - mb, "stderr": paired[1] if paired else independent,
                "stderr_basis": "paired documents" if paired else "independent averages",
                "stderr_independent": independent, "decisive_task": decisive,
                "diff_without_decisive_task": (without[0] if without else
                                               (sum(by_task[t] for t in rest) / len(rest) if rest else None)),
                "stderr_without_decisive_task": without[1] if without else None}

    pruned = table[table["variant"].str.startswith("prune") & (table.get("gate_weights") == "keep")
                   & (table.get("train_modules") == "moe")]
    verdicts = []
    within2 = [d for d in (diff(a, "sft-moe") for a in pruned[pruned["variant"].str.startswith("prune2")]["arm"]) if d]
    verdicts.append({
        "claim": "pruning within 2 devices is about as good as standard fine-tuning",
        "comparisons": within2,
        "verdict": "holds" if within2 and all(d["diff"] >= -2 * d["stderr"] for d in within2) else
                   ("does not hold" if within2 else "not measured"),
    })
    within1 = [d for d in (diff(a, "sft-moe") for a in pruned[pruned["variant"].str.startswith("prune1")]["arm"]) if d]
    verdicts.append({
        "claim": "pruning within 1 device hurts",
        "comparisons": within1,
        "verdict": "holds" if within1 and all(d["diff"] < -2 * d["stderr"] for d in within1) else
                   ("does not hold (no loss beyond 2 standard errors)" if within1 else "not measured"),
    })
    pairs = [d for d in (diff(a, a.replace("-sim-", "-router-")) for a in pruned["arm"] if "-sim-" in a) if d]
    mean = sum(d["diff"] for d in pairs) / len(pairs) if pairs else 0.0
    if pairs and all(d["stderr_basis"] == "paired documents" for d in pairs):      # the pairs share documents too
        spread = paired_difference([(per_doc[d["a"]], per_doc[d["b"]]) for d in pairs], tasks)[1]
    else:
        spread = math.sqrt(sum(d["stderr"] ** 2 for d in pairs)) / len(pairs) if pairs else 0.0
    verdicts.append({
        "claim": "similarity-based pruning beats router-score-based pruning",
        "comparisons": pairs,
        "mean_diff": mean, "mean_diff_stderr": spread,
        "verdict": "not measured" if not pairs else "holds" if mean > 2 * spread else
                   "does not hold" if mean < -2 * spread else "inconclusive (within 2 standard errors)",
    })
    # two ablations the paper reports without a claim we could test: the sign of each difference
    arms = table[table["arm"] != "chance"]
    full = [d for d in (diff(a, a[: -len("-all")] + "-moe") for a in arms[arms["train_modules"] == "all"]["arm"]) if d]
    verdicts.append({"claim": "full fine-tuning against MoE-only fine-tuning (same variant)", "comparisons": full,
                     "verdict": _sign_verdict(full, "full fine-tuning", "MoE-only fine-tuning")})
    gates = [d for d in (diff(a, a.replace("-renormalise-", "-keep-")) for a in
                         arms[arms["gate_weights"] == "renormalise"]["arm"]) if d]
    verdicts.append({"claim": "gate weights renormalised after pruning against kept as they are", "comparisons": gates,
                     "verdict": _sign_verdict(gates, "renormalised gates", "kept gates")})
    return verdicts


def _sign_verdict(comparisons: list[dict], a: str, b: str) -> str:
    """`a better`, `b better` (every comparison beyond 2 standard errors, one sign), or no difference."""
    if not comparisons:
        return "not measured"
    if all(d["diff"] > 2 * d["stderr"] for d in comparisons):
        return f"{a} better"
    if all(d["diff"] < -2 * d["stderr"] for d in comparisons):
        return f"{b} better"
    return "no consistent difference beyond 2 standard errors"


def load_per_doc(eval_dir: Path) -> dict[str, dict[str, str]]:
    """arm -> task -> its per-document correctness ("0"/"1" per document) from `eval_dir/*.json`."""
    per_doc = {}
    for path in sorted(Path(eval_dir).glob("*.json")):
        summary = json.loads(path.read_text())
        if summary.get("per_doc"):
            per_doc[summary.get("arm", path.stem)] = summary["per_doc"]
    return per_doc


def replicate_table(spec_path: Path) -> "pd.DataFrame":
    """Two runs of the same recipe on two base models (pre-training is not bitwise reproducible on a
    GPU): how far does the second move each arm, and each arm's difference from the reference arm?

    `spec_path` (YAML, in the second run's folder): `first:` the first run's folder; `reference:` an
    arm of the second run; `same_arms:` {first run's arm: second run's arm} for the arms that ran the
    same recipe in both. All four arms of a change answered the same documents, so every error is
    paired (`paired_contrast`); z = change / its error, beyond 2 meaning the base model, not the
    test set, moved it. Accuracy rows also give the runs' document agreement (`document_agreement`)."""
    import pandas as pd
    import yaml

    spec_path = Path(spec_path)
    spec = yaml.safe_load(spec_path.read_text()) or {}
    for field in ("first", "reference", "same_arms"):
        if field not in spec:
            raise ValueError(f"{spec_path}: missing field '{field}'")
    second_dir, first_dir = spec_path.parent, Path(spec["first"])
    first, second = load_per_doc(first_dir / "evaluate"), load_per_doc(second_dir / "evaluate")
    same = {str(a): str(b) for a, b in spec["same_arms"].items()}
    for name, runs, where in [(a, first, first_dir) for a in same] + [(b, second, second_dir) for b in same.values()]:
        if name not in runs:
            raise ValueError(f"{spec_path}: same_arms names {name!r}, which {where}/evaluate has no per-document scores for")
    reference = str(spec["reference"])
    ref_first = next((a for a, b in same.items() if b == reference), None)
    if ref_first is None:
        raise ValueError(f"{spec_path}: reference {reference!r} is not a second-run arm of same_arms")
    arms = [first[a] for a in same] + [second[b] for b in same.values()]
    tasks = sorted(set.intersection(*(set(arm) for arm in arms)))

    def row(kind: str, name: str, first_terms: list, second_terms: list) -> dict:
        one, two = paired_contrast(first_terms, tasks), paired_contrast(second_terms, tasks)
        change = paired_contrast(second_terms + [(-w, arm) for w, arm in first_terms], tasks)
        pooled = paired_contrast([(w / 2, arm) for w, arm in first_terms + second_terms], tasks)
        if None in (one, two, change, pooled):
            raise ValueError(f"{spec_path}: {name}: the two runs did not score the same documents")
        return {"kind": kind, "arm": name, "first": one[0], "first_stderr": one[1], "second": two[0],
                "second_stderr": two[1], "change": change[0], "change_stderr": change[1],
                "z": change[0] / change[1] if change[1] else float("nan"), "pooled": pooled[0],
                "pooled_stderr": pooled[1]}

    rows = [{**row("accuracy", b, [(1.0, first[a])], [(1.0, second[b])]), **document_agreement(first[a], second[b], tasks)}
            for a, b in same.items()]
    rows += [row(f"minus {reference}", b, [(1.0, first[a]), (-1.0, first[ref_first])],
                 [(1.0, second[b]), (-1.0, second[reference])]) for a, b in same.items() if b != reference]
    table = pd.DataFrame(rows)
    table.attrs["tasks"] = tasks
    return table


def document_agreement(a: dict[str, str], b: dict[str, str], tasks: list[str]) -> dict[str, float]:
    """Share of documents two arms answer alike (both right or both wrong), mean over `tasks`, and
    the share expected of independent answers at the same accuracies: far above it, the two
    per-document records are aligned (the same documents in the same order)."""
    import numpy as np

    same, independent = [], []
    for task in tasks:
        x, y = (np.frombuffer(arm[task].encode(), dtype=np.uint8) == ord("1") for arm in (a, b))
        same.append(float(np.mean(x == y)))
        independent.append(float(x.mean() * y.mean() + (1 - x.mean()) * (1 - y.mean())))
    return {"agreement": float(np.mean(same)), "agreement_if_independent": float(np.mean(independent))}


def plot_replicates(table: "pd.DataFrame", path: Path) -> None:
    """Each run's value beside the other's, with paired 2-standard-error bars: the arms' accuracies
    (left) and their differences from the reference arm (right), one row of `replicate_table` each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.provenance import atomic_path

    kinds = list(dict.fromkeys(table["kind"]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rows = table[table["kind"] == kind].reset_index(drop=True)
        for offset, run, color in ((-0.15, "first", "tab:blue"), (0.15, "second", "tab:orange")):
            ax.errorbar(rows.index + offset, 100 * rows[run], yerr=200 * rows[f"{run}_stderr"], fmt="o",
                        color=color, capsize=3, label=f"{run} run")
        for i, row in rows.iterrows():      # above both error bars
            top = 100 * max(row["first"] + 2 * row["first_stderr"], row["second"] + 2 * row["second_stderr"])
            ax.annotate(f"z {row['z'] + 0.0:+.1f}", (i, top), textcoords="offset points", xytext=(0, 4),
                        ha="center", fontsize=7)
        if kind != "accuracy":
            ax.axhline(0.0, color="black", linewidth=0.8, linestyle="dotted")
        ax.set_xticks(rows.index, rows["arm"], rotation=25, ha="right", fontsize=7)
        ax.set_ylabel("task-averaged accuracy, %" if kind == "accuracy" else f"{kind}, points")
        ax.set_title(kind, fontsize=9)
        ax.margins(y=0.15)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("one recipe, two base models: bars are 2 paired standard errors; z = change / its error", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def summarise_arms(results_dir: Path, figures_dir: Path) -> None:
    """From `results_dir/evaluate/*.json` (committed GPU results): `tables/accuracy.csv` (arms x
    tasks with averages, the paper's layout), `tables/verdicts.json` and `figures_dir/accuracy.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.provenance import atomic_path, write_csv

    results_dir, figures_dir = Path(results_dir), Path(figures_dir)
    table = arms_accuracy_table(results_dir / "evaluate")
    per_doc = load_per_doc(results_dir / "evaluate")
    meta = provenance(None, None, stage="summarise", source=str(results_dir / "evaluate"))
    write_csv(results_dir / "tables" / "accuracy.csv", table, meta)
    write_json(results_dir / "tables" / "verdicts.json",
               {"provenance": meta, "verdicts": claim_verdicts(table, per_doc)})
    tasks = [c for c in table.columns if f"{c}_stderr" in table.columns and c != "average"]
    arms = table[table["arm"] != "chance"]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(tasks) + 2), 5))
    width = 0.8 / max(1, len(arms))
    colors = plt.get_cmap("tab20").colors          # 20 distinct colours: a full grid has 14-16 arms
    for i, (_, row) in enumerate(arms.iterrows()):
        xs = [t + i * width for t in range(len(tasks) + 1)]
        ax.bar(xs, [row[t] for t in tasks] + [row["average"]], width, color=colors[i % len(colors)],
               yerr=[row[f"{t}_stderr"] for t in tasks] + [row["average_stderr"]], label=row["arm"], capsize=1)
    chance = table[table["arm"] == "chance"].iloc[0]
    for t, task in enumerate(tasks + ["average"]):
        ax.hlines(chance[task], t - 0.1, t + 0.9, colors="black", linestyles="dotted")
    ax.set_xticks([t + 0.4 for t in range(len(tasks) + 1)], tasks + ["average"], rotation=30, ha="right")
    ax.set_ylabel("accuracy (dotted: chance)")
    ax.set_title(f"{', '.join(UNAVAILABLE_TASKS)}: {NOT_AVAILABLE}, not substituted", fontsize=8, loc="left")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    with atomic_path(figures_dir / "accuracy.png") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
