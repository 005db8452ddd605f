"""The paper's claims beside ours: one table and one figure, computed from committed result files.

A spec (YAML, `results/paper/claims_spec.yaml`) lists the claims. Each names the paper's value, its
unit and where in the paper it stands; the runs that measure it (`latest`, then the `earlier` runs
of the same point on the same kind of machine); a `measure` that reads one number from a run's
files; a test (`holds_if`) that says whether a reading bears the claim out; and how the spread is
taken (`spread`: over the runs, or over the values of one column such as the layer or the shape).
Only the paper's numbers are typed in the spec; every number of ours is read here from the files.

Measures (a mapping with one key):
- `point: {file, where, column}`: the median of `column` over the rows of `<run>/<file>` matching
  `where` (column -> value or list of values); the median folds a run's replicate rows into one.
- `ratio: [measure, measure]`: the first divided by the second.
- `correlation: {file, where, x, y}`: Pearson's r of columns x and y over the matching rows.
- `pooled: {claim, expect, file}`: a quality claim pooled over base models, read from each run's
  `file` (default `tables/verdicts_pooled.csv`, `occult.report.quality_pooled`) by
  `occult.report.claims_pooled`: the deciding model family's row (`drop` before `virtual_groups`)
  gives the value (`estimate_pp`), the spread (`±stderr_pp; between-base SD ... over B base
  models`) and the verdict (`claims_pooled.claim_verdict`; `expect`, for a two-sided claim only, is
  the outcome it predicts); the other families' rows go into the note. No `holds_if`, `spread` or
  `reference`: the pooled verdict is the test.

Verdicts of the other measures: `reproduced` when every reading (each run, or each value of the
spread column) passes the test, `refuted` when none does, `mixed` otherwise; `not measurable here`
for a claim without runs, whose `unmeasured` text says why and which run would settle it.

CLI: `python -m occult.report.claims --spec SPEC --out CSV --figure PNG`.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from occult.report.claims_pooled import POOLED_FILE, pooled_reading, read_table

COLUMNS = ("claim", "paper_value", "our_value", "our_spread", "unit", "source_run", "source_file", "verdict", "note")
VERDICTS = ("reproduced", "refuted", "mixed", "not measurable here")
MEASURES = ("point", "ratio", "correlation", "pooled")
CLAIM_FIELDS = {"id", "claim", "unit", "paper", "latest", "earlier", "measure", "holds_if", "reference", "spread",
                "note", "unmeasured"}


class SpecError(ValueError):
    """The spec is malformed: the message names the claim and the field."""


@dataclass(frozen=True)
class Reading:
    """One number read from one run and the files it came from."""

    value: float
    files: tuple[str, ...]


@dataclass(frozen=True)
class Claim:
    id: str
    claim: str
    unit: str
    paper_value: float | None
    paper_source: str
    latest: str | None = None
    earlier: tuple[str, ...] = ()
    measure: dict | None = None
    holds_if: dict | None = None
    reference: dict | None = None
    spread: dict | None = None
    note: str = ""
    unmeasured: str = ""

    @property
    def runs(self) -> tuple[str, ...]:
        return ((self.latest,) if self.latest else ()) + tuple(r for r in self.earlier if r != self.latest)


@dataclass
class Row:
    values: dict[str, Any] = field(default_factory=dict)
    readings: list[float] = field(default_factory=list)
    threshold: float | None = None


# --------------------------------------------------------------------------------------------- spec


def load_spec(path: str | Path) -> list[Claim]:
    """The claims of a spec file, each checked; a bad field raises SpecError naming claim and field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: claims spec not found")
    raw = yaml.safe_load(path.read_text()) or {}
    entries = raw.get("claims") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise SpecError(f"{path}: 'claims' must be a non-empty list")
    claims, seen = [], set()
    for index, entry in enumerate(entries):
        claim = _claim(entry, f"{path}: claims[{index}]")
        if claim.id in seen:
            raise SpecError(f"{path}: claim id {claim.id!r} appears twice")
        seen.add(claim.id)
        claims.append(claim)
    return claims


