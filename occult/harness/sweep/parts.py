"""A sweep whose methods cannot share one process, run as several: `python -m occult.harness.sweep.parts`.

A process imports one grouped_gemm build, a crash in a library's kernels ends a process's CUDA
context, which would lose every method timed after it, and MegaBlocks timed late in a shared
process ran slower than timed early (+3.7% per place in the order over one run; 5.08 against
4.59 ms eighth in the order and with it reversed in another). So the methods are split by `process_key`: the main part (Occult, the
naive EP, HF, FSDP, DeepSpeed), MegaBlocks on each grouped_gemm build (cuBLAS, with its sparse MLP;
CUTLASS), each in a process of its own, and the methods that run Tutel's kernels (Tutel, DeepSpeed
with `use_tutel=1`). Each part is one sweep process (`--launch` then `-m occult.harness.sweep ...`,
e.g. torchrun on GPUs) with the sweep's own arguments, writing a CSV of its own; the parts run in
an order drawn from the seed (recorded in the sidecar) and their rows are merged into `--out`, each
with `point_position`: how many of the point's methods ran before it, over every part. A part whose process ends early (a crash, or
`--part-timeout-s`) is started again on the points it has not written (`--skip-points`): the
point it was on gets `error: process exited with code N during this point`, and after
`--restarts` restarts every point still missing gets `error: process exited with code N before
this point`; both end with the process's own last error line where it printed one (`: CUDA error:
...`; its stderr is passed on as it comes). Like a method that raises, a lost process is recorded
in the rows, not fatal.

    python -m occult.harness.sweep.parts --kind prefill --D 1 --routings synthetic uniform trace \\
        --trace results/.../routing_heldout_sample.npz --grouped-gemm-dir .thirdparty/baselines --out sweep.csv
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

from occult.logs import failure_message
from occult.provenance import derive_seed
from occult.harness.sweep.points import method_order, order_seed
from occult.harness.sweep.run import build_parser, default_out_csv
from occult.harness.sweep.settings import (COLUMNS, DEFAULT_SIZES, FAIR_METHODS, SweepError, SweepSettings,
                                           order_base_seed)
from occult.method_names import parse_method

MAIN = "main"
OWN_OPTIONS = ("methods", "out", "launch", "part_timeout_s", "restarts", "skip_points")
Point = tuple[str, str, int, str]      # (routing, shape, tokens_per_gpu, method)
STATUS_CHARS = 200                      # the longest status a lost point's row gets


def process_key(name: str) -> str:
    """Which process a method runs in: `main`, `grouped_gemm=<build>` (MegaBlocks on that build) or
    `tutel` (module doc)."""
    spec = parse_method(name)
    if spec.system == "tutel" or (spec.system == "deepspeed" and spec.setting("use_tutel") == "1"):
        return "tutel"
    if spec.system == "megablocks":
        return f"grouped_gemm={spec.setting('grouped_gemm')}"
    return MAIN


def split_methods(methods: Sequence[str]) -> dict[str, list[str]]:
    """The methods of each process, in the order given; the main part first."""
    parts: dict[str, list[str]] = {MAIN: []}
    for name in methods:
        parts.setdefault(process_key(name), []).append(name)
    return {key: names for key, names in parts.items() if names}


def part_order(keys: Sequence[str], seed: int, kind: str, world: int) -> list[str]:
    """The parts in the order they run: drawn from the seed, so no part always runs first."""
    return random.Random(derive_seed(seed, "parts", kind, world)).sample(list(keys), len(keys))


def build_parts_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    parser.prog = "python -m occult.harness.sweep.parts"
    parser.description = __doc__.split("\n\n")[0]
    parser.set_defaults(methods=list(FAIR_METHODS))
    parser.add_argument("--launch", default="",
                        help="command that starts one part before `-m occult.harness.sweep` (default: "
                             "`torchrun --nproc_per_node=D` on cuda, this python on cpu)")
    parser.add_argument("--part-timeout-s", type=float, default=0.0,
                        help="wall-clock limit of each part's process (0: none)")
    parser.add_argument("--restarts", type=int, default=8,
                        help="times a part's process is started again after it ended early (default 8)")
    return parser


def sweep_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The sweep options of `args` as command-line words (those at their default left out), without
    the ones each part sets itself (OWN_OPTIONS)."""
    words: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in OWN_OPTIONS or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        if value is None or value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(value, (list, tuple)):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return words


