"""The quality claims pooled over base models, per model family (`verdicts_pooled.csv`).

One quality run fine-tunes every arm from one base model. A second base model of the same recipe
moves single comparisons by about as much as the test's own per-document noise
(`tables/replicates.csv` of quality_upcycle_v4), so each claim is measured on every base model of a
family and pooled with the base models as a random effect.

Per base model b, a claim's contrast y_b (percentage points of the task-averaged accuracy: e.g. the
mean of the N_d = 2 arms minus standard fine-tuning) and its paired standard error s_b (every arm of
b answered the same documents: `occult.report.quality.paired_contrast`). Model:
y_b = mu + u_b + e_b, u_b ~ N(0, tau^2) the base model's own effect, e_b ~ N(0, s_b^2).
DerSimonian-Laird: w_b = 1 / s_b^2, y_FE = sum w_b y_b / sum w_b, Q = sum w_b (y_b - y_FE)^2,
tau^2 = max(0, (Q - (B - 1)) / (sum w_b - sum w_b^2 / sum w_b)); then w*_b = 1 / (s_b^2 + tau^2),
mu = sum w*_b y_b / sum w*_b, SE(mu) = 1 / sqrt(sum w*_b) (an s_b of 0, arms that answered every document alike, counts as
MIN_STDERR_PP). Columns: `estimate_pp` = mu, `stderr_pp` =
SE(mu) (per-document errors and the between-base variance together), `between_base_sd_pp` = tau
(the spread of the per-base estimates beyond their own errors; empty with one base model),
`base_models` = B. With one base model, mu = y_1 and SE = s_1.

Verdicts (`verdict`), on the interval [lo, hi] = mu -/+ 2 SE(mu) and the margin M = MARGIN_PP:
- `near` claims (N_d = 2 keeps quality near SFT): holds if lo > -M; does not hold if hi < -M;
- `below` claims (N_d = 1 hurts): holds if hi < 0; does not hold if lo > -M (any loss is smaller
  than the margin);
- `above` claims (similarity beats router, SFT beats the raw model): holds if lo > 0; does not hold
  if hi < M (no gain as large as the margin);
- `either` (renormalised against kept gates): "<a> better" if lo > 0, "<b> better" if hi < 0, "no
  difference beyond the margin" if -M < lo and hi < M;
- otherwise `not settled`; and `mixed` whenever two base models are each beyond 2 s_b from zero
  with opposite signs (the base model decides the sign). With one base model the verdict gets the
  suffix "(one base model)".

Inputs: run folders laid out as a quality run (`evaluate/<arm>.json` with per-document scores), a
spec YAML naming them per family (`--spec`), or one family's folders (`--family F --runs DIR...`).
A spec may rename a run's arms (`rename: {file arm: arm it is}`), for runs whose arm names meant
another setting at the time.

Each family's rows also carry how far its base models' routing follows the expert groups of
virtual-group upcycling (`inheritance_index`: the mean over base models of the held-out layer-mean
index of `occult.routing.inheritance`, 0 = random, 1 = every token in one group;
`inheritance_basis`: `inherited` for virtual-group models, `reference` for models without initial
groups; `inheritance_base_models`: how many base models had a table; NaN and 0 where none had),
and the held-out perplexity its base models ended pre-training at (`base_heldout_ppl`: their mean,
from each run's `model/pretrain_log.csv`; per base model in the per-base table; NaN where a run has
no log), so that families of different quality are not compared unawares.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from occult.logs import ENV_LOG_JSON, run_main

MARGIN_PP = 1.0
MIN_STDERR_PP = 1e-6
COLUMNS = ["model_family", "claim", "estimate_pp", "stderr_pp", "between_base_sd_pp", "base_models", "verdict"]
INHERITANCE_COLUMNS = ["inheritance_index", "inheritance_basis", "inheritance_base_models"]
FAMILY_COLUMNS = INHERITANCE_COLUMNS + ["base_heldout_ppl"]
BASE_COLUMNS = ["model_family", "claim", "base_model", "estimate_pp", "stderr_pp", "base_heldout_ppl"]
PRETRAIN_LOG = "model/pretrain_log.csv"
INHERITANCE_FILES = ("tables/inheritance.csv", "placement/inheritance.csv")
KINDS = ("near", "below", "above", "either")


@dataclass(frozen=True)
class Claim:
    """A contrast of arms (weights summing to zero) and how its sign is read."""

    name: str
    kind: str
    terms: tuple[tuple[float, str], ...]
    labels: tuple[str, str] = ("", "")      # `either`: the two sides' names


def claims_at(devices: int) -> list[Claim]:
    """The pooled claims at D = `devices`, MoE-only fine-tuning (arm names of
    `occult.routing.variants.quality_arms`)."""
    d = devices

    def arm(nd: int, method: str, gate: str = "keep") -> str:
        return f"prune{nd}-{method}-D{d}-{gate}-moe"

    return [
        Claim("N_d=2 near SFT (kept gates)", "near",
              ((0.5, arm(2, "router")), (0.5, arm(2, "sim")), (-1.0, "sft-moe"))),
        Claim("N_d=1 hurts (kept gates)", "below",
              ((0.5, arm(1, "router")), (0.5, arm(1, "sim")), (-1.0, "sft-moe"))),
        Claim("similarity beats router (kept gates)", "above",
              ((0.5, arm(2, "sim")), (-0.5, arm(2, "router")), (0.5, arm(1, "sim")), (-0.5, arm(1, "router")))),
        Claim("N_d=2 near SFT (similarity, renormalised gates)", "near",
              ((1.0, arm(2, "sim", "renormalise")), (-1.0, "sft-moe"))),
        Claim("N_d=1 hurts (similarity, renormalised gates)", "below",
              ((1.0, arm(1, "sim", "renormalise")), (-1.0, "sft-moe"))),
        Claim("renormalised against kept gates", "either",
              ((0.5, arm(2, "sim", "renormalise")), (-0.5, arm(2, "sim")),
               (0.5, arm(1, "sim", "renormalise")), (-0.5, arm(1, "sim"))), ("renormalised", "kept")),
        Claim("SFT beats the raw model", "above", ((1.0, "sft-moe"), (-1.0, "raw"))),
    ]


# --------------------------------------------------------------------------- pooling and verdicts


def pool(estimates: list[float], stderrs: list[float]) -> tuple[float, float, float]:
    """(mu, SE(mu), tau) by DerSimonian-Laird (module docstring); tau is NaN for one estimate."""
    if not estimates or len(estimates) != len(stderrs):
        raise ValueError("pool: need one standard error per estimate, at least one")
    y, s = np.asarray(estimates, dtype=float), np.asarray(stderrs, dtype=float)
    if (s < 0).any() or not np.isfinite(s).all():
        raise ValueError(f"pool: standard errors must be finite and not negative, got {s.tolist()}")
    s = np.maximum(s, MIN_STDERR_PP)        # 0: the arms answered every document alike
    if len(y) == 1:
        return float(y[0]), float(s[0]), float("nan")
    w = 1.0 / s**2
    fixed = float((w * y).sum() / w.sum())
    q = float((w * (y - fixed) ** 2).sum())
    tau2 = max(0.0, (q - (len(y) - 1)) / float(w.sum() - (w**2).sum() / w.sum()))
    w_star = 1.0 / (s**2 + tau2)
    return float((w_star * y).sum() / w_star.sum()), float(1.0 / math.sqrt(w_star.sum())), math.sqrt(tau2)


def verdict(claim: Claim, estimate: float, stderr: float, per_base: list[tuple[float, float]]) -> str:
    """The verdict of one pooled claim (module docstring)."""
    significant = {np.sign(y) for y, s in per_base if abs(y) > 2 * s}
    if len(per_base) > 1 and {1.0, -1.0} <= significant:
        return "mixed"
    lo, hi, m = estimate - 2 * stderr, estimate + 2 * stderr, MARGIN_PP
    if claim.kind == "near":
        text = "holds" if lo > -m else "does not hold" if hi < -m else "not settled"
    elif claim.kind == "below":
        text = "holds" if hi < 0 else "does not hold" if lo > -m else "not settled"
    elif claim.kind == "above":
        text = "holds" if lo > 0 else "does not hold" if hi < m else "not settled"
    elif claim.kind == "either":
        a, b = claim.labels
        text = (f"{a} better" if lo > 0 else f"{b} better" if hi < 0 else
                "no difference beyond the margin" if -m < lo and hi < m else "not settled")
    else:
        raise ValueError(f"claim {claim.name!r}: kind {claim.kind!r} is not one of {', '.join(KINDS)}")
    return text + (" (one base model)" if len(per_base) == 1 else "")


# --------------------------------------------------------------------------- reading runs


@dataclass(frozen=True)
class BaseModel:
    """One base model's run folder, and the renames of its arm files."""

    run: Path
    rename: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return self.run.name


