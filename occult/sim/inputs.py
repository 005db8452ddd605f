"""The simulator's measured inputs, found in the results tree.

Every run that its machine's `index.csv` marks `used_by` `simulator` holds a `simulator.yaml` that
says how the run's files feed the simulator (results/README.md has the format): the measured sets
its entries belong to (`headline`, the set the cost model is validated on; the history sets, older
runtimes each calibrated and validated on its own), which of its files are measured and which
calibrate, and the files with a special role (all-to-all and grouped-GEMM curves, the weight-streaming
calls, the dense matmul peak, shared-expert A/B pairs, sweeps for the pre-registered check).
`discover` reads them all and assembles the sets; `simulator_settings` joins them to the config's
`simulate` section; `read_sets` reads every set's rows.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from occult.config import SimulateConfig
from occult.sim.columns import SimulateError
from occult.sim.measured import FileEntry, host_scale_of_set, read_measured, read_table

SPEC_NAME = "simulator.yaml"
HEADLINE = "headline"
SET_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
SINGLE_ROLES = ("alltoall", "gemm", "kernel_stream", "dense_peak")
SPEC_KEYS = ("sets", *SINGLE_ROLES, "shared_ab", "prediction_check")
BLOCK_KEYS = ("in", "measured", "calibration")


@dataclass(frozen=True)
class MeasuredSet:
    """A set's entries (`FILE[@methods=..][@tokens_per_gpu=..]`, FILE under the results folder) in
    reading order, and the simulator.yaml files that contributed them."""

    name: str
    measured: tuple[str, ...]
    calibration: tuple[str, ...]
    specs: tuple[str, ...]


@dataclass(frozen=True)
class SimulatorInputs:
    """Everything the simulator.yaml files of a results tree name."""

    sets: tuple[MeasuredSet, ...]            # the headline set first, then the history sets in order
    alltoall: str | None = None              # occult.harness.commbench alltoall.csv
    gemm: str | None = None                  # occult.harness.commbench gemm.csv
    kernel_stream: str | None = None         # occult-compute-graph calls of 1-16 tokens (fit_weight_streaming)
    dense_peak: str | None = None            # the bf16 matmul peak (a `tflops` column, one row)
    shared_ab: tuple[tuple[str, str], ...] = ()   # (file with the shared experts, file without)
    prediction_check: tuple[str, ...] = ()   # sweeps at D >= 4 for occult.sim.check
    specs: tuple[str, ...] = ()              # the simulator.yaml files read

    def files(self) -> list[str]:
        """Every file read: the simulator.yaml files and the files they name (selectors dropped)."""
        named = [*self.specs, *(text.partition("@")[0] for s in self.sets for text in s.measured),
                 *(p for p in (self.alltoall, self.gemm, self.kernel_stream, self.dense_peak) if p),
                 *(p for pair in self.shared_ab for p in pair), *self.prediction_check]
        return list(dict.fromkeys(named))


@dataclass(frozen=True)
class SimulatorSettings(SimulateConfig):
    """The config's `simulate` section with the measured inputs of the results tree."""

    measured: tuple[str, ...] = ()           # the headline set
    calibration: tuple[str, ...] = ()
    history: tuple[MeasuredSet, ...] = ()
    alltoall_csv: str | None = None          # None: the built-in 2-GPU table
    gemm_csv: str | None = None              # None: the naive EP uncalibrated
    kernel_stream_csv: str | None = None
    shared_ab: tuple[tuple[str, str], ...] = ()

    def sets(self) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
        """(name, measured, calibration) of the headline set and of every history set, in order."""
        history = [(s.name, s.measured, s.calibration) for s in self.history]
        return [(HEADLINE, self.measured, self.calibration), *history]


def results_root(results_dir: str | Path | None = None) -> tuple[Path, str]:
    """(the results folder, the prefix its files are named with): `results_dir` as given; by default
    `results/` of the working directory where it holds an index, else the repository's."""
    from occult.provenance import REPO_ROOT
    from occult.report.results_index import INDEX_NAME

    if results_dir is not None:
        return Path(results_dir), str(results_dir).rstrip("/")
    here = Path("results")
    return (here if any(here.glob(f"*/{INDEX_NAME}")) else REPO_ROOT / "results"), "results"


def _load_spec(path: Path, name: str) -> dict[str, Any]:
    import yaml

    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise SimulateError(f"{name}: not valid YAML ({err})") from None
    if not isinstance(spec, dict) or not spec:
        raise SimulateError(f"{name}: expected a mapping with any of {', '.join(SPEC_KEYS)}")
    unknown = [k for k in spec if k not in SPEC_KEYS]
    if unknown:
        raise SimulateError(f"{name}: {unknown[0]}: unknown key (allowed: {', '.join(SPEC_KEYS)})")
    return spec


