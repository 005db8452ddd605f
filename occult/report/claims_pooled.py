"""The quality rows of the claims table: verdicts pooled over base models (`verdicts_pooled.csv`).

`occult.report.quality_pooled` writes one row per (model family, claim) with the claim's contrast
pooled over the family's base models (`estimate_pp`, `stderr_pp`, `between_base_sd_pp`,
`base_models`) and its verdict. A claim of the paper names one pooled claim and the runs whose
tables hold it, latest first; each family's row is taken from the first of those tables that has
it. Which family tests the paper's claim (`FAMILY_PRECEDENCE`): `drop`, whose experts start without
the dense model's groups; otherwise `virtual_groups`, whose routing still follows the groups it was
upcycled with (docs/quality.md); otherwise the first other family by name. A family decides only
with at least `MIN_DECIDING_BASE_MODELS` base models; where none has that many, the first family
decides and the row is provisional. The other families' rows are context in the note.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from occult.report.quality_pooled import COLUMNS as POOLED_COLUMNS

POOLED_FILE = "tables/verdicts_pooled.csv"
FAMILY_PRECEDENCE = ("drop", "virtual_groups")
MIN_DECIDING_BASE_MODELS = 2
ONE_BASE_SUFFIX = " (one base model)"
NO_DIFFERENCE = "no difference"
ONE_SIDED = {"holds": "reproduced", "does not hold": "refuted", "mixed": "mixed",
             "not settled": "not measurable here"}


def claim_verdict(pooled: str, expect: str | None = None) -> str:
    """The claims table's verdict for a pooled verdict (`occult.report.quality_pooled.verdict`).

    One-sided claims (near, below, above): `holds` -> reproduced, `does not hold` -> refuted,
    `mixed` (two base models beyond their errors with opposite signs) -> mixed, `not settled` (the
    interval estimate -/+ 2 standard errors leaves the question open at this many documents and
    base models) -> not measurable here. Two-sided claims (`<a> better`, `<b> better`, `no
    difference beyond the margin`, `not settled`, `mixed`): `expect` is the outcome the claim
    predicts, a side's label or "no difference"; that outcome -> reproduced, another -> refuted.
    The suffix "(one base model)" leaves the verdict as it is (the note calls the row provisional).
    """
    text = pooled.strip()
    if text.endswith(ONE_BASE_SUFFIX):
        text = text[: -len(ONE_BASE_SUFFIX)]
    if text in ONE_SIDED:
        if expect is not None and text in ("holds", "does not hold"):
            raise ValueError(f"pooled verdict {pooled!r} is one-sided: 'expect' applies only to two-sided claims")
        return ONE_SIDED[text]
    if text == "no difference beyond the margin":
        outcome = NO_DIFFERENCE
    elif text.endswith(" better") and text[: -len(" better")]:
        outcome = text[: -len(" better")]
    else:
        raise ValueError(f"pooled verdict {pooled!r} is not one of occult.report.quality_pooled's verdicts")
    if expect is None:
        raise ValueError(f"pooled verdict {pooled!r} is two-sided: the claim needs 'expect' "
                         f"(a side's label or {NO_DIFFERENCE!r})")
    return "reproduced" if outcome == expect else "refuted"


@dataclass(frozen=True)
class FamilyRow:
    """One family's pooled row of a claim, and the table it came from."""

    run: str
    file: str
    family: str
    estimate_pp: float
    stderr_pp: float
    between_base_sd_pp: float
    base_models: int
    verdict: str
    inheritance_index: float = float("nan")
    inheritance_basis: str = ""
    base_heldout_ppl: float = float("nan")

    @property
    def inheritance(self) -> str:
        """`inheritance index I (basis)` of the family's routing, and its base models' mean held-out
        perplexity, or "" where its table has neither."""
        parts = []
        if not math.isnan(self.inheritance_index):
            parts.append(f"inheritance index {self.inheritance_index:.2f} ({self.inheritance_basis})")
        if not math.isnan(self.base_heldout_ppl):
            parts.append(f"base models' held-out perplexity {self.base_heldout_ppl:.2f}")
        return ", ".join(parts)

    @property
    def spread(self) -> str:
        """`±stderr; between-base SD tau over B base models` (one base model: no SD to give)."""
        if self.base_models == 1 or math.isnan(self.between_base_sd_pp):
            return f"±{self.stderr_pp:.3g}; one base model"
        return (f"±{self.stderr_pp:.3g}; between-base SD {self.between_base_sd_pp:.3g} "
                f"over {self.base_models} base models")

    @property
    def interval(self) -> tuple[float, float]:
        """The interval the verdict reads: estimate -/+ 2 standard errors."""
        return self.estimate_pp - 2 * self.stderr_pp, self.estimate_pp + 2 * self.stderr_pp

    def summary(self) -> str:
        return (f"{self.family} family ({self.run}): {self.estimate_pp:+.3g} {self.spread}, "
                f"pooled verdict {self.verdict}" + (f", {self.inheritance}" if self.inheritance else ""))


