"""Running a sweep: provenance of the rows, the loop over shapes, methods and sizes, one point's
measurement, the printed table and the command line (`python -m occult.harness.sweep`)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import re
import statistics
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

import occult.harness.sweep as package
from occult.harness.baselines import METHOD_CLASSES, ExpertWeights, Method, MoEShape, get_shape, world_and_rank
from occult.harness.sweep.check import agree, error_text, reference_outputs, relative_error
from occult.harness.sweep.inputs import (
    InputSet, SharedExpert, derive_seed, make_inputs, make_router, occult_placement, routing_key,
)
from occult.harness.sweep.occult_method import OccultEP, build_method, method_skip_reason, occult_options
from occult.harness.sweep.settings import (
    COLUMNS, DEFAULT_METHODS, DEFAULT_SIZES, DTYPES, KINDS, REL_TOLERANCE, ROUTINGS, STREAM_BLOCKS, TIMINGS,
    VERSION_PACKAGES,
    SweepError, SweepSettings,
)
from occult.harness.sweep.timing import (
    phase_medians, profile_host, quantile, synchronize, time_steps, time_stream, train_step,
)
from occult.method_names import parse_method


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
    `SweepSettings` (device, dtype, seed, seq_len, input_sets, check_tokens, occult_backend,
    include_shared, command). Rank 0 writes `out_csv` (+ `.meta.json`) and prints a table;
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
                      note="one row per (shape, method, size); times are per-step max over ranks")
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append({column: row.get(column) for column in COLUMNS})
        if rank == 0:
            import pandas as pd

            from occult.provenance import write_csv

            write_csv(settings.out_csv, pd.DataFrame(rows, columns=list(COLUMNS)), meta=meta)

    total = len(settings.shapes) * len(settings.methods) * len(settings.sizes)
    bar = progress(total, desc=f"sweep {settings.kind} D={world}", unit="point", disable=rank != 0, every_s=0)
    for shape_name in settings.shapes:
        shape = get_shape(shape_name)
        _sweep_shape(settings, shape, device, dtype, backend, fixed, emit, bar)
    bar.close()
    if rank == 0:
        print_table(rows)
    return rows


def _sweep_shape(settings: SweepSettings, shape: MoEShape, device: torch.device, dtype: torch.dtype,
                 backend: str, fixed: dict[str, Any], emit: Callable[[dict[str, Any]], None], bar) -> None:
    world, rank = world_and_rank(None)
    train = settings.kind == "train"
    weights = ExpertWeights.random(shape, derive_seed(settings.seed, "experts", shape.name), device, dtype)
    weights = ExpertWeights(weights.w_gate_up_E2FD.cpu(), weights.w_down_EDF.cpu())
    shared = (SharedExpert(shape, settings.seed, device, dtype)
              if settings.include_shared and shape.shared_ffn else None)
    router = make_router(settings, shape)
    wants_occult = any(parse_method(m).is_occult for m in settings.methods)
    placement = (occult_placement(shape, router, world, settings.seed)
                 if wants_occult and shape.num_experts % world == 0 else None)
    shape_fields = {"shape": shape.name, "num_experts": shape.num_experts, "top_k": shape.top_k,
                    "hidden": shape.hidden, "ffn": shape.ffn,
                    "shared_ffn": shape.shared_ffn if shared is not None else 0}

    balanced = (occult_placement(shape, router, world, settings.seed, balanced=True)
                if placement is not None and any("balanced" in occult_options(m) for m in settings.methods) else None)
    methods = {name: build_method(name, balanced if "balanced" in occult_options(name) else placement, backend)
               for name in settings.methods}
    skip = {name: method_skip_reason(name, m, shape, world) for name, m in methods.items()}
    routes = sorted({routing_key(n) for n in settings.methods if skip[n] is None} - {None})
    check = make_inputs(shape, router, settings.check_tokens,
                        derive_seed(settings.seed, "check", shape.name, rank), device, dtype,
                        routes, placement, with_grad_output=train)
    references = {nd: reference_outputs(check, nd, weights, device, with_grad=train)
                  for nd in (None, *routes)}
    tolerance = REL_TOLERANCE[settings.dtype]

    for name, method in methods.items():
        base = {**fixed, **shape_fields, "method": name, "routing": settings.routing}
        status = skip[name]
        max_rel_err = None
        if status is None:
            error = None
            try:
                method.setup(shape, None, dtype, device, weights)
            except Exception as err:  # noqa: BLE001 - recorded in the row and on stderr
                error = error_text(err)
            error = agree(error, world)
            if error:
                status = f"error: setup: {error}"
        if status is None and getattr(method, "checks_output", True):
            error = None
            try:
                max_rel_err = relative_error(method, check, routing_key(name), references[routing_key(name)], world)
            except Exception as err:  # noqa: BLE001
                error = error_text(err)
            error = agree(error, world)
            if error:
                status = f"error: check: {error}"
            elif not max_rel_err <= tolerance:
                status = f"failed: max_rel_err {max_rel_err:.3g} > {tolerance:g}"
        for size in settings.sizes:
            row = {**base, "tokens_per_gpu": settings.tokens_per_gpu(size), "batch": settings.batch(size),
                   "max_rel_err": max_rel_err}
            if status is None:
                row.update(_measure(settings, shape, name, method, shared, router, placement, size,
                                    device, dtype, world, rank))
            else:
                row["status"] = status
            emit(row)
            bar.log(shape=shape.name, method=name, size=size, status=row.get("status"),
                    median_ms=row.get("median_ms"))
            bar.update(1)
        method.teardown()
        # Free the method before the next is measured: its leftovers would count in the next peak memory.
        # The collection also frees make_graphed_callables' graphs, which sit in reference cycles; NCCL
        # keeps communicators alive while a graph that captured them exists, so the process group's
        # teardown waited on them until killed (results/nvidia-h200-x2/ep_v6, train kind with occult-graph).
        methods[name] = None
        del method
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _measure(settings: SweepSettings, shape: MoEShape, name: str, method: Method, shared: SharedExpert | None,
             router: Any, placement: torch.Tensor | None, size: int, device: torch.device,
             dtype: torch.dtype, world: int, rank: int) -> dict[str, Any]:
    """Time one method at one size; returns the measured columns and the status."""
    train = settings.kind == "train"
    tokens = settings.tokens_per_gpu(size)
    nd = routing_key(name)
    out: dict[str, Any] = {}
    error = None
    sets: list[InputSet] = []
    try:
        sets = [make_inputs(shape, router, tokens,
                            derive_seed(settings.seed, settings.kind, shape.name, tokens, index, rank),
                            device, dtype, [nd], placement, with_grad_output=train)
                for index in range(settings.input_sets)]
        first_ids, first_weights = sets[0].routes[nd]
        if isinstance(method, OccultEP):
            out["bytes_sent"], out["mean_devices_per_token"], out["pairs_received_max"] = method.traffic(
                first_ids, sets[0].x_TD, first_weights)
            phases = device.type == "cuda" and not train and not (method.graphed or method.compute_only)
            method.phase_events = [] if phases else None
        else:
            out["bytes_sent"] = method.bytes_sent(first_ids)
        params = method.expert_parameters() + (list(shared.parameters()) if shared is not None else [])

        def step(i: int) -> None:
            inputs = sets[i % len(sets)]
            ids, gate = inputs.routes[nd]
            if train:
                train_step(method, inputs.x_TD, ids, gate, shared, inputs.dy_TD, params)
            else:
                with torch.no_grad():
                    y = method.forward(inputs.x_TD, ids, gate)
                    if shared is not None:
                        y = y + shared(inputs.x_TD)

        if device.type == "cuda":
            synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        host_times: list[float] = []
        host_probes: list[tuple[float, float]] = []
        timer = time_stream if settings.timing == "stream" else time_steps
        times = timer(step, settings.repeats, settings.warmup, device, world, host_times, host_probes)
        if settings.host_profile:
            profile_host(step, settings.repeats, device, world, rank, Path(settings.host_profile)
                         / f"host_{settings.kind}_{shape.name}_{name}_{size}.txt")
        out.update(median_ms=statistics.median(times), p10_ms=quantile(times, 0.1), p90_ms=quantile(times, 0.9),
                   host_ms=statistics.median(host_times),
                   host_probe_us=statistics.median(p for p, _ in host_probes),
                   host_launch_us=statistics.median(q for _, q in host_probes))
        if isinstance(method, OccultEP) and method.phase_events:
            out.update(phase_medians(method.phase_events[settings.warmup:], device, world))
        if device.type == "cuda":
            peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
            if world > 1:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            out["peak_mem_gib"] = float(peak)
    except Exception as err:  # noqa: BLE001 - recorded in the row and on stderr
        error = error_text(err)
    finally:
        del sets
    error = agree(error, world)
    out["status"] = f"error: {error}" if error else "ok"
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    """Median ms per (shape, method) × size, and the status of rows that did not run."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    if frame.empty:
        return
    size_col = "tokens_per_gpu" if frame["batch"].isna().all() else "batch"
    ok = frame[frame["status"] == "ok"]
    if not ok.empty:
        table = ok.pivot_table(index=["shape", "method"], columns=size_col, values="median_ms", aggfunc="first")
        print(f"\nmedian ms per step ({frame['kind'].iloc[0]}, D={frame['D'].iloc[0]}, columns = {size_col}):")
        print(table.to_string(float_format=lambda v: f"{v:.3f}"))
    others = frame[frame["status"] != "ok"].drop_duplicates(["shape", "method", "status"])
    for _, row in others.iterrows():
        print(f"{row['shape']:>12} {row['method']:<12} {row['status']}")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.sweep", description=package.__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=KINDS, default="prefill")
    parser.add_argument("--shapes", nargs="+", default=["olmoe", "qwen", "deepseek"])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        help="occult, occult-nd<N>, or baselines: " + ", ".join(METHOD_CLASSES))
    parser.add_argument("--D", type=int, default=None, help="EP group size (default: torchrun's world size, else 1)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="tokens per GPU (prefill) or batch (decode, train); default per kind")
    parser.add_argument("--out", type=Path, default=None, help="CSV (default results/<machine>/sweep_<kind>_D<D>.csv)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence of the train kind")
    parser.add_argument("--input-sets", type=int, default=3, help="pre-generated input sets rotated over steps")
    parser.add_argument("--check-tokens", type=int, default=64, help="tokens per rank of the correctness check")
    parser.add_argument("--occult-backend", choices=("auto", "torch", "triton"), default="auto")
    parser.add_argument("--no-shared", action="store_true", help="leave out the shapes' shared experts")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout")
    parser.add_argument("--routing", choices=ROUTINGS, default="synthetic",
                        help="synthetic low-rank router, uniform, or a measured trace (--trace)")
    parser.add_argument("--trace", default="", help="routing_*.npz of occult.routing.profiling (routing=trace)")
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
        seq_len=args.seq_len, input_sets=args.input_sets, check_tokens=args.check_tokens,
        occult_backend=args.occult_backend, include_shared=not args.no_shared, command=command,
        routing=args.routing, trace=args.trace, host_profile=args.host_profile, timing=args.timing,
    )
    settings.validate()
    run_in_group(lambda: _sweep(settings), args.device, world, args.timeout_s, error=SweepError)
    return 0