def load_arms(base: BaseModel) -> dict[str, dict[str, str]]:
    """arm -> task -> per-document correctness of a run (after its renames)."""
    from occult.report.quality import load_per_doc

    eval_dir = base.run / "evaluate"
    if not eval_dir.is_dir():
        raise FileNotFoundError(f"{eval_dir}: no such folder of evaluations")
    arms = load_per_doc(eval_dir)
    renamed = dict(base.rename)
    for old in renamed:
        if old not in arms:
            raise ValueError(f"{base.run}: rename names {old!r}, which has no per-document scores there")
    out = {renamed.get(arm, arm): docs for arm, docs in arms.items() if arm not in renamed}
    for old, new in renamed.items():
        if new in out:
            raise ValueError(f"{base.run}: rename {old!r} -> {new!r} collides with an arm of that name")
        out[new] = arms[old]
    return out


def base_estimate(claim: Claim, arms: dict[str, dict[str, str]]) -> tuple[float, float] | None:
    """(contrast, paired standard error) in points on the tasks every arm of the claim answered;
    None where the run lacks an arm of the claim."""
    from occult.report.quality import paired_contrast

    if any(name not in arms for _, name in claim.terms):
        return None
    tasks = sorted(set.intersection(*(set(arms[name]) for _, name in claim.terms)))
    result = paired_contrast([(w, arms[name]) for w, name in claim.terms], tasks)
    if result is None:
        raise ValueError(f"claim {claim.name!r}: its arms did not answer the same documents")
    return 100.0 * result[0], 100.0 * result[1]


