"""A sweep whose methods cannot share one process, run as several: `python -m occult.harness.sweep.parts`.

A process imports one grouped_gemm build, and Tutel's kernels can end a process's CUDA context (an
illegal memory access at 2^16 tokens on an H200), which would lose every method timed after it. So
the methods are split by `process_key`: the main part (Occult, the naive EP, HF, FSDP, DeepSpeed,
MegaBlocks on the cuBLAS build and its sparse MLP), MegaBlocks on the CUTLASS build, and the methods
that run Tutel's kernels (Tutel, DeepSpeed with `use_tutel=1`). Each part is one sweep process
(`--launch` then `-m occult.harness.sweep ...`, e.g. torchrun on GPUs) with the sweep's own
arguments, writing a CSV of its own; the parts run in an order drawn from the seed (recorded in the
sidecar) and their rows are merged into `--out`. A part that ends early leaves, for each point it
did not write, a row `error: process exited with code N before this point` (the merge still
succeeds: like a method that raises, a lost process is recorded, not fatal).

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
from pathlib import Path
from typing import Any, Sequence

from occult.harness.sweep.inputs import derive_seed
from occult.harness.sweep.run import build_parser, default_out_csv
from occult.harness.sweep.settings import COLUMNS, DEFAULT_SIZES, FAIR_METHODS, SweepError, SweepSettings
from occult.method_names import parse_method

MAIN = "main"
OWN_OPTIONS = ("methods", "out", "launch", "part_timeout_s")


def process_key(name: str) -> str:
    """Which process a method runs in: `main`, `grouped_gemm=cutlass` or `tutel` (module doc)."""
    spec = parse_method(name)
    if spec.system == "tutel" or (spec.system == "deepspeed" and spec.setting("use_tutel") == "1"):
        return "tutel"
    if spec.system == "megablocks" and spec.setting("mlp_impl") == "grouped" and spec.setting("grouped_gemm") != "cublas":
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
                      dtype=args.dtype, timing=args.timing, grouped_gemm_dir=args.grouped_gemm_dir).validate()
    launch = shlex.split(args.launch) if args.launch else (
        ["torchrun", f"--nproc_per_node={world}"] if args.device == "cuda" else [sys.executable])
    common = sweep_argv(parser, args)
    if args.D is None:
        common += ["--D", str(world)]
    order = part_order(list(parts), args.seed, args.kind, world)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.stem}.parts", dir=out.parent))
    frames, records, failed = [], [], 0
    try:
        for position, key in enumerate(order):
            csv = scratch / f"part{position}.csv"
            command = [*launch, "-m", "occult.harness.sweep", *common, "--methods", *parts[key], "--out", str(csv)]
            print(f"== part {position + 1}/{len(order)} ({key}): {shlex.join(command)}", flush=True)
            code = _run(command, args.part_timeout_s)
            frame = pd.read_csv(csv) if csv.is_file() else pd.DataFrame(columns=list(COLUMNS))
            if code:
                failed += 1
                frame = pd.concat([frame, missing_rows(frame, args, parts[key], sizes, world, code,
                                                       shlex.join(command))], ignore_index=True)
            frames.append(frame)
            records.append({"part": key, "position": position, "methods": parts[key], "returncode": code,
                            "command": shlex.join(command),
                            "meta": _read_json(Path(str(csv) + ".meta.json"))})
        merged = pd.concat(frames, ignore_index=True)[list(COLUMNS)]
        meta = {"commit": git_commit(), "stage": "sweep", "command": shlex.join(["python -m occult.harness.sweep.parts",
                                                                                    *argv]),
                "settings": {**vars(args), "out": str(out)}, "part_order_seed": derive_seed(args.seed, "parts",
                                                                                          args.kind, world),
                "parts": records}
        write_csv(out, merged, meta=json.loads(json.dumps(meta, default=str)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"sweep parts: {len(order)} processes, {failed} ended early (their missing points are error rows); "
          f"{len(merged)} rows in {out}", flush=True)
    return 0


def _run(command: list[str], timeout_s: float) -> int:
    try:
        return subprocess.run(command, timeout=timeout_s or None, env=os.environ.copy()).returncode
    except subprocess.TimeoutExpired:
        return 124


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def missing_rows(done, args: argparse.Namespace, methods: Sequence[str], sizes: Sequence[int], world: int,
                 code: int, command: str):
    """Rows for the points of a part that ended before writing them (status names the exit code)."""
    import pandas as pd

    settings = SweepSettings(kind=args.kind, shapes=tuple(args.shapes), methods=tuple(methods), world=world,
                             sizes=tuple(sizes), out_csv="", seq_len=args.seq_len)
    have = set(zip(done["routing"], done["shape"], done["method"], done["tokens_per_gpu"])) if len(done) else set()
    rows = []
    for routing in args.routings:
        for shape in args.shapes:
            for name in methods:
                for size in sizes:
                    tokens = settings.tokens_per_gpu(size)
                    if (routing, shape, name, tokens) in have:
                        continue
                    rows.append({"command": command, "kind": args.kind, "shape": shape, "method": name, "D": world,
                                 "tokens_per_gpu": tokens, "batch": settings.batch(size), "dtype": args.dtype,
                                 "seq_len": args.seq_len if args.kind == "train" else None, "routing": routing,
                                 "status": f"error: process exited with code {code} before this point"})
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
