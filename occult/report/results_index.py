"""The index of committed result runs: one `results/<machine>/index.csv` per machine (results/README.md).

Each row names a run folder, what it measures (`kind`), the commit and target that made it, whether
it is `current`, `superseded` (by `superseded_by`), `invalid` or `partial` (stopped before its
targets finished), whether its folder is still in the
tree, and what still reads it (`used_by`). `load_index` reads every machine's index and checks it
against the tree; a bad row raises one `ResultsIndexError` naming the file, the run and the field.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

COLUMNS = ("run", "kind", "commit", "target", "status", "superseded_by", "in_tree", "used_by", "note")
STATUSES = ("current", "superseded", "invalid", "partial")
USES = ("simulator", "figures", "claims", "docs")
INDEX_NAME = "index.csv"


class ResultsIndexError(ValueError):
    """An index file that does not match its schema or the tree."""


def read_machine_index(path: Path) -> pd.DataFrame:
    """One machine's index, its columns and values checked, without the cross-machine checks."""
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise ResultsIndexError(f"{path}: cannot be read as CSV ({err})") from None
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise ResultsIndexError(f"{path}: missing column {missing[0]!r} (expected {', '.join(COLUMNS)})")
    frame = frame[list(COLUMNS)]
    machine_dir = path.parent
    for line, row in enumerate(frame.itertuples(index=False), start=2):
        where = f"{path}, line {line} (run {row.run!r})"
        if not row.run or "/" in row.run:
            raise ResultsIndexError(f"{where}: field 'run' must be a folder name")
        for field in ("kind", "commit", "target"):
            if not getattr(row, field):
                raise ResultsIndexError(f"{where}: field {field!r} is empty")
        if row.status not in STATUSES:
            raise ResultsIndexError(f"{where}: field 'status' is {row.status!r}, not one of {', '.join(STATUSES)}")
        if row.status == "superseded" and not row.superseded_by:
            raise ResultsIndexError(f"{where}: field 'superseded_by' is empty for a superseded run")
        if row.status in ("current", "partial") and row.superseded_by:
            raise ResultsIndexError(f"{where}: field 'superseded_by' is set for a {row.status} run")
        unknown = [u for u in row.used_by.split(";") if u and u not in USES]
        if unknown:
            raise ResultsIndexError(f"{where}: field 'used_by' has {unknown[0]!r}, not one of {', '.join(USES)}")
        if row.in_tree not in ("yes", "no"):
            raise ResultsIndexError(f"{where}: field 'in_tree' is {row.in_tree!r}, not yes or no")
        exists = (machine_dir / row.run).is_dir()
        if row.in_tree == "yes" and not exists:
            raise ResultsIndexError(f"{where}: field 'in_tree' is yes but {machine_dir / row.run} does not exist")
        if row.in_tree == "no" and exists:
            raise ResultsIndexError(f"{where}: field 'in_tree' is no but {machine_dir / row.run} exists")
    duplicated = frame["run"][frame["run"].duplicated()]
    if not duplicated.empty:
        raise ResultsIndexError(f"{path}: run {duplicated.iloc[0]!r} has more than one row")
    return frame


def load_index(results_dir: str | Path = "results") -> pd.DataFrame:
    """Every machine's index rows with a `machine` column; `superseded_by` checked to name an indexed
    run (`<run>` on the same machine or `<machine>/<run>`)."""
    root = Path(results_dir)
    frames = [read_machine_index(path).assign(machine=path.parent.name)
              for path in sorted(root.glob(f"*/{INDEX_NAME}"))]
    if not frames:
        return pd.DataFrame(columns=["machine", *COLUMNS])
    index = pd.concat(frames, ignore_index=True)[["machine", *COLUMNS]]
    known = set(zip(index["machine"], index["run"]))
    for row in index.itertuples(index=False):
        if not row.superseded_by:
            continue
        machine, _, run = row.superseded_by.rpartition("/")
        if (machine or row.machine, run) not in known:
            raise ResultsIndexError(f"{root / row.machine / INDEX_NAME} (run {row.run!r}): field 'superseded_by' "
                                    f"names {row.superseded_by!r}, which is no indexed run")
    return index


def unindexed_runs(results_dir: str | Path = "results") -> list[str]:
    """`<machine>/<run>` folders of indexed machines that have no row in their index."""
    root = Path(results_dir)
    missing = []
    for path in sorted(root.glob(f"*/{INDEX_NAME}")):
        runs = set(read_machine_index(path)["run"])
        missing += [f"{path.parent.name}/{d.name}" for d in sorted(path.parent.iterdir())
                    if d.is_dir() and d.name not in runs]
    return missing


def _of_kind(index: pd.DataFrame, kind: str | None) -> pd.DataFrame:
    return index if kind is None else index[index["kind"] == kind]


def current_runs(kind: str | None = None, results_dir: str | Path = "results") -> pd.DataFrame:
    """Rows of the current runs, of one `kind` or all."""
    index = load_index(results_dir)
    return _of_kind(index[index["status"] == "current"], kind).reset_index(drop=True)


def runs_in_tree(kind: str | None = None, results_dir: str | Path = "results") -> pd.DataFrame:
    """Rows of the runs whose folders are in the tree, of one `kind` or all."""
    index = load_index(results_dir)
    return _of_kind(index[index["in_tree"] == "yes"], kind).reset_index(drop=True)