def run_inheritance(run: Path) -> tuple[float, str] | None:
    """(held-out layer-mean inheritance index, basis) from a run's inheritance table
    (`occult.routing.inheritance`: `tables/inheritance.csv` of a committed run,
    `placement/inheritance.csv` of a base model's folder); None where the run has none."""
    path = next((run / name for name in INHERITANCE_FILES if (run / name).is_file()), None)
    if path is None:
        return None
    table = pd.read_csv(path, comment="#", dtype={"layer": str})
    means = table[table["layer"] == "mean"]
    if "split" in means.columns and (means["split"] == "heldout").any():
        means = means[means["split"] == "heldout"]
    if means.empty:
        raise ValueError(f"{path}: no layer 'mean' row (occult.routing.inheritance writes one per split)")
    return float(means["inheritance_index"].iloc[0]), str(means["basis"].iloc[0])


def final_heldout_ppl(run: Path) -> float:
    """The held-out perplexity of a run's base model at its last evaluation in pre-training
    (`model/pretrain_log.csv`, column `heldout_ppl`); NaN where the run keeps no such log."""
    path = run / PRETRAIN_LOG
    if not path.is_file():
        return float("nan")
    log = pd.read_csv(path)
    if "heldout_ppl" not in log.columns:
        raise ValueError(f"{path}: no column 'heldout_ppl' (occult.stages.pretrain writes one)")
    values = log["heldout_ppl"].dropna()
    if values.empty:
        raise ValueError(f"{path}: column 'heldout_ppl' has no value")
    return float(values.iloc[-1])


def family_inheritance(bases: list[BaseModel]) -> dict[str, float | str | int]:
    """The `INHERITANCE_COLUMNS` of a family: the mean held-out inheritance index over the base
    models that have a table, their basis (`inherited`, `reference`, or `mixed`) and how many."""
    found = [r for r in (run_inheritance(base.run) for base in bases) if r is not None]
    if not found:
        return {"inheritance_index": float("nan"), "inheritance_basis": "", "inheritance_base_models": 0}
    bases_seen = {basis for _, basis in found}
    return {"inheritance_index": float(np.mean([index for index, _ in found])),
            "inheritance_basis": bases_seen.pop() if len(bases_seen) == 1 else "mixed",
            "inheritance_base_models": len(found)}


