"""Structured logs: JSON lines beside the human text, progress records, one outcome record per stage.

Every `occult <stage>` (and `python -m occult.<module>` entry point that uses `run_main`) logs

- human text to stderr, as it always did: `<time> <logger> <LEVEL> <message>` lines and tqdm bars;
- JSON lines to `--log-json PATH` (default: the environment variable `OCCULT_LOG_JSON`; none when
  both are unset), appended one object per record:
  `{"ts": ISO-8601 UTC, "level", "stage", "event", "message", "logger", "pid", ...fields}`.

Events: `start` (argv, cwd), `log` (any ordinary `logging` call, from any library), `progress`
(from `progress()`: step, total, rate, elapsed, metrics; at most every `every_s` seconds and once
at the end), then exactly one of `done` (elapsed_s, outputs) or `failed` (exception type and
message, the offending file and config field when the error names them, the last traceback frame
in our code, the full traceback, the exit code). Snakemake deletes a rule's logs before the job,
so a rule's JSON log holds one run; outside Snakemake runs append to the same file.

A failed stage prints one line to stderr, `occult <stage>: error: <message> [<Type> at <file:line
function>]`; errors of bad inputs (the `brief` exceptions: they name their file or field) stop
there, anything else prints its traceback first. SIGTERM (a cancelled job) and Ctrl-C are recorded
as failures too (exit codes 143 and 130).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

ENV_LOG_JSON = "OCCULT_LOG_JSON"
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
FIELDS_ATTR = "occult_fields"          # LogRecord attribute: the structured fields of a record
JSON_ONLY_ATTR = "occult_json_only"    # LogRecord attribute: keep the record out of the text log
REPO_ROOT = Path(__file__).resolve().parent.parent
OWN_PACKAGES = ("occult", "kernels")   # folders of REPO_ROOT whose frames are "our code"
BASE_KEYS = ("ts", "level", "stage", "event", "message", "logger", "pid")
STANDARD_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName", FIELDS_ATTR, JSON_ONLY_ATTR}
PATH_SUFFIXES = frozenset({".npz", ".json", ".jsonl", ".csv", ".tsv", ".yaml", ".yml", ".safetensors", ".bin",
                           ".pt", ".txt", ".png", ".log"})
TOKEN_RE = re.compile(r"[^\s'\"(),;\[\]{}<>|=*]+")
FIELD_RE = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*):\s")


# ----------------------------------------------------------------------------------------------
# Records


def utc_timestamp(seconds: float) -> str:
    return _dt.datetime.fromtimestamp(seconds, tz=_dt.timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def jsonable(value: Any) -> Any:
    """`value` as plain JSON: paths and unknown objects as strings, arrays and tensors as lists,
    non-finite floats as the strings "nan", "inf", "-inf" (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist"):            # numpy scalars and arrays, torch tensors
        return jsonable(value.tolist())
    return str(value)


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per record: the base keys, then the record's structured fields and extras."""

    def __init__(self, stage: str | None = None) -> None:
        super().__init__()
        self.stage = stage

    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, FIELDS_ATTR, None) or {})
        extras = {k: v for k, v in vars(record).items() if k not in STANDARD_RECORD_ATTRS}
        fields = {**extras, **fields}
        obj: dict[str, Any] = {
            "ts": utc_timestamp(record.created),
            "level": record.levelname,
            "stage": fields.pop("stage", None) or self.stage,
            "event": fields.pop("event", None) or "log",
            "message": record.getMessage(),
            "logger": record.name,
            "pid": record.process,
        }
        if "RANK" in os.environ:            # torchrun rank
            obj["rank"] = os.environ["RANK"]
        if record.exc_info and "traceback" not in fields:
            fields["traceback"] = self.formatException(record.exc_info)
        for key, value in fields.items():
            obj.setdefault(key, value)
        return json.dumps(jsonable(obj), ensure_ascii=False, allow_nan=False)