def run_parts(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    import pandas as pd

    from occult.provenance import git_commit, write_csv

    world = args.D or 1
    out = Path(args.out or default_out_csv(args.kind, args.device, world))
    sizes = tuple(args.sizes or DEFAULT_SIZES[args.kind])
    parts = split_methods(args.methods)
    for names in parts.values():          # every part's settings are valid before any starts
        SweepSettings(kind=args.kind, shapes=tuple(args.shapes), methods=tuple(names), world=world, sizes=sizes,
                      out_csv=str(out), routings=tuple(args.routings), trace=args.trace, device=args.device,
                      dtype=args.dtype, timing=args.timing, grouped_gemm_dir=args.grouped_gemm_dir,
                      order_seed=args.order_seed).validate()
    launch = shlex.split(args.launch) if args.launch else (
        ["torchrun", f"--nproc_per_node={world}"] if args.device == "cuda" else [sys.executable])
    common = sweep_argv(parser, args) + ([] if args.D else ["--D", str(world)])
    base_seed = order_base_seed(args.seed, args.order_seed)
    order = part_order(list(parts), base_seed, args.kind, world)
    fields = {"kind": args.kind, "D": world, "dtype": args.dtype, "repeats": args.repeats, "warmup": args.warmup,
              "timing": args.timing, "seq_len": args.seq_len if args.kind == "train" else None}
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.stem}.parts", dir=out.parent))
    frames, records = [], []
    try:
        for position, key in enumerate(order):
            print(f"== part {position + 1}/{len(order)}: {key}", flush=True)
            sequence = point_sequence(args, parts[key], sizes, world)
            frame, runs = run_part(launch, common, parts[key], sequence, scratch / f"part{position}",
                                   args.part_timeout_s, args.restarts, fields)
            offset = sum(len(parts[earlier]) for earlier in order[:position])
            frames.append(frame.assign(point_position=frame["order_position"] + offset))
            records.append({"part": key, "position": position, "methods": parts[key], "processes": runs})
        merged = pd.concat(frames, ignore_index=True)[list(COLUMNS)]
        meta = {"commit": git_commit(), "stage": "sweep",
                "command": shlex.join(["python -m occult.harness.sweep.parts", *argv]),
                "settings": {**vars(args), "out": str(out)},
                "part_order_seed": derive_seed(base_seed, "parts", args.kind, world), "parts": records}
        write_csv(out, merged, meta=json.loads(json.dumps(meta, default=str)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lost = sum(1 for record in records for run in record["processes"] if run["returncode"])
    print(f"sweep parts: {len(order)} parts, {lost} processes ended early (their points are error rows); "
          f"{len(merged)} rows in {out}", flush=True)
    return 0


def point_sequence(args: argparse.Namespace, methods: Sequence[str], sizes: Sequence[int],
                   world: int) -> list[Point]:
    """A part's points in the order its process runs them (routing, shape, size, then the seeded
    method order of the point)."""
    settings = SweepSettings(kind=args.kind, shapes=tuple(args.shapes), methods=tuple(methods), world=world,
                             sizes=tuple(sizes), out_csv="", seq_len=args.seq_len)
    base_seed = order_base_seed(args.seed, args.order_seed)
    return [(routing, shape, settings.tokens_per_gpu(size), name)
            for routing in args.routings for shape in args.shapes for size in sizes
            for name in method_order(methods, order_seed(base_seed, routing, shape, size))]


def run_part(launch: list[str], common: list[str], methods: Sequence[str], sequence: list[Point], stem: Path,
             timeout_s: float, restarts: int, fields: dict[str, Any]):
    """Run one part's process, restarting it on the points not yet written after a crash; returns
    its rows (error rows for lost points included, with the run's `fields`) and a record of each process."""
    import pandas as pd

    from occult.harness.sweep.run import POINT_COLUMNS

    frames, runs = [], []
    done: set[Point] = set()
    for attempt in range(restarts + 1):
        csv, skip = Path(f"{stem}_{attempt}.csv"), Path(f"{stem}_{attempt}_skip.csv")
        command = [*launch, "-m", "occult.harness.sweep", *common, "--methods", *methods, "--out", str(csv)]
        if done:
            pd.DataFrame(sorted(done), columns=list(POINT_COLUMNS)).to_csv(skip, index=False)
            command += ["--skip-points", str(skip)]
        print(f"   {shlex.join(command)}", flush=True)
        code, last_error = _run(command, timeout_s)
        written = pd.read_csv(csv) if csv.is_file() else pd.DataFrame(columns=list(COLUMNS))
        frames.append(written)
        done |= {(str(r), str(s), int(t), str(m))
                 for r, s, t, m in written[list(POINT_COLUMNS)].itertuples(index=False)}
        runs.append({"attempt": attempt, "returncode": code, "command": shlex.join(command), "rows": len(written),
                     "meta": _read_json(Path(str(csv) + ".meta.json"))})
        missing = [point for point in sequence if point not in done]
        if not code or not missing:
            break
        lost = missing[:1] if attempt < restarts else missing
        status = "during this point (started again after it)" if attempt < restarts else "before this point"
        frames.append(error_rows(lost, code, status, shlex.join(command), fields, last_error))
        done |= set(lost)
    return pd.concat(frames, ignore_index=True), runs


def _run(command: list[str], timeout_s: float) -> tuple[int, str]:
    """Run one process; returns its exit code (124 when `timeout_s` ran out) and the message of the
    last failure line (`occult.logs.failure_line`) it printed on stderr, or "". Its stderr is passed on line by line."""
    process = subprocess.Popen(command, env=os.environ.copy(), stderr=subprocess.PIPE)
    found: list[str] = []
    reader = threading.Thread(target=_tee_stderr, args=(process.stderr, found), daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=timeout_s or None)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        code = 124
    reader.join(timeout=10)              # a rank left running may hold the pipe open: do not wait on it
    return code, found[-1] if found else ""


def _tee_stderr(stream, found: list[str]) -> None:
    """Copy a child's stderr to ours as it comes, appending the message of each error line to `found`."""
    for raw in stream:
        text = raw.decode(errors="replace")
        sys.stderr.write(text)
        sys.stderr.flush()
        message = failure_message(text)
        if message:
            found.append(message)
    stream.close()


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def error_rows(points: Sequence[Point], code: int, when: str, command: str, fields: dict[str, Any],
               last_error: str = ""):
    """Rows for points a part's process did not write: `error: process exited with code N <when>`,
    then `: <last_error>` where the process printed one, the status cut to STATUS_CHARS."""
    import pandas as pd

    status = f"error: process exited with code {code} {when}"
    if last_error:
        status = f"{status}: {last_error}"
        if len(status) > STATUS_CHARS:
            status = status[:STATUS_CHARS - 3].rstrip() + "..."
    seq_len = fields.get("seq_len")
    rows = [{**fields, "command": command, "routing": routing, "shape": shape, "tokens_per_gpu": tokens,
             "batch": None if fields["kind"] == "prefill" else tokens // (seq_len or 1), "method": name,
             "status": status}
            for routing, shape, tokens, name in points]
    return pd.DataFrame(rows, columns=list(COLUMNS))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parts_parser()
    args = parser.parse_args(argv)
    if args.D is not None and args.D < 1:
        raise SweepError(f"D: must be at least 1, got {args.D}")
    return run_parts(args, parser, argv)


if __name__ == "__main__":
    from occult.logs import run_main

    sys.exit(run_main("sweep-parts", main))