def _claim(entry: Any, where: str) -> Claim:
    if not isinstance(entry, dict):
        raise SpecError(f"{where}: a claim must be a mapping")
    cid = entry.get("id")
    where = f"{where} ({cid})" if cid else where
    unknown = set(entry) - CLAIM_FIELDS
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {sorted(unknown)}")
    for name in ("id", "claim", "unit"):
        if not isinstance(entry.get(name), str) or not entry[name].strip():
            raise SpecError(f"{where}: field '{name}' must be a non-empty string")
    paper = entry.get("paper")
    if not isinstance(paper, dict) or not isinstance(paper.get("source"), str):
        raise SpecError(f"{where}: field 'paper' must be a mapping with a 'source' string (and an optional 'value')")
    value = paper.get("value")
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise SpecError(f"{where}: field 'paper.value' must be a number or absent")
    latest, earlier, spread = entry.get("latest"), entry.get("earlier") or [], entry.get("spread")
    if not isinstance(earlier, list) or not all(isinstance(r, str) for r in earlier):
        raise SpecError(f"{where}: field 'earlier' must be a list of run folders")
    if latest is None:
        if earlier or entry.get("measure"):
            raise SpecError(f"{where}: field 'latest' is missing (runs or a measure are given)")
        if not isinstance(entry.get("unmeasured"), str) or not entry["unmeasured"].strip():
            raise SpecError(f"{where}: a claim without runs needs field 'unmeasured' (why, and which run would settle it)")
    else:
        if not isinstance(latest, str):
            raise SpecError(f"{where}: field 'latest' must be a run folder")
        _check_measure(entry.get("measure"), f"{where}: field 'measure'")
        is_pooled = "pooled" in entry["measure"]
        if is_pooled:
            for name in ("holds_if", "spread", "reference"):
                if entry.get(name) is not None:
                    raise SpecError(f"{where}: field '{name}' must be absent for a pooled measure "
                                    "(its verdict is the test)")
        else:
            _check_test(entry.get("holds_if"), f"{where}: field 'holds_if'", entry.get("reference") is not None)
        if entry.get("reference") is not None:
            ref = entry["reference"]
            if (not isinstance(ref, dict) or not isinstance(ref.get("label"), str)
                    or len({"where", "measure"} & set(ref)) != 1):
                raise SpecError(f"{where}: field 'reference' must be a mapping with 'label' and one of 'where' "
                                "(the measure with these selections) or 'measure'")
            if "measure" in ref:
                _check_measure(ref["measure"], f"{where}: field 'reference.measure'")
            elif not isinstance(ref["where"], dict):
                raise SpecError(f"{where}: field 'reference.where' must be a mapping")
        if spread is not None and (not isinstance(spread, dict) or not isinstance(spread.get("column"), str)):
            raise SpecError(f"{where}: field 'spread' must be absent (spread over the runs) or a mapping with 'column'")
    return Claim(id=entry["id"], claim=entry["claim"].strip(), unit=entry["unit"], paper_value=value,
                 paper_source=paper["source"], latest=latest, earlier=tuple(earlier), measure=entry.get("measure"),
                 holds_if=entry.get("holds_if"), reference=entry.get("reference"), spread=spread,
                 note=str(entry.get("note") or "").strip(), unmeasured=str(entry.get("unmeasured") or "").strip())


def _check_measure(measure: Any, where: str) -> None:
    if not isinstance(measure, dict) or len(measure) != 1 or next(iter(measure)) not in MEASURES:
        raise SpecError(f"{where}: must be a mapping with exactly one of {list(MEASURES)}")
    kind, body = next(iter(measure.items()))
    if kind == "ratio":
        if not isinstance(body, list) or len(body) != 2:
            raise SpecError(f"{where}.ratio: must be a list of two measures")
        for i, part in enumerate(body):
            _check_measure(part, f"{where}.ratio[{i}]")
            if "pooled" in part:
                raise SpecError(f"{where}.ratio[{i}]: a pooled measure cannot be part of a ratio")
        return
    needed = {"point": ("file", "column"), "correlation": ("file", "x", "y"), "pooled": ("claim",)}[kind]
    if not isinstance(body, dict) or any(not isinstance(body.get(k), str) for k in needed):
        raise SpecError(f"{where}.{kind}: needs string field(s) {list(needed)}")
    if kind == "pooled":
        unknown = set(body) - {"claim", "expect", "file"}
        if unknown:
            raise SpecError(f"{where}.pooled: unknown field(s) {sorted(unknown)}; expected claim, expect, file")
        if any(body.get(k) is not None and not isinstance(body[k], str) for k in ("expect", "file")):
            raise SpecError(f"{where}.pooled: 'expect' and 'file' must be strings")
    elif not isinstance(body.get("where", {}), dict):
        raise SpecError(f"{where}.{kind}.where: must be a mapping of column -> value(s)")