class TextHandler(logging.StreamHandler):
    """Human lines on stderr (the format the CLI always used); JSON-only records are skipped."""

    def __init__(self, stream=None) -> None:
        super().__init__(sys.stderr if stream is None else stream)
        self.setFormatter(logging.Formatter(TEXT_FORMAT))
        self.addFilter(lambda record: not getattr(record, JSON_ONLY_ATTR, False))


class JsonLinesHandler(logging.FileHandler):
    """Appends one JSON object per record to `path` and flushes it (forked ranks share the file)."""

    def __init__(self, path: str | Path, stage: str | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path, mode="a", encoding="utf-8")
        self.path = path
        self.setFormatter(JsonLinesFormatter(stage))


@dataclass
class LoggingSetup:
    """The handlers `setup_logging` put on the root logger; `remove()` takes them off again."""

    stage: str
    text: logging.Handler
    json: JsonLinesHandler | None
    previous_level: int

    @property
    def json_path(self) -> Path | None:
        return None if self.json is None else self.json.path

    def remove(self) -> None:
        root = logging.getLogger()
        for handler in (self.text, self.json):
            if handler is not None:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(self.previous_level)


def json_log_path(json_path: str | Path | None = None) -> Path | None:
    """`json_path`, else `$OCCULT_LOG_JSON`, else None (an empty value counts as unset)."""
    chosen = json_path if json_path not in (None, "") else os.environ.get(ENV_LOG_JSON, "")
    return Path(chosen) if chosen else None