@dataclass(frozen=True)
class PooledReading:
    """The deciding family's row of a claim, the other families' rows, and the claims verdict."""

    test: FamilyRow
    context: tuple[FamilyRow, ...]
    verdict: str

    @property
    def note(self) -> str:
        """Which family decides, whether it is provisional, and the other families as context."""
        test = self.test
        parts = [f"Model family {test.family}: {test.base_models} base model{'s' if test.base_models > 1 else ''}, "
                 f"pooled verdict {test.verdict}" + (f"; its routing's {test.inheritance}" if test.inheritance else "")]
        if test.base_models == 1:
            parts.append("Provisional: one base model")
        if test.family != "drop":
            drop = next((row for row in self.context if row.family == "drop"), None)
            if drop is None:
                parts.append("No table read here has the drop family (experts that start without the dense "
                             "model's groups), which would decide before it")
            else:
                parts.append(f"The drop family (experts that start without the dense model's groups) decides "
                             f"once it has {MIN_DECIDING_BASE_MODELS} base models; it has {drop.base_models}")
        parts += [f"Context, {row.summary()}" for row in self.context]
        return ". ".join(parts)


def read_table(path: str) -> pd.DataFrame:
    """A pooled table, checked for its columns (one error naming the file and what it lacks)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: pooled quality verdicts not found")
    frame = pd.read_csv(path, comment="#")
    missing = [c for c in POOLED_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: not a pooled verdicts table (occult.report.quality_pooled): no column(s) {missing}")
    return frame


def family_rows(claim: str, tables: list[tuple[str, str, pd.DataFrame]]) -> list[FamilyRow]:
    """Each family's row of `claim`, from the first of `tables` ((run, file, frame), latest first)
    that has one; in the order of `FAMILY_PRECEDENCE`, then by family name."""
    found: dict[str, FamilyRow] = {}
    for run, path, frame in tables:
        for record in frame[frame["claim"] == claim].to_dict("records"):
            family = str(record["model_family"])
            if family in found:
                continue
            try:
                found[family] = FamilyRow(run, path, family, float(record["estimate_pp"]), float(record["stderr_pp"]),
                                          float(record["between_base_sd_pp"]), int(record["base_models"]),
                                          str(record["verdict"]), float(record.get("inheritance_index", math.nan)),
                                          "" if pd.isna(basis := record.get("inheritance_basis")) else str(basis),
                                          float(record.get("base_heldout_ppl", math.nan)))
            except (TypeError, ValueError) as err:
                raise ValueError(f"{path}: claim {claim!r}, family {family!r}: {err}") from None
    rank = {family: i for i, family in enumerate(FAMILY_PRECEDENCE)}
    return sorted(found.values(), key=lambda row: (rank.get(row.family, len(rank)), row.family))


def pooled_reading(claim: str, expect: str | None, tables: list[tuple[str, str, pd.DataFrame]]) -> PooledReading:
    """The claim's reading from the pooled tables (latest first): the deciding family's row (the
    first by precedence with at least `MIN_DECIDING_BASE_MODELS` base models, else the first), the
    others as context, and its verdict in the claims vocabulary."""
    rows = family_rows(claim, tables)
    if not rows:
        known = sorted({c for _, _, frame in tables for c in frame["claim"].astype(str)})
        raise ValueError(f"{', '.join(path for _, path, _ in tables)}: no pooled claim {claim!r}; known: {known}")
    test = next((row for row in rows if row.base_models >= MIN_DECIDING_BASE_MODELS), rows[0])
    try:
        verdict = claim_verdict(test.verdict, expect)
    except ValueError as err:
        raise ValueError(f"{test.file}: claim {claim!r}, family {test.family!r}: {err}") from None
    return PooledReading(test, tuple(row for row in rows if row is not test), verdict)
