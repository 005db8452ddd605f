"""Running a sweep: provenance of the rows, the loop over routings and shapes (their points:
`occult.harness.sweep.points`), the printed table and the command line
(`python -m occult.harness.sweep`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import torch

import occult.harness.sweep as package
from occult.harness.baselines import world_and_rank
from occult.shapes import get_shape
from occult.harness.sweep.points import sweep_shape
from occult.harness.sweep.settings import (
    COLUMNS, DEFAULT_METHODS, DEFAULT_SIZES, DTYPES, KINDS, ROUTINGS, STREAM_BLOCKS, TIMINGS, VERSION_PACKAGES,
    SweepError, SweepSettings,
)
from occult.method_names import GRAMMAR


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def machine_name(device: torch.device, world: int) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} x{world}"
    return f"cpu {platform.machine()} x{world}"


def machine_slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def default_out_csv(kind: str, device: str, world: int) -> Path:
    from occult.provenance import REPO_ROOT

    if device == "cuda" and torch.cuda.is_available():
        name = machine_name(torch.device("cuda", torch.cuda.current_device()), world)
    else:
        name = machine_name(torch.device("cpu"), world) if device == "cpu" else f"{device} x{world}"
    return REPO_ROOT / "results" / machine_slug(name) / f"sweep_{kind}_D{world}.csv"


def run_sweep(
    kind: str,
    shapes: Sequence[str],
    methods: Sequence[str],
    D: int,
    tokens_list: Sequence[int],
    out_csv: str | Path,
    repeats: int = 20,
    warmup: int = 5,
    **options: Any,
) -> list[dict[str, Any]]:
    """Run one sweep on every rank of the default process group (D ranks, or none for D=1).

    `tokens_list` are the sizes of the kind: tokens per GPU (prefill), batch = tokens per GPU
    (decode), batch of `seq_len`-token sequences (train). `options` are the other fields of
    `SweepSettings` (device, dtype, seed, order_seed, seq_len, input_sets, check_tokens, occult_backend,
    include_shared, command, routings, trace, timing, grouped_gemm_dir). Rank 0 writes `out_csv` (+ `.meta.json`) and prints a table;
    every rank returns the rows.
    """
    settings = SweepSettings(kind=kind, shapes=tuple(shapes), methods=tuple(methods), world=D,
                             sizes=tuple(tokens_list), out_csv=str(out_csv), repeats=repeats, warmup=warmup,
                             **options)
    settings.validate()
    return _sweep(settings)


def _sweep(settings: SweepSettings) -> list[dict[str, Any]]:
    from occult.config import config_hash
    from occult.logs import progress
    from occult.provenance import git_commit, provenance, seed_everything

    world, rank = world_and_rank(None)
    if world != settings.world:
        raise SweepError(f"D: {settings.world} given but the process group has {world} ranks")
    if settings.device == "cuda":
        if not torch.cuda.is_available():
            raise SweepError("device: cuda requested but torch sees no GPU (use --device cpu)")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dtype = DTYPES[settings.dtype]
    backend = settings.occult_backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    seed_everything(settings.seed)
    if settings.grouped_gemm_dir and settings.grouped_gemm_mode():
        from occult.harness.baselines.megablocks import use_grouped_gemm_build

        use_grouped_gemm_build(settings.grouped_gemm_dir, settings.grouped_gemm_mode())   # before the versions

    machine = machine_name(device, world)
    fixed = {
        "machine": machine, "commit": git_commit(), "command": settings.command, "kind": settings.kind,
        "D": world, "seq_len": settings.seq_len if settings.kind == "train" else None, "dtype": settings.dtype,
        "repeats": settings.repeats, "warmup": settings.warmup,
        "timer": "cuda_events" if device.type == "cuda" else "perf_counter", "timing": settings.timing,
        **{f"version_{name.replace('-', '_')}": package_version(name) for name in VERSION_PACKAGES},
    }
    meta = provenance(config_hash(dataclasses.asdict(settings)), settings.seed, stage="sweep",
                      settings=dataclasses.asdict(settings), occult_backend=backend, machine=machine,
                      note="one row per (routing, shape, method, size), the methods of a point in the order "
                           "order_seed gives; times are per-step max over ranks")
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append({column: row.get(column) for column in COLUMNS})
        if rank == 0:
            import pandas as pd

            from occult.provenance import write_csv

            write_csv(settings.out_csv, pd.DataFrame(rows, columns=list(COLUMNS)), meta=meta)

    skip = read_points(settings.skip_points) if settings.skip_points else frozenset()
    total = len(settings.routings) * len(settings.shapes) * len(settings.methods) * len(settings.sizes)
    bar = progress(total, desc=f"sweep {settings.kind} D={world}", unit="point", disable=rank != 0, every_s=0)
    for routing in settings.routings:
        for shape_name in settings.shapes:
            sweep_shape(settings, get_shape(shape_name), routing, device, dtype, backend, fixed, emit, bar, skip)
    bar.close()
    if rank == 0:
        print_table(rows)
    return rows


POINT_COLUMNS = ("routing", "shape", "tokens_per_gpu", "method")


def read_points(path: str | Path) -> frozenset[tuple[str, str, int, str]]:
    """The points (routing, shape, tokens_per_gpu, method) listed in a CSV with those columns
    (any sweep CSV will do: the points an earlier process wrote)."""
    import pandas as pd

    frame = pd.read_csv(path)
    missing = [c for c in POINT_COLUMNS if c not in frame.columns]
    if missing:
        raise SweepError(f"skip_points: {path} has no column(s) {missing}")
    return frozenset((str(r), str(s), int(t), str(m)) for r, s, t, m in frame[list(POINT_COLUMNS)].itertuples(index=False))


def print_table(rows: list[dict[str, Any]]) -> None:
    """Median ms per (shape, method) × size, and the status of rows that did not run."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    if frame.empty:
        return
    size_col = "tokens_per_gpu" if frame["batch"].isna().all() else "batch"
    ok = frame[frame["status"] == "ok"]
    if not ok.empty:
        table = ok.pivot_table(index=["routing", "shape", "method"], columns=size_col, values="median_ms",
                               aggfunc="first")
        print(f"\nmedian ms per step ({frame['kind'].iloc[0]}, D={frame['D'].iloc[0]}, columns = {size_col}):")
        print(table.to_string(float_format=lambda v: f"{v:.3f}"))
    others = frame[frame["status"] != "ok"].drop_duplicates(["routing", "shape", "method", "status"])
    for _, row in others.iterrows():
        print(f"{row['routing']:>9} {row['shape']:>12} {row['method']:<12} {row['status']}")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.sweep", description=package.__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=KINDS, default="prefill")
    parser.add_argument("--shapes", nargs="+", default=["olmoe", "qwen", "deepseek"])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        help=f"method names ({GRAMMAR})")
    parser.add_argument("--D", type=int, default=None, help="EP group size (default: torchrun's world size, else 1)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="tokens per GPU (prefill) or batch (decode, train); default per kind")
    parser.add_argument("--out", type=Path, default=None, help="CSV (default results/<machine>/sweep_<kind>_D<D>.csv)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the data: router, weights, inputs, placements (and of the order, unless --order-seed)")
    parser.add_argument("--order-seed", type=int, default=None,
                        help="seed of the methods' order at each point, apart from the data (default: --seed)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence of the train kind")
    parser.add_argument("--input-sets", type=int, default=3, help="pre-generated input sets rotated over steps")
    parser.add_argument("--check-tokens", type=int, default=64, help="tokens per rank of the correctness check")
    parser.add_argument("--occult-backend", choices=("auto", "torch", "triton"), default="auto")
    parser.add_argument("--no-shared", action="store_true", help="leave out the shapes' shared experts")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout")
    parser.add_argument("--routings", nargs="+", choices=ROUTINGS, default=["synthetic"],
                        help="synthetic low-rank router, uniform, and/or a measured trace (--trace), one after another")
    parser.add_argument("--trace", default="", help="routing_*.npz of occult.routing.profiling (routing trace)")
    parser.add_argument("--grouped-gemm-dir", default="", metavar="DIR",
                        help="folder of the grouped_gemm builds gg-cublas/ and gg-cutlass/ "
                             "(tools/build_baselines.sh); the one MegaBlocks' methods ask for goes first on "
                             "sys.path (default: grouped_gemm as installed)")
    parser.add_argument("--skip-points", default="", metavar="CSV",
                        help="leave out the points (routing, shape, tokens_per_gpu, method) this CSV lists: "
                             "those an earlier process of the same sweep wrote")
    parser.add_argument("--timing", choices=TIMINGS, default="step",
                        help="step: the GPU drained before each timed step (default); stream: "
                             f"{STREAM_BLOCKS} blocks of --repeats steps issued back to back, ms per step")
    parser.add_argument("--host-profile", default="", metavar="DIR",
                        help="after each timed row, profile as many more steps with cProfile into "
                             "DIR/host_<kind>_<shape>_<method>_<size>.txt (rank 0)")
    parser.add_argument("--log-json", metavar="PATH",
                        help="append JSON-lines logs here (default: $OCCULT_LOG_JSON); read by the entry point")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from occult.harness.ranks import launched_by_torchrun, run_in_group

    args = build_parser().parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SweepError("device: cuda requested but torch sees no GPU (use --device cpu)")
    torchrun = launched_by_torchrun()
    if torchrun and args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))   # before any CUDA call
    world = args.D if args.D is not None else int(os.environ.get("WORLD_SIZE", "1"))
    launcher = f"torchrun(nproc={os.environ['WORLD_SIZE']}) " if torchrun else ""
    command = launcher + " ".join(["python -m occult.harness.sweep", *(argv if argv is not None else sys.argv[1:])])
    settings = SweepSettings(
        kind=args.kind, shapes=tuple(args.shapes), methods=tuple(args.methods), world=world,
        sizes=tuple(args.sizes or DEFAULT_SIZES[args.kind]),
        out_csv=str(args.out or default_out_csv(args.kind, args.device, world)),
        repeats=args.repeats, warmup=args.warmup, device=args.device, dtype=args.dtype, seed=args.seed,
        order_seed=args.order_seed, seq_len=args.seq_len, input_sets=args.input_sets, check_tokens=args.check_tokens,
        occult_backend=args.occult_backend, include_shared=not args.no_shared, command=command,
        routings=tuple(args.routings), trace=args.trace, host_profile=args.host_profile, timing=args.timing,
        grouped_gemm_dir=args.grouped_gemm_dir, skip_points=args.skip_points,
    )
    settings.validate()
    run_in_group(lambda: _sweep(settings), args.device, world, args.timeout_s, error=SweepError)
    return 0