def setup_logging(stage: str, json_path: str | Path | None = None, level: int = logging.INFO) -> LoggingSetup:
    """Human text to stderr and, when `json_path` (or `$OCCULT_LOG_JSON`) is set, JSON lines there.

    Handlers of an earlier call are replaced, so calling it twice never doubles the lines.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, (TextHandler, JsonLinesHandler)):
            root.removeHandler(handler)
            handler.close()
    setup = LoggingSetup(stage, TextHandler(), None, root.level)
    path = json_log_path(json_path)
    if path is not None:
        try:
            setup.json = JsonLinesHandler(path, stage)
        except OSError as err:
            raise OSError(f"--log-json: cannot open {path} ({err.strerror or err})") from None
        root.addHandler(setup.json)
    root.addHandler(setup.text)
    root.setLevel(level)
    return setup


def log_event(event: str, message: str, *, level: int = logging.INFO, logger: str | logging.Logger = "occult",
              json_only: bool = False, **fields: Any) -> None:
    """Log one structured record: `event` and `fields` become keys of its JSON line."""
    target = logging.getLogger(logger) if isinstance(logger, str) else logger
    target.log(level, "%s", message, extra={FIELDS_ATTR: {"event": event, **fields}, JSON_ONLY_ATTR: json_only})


# ----------------------------------------------------------------------------------------------
# Progress


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Progress:
    """A tqdm bar on stderr that also writes JSON `progress` records (see `progress`)."""

    def __init__(self, iterable: Iterable | None, total: int | None, *, stage: str | None, desc: str,
                 every_s: float, unit: str, disable: bool, leave: bool, initial: int, logger: str,
                 bar_options: Mapping[str, Any]) -> None:
        from tqdm import tqdm

        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.iterable, self.total, self.stage, self.desc, self.unit = iterable, total, stage, desc, unit
        self.every_s, self.disabled, self.logger = every_s, disable, logger
        self.initial = self.step = initial
        self.metrics: dict[str, Any] = {}
        self.started = self.last_record = time.monotonic()
        self.closed = False
        tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
        # a bar in a log file (not a TTY) redraws rarely: one line per `every_s`, not ten per second
        options = {"mininterval": 0.1 if tty else max(1.0, every_s), **bar_options}
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable, leave=leave,
                        initial=initial, **options)

    def __iter__(self) -> Iterator:
        if self.iterable is None:
            raise TypeError(f"progress {self.desc!r}: made from a total, not an iterable; call update()")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.step += n
        self.bar.update(n)
        if time.monotonic() - self.last_record >= self.every_s:
            self._record(final=False)

    def log(self, **metrics: Any) -> None:
        """Metrics carried by the next progress records (and shown beside the bar)."""
        self.metrics.update(metrics)
        if not self.disabled:
            self.bar.set_postfix({k: _short(v) for k, v in self.metrics.items()}, refresh=False)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._record(final=True)
        self.bar.close()

    def _record(self, final: bool) -> None:
        now = time.monotonic()
        self.last_record = now
        if self.disabled:
            return
        elapsed = now - self.started
        rate = (self.step - self.initial) / elapsed if elapsed > 0 else None
        fields: dict[str, Any] = {
            **self.metrics,
            "desc": self.desc, "step": self.step, "total": self.total, "unit": self.unit,
            "elapsed_s": round(elapsed, 3), "rate": None if rate is None else round(rate, 4),
            "eta_s": round((self.total - self.step) / rate, 1) if rate and self.total is not None else None,
            "final": final,
        }
        if self.stage is not None:
            fields["stage"] = self.stage
        of_total = f"/{self.total}" if self.total is not None else ""
        log_event("progress", f"{self.desc}: {self.step}{of_total} {self.unit}", logger=self.logger,
                  json_only=True, **fields)


def progress(iterable_or_total: Iterable | int | None, stage: str | None = None, desc: str = "",
             every_s: float = 10.0, *, total: int | None = None, unit: str = "it", disable: bool = False,
             leave: bool = True, initial: int = 0, logger: str = "occult.progress", **bar_options: Any) -> Progress:
    """A tqdm bar (stderr) that writes a JSON `progress` record at most every `every_s` seconds
    and once when closed: desc, step, total, unit, elapsed_s, rate (steps/s), eta_s, final, and
    the metrics given to `.log(**metrics)`.

    Iterate it (`for x in progress(items, desc=...)`), or make it from a total (None: unknown)
    and call `.update(n)` (`with progress(100, desc=...) as bar:`). `stage` defaults to the stage
    whose logging is set up. `disable=True` (e.g. ranks other than 0) turns off bar and records
    alike. `initial` is the step a resumed loop starts at (the rate counts this run's steps only);
    other keywords go to tqdm (e.g. `unit_scale=True`).
    """
    is_total = isinstance(iterable_or_total, int) and not isinstance(iterable_or_total, bool)
    if iterable_or_total is None or is_total:
        iterable, total = None, total if iterable_or_total is None else iterable_or_total
    else:
        iterable = iterable_or_total
    return Progress(iterable, total, stage=stage, desc=desc, every_s=every_s, unit=unit, disable=disable,
                    leave=leave, initial=initial, logger=logger, bar_options=bar_options)


# ----------------------------------------------------------------------------------------------
# Failures


class Terminated(BaseException):
    """A termination signal reached the stage (a cancelled job); raised so the failure is recorded.

    A BaseException, like KeyboardInterrupt: `except Exception` blocks do not swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signal.Signals(signum).name}")
        self.signum = signum


def exit_code_of(err: BaseException) -> int:
    if isinstance(err, Terminated):
        return 128 + err.signum
    if isinstance(err, KeyboardInterrupt):
        return 130
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) and err.code else 1
    return 1


def own_frame(frame: traceback.FrameSummary) -> str | None:
    """`occult/x.py` when the frame is in our code (not this module), else None."""
    try:
        relative = Path(frame.filename).resolve().relative_to(REPO_ROOT)
    except ValueError:
        return None
    if relative.parts[0] not in OWN_PACKAGES or relative == Path(__file__).resolve().relative_to(REPO_ROOT):
        return None
    return relative.as_posix()


def last_own_frame(err: BaseException) -> dict[str, Any] | None:
    """The innermost traceback frame in our code: file (relative to the repository), line, function, code."""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        relative = own_frame(frame)
        if relative is not None:
            return {"file": relative, "line": frame.lineno, "function": frame.name, "code": frame.line}
    return None