def _run_file(text: Any, run_dir: str, field: str, selectors_allowed: bool = False) -> str:
    """`FILE[@selectors]` of the run as `<run_dir>/FILE[@selectors]`, its file existing and its
    selectors valid (allowed in measured and calibration entries only)."""
    if not isinstance(text, str) or not text:
        expected = "FILE[@methods=a,b][@tokens_per_gpu=N,...]" if selectors_allowed else "a file of the run"
        raise SimulateError(f"{field}: expected {expected}, got {text!r}")
    name, at, selectors = text.partition("@")
    if at and not selectors_allowed:
        raise SimulateError(f"{field}: {text!r}: row selectors are for measured and calibration entries only")
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise SimulateError(f"{field}: {name!r} must be a file of the run, relative to its folder")
    full = f"{run_dir}/{name}{at}{selectors}"
    FileEntry.parse(full, field)
    return full


def _file_list(value: Any, run_dir: str, field: str, selectors_allowed: bool = False) -> list[str]:
    if not isinstance(value, list):
        raise SimulateError(f"{field}: expected a list of files, got {value!r}")
    return [_run_file(text, run_dir, f"{field}[{i}]", selectors_allowed) for i, text in enumerate(value)]


def _blocks(spec: dict[str, Any], run_dir: str, name: str) -> list[tuple[str, int, list[str], list[str]]]:
    """(set, place, measured, calibration) of every set the spec puts entries in."""
    blocks = spec.get("sets", [])
    if not isinstance(blocks, list):
        raise SimulateError(f"{name}: sets: expected a list of {{in, measured, calibration}}")
    out, seen = [], set()
    for i, block in enumerate(blocks):
        field = f"{name}: sets[{i}]"
        if not isinstance(block, dict) or "in" not in block or "measured" not in block:
            raise SimulateError(f"{field}: expected a mapping with in, measured and optionally calibration")
        unknown = [k for k in block if k not in BLOCK_KEYS]
        if unknown:
            raise SimulateError(f"{field}.{unknown[0]}: unknown key (allowed: {', '.join(BLOCK_KEYS)})")
        places = block["in"]
        if not isinstance(places, dict) or not places:
            raise SimulateError(f"{field}.in: expected a mapping of set name to its place, e.g. {{headline: 1}}")
        measured = _file_list(block["measured"], run_dir, f"{field}.measured", selectors_allowed=True)
        if not measured:
            raise SimulateError(f"{field}.measured: names no file")
        calibration = _file_list(block.get("calibration", []), run_dir, f"{field}.calibration", selectors_allowed=True)
        files = {text.partition("@")[0] for text in measured}
        for j, text in enumerate(calibration):
            if text.partition("@")[0] not in files:
                raise SimulateError(f"{field}.calibration[{j}]: {text.partition('@')[0]} is not one of the block's "
                                    "measured files")
        for set_name, place in places.items():
            if not isinstance(set_name, str) or not SET_NAME.match(set_name):
                raise SimulateError(f"{field}.in: {set_name!r} is not a set name (letters, digits, _ . -)")
            if isinstance(place, bool) or not isinstance(place, int):
                raise SimulateError(f"{field}.in.{set_name}: expected an integer place, got {place!r}")
            if set_name in seen:
                raise SimulateError(f"{field}.in.{set_name}: another block of the file is in this set already")
            seen.add(set_name)
            out.append((set_name, place, measured, calibration))
    return out


def _shared_pairs(value: Any, run_dir: str, name: str) -> list[tuple[str, str]]:
    if not isinstance(value, list):
        raise SimulateError(f"{name}: shared_ab: expected a list of [file with shared experts, file without]")
    pairs = []
    for i, pair in enumerate(value):
        field = f"{name}: shared_ab[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise SimulateError(f"{field}: expected [file with shared experts, file without], got {pair!r}")
        pairs.append(tuple(_run_file(text, run_dir, field) for text in pair))
    return pairs


def _assemble(blocks: list[tuple[str, str, int, list[str], list[str]]]) -> tuple[MeasuredSet, ...]:
    """The sets from (spec, set, place, measured, calibration): each set's blocks by place; the
    headline set first, then the others in the order of their first place."""
    by_set: dict[str, list] = {}
    for block in blocks:
        by_set.setdefault(block[1], []).append(block)
    sets = []
    for name, parts in by_set.items():
        parts.sort(key=lambda b: b[2])
        for a, b in zip(parts, parts[1:]):
            if a[2] == b[2]:
                raise SimulateError(f"{a[0]} and {b[0]}: both put entries of set {name!r} at place {a[2]}")
        specs = tuple(b[0] for b in parts)
        calibration = tuple(t for b in parts for t in b[4])
        if not calibration:
            raise SimulateError(f"{', '.join(specs)}: set {name!r} has no calibration entry "
                                "(each set is calibrated on its own rows)")
        sets.append((name != HEADLINE, parts[0][2], name,
                     MeasuredSet(name, tuple(t for b in parts for t in b[3]), calibration, specs)))
    return tuple(s for *_, s in sorted(sets, key=lambda s: s[:3]))