def pooled_tables(families: dict[str, list[BaseModel]], devices: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the pooled table in `COLUMNS` + `FAMILY_COLUMNS`, the per-base estimates in
    `BASE_COLUMNS`); a claim no base model of a family measured is left out for that family. The
    family columns repeat on every row of a family: how far its base models' routing still follows
    the virtual groups (`run_inheritance`) and the perplexity they ended pre-training at."""
    rows, base_rows = [], []
    for family, bases in families.items():
        ppl = {base.name: final_heldout_ppl(base.run) for base in bases}
        with_ppl = [v for v in ppl.values() if not math.isnan(v)]
        family_values = {**family_inheritance(bases),
                         "base_heldout_ppl": float(np.mean(with_ppl)) if with_ppl else float("nan")}
        loaded = [(base, load_arms(base)) for base in bases]
        for claim in claims_at(devices):
            per_base = []
            for base, arms in loaded:
                found = base_estimate(claim, arms)
                if found is not None:
                    per_base.append(found)
                    base_rows.append({"model_family": family, "claim": claim.name, "base_model": base.name,
                                      "estimate_pp": found[0], "stderr_pp": found[1],
                                      "base_heldout_ppl": ppl[base.name]})
            if not per_base:
                continue
            mu, se, tau = pool([y for y, _ in per_base], [s for _, s in per_base])
            rows.append({"model_family": family, "claim": claim.name, "estimate_pp": mu, "stderr_pp": se,
                         "between_base_sd_pp": tau, "base_models": len(per_base),
                         "verdict": verdict(claim, mu, se, per_base), **family_values})
    return (pd.DataFrame(rows, columns=COLUMNS + FAMILY_COLUMNS),
            pd.DataFrame(base_rows, columns=BASE_COLUMNS))


def read_spec(path: Path) -> tuple[dict[str, list[BaseModel]], int]:
    """`families: {family: [{run: DIR, rename: {...}}, ...]}` and `devices: D` from a spec YAML;
    relative run folders are relative to the working directory (the repository)."""
    import yaml

    spec = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(spec.get("families"), dict) or not spec["families"]:
        raise ValueError(f"{path}: missing field 'families' (family -> list of runs)")
    devices = spec.get("devices")
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"{path}: field 'devices' must be the D of the pruned arms, a whole number")
    families = {}
    for family, runs in spec["families"].items():
        if not isinstance(runs, list) or not runs:
            raise ValueError(f"{path}: families.{family} must list at least one run")
        bases = []
        for i, entry in enumerate(runs):
            if not isinstance(entry, dict) or "run" not in entry:
                raise ValueError(f"{path}: families.{family}[{i}] has no 'run'")
            rename = entry.get("rename") or {}
            bases.append(BaseModel(Path(entry["run"]), tuple((str(a), str(b)) for a, b in rename.items())))
        families[str(family)] = bases
    return families, devices


def spec_runs(path: Path) -> list[Path]:
    """The run folders a spec names (for the workflow's inputs)."""
    families, _ = read_spec(path)
    return [base.run for bases in families.values() for base in bases]


# --------------------------------------------------------------------------- the figure


def plot_pooled(table: pd.DataFrame, bases: pd.DataFrame, path: Path) -> None:
    """Per family, each claim's contrast on each base model (2 paired standard errors) and pooled:
    the inner bar is the per-document error alone (fixed-effect), the outer one adds the spread
    between base models (random effects); dotted: zero and -/+ the margin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from occult.provenance import atomic_path

    families = list(dict.fromkeys(table["model_family"]))
    widest = max(int((table["model_family"] == f).sum()) for f in families)
    fig, axes = plt.subplots(1, len(families), figsize=((1.3 * widest + 2) * len(families), 5.2), squeeze=False,
                             sharey=True)
    colors = plt.get_cmap("tab10").colors
    for ax, family in zip(axes[0], families):
        rows = table[table["model_family"] == family].reset_index(drop=True)
        mine = bases[bases["model_family"] == family]
        names = sorted(set(mine["base_model"]))
        offsets = np.linspace(-0.3, 0.0, len(names)) if len(names) > 1 else [-0.15]
        labelled: set[str] = set()
        for i, row in rows.iterrows():
            own = mine[mine["claim"] == row["claim"]]
            for j, base in enumerate(names):
                hit = own[own["base_model"] == base]
                if len(hit):
                    ax.errorbar(i + offsets[j], hit["estimate_pp"].iloc[0], yerr=2 * hit["stderr_pp"].iloc[0], fmt="o",
                                ms=4, color=colors[j % 10], capsize=2, label=None if base in labelled else base)
                    labelled.add(base)
            fixed_se = 1.0 / math.sqrt((1.0 / own["stderr_pp"] ** 2).sum())
            ax.errorbar(i + 0.25, row["estimate_pp"], yerr=2 * row["stderr_pp"], fmt="none", color="black",
                        capsize=4, linewidth=1)
            ax.errorbar(i + 0.25, row["estimate_pp"], yerr=2 * fixed_se, fmt="D", color="black", ms=5,
                        capsize=0, linewidth=3, label="pooled" if i == 0 else None)
            tau = row["between_base_sd_pp"]
            if not pd.isna(tau):
                ax.annotate(f"tau {tau:.2f}", (i + 0.25, row["estimate_pp"] + 2 * row["stderr_pp"]),
                            xytext=(0, 3), textcoords="offset points", ha="center", fontsize=6)
        for level in (0.0, -MARGIN_PP, MARGIN_PP):
            ax.axhline(level, color="grey", linewidth=0.8, linestyle="dotted" if level else "-")
        labels = [f"{claim}\n[{text}]" for claim, text in zip(rows["claim"], rows["verdict"])]
        ax.set_xticks(rows.index, labels, rotation=35, ha="right", fontsize=6)
        ax.set_title(f"{family}: {len(names)} base model(s)", fontsize=9)
        ax.set_ylabel("contrast, points of task-averaged accuracy")
        ax.legend(fontsize=6, loc="best")
    fig.suptitle("bars: 2 standard errors; pooled: inner = per-document error, outer = with the spread "
                 "between base models", fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """`python -m occult.report.quality_pooled (--spec YAML | --family F --runs DIR [DIR ...] [--devices D])
    --out CSV [--figure PNG]`; the per-base estimates go beside the CSV (`<stem>_bases.csv`)."""
    from occult.provenance import provenance, write_csv

    parser = argparse.ArgumentParser(prog="python -m occult.report.quality_pooled", description=main.__doc__)
    parser.add_argument("--spec", type=Path, help="YAML: devices and families -> runs (with renames)")
    parser.add_argument("--family", help="the family of --runs")
    parser.add_argument("--runs", type=Path, nargs="+", help="run folders of one family, one per base model")
    parser.add_argument("--devices", type=int, default=8, help="D of the pruned arms (with --runs)")
    parser.add_argument("--out", type=Path, required=True, metavar="CSV")
    parser.add_argument("--figure", type=Path, metavar="PNG")
    parser.add_argument("--log-json", metavar="PATH", help=f"append JSON-lines logs here (default: ${ENV_LOG_JSON})")
    args = parser.parse_args(argv)
    if args.spec is not None and (args.family or args.runs):
        parser.error("give --spec or --family with --runs, not both")
    if args.spec is not None:
        families, devices = read_spec(args.spec)
    elif args.family and args.runs:
        families, devices = {args.family: [BaseModel(run) for run in args.runs]}, args.devices
    else:
        parser.error("give --spec, or --family with --runs")
    table, bases = pooled_tables(families, devices)
    if table.empty:
        raise ValueError("no claim could be measured: the runs lack the arms of every claim at "
                         f"D = {devices} (occult.report.quality_pooled.claims_at)")
    meta = provenance(None, None, stage="quality_pooled", devices=devices, margin_pp=MARGIN_PP,
                      families={f: [str(b.run) for b in bs] for f, bs in families.items()},
                      claims={c.name: {"kind": c.kind, "terms": [list(t) for t in c.terms]} for c in claims_at(devices)})
    write_csv(args.out, table, meta)
    write_csv(args.out.with_name(f"{args.out.stem}_bases.csv"), bases, meta)
    if args.figure is not None:
        plot_pooled(table, bases, args.figure)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("quality_pooled", main, output_flags=("--out", "--figure")))