def _raised_by_us(err: BaseException) -> bool:
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and own_frame(frames[-1]) is not None


def looks_like_path(token: str) -> bool:
    """A message token that names a file: it has a known suffix, or slashes between real names
    (`work/tiny/profile`, `/tmp/x`; not `E/D`, not a URL)."""
    if "://" in token or token.startswith("//"):
        return False
    if Path(token).suffix in PATH_SUFFIXES and len(Path(token).stem) > 0:
        return True
    if "/" not in token:
        return False
    names = [part for part in token.split("/") if part not in ("", ".", "..", "~")]
    return token.startswith(("/", "./", "../", "~")) and bool(names) or sum(len(n) > 1 for n in names) >= 2


def offending_file(err: BaseException) -> str | None:
    """The file an error is about: an OSError's filename, else the first path its message names."""
    for candidate in (err, err.__cause__):
        name = getattr(candidate, "filename", None)
        if isinstance(candidate, OSError) and name:
            return os.fspath(name)
    for match in TOKEN_RE.finditer(_message(err)):
        token = re.sub(r"(:\d*)+$", "", match.group(0).rstrip(".,;:"))
        if looks_like_path(token):
            return token
    return None


def offending_field(err: BaseException) -> str | None:
    """The config or argument field our error message leads with (`placement.devices: ...`)."""
    if not _raised_by_us(err):
        return None
    match = FIELD_RE.match(_message(err))
    return match.group(1) if match else None


def _message(err: BaseException) -> str:
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, str) else f"exit status {err.code}"
    return str(err) or type(err).__name__


def failure_fields(err: BaseException) -> dict[str, Any]:
    """The structured description of a failure (see the module docstring)."""
    where = last_own_frame(err)
    return {
        "exception_type": f"{type(err).__module__}.{type(err).__qualname__}".removeprefix("builtins."),
        "exception_message": _message(err),
        "file": offending_file(err),
        "field": offending_field(err),
        "where": where,
        "traceback": "".join(traceback.format_exception(err)),
    }


# A `failure_line` as it reaches a parent's pipe, a rank's prefix (`[rank0]:`) allowed.
FAILURE_LINE = re.compile(r"^(?:\[[^\]]*\]:?\s*)?occult[\w.-]*: error: (?P<message>.*?)(?: \[\w+(?: at [^\]]*)?\])?$")


def failure_message(line: str) -> str:
    """The first line of the message of a `failure_line` (`occult.sweep: error: CUDA error: ... | ...
    [Type at ...]` gives `CUDA error: ...`); "" for any other line."""
    match = FAILURE_LINE.match(line.strip())
    return match.group("message").split(" | ")[0].strip() if match else ""


def failure_line(prog: str, err: BaseException, label: str = "error") -> str:
    """The one stderr line of a failure: `<prog>: <label>: <message> [<Type> at <file:line function>]`."""
    where = last_own_frame(err)
    at = f" at {where['file']}:{where['line']} {where['function']}" if where else ""
    message = " | ".join(part for part in _message(err).splitlines() if part.strip())
    return f"{prog}: {label}: {message} [{type(err).__name__}{at}]"