def discover(results_dir: str | Path | None = None) -> SimulatorInputs:
    """The simulator.yaml of every in-tree run whose index row lists `simulator` in `used_by`, read
    and assembled (`results_root` says where); one SimulateError naming the file and field of a bad
    spec, a run that lacks one, or a spec whose run is not marked."""
    from occult.report.results_index import runs_in_tree

    root, prefix = results_root(results_dir)
    index = runs_in_tree(results_dir=root)
    used = [(m, r) for m, r, u in zip(index["machine"], index["run"], index["used_by"]) if "simulator" in u.split(";")]
    marked = {root / m / r / SPEC_NAME for m, r in used}
    for path in sorted(root.glob(f"*/*/{SPEC_NAME}")):
        if path not in marked:
            raise SimulateError(f"{prefix}/{path.parent.parent.name}/{path.parent.name}/{SPEC_NAME}: the run's row "
                                f"in {path.parent.parent.name}/index.csv does not list simulator in used_by")
    blocks, singles, shared, check, specs = [], {}, [], [], []
    for machine, run in used:
        run_dir, path = f"{prefix}/{machine}/{run}", root / machine / run / SPEC_NAME
        name = f"{run_dir}/{SPEC_NAME}"
        if not path.is_file():
            raise SimulateError(f"{run_dir}: {machine}/index.csv lists simulator in its used_by, "
                                f"but it has no {SPEC_NAME}")
        spec = _load_spec(path, name)
        specs.append(name)
        blocks += [(name, *block) for block in _blocks(spec, run_dir, name)]
        for role in SINGLE_ROLES:
            if role in spec:
                if role in singles:
                    raise SimulateError(f"{singles[role][0]} and {name}: both name the {role} file")
                singles[role] = (name, _run_file(spec[role], run_dir, f"{name}: {role}"))
        shared += _shared_pairs(spec.get("shared_ab", []), run_dir, name)
        check += _file_list(spec.get("prediction_check", []), run_dir, f"{name}: prediction_check")
    return SimulatorInputs(_assemble(blocks), **{role: file for role, (_, file) in singles.items()},
                           shared_ab=tuple(shared), prediction_check=tuple(check), specs=tuple(specs))


def dense_peak_tflops(path: str) -> float:
    """The bf16 matmul rate of a peak file (occult.harness.ep_profile's peak.csv: one row, `tflops`)."""
    frame = read_table(path, ("tflops",), "dense_peak")
    if len(frame) != 1 or not float(frame["tflops"].iloc[0]) > 0:
        raise SimulateError(f"dense_peak: {path} must hold one row with a positive tflops")
    return float(frame["tflops"].iloc[0])


def simulator_settings(config: SimulateConfig, results_dir: str | Path | None = None) -> SimulatorSettings:
    """`config` with the measured inputs `discover` finds; the headline set is required, and
    `dense_tflops` comes from the dense_peak file unless the config sets it."""
    inputs = discover(results_dir)
    if not inputs.sets or inputs.sets[0].name != HEADLINE:
        raise SimulateError(f"{results_root(results_dir)[1]}: no {SPEC_NAME} puts entries in the {HEADLINE} set")
    dense = config.dense_tflops
    if dense is None:
        if inputs.dense_peak is None:
            raise SimulateError(f"simulate.dense_tflops: not set, and no {SPEC_NAME} names a dense_peak file")
        dense = dense_peak_tflops(inputs.dense_peak)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    headline, history = inputs.sets[0], inputs.sets[1:]
    return SimulatorSettings(**{**fields, "dense_tflops": dense}, measured=headline.measured,
                             calibration=headline.calibration, history=history, alltoall_csv=inputs.alltoall,
                             gemm_csv=inputs.gemm, kernel_stream_csv=inputs.kernel_stream, shared_ab=inputs.shared_ab)


def read_sets(settings: Any) -> dict[str, Any]:
    """Every set's rows (`read_measured`) with their `host_scale`, by set name in order; a set none
    of whose rows calibrates is an error."""
    frames = {}
    for name, measured, calibration in settings.sets():
        frame = read_measured(measured, calibration, f"sets.{name}")
        if not (frame["role"] == "calibration").any():
            raise SimulateError(f"sets.{name}: its calibration entries select no row")
        frame["host_scale"] = host_scale_of_set(frame, getattr(settings, "host_speed", "auto"))
        frames[name] = frame
    return frames