def _check_test(test: Any, where: str, has_reference: bool) -> None:
    if not isinstance(test, dict) or len(test) != 1 or next(iter(test)) not in ("above", "below"):
        raise SpecError(f"{where}: must be {{above: X}} or {{below: X}}, X a number or 'reference'")
    bound = next(iter(test.values()))
    if bound == "reference":
        if not has_reference:
            raise SpecError(f"{where}: compares with 'reference', but the claim has no 'reference'")
    elif isinstance(bound, bool) or not isinstance(bound, (int, float)):
        raise SpecError(f"{where}: the bound must be a number or 'reference'")


# ------------------------------------------------------------------------------------------ inputs


def measure_files(measure: dict, run: str) -> list[str]:
    """The files a measure reads in `run`."""
    kind, body = next(iter(measure.items()))
    if kind == "ratio":
        return [f for part in body for f in measure_files(part, run)]
    if kind == "pooled":
        return [str(Path(run) / body.get("file", POOLED_FILE))]
    return [str(Path(run) / body["file"])]


def spec_inputs(spec: str | Path) -> list[str]:
    """Every file the claims of `spec` read, for the rule's input (missing ones are Snakemake's to name)."""
    files = []
    for claim in load_spec(spec):
        for run in claim.runs:
            files += measure_files(claim.measure, run)
            if claim.reference and "measure" in claim.reference:
                files += measure_files(claim.reference["measure"], run)
    return list(dict.fromkeys(files))


# ------------------------------------------------------------------------------------------ reading


@functools.lru_cache(maxsize=None)
def _table(path: str) -> pd.DataFrame:
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: result file not found")
    return pd.read_csv(path, comment="#", low_memory=False)


def _matching(path: str, where: dict) -> pd.DataFrame:
    frame = _table(path)
    keep = pd.Series(True, index=frame.index)
    for column, wanted in where.items():
        if column not in frame.columns:
            raise ValueError(f"{path}: no column {column!r} (asked for by 'where')")
        values = wanted if isinstance(wanted, list) else [wanted]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            keep &= pd.to_numeric(frame[column], errors="coerce").isin(values)
        else:
            keep &= frame[column].astype(str).isin([str(v) for v in values])
    rows = frame[keep]
    if rows.empty:
        raise ValueError(f"{path}: no rows where {where}")
    return rows


def _override(measure: dict, where: dict) -> dict:
    """The measure with `where` entries replaced (every part of a ratio)."""
    kind, body = next(iter(measure.items()))
    if kind == "ratio":
        return {"ratio": [_override(part, where) for part in body]}
    return {kind: {**body, "where": {**body.get("where", {}), **where}}}


def read(measure: dict, run: str) -> Reading:
    """One reading of `measure` from the files of `run`."""
    kind, body = next(iter(measure.items()))
    if kind == "ratio":
        top, bottom = (read(part, run) for part in body)
        if bottom.value == 0:
            raise ValueError(f"{', '.join(bottom.files)}: the ratio's denominator is 0")
        return Reading(top.value / bottom.value, top.files + bottom.files)
    if kind == "pooled":
        raise ValueError(f"{run}: a pooled measure is read whole by evaluate_pooled, not as one reading")
    path = str(Path(run) / body["file"])
    rows = _matching(path, body.get("where", {}))
    if kind == "point":
        if body["column"] not in rows.columns:
            raise ValueError(f"{path}: no column {body['column']!r}")
        values = pd.to_numeric(rows[body["column"]], errors="coerce").dropna()
        if values.empty:
            raise ValueError(f"{path}: column {body['column']!r} has no number where {body.get('where', {})}")
        return Reading(float(values.median()), (path,))
    for axis in (body["x"], body["y"]):
        if axis not in rows.columns:
            raise ValueError(f"{path}: no column {axis!r}")
    pairs = rows[[body["x"], body["y"]]].apply(pd.to_numeric, errors="coerce").dropna()
    if len(pairs) < 3 or pairs[body["x"]].nunique() < 2:
        raise ValueError(f"{path}: a correlation needs 3 rows and 2 distinct {body['x']!r} values where {body.get('where', {})}")
    return Reading(float(pairs[body["x"]].corr(pairs[body["y"]])), (path,))


