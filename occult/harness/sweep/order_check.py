"""The order check: does a method's median move with its place in the order of a point?
`python -m occult.harness.sweep.order_check`.

It runs the same sweep `--replicates` R times, one size per kind and one routing, each time as fresh
processes (`occult.harness.sweep.parts`) with the same `--seed` (the same router, weights, inputs and
placements) and its own `--order-seed` 0 ... R-1, so each replicate runs the methods of every point in
another order. Their rows, each with its `replicate` and `replicate_order_seed`, go into one CSV
(written once all replicates have run, with a `.meta.json` sidecar); `occult.report.order_effect`
reads it. Methods that need a process of their own (`parts.process_key`: MegaBlocks on each
build) are alone in their process: their place at a point (`point_position`) changes with the
order of the processes, which the order seed draws too.

    python -m occult.harness.sweep.order_check --kind prefill --D 1 --replicates 6 \\
        --grouped-gemm-dir .thirdparty/baselines --out results/<machine>/sweeps_<v>/order_check_prefill_D1.csv
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from occult.harness.sweep import parts
from occult.harness.sweep.settings import COLUMNS, DTYPES, KINDS, ROUTINGS, SweepError

# One size per kind, in the units of the sweep's --sizes: tokens per GPU (prefill), sequences of one
# token (decode), sequences of --seq-len tokens (train).
CHECK_SIZES = {"prefill": 16384, "decode": 64, "train": 8}
CHECK_METHODS = ("occult", "megablocks", "megablocks:grouped_gemm=cutlass", "naive")
EXTRA_COLUMNS = ("replicate", "replicate_order_seed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.sweep.order_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=KINDS, default="prefill")
    parser.add_argument("--D", type=int, default=1, help="EP group size")
    parser.add_argument("--shapes", nargs="+", default=["olmoe", "qwen", "deepseek"])
    parser.add_argument("--methods", nargs="+", default=list(CHECK_METHODS))
    parser.add_argument("--size", type=int, default=None,
                        help=f"the one size, in the sweep's --sizes units (default per kind: {CHECK_SIZES})")
    parser.add_argument("--replicates", type=int, default=6, help="runs, with order seeds 0 ... R-1 (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the same in every replicate")
    parser.add_argument("--routing", choices=ROUTINGS, default="synthetic")
    parser.add_argument("--trace", default="", help="routing_*.npz of the trace routing")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence of the train kind")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout")
    parser.add_argument("--grouped-gemm-dir", default="", metavar="DIR",
                        help="folder of the grouped_gemm builds (tools/build_baselines.sh)")
    parser.add_argument("--launch", default="", help="command that starts one sweep process (sweep.parts --launch)")
    parser.add_argument("--part-timeout-s", type=float, default=0.0, help="wall-clock limit of each process (0: none)")
    parser.add_argument("--restarts", type=int, default=8, help="restarts of a process that ended early")
    parser.add_argument("--out", type=Path, required=True, help="order_check_<kind>_D<D>.csv")
    parser.add_argument("--log-json", metavar="PATH",
                        help="append JSON-lines logs here (default: $OCCULT_LOG_JSON); read by the entry point")
    return parser


def replicate_argv(args: argparse.Namespace, order_seed: int, out: Path) -> list[str]:
    """The `occult.harness.sweep.parts` arguments of one replicate."""
    argv = ["--kind", args.kind, "--D", str(args.D), "--shapes", *args.shapes, "--methods", *args.methods,
            "--sizes", str(args.size), "--routings", args.routing, "--seed", str(args.seed),
            "--order-seed", str(order_seed), "--device", args.device, "--dtype", args.dtype,
            "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--seq-len", str(args.seq_len),
            "--timeout-s", str(args.timeout_s), "--part-timeout-s", str(args.part_timeout_s),
            "--restarts", str(args.restarts), "--out", str(out)]
    for flag, value in (("--trace", args.trace), ("--grouped-gemm-dir", args.grouped_gemm_dir),
                        ("--launch", args.launch)):
        if value:
            argv += [flag, value]
    return argv


def validate(args: argparse.Namespace) -> None:
    for field in ("replicates", "D", "size"):
        if getattr(args, field) < 1:
            raise SweepError(f"{field}: must be at least 1, got {getattr(args, field)}")


def main(argv: Sequence[str] | None = None) -> int:
    import pandas as pd

    from occult.provenance import git_commit, write_csv

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.size is None:
        args.size = CHECK_SIZES[args.kind]
    validate(args)
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.stem}.replicates", dir=out.parent))
    frames, records = [], []
    try:
        for replicate in range(args.replicates):
            print(f"== replicate {replicate + 1}/{args.replicates}: order seed {replicate}", flush=True)
            csv = scratch / f"replicate{replicate}.csv"
            words = replicate_argv(args, replicate, csv)
            parts.main(words)
            frame = pd.read_csv(csv)[list(COLUMNS)]
            frame["replicate"], frame["replicate_order_seed"] = replicate, replicate
            frames.append(frame)
            records.append({"replicate": replicate, "order_seed": replicate,
                            "command": shlex.join(["python -m occult.harness.sweep.parts", *words]),
                            "meta": json.loads(Path(str(csv) + ".meta.json").read_text())})
        merged = pd.concat(frames, ignore_index=True)
        meta = {"commit": git_commit(), "stage": "order_check",
                "command": shlex.join(["python -m occult.harness.sweep.order_check", *argv]),
                "settings": {**vars(args), "out": str(out)}, "replicates": records}
        write_csv(out, merged, meta=json.loads(json.dumps(meta, default=str)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"order check: {args.replicates} replicates, {len(merged)} rows in {out}", flush=True)
    return 0


if __name__ == "__main__":
    from occult.logs import run_main

    sys.exit(run_main("order-check", main))