# ----------------------------------------------------------------------------------------------
# A stage's lifetime


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into `Terminated` in this process; forked children (ranks) die as without it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def on_sigterm(signum: int, frame: object) -> None:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class StageRun:
    """Logging for one stage: `with StageRun(stage, json_path) as run:` writes `start`; then
    `return run.done(outputs)` or `return run.failed(err)` writes the outcome and gives the exit
    code. An exception that leaves the block unrecorded is recorded as `failed`, then re-raised."""

    stage: str
    json_path: str | Path | None = None
    level: int = logging.INFO
    prog: str = ""
    started: float = field(default=0.0, init=False)
    finished: bool = field(default=False, init=False)
    setup: LoggingSetup | None = field(default=None, init=False)
    _signals: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, init=False)

    def __post_init__(self) -> None:
        self.prog = self.prog or f"occult {self.stage}"

    def __enter__(self) -> StageRun:
        try:
            self.setup = setup_logging(self.stage, self.json_path, self.level)
        except OSError as err:                       # an unwritable --log-json: a bad argument
            print(f"{self.prog}: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        self.started = time.monotonic()
        self._signals.enter_context(_sigterm_raises())
        json_log = self.setup.json_path
        log_event("start", f"stage {self.stage} started", json_only=True, argv=list(sys.argv), cwd=os.getcwd(),
                  json_log=None if json_log is None else str(json_log))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc is not None and not self.finished:
                self.failed(exc)
        finally:
            self._signals.close()
            if self.setup is not None:
                self.setup.remove()

    @property
    def elapsed_s(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def done(self, outputs: Sequence[str | Path | None] = ()) -> int:
        """Record success with the elapsed time and the output paths; returns 0."""
        paths = [os.fspath(p) for p in outputs if p is not None]
        missing = [p for p in paths if not Path(p).exists()]
        written = f": {', '.join(paths)}" if paths else ""
        log_event("done", f"stage {self.stage} done in {self.elapsed_s:.1f} s{written}",
                  elapsed_s=self.elapsed_s, outputs=paths, missing_outputs=missing)
        self.finished = True
        return 0

    def failed(self, err: BaseException, *, exit_code: int | None = None, brief: bool = False,
               label: str = "error") -> int:
        """Record `err`: the JSON `failed` record, and on stderr the traceback (unless `brief`) and
        one summary line. Returns the exit code (default: 1; 130 for Ctrl-C, 128+N for signal N)."""
        code = exit_code_of(err) if exit_code is None else exit_code
        line = failure_line(self.prog, err, label)
        if not brief:
            print("".join(traceback.format_exception(err)).rstrip(), file=sys.stderr)
        print(line, file=sys.stderr, flush=True)
        log_event("failed", line, level=logging.ERROR, json_only=True, elapsed_s=self.elapsed_s, exit_code=code,
                  **failure_fields(err))
        self.finished = True
        return code


class StagePaused(RuntimeError):
    """A stage stopped early on purpose after saving its progress: the same command continues it.
    The entry point reports it in one line (no traceback) and exits with `exit_code`."""

    exit_code = 3


BRIEF_ERRORS: tuple[type[BaseException], ...] = (FileNotFoundError, ValueError, EOFError)


def run_main(stage: str, main: Callable[[list[str]], Any], argv: Sequence[str] | None = None, *,
             output_flags: Sequence[str] = ("--out",),
             brief: tuple[type[BaseException], ...] = BRIEF_ERRORS) -> int:
    """Run a module's `main(argv)` as a logged stage and return its exit code (`sys.exit(run_main(...))`).

    `--log-json PATH` and the `output_flags` are read from `argv` here (add `--log-json` to the
    module's own parser too, so that it accepts and documents it); the outputs named by those
    flags are listed in the `done` record. A nonzero return value of `main` counts as a failure.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    peek.add_argument("--log-json")
    for flag in output_flags:
        peek.add_argument(flag)
    known, _ = peek.parse_known_args(args)
    outputs = [getattr(known, flag.lstrip("-").replace("-", "_")) for flag in output_flags]
    with StageRun(stage, known.log_json, prog=f"occult.{stage}") as run:
        try:
            code = main(args)
            if isinstance(code, int) and not isinstance(code, bool) and code:
                raise SystemExit(code)
        except SystemExit as err:
            if err.code in (0, None):
                return run.done(outputs)
            return run.failed(err, brief=True)
        except brief as err:
            return run.failed(err, brief=True)
        except BaseException as err:  # noqa: BLE001 - recorded, and the exit code says it failed
            return run.failed(err)
        return run.done(outputs)