def _spread_values(claim: Claim, run: str) -> list[Any]:
    """The values of the spread column in the run's first file, among the rows the measure selects
    (that column's own selection left out), minus `exclude`."""
    column, exclude = claim.spread["column"], {str(v) for v in claim.spread.get("exclude", [])}
    kind, body = next(iter(claim.measure.items()))
    while kind == "ratio":
        kind, body = next(iter(body[0].items()))
    path = str(Path(run) / body["file"])
    rows = _matching(path, {k: v for k, v in body.get("where", {}).items() if k != column})
    if column not in rows.columns:
        raise ValueError(f"{path}: no column {column!r} (the claim {claim.id!r} spreads over it)")
    values = [v for v in dict.fromkeys(rows[column].tolist()) if str(v) not in exclude]
    return [v.item() if hasattr(v, "item") else v for v in values]


def _reference(claim: Claim, run: str) -> float | None:
    if not claim.reference:
        return None
    if "measure" in claim.reference:
        return read(claim.reference["measure"], run).value
    return read(_override(claim.measure, claim.reference["where"]), run).value


def _passes(claim: Claim, reading: Reading, reference: float | None) -> bool:
    (side, bound), = claim.holds_if.items()
    bound = reference if bound == "reference" else float(bound)
    return reading.value > bound if side == "above" else reading.value < bound


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def evaluate(claim: Claim) -> Row:
    """The table row of one claim (and the readings behind its spread, for the figure)."""
    row = Row(values={"claim": claim.claim, "paper_value": claim.paper_value, "our_value": None, "our_spread": "",
                      "unit": claim.unit, "source_run": claim.latest or "", "source_file": "", "verdict": "",
                      "note": claim.note})
    if not claim.latest:
        row.values.update(verdict="not measurable here", note=_join(claim.note, claim.unmeasured))
        return row
    if "pooled" in claim.measure:
        return evaluate_pooled(claim, row)
    headline = read(claim.measure, claim.latest)
    row.values.update(our_value=headline.value, source_file="; ".join(dict.fromkeys(headline.files)))
    passes, readings, reference_texts = [], [], []
    for run in claim.runs:
        reference = _reference(claim, run)
        if reference is not None:
            reference_texts.append(f"{_fmt(reference)} ({run})")
        if claim.spread:
            members = [read(_override(claim.measure, {claim.spread["column"]: v}), run)
                       for v in _spread_values(claim, run)]
        else:
            members = [read(claim.measure, run)]
        for reading in members:
            readings.append(reading.value)
            passes.append(_passes(claim, reading, reference))
        if run == claim.latest and claim.holds_if:
            bound = next(iter(claim.holds_if.values()))
            row.threshold = reference if bound == "reference" else float(bound)
    row.readings = readings
    what = f"{claim.spread['column']} values" if claim.spread else "runs"
    count = len(readings) if claim.spread else len(claim.runs)
    if claim.spread and len(claim.runs) > 1:
        what = f"readings ({claim.spread['column']} values of {len(claim.runs)} runs)"
    row.values["our_spread"] = (f"[{_fmt(min(readings))}, {_fmt(max(readings))}] over {count} {what}"
                                if len(readings) > 1 else "one run")
    row.values["verdict"] = ("reproduced" if all(passes) else "refuted" if not any(passes) else "mixed")
    extra = []
    if claim.reference:
        label = claim.reference["label"]
        extra.append(f"{label[:1].upper()}{label[1:]}: {', '.join(reference_texts)}")
    if row.values["verdict"] == "mixed":
        extra.append(f"{sum(passes)} of {len(passes)} readings pass the test")
    row.values["note"] = _join(claim.note, *extra)
    return row


def evaluate_pooled(claim: Claim, row: Row) -> Row:
    """The row of a pooled quality claim (`occult.report.claims_pooled`): the deciding family's value,
    spread and verdict; the figure's bar spans its interval estimate -/+ 2 standard errors."""
    body = claim.measure["pooled"]
    tables = []
    for run in claim.runs:
        (path,) = measure_files(claim.measure, run)
        tables.append((run, path, _pooled_table(path)))
    reading = pooled_reading(body["claim"], body.get("expect"), tables)
    test = reading.test
    row.values.update(our_value=test.estimate_pp, our_spread=test.spread, source_run=test.run, source_file=test.file,
                      verdict=reading.verdict, note=_join(claim.note, reading.note))
    row.readings = list(test.interval)
    return row


@functools.lru_cache(maxsize=None)
def _pooled_table(path: str) -> pd.DataFrame:
    return read_table(path)


def _join(*parts: str) -> str:
    return " ".join(p if p.endswith(".") else p + "." for p in parts if p)


def claims_table(claims: list[Claim]) -> tuple[pd.DataFrame, list[Row]]:
    rows = [evaluate(c) for c in claims]
    return pd.DataFrame([r.values for r in rows], columns=list(COLUMNS)), rows


# ------------------------------------------------------------------------------------------ figure

VERDICT_COLORS = {"reproduced": "#2a9d3f", "refuted": "#c0392b", "mixed": "#e08e0b", "not measurable here": "#888888"}


def plot_claims(rows: list[Row], path: Path) -> None:
    """One panel per unit: per claim, the paper's value (black diamond) beside ours (dot coloured by
    the verdict, bar over the spread; pooled quality rows: over the estimate -/+ 2 standard errors);
    a grey tick marks the test's bound where it is a number."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    from matplotlib.lines import Line2D

    from occult.provenance import atomic_path

    units = list(dict.fromkeys(r.values["unit"] for r in rows))
    heights = [sum(r.values["unit"] == u for r in rows) + 1.2 for u in units]
    fig, axes = plt.subplots(len(units), 1, figsize=(9.5, 0.32 * sum(heights) + 1.0), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, unit in zip(axes[:, 0], units):
        part = [r for r in rows if r.values["unit"] == unit]
        for y, row in enumerate(part):
            v = row.values
            color = VERDICT_COLORS[v["verdict"]]
            if v["paper_value"] is not None:
                ax.plot(v["paper_value"], y + 0.15, "D", color="black", ms=5)
            if v["our_value"] is not None:
                if len(row.readings) > 1:
                    ax.hlines(y - 0.15, min(row.readings), max(row.readings), color=color, lw=2.5, alpha=0.6)
                ax.plot(v["our_value"], y - 0.15, "o", color=color, ms=6)
            if row.threshold is not None:
                ax.plot(row.threshold, y, "|", color="grey", ms=14)
        ax.set_yticks(range(len(part)), [_wrap(r.values["claim"]) for r in part], fontsize=7)
        ax.set_ylim(len(part) - 0.4, -0.6)
        shown = [x for r in part for x in (*r.readings, r.values["paper_value"], r.values["our_value"], r.threshold)
                 if x is not None and not (isinstance(x, float) and math.isnan(x))]
        if shown and min(shown) > 0 and max(shown) / min(shown) > 5:
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel(unit, fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(True, axis="x", lw=0.3, alpha=0.5)
    handles = [Line2D([], [], marker="D", color="black", ls="", label="paper"),
               *[Line2D([], [], marker="o", color=c, ls="", label=f"ours: {k}") for k, c in VERDICT_COLORS.items()],
               Line2D([], [], marker="|", color="grey", ls="", ms=10, label="bound of the test")]
    fig.legend(handles=handles, loc="upper center", ncol=4, fontsize=7, bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def _wrap(text: str, width: int = 70) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)[:2])


# --------------------------------------------------------------------------------------------- CLI


def make_claims(spec: Path, out: Path, figure: Path | None) -> pd.DataFrame:
    """Read every claim of `spec`, then write the table (and the figure): nothing is written unless
    every claim could be evaluated."""
    from occult.provenance import provenance, write_csv

    claims = load_spec(spec)
    table, rows = claims_table(claims)
    bad = set(table["verdict"]) - set(VERDICTS)
    if bad:
        raise ValueError(f"{spec}: verdicts outside {VERDICTS}: {sorted(bad)}")
    if figure is not None:
        plot_claims(rows, figure)
    write_csv(out, table, provenance(stage="claims", spec=str(spec),
                                     inputs=sorted({f for c in claims for r in c.runs for f in measure_files(c.measure, r)})))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult.report.claims", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, required=True, help="claims spec (YAML)")
    parser.add_argument("--out", type=Path, required=True, help="the claims table (CSV)")
    parser.add_argument("--figure", type=Path, help="the paper-vs-ours figure (PNG)")
    parser.add_argument("--log-json", metavar="PATH", help="append JSON-lines logs here; read by the entry point")
    args = parser.parse_args(argv)
    table = make_claims(args.spec, args.out, args.figure)
    counts = table["verdict"].value_counts().to_dict()
    print(f"claims: {len(table)} rows ({', '.join(f'{k} {v}' for k, v in counts.items())}) -> {args.out}")
    return 0


if __name__ == "__main__":
    from occult.logs import run_main

    raise SystemExit(run_main("claims", main, output_flags=("--out", "--figure")))
