"""Microbenchmarks the scale simulator reads: `all_to_all_single` and grouped-GEMM throughput.

Launch on GPUs (one process per GPU; the whole run takes about a minute):

    torchrun --nproc_per_node=2 -m occult.harness.commbench --out results/nvidia-h200-x2/comm_v1

and on the CPU (gloo ranks forked here, tiny sizes) for smoke tests:

    python -m occult.harness.commbench --device cpu --D 2 --out /tmp/comm --sizes 65536 262144 --repeats 3

`alltoall.csv`, one row per (pattern, dtype, size):
  * `equal`: every rank sends `bytes_per_rank / D` to every rank (64 KiB … 1 GiB per rank, bf16
    and uint8 buffers);
  * `dedup`: the uneven splits of Occult's dedup dispatch: the row counts one rank sends each
    device for `tokens` tokens of the OLMoE-shape sweep routing (`occult.harness.sweep`'s router and
    placement), rows of the runtime's packed size (4160 B at d = 2048, bf16).
Columns: D, pattern, dtype, tokens, bytes_per_rank (whole send buffer), bytes_remote_per_rank
(the max over ranks of bytes leaving the rank), median/p10/p90 ms (max over ranks per step),
algbw_gbps = bytes_per_rank / time, busbw_gbps = bytes_remote_per_rank / time.

`gemm.csv` (rank 0 alone, the other ranks wait): a grouped SwiGLU expert FFN (gate-up GEMM,
SwiGLU, down GEMM) over `experts` local experts at the OLMoE / Qwen / DeepSeek expert shapes,
for a range of rows per expert, forward and forward+backward, through `torch._grouped_mm` (or a
batched matmul where torch lacks it). Columns: shape, experts, hidden, ffn, rows_per_expert,
impl, pass, median_ms, p10_ms, p90_ms, tflops (2·3·d·F FLOPs per row forward, 3× for fwd+bwd).

Timing: CUDA events around each step after a barrier (perf_counter on the CPU), `warmup` untimed
steps, median of `repeats` (≥ 20 on GPUs). Both CSVs carry a `.meta.json` provenance sidecar.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from occult.logs import ENV_LOG_JSON, progress, run_main

DEFAULT_SIZES = tuple(2**p for p in range(16, 31, 2))        # 64 KiB … 1 GiB per rank
DEFAULT_DEDUP_TOKENS = (1024, 4096, 16384, 65536)
DEFAULT_ROWS_PER_EXPERT = (16, 64, 256, 1024, 4096, 16384)
DTYPES = {"bfloat16": torch.bfloat16, "uint8": torch.uint8, "float32": torch.float32}
ALLTOALL_COLUMNS = ("machine", "D", "pattern", "dtype", "tokens", "bytes_per_rank", "bytes_remote_per_rank",
                    "median_ms", "p10_ms", "p90_ms", "algbw_gbps", "busbw_gbps", "repeats", "timer")
GEMM_COLUMNS = ("machine", "shape", "experts", "hidden", "ffn", "rows_per_expert", "impl", "pass", "median_ms",
                "p10_ms", "p90_ms", "tflops", "repeats", "timer")


@dataclass(frozen=True)
class BenchSettings:
    out_dir: str
    device: str = "cuda"
    sizes: tuple[int, ...] = DEFAULT_SIZES
    dtypes: tuple[str, ...] = ("bfloat16", "uint8")
    dedup_shape: str = "olmoe"
    dedup_tokens: tuple[int, ...] = DEFAULT_DEDUP_TOKENS
    gemm_shapes: tuple[str, ...] = ("olmoe", "qwen", "deepseek")
    gemm_experts: int = 8
    rows_per_expert: tuple[int, ...] = DEFAULT_ROWS_PER_EXPERT
    repeats: int = 20
    warmup: int = 5
    seed: int = 0
    command: str = ""

    def validate(self) -> None:
        from occult.shapes import get_shape

        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device: {self.device!r} is not cuda or cpu")
        for name in self.dtypes:
            if name not in DTYPES:
                raise ValueError(f"dtypes: {name!r} is not one of {sorted(DTYPES)}")
        for field in ("sizes", "dedup_tokens", "rows_per_expert"):
            values = getattr(self, field)
            if any(v < 1 for v in values):
                raise ValueError(f"{field}: need positive values, got {values}")
        for name in (self.dedup_shape, *self.gemm_shapes):
            get_shape(name)                                   # raises naming the shape
        if self.repeats < 1 or self.warmup < 0 or self.gemm_experts < 1:
            raise ValueError("repeats, gemm_experts must be >= 1 and warmup >= 0")


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], None], repeats: int, warmup: int, device: torch.device,
               collective: bool) -> list[float]:
    """ms of each timed step; with `collective`, each step's max over ranks."""
    world, _ = _world()
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        if collective and world > 1:
            dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            begin = time.perf_counter()
            step()
            elapsed = 1e3 * (time.perf_counter() - begin)
        if i >= warmup:
            times.append(elapsed)
    if collective and world > 1:
        values = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        times = values.tolist()
    return times


def _stats(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)

    def q(frac: float) -> float:
        pos = frac * (len(ordered) - 1)
        low = int(pos)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    return {"median_ms": statistics.median(times), "p10_ms": q(0.1), "p90_ms": q(0.9)}


def alltoall_row(send_elems: list[int], dtype: torch.dtype, device: torch.device, repeats: int,
                 warmup: int) -> dict[str, Any]:
    """Time `all_to_all_single` of this rank's per-destination element counts (all ranks call)."""
    world, rank = _world()
    counts = torch.tensor(send_elems, dtype=torch.long, device=device)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    recv_elems = recv_counts.tolist()
    send = torch.zeros(sum(send_elems), dtype=dtype, device=device)
    recv = torch.empty(sum(recv_elems), dtype=dtype, device=device)

    def step() -> None:
        dist.all_to_all_single(recv, send, recv_elems, send_elems)

    times = time_steps(step, repeats, warmup, device, collective=True)
    elem = send.element_size()
    remote = torch.tensor([float(sum(send_elems) - send_elems[rank]) * elem,
                           float(sum(recv_elems) - recv_elems[rank]) * elem], dtype=torch.float64, device=device)
    total = torch.tensor([float(sum(send_elems) * elem)], dtype=torch.float64, device=device)
    dist.all_reduce(remote, op=dist.ReduceOp.MAX)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    stats = _stats(times)
    seconds = stats["median_ms"] * 1e-3
    bytes_remote = float(remote.max())
    return {**stats, "bytes_per_rank": int(total.item()), "bytes_remote_per_rank": int(bytes_remote),
            "algbw_gbps": total.item() / seconds / 1e9 if seconds > 0 else None,
            "busbw_gbps": bytes_remote / seconds / 1e9 if seconds > 0 else None}


def dedup_rows_per_device(shape_name: str, tokens: int, seed: int) -> list[int]:
    """Rows this rank's `tokens` send to each device in dedup mode (the sweep's routing and placement)."""
    from occult.shapes import get_shape
    from occult.ep.plan import build_plan, local_expert_ids
    from occult.harness.sweep.inputs import SyntheticRouter, make_inputs, occult_placement
    from occult.provenance import derive_seed

    world, rank = _world()
    shape = get_shape(shape_name)
    router = SyntheticRouter.make(shape, seed)
    placement = occult_placement(shape, router, world, seed)
    inputs = make_inputs(shape, router, tokens, derive_seed(seed, "commbench", shape.name, tokens, rank),
                         torch.device("cpu"), torch.bfloat16, [None], None, with_grad_output=False)
    plan = build_plan(inputs.routes[None][0], placement, world, local_expert_ids(placement, world), "dedup")
    return list(plan.rows_per_device)


def packed_row_bytes(hidden: int, elem_bytes: int, slots: int) -> int:
    from occult.sim.traffic import wire_row_bytes

    return wire_row_bytes("dedup", hidden, elem_bytes, slots)[0]


def bench_alltoall(settings: BenchSettings, device: torch.device, machine: str) -> list[dict[str, Any]]:
    from occult.shapes import get_shape

    world, rank = _world()
    rows = []
    total = len(settings.sizes) * len(settings.dtypes) + len(settings.dedup_tokens)
    bar = progress(total, desc=f"all_to_all D={world}", unit="size", disable=rank != 0)
    fixed = {"machine": machine, "D": world, "repeats": settings.repeats,
             "timer": "cuda_events" if device.type == "cuda" else "perf_counter"}
    for dtype_name in settings.dtypes:
        dtype = DTYPES[dtype_name]
        elem = torch.empty(0, dtype=dtype).element_size()
        for size in settings.sizes:
            per_peer = max(size // (elem * world), 1)
            row = alltoall_row([per_peer] * world, dtype, device, settings.repeats, settings.warmup)
            rows.append({**fixed, "pattern": "equal", "dtype": dtype_name, "tokens": None, **row})
            bar.log(pattern="equal", dtype=dtype_name, bytes_per_rank=row["bytes_per_rank"],
                    median_ms=row["median_ms"], algbw_gbps=row["algbw_gbps"])
            bar.update(1)
    shape = get_shape(settings.dedup_shape)
    for tokens in settings.dedup_tokens:
        per_device = dedup_rows_per_device(settings.dedup_shape, tokens, settings.seed)
        row_bytes = packed_row_bytes(shape.hidden, 2, shape.top_k)
        row = alltoall_row([n * row_bytes for n in per_device], torch.uint8, device, settings.repeats,
                           settings.warmup)
        rows.append({**fixed, "pattern": "dedup", "dtype": "uint8", "tokens": tokens, **row})
        bar.log(pattern="dedup", dtype="uint8", bytes_per_rank=row["bytes_per_rank"], median_ms=row["median_ms"],
                algbw_gbps=row["algbw_gbps"])
        bar.update(1)
    bar.close()
    return rows


def grouped_ffn(x_MD: torch.Tensor, offsets: torch.Tensor, w_gate_up_E2FD: torch.Tensor,
                w_down_EDF: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert FFN of rows grouped by expert (equal groups): `_grouped_mm`, else bmm."""
    ffn = w_down_EDF.shape[2]
    if hasattr(torch, "_grouped_mm") and x_MD.is_cuda:
        gate_up = torch._grouped_mm(x_MD, w_gate_up_E2FD.transpose(-2, -1), offs=offsets)
        h_MF = F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
        return torch._grouped_mm(h_MF.contiguous(), w_down_EDF.transpose(-2, -1), offs=offsets)
    experts = w_gate_up_E2FD.shape[0]
    x_EmD = x_MD.view(experts, -1, x_MD.shape[1])
    gate_up = torch.bmm(x_EmD, w_gate_up_E2FD.transpose(1, 2))
    h = F.silu(gate_up[..., :ffn]) * gate_up[..., ffn:]
    return torch.bmm(h, w_down_EDF.transpose(1, 2)).reshape(x_MD.shape[0], -1)


def bench_gemm(settings: BenchSettings, device: torch.device, machine: str) -> list[dict[str, Any]]:
    from occult.shapes import get_shape

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    impl = "grouped_mm" if hasattr(torch, "_grouped_mm") and device.type == "cuda" else "bmm"
    rows = []
    total = len(settings.gemm_shapes) * len(settings.rows_per_expert)
    bar = progress(total, desc="grouped GEMM", unit="size")
    gen = torch.Generator(device=device).manual_seed(settings.seed)
    for shape_name in settings.gemm_shapes:
        shape = get_shape(shape_name)
        experts, d, f = settings.gemm_experts, shape.hidden, shape.ffn
        w_gate_up = (torch.randn(experts, 2 * f, d, generator=gen, device=device) / d**0.5).to(dtype).requires_grad_()
        w_down = (torch.randn(experts, d, f, generator=gen, device=device) / f**0.5).to(dtype).requires_grad_()
        for per_expert in settings.rows_per_expert:
            m = experts * per_expert
            x = torch.randn(m, d, generator=gen, device=device).to(dtype).requires_grad_()
            dy = torch.randn(m, d, generator=gen, device=device).to(dtype)
            offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * per_expert

            def forward() -> None:
                with torch.no_grad():
                    grouped_ffn(x, offsets, w_gate_up, w_down)

            def forward_backward() -> None:
                y = grouped_ffn(x, offsets, w_gate_up, w_down)
                torch.autograd.grad(y, (x, w_gate_up, w_down), dy)

            for pass_, step, factor in (("fwd", forward, 1.0), ("fwd+bwd", forward_backward, 3.0)):
                stats = _stats(time_steps(step, settings.repeats, settings.warmup, device, collective=False))
                flops = 2.0 * 3.0 * d * f * m * factor
                rows.append({"machine": machine, "shape": shape_name, "experts": experts, "hidden": d, "ffn": f,
                             "rows_per_expert": per_expert, "impl": impl, "pass": pass_, **stats,
                             "tflops": flops / (stats["median_ms"] * 1e-3) / 1e12, "repeats": settings.repeats,
                             "timer": "cuda_events" if device.type == "cuda" else "perf_counter"})
            del x, dy
            bar.log(shape=shape_name, rows_per_expert=per_expert, fwd_ms=rows[-2]["median_ms"],
                    fwd_bwd_ms=rows[-1]["median_ms"])
            bar.update(1)
        del w_gate_up, w_down
    bar.close()
    return rows


def machine_name(device: torch.device, world: int) -> str:
    import platform

    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} x{world}"
    return f"cpu {platform.machine()} x{world}"


def run_commbench(settings: BenchSettings) -> dict[str, Path]:
    """Run both benchmarks on every rank of the default process group; rank 0 writes the CSVs."""
    import pandas as pd

    from occult.config import config_hash
    from occult.provenance import provenance, seed_everything, write_csv

    settings.validate()
    world, rank = _world()
    device = torch.device("cuda", torch.cuda.current_device()) if settings.device == "cuda" else torch.device("cpu")
    seed_everything(settings.seed)
    machine = machine_name(device, world)
    a2a = bench_alltoall(settings, device, machine)
    gemm = bench_gemm(settings, device, machine) if rank == 0 else []
    if world > 1:
        dist.barrier()
    out = Path(settings.out_dir)
    paths = {"alltoall": out / "alltoall.csv", "gemm": out / "gemm.csv"}
    if rank == 0:
        meta = provenance(config_hash(asdict(settings)), settings.seed, stage="commbench", settings=asdict(settings),
                          machine=machine)
        write_csv(paths["alltoall"], pd.DataFrame(a2a, columns=list(ALLTOALL_COLUMNS)), meta=meta)
        write_csv(paths["gemm"], pd.DataFrame(gemm, columns=list(GEMM_COLUMNS)), meta=meta)
        frame = pd.DataFrame(a2a)
        print(frame[["pattern", "dtype", "tokens", "bytes_per_rank", "median_ms", "algbw_gbps"]].to_string(index=False))
        sys.stdout.flush()
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.commbench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for alltoall.csv and gemm.csv")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--D", type=int, default=None, help="ranks (default: torchrun's world size; CPU: forked)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="bytes per rank")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "uint8"], choices=sorted(DTYPES))
    parser.add_argument("--dedup-shape", default="olmoe")
    parser.add_argument("--dedup-tokens", type=int, nargs="+", default=list(DEFAULT_DEDUP_TOKENS))
    parser.add_argument("--gemm-shapes", nargs="+", default=["olmoe", "qwen", "deepseek"])
    parser.add_argument("--gemm-experts", type=int, default=8)
    parser.add_argument("--rows-per-expert", type=int, nargs="+", default=list(DEFAULT_ROWS_PER_EXPERT))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--log-json", metavar="PATH",
                        help=f"append JSON-lines logs here (default: ${ENV_LOG_JSON}); read by the entry point")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from occult.harness.ranks import run_in_group

    args = build_parser().parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    world = args.D if args.D is not None else int(os.environ.get("WORLD_SIZE", "1"))
    command = " ".join(["python -m occult.harness.commbench", *(argv if argv is not None else sys.argv[1:])])
    settings = BenchSettings(
        out_dir=str(args.out), device=args.device, sizes=tuple(args.sizes), dtypes=tuple(args.dtypes),
        dedup_shape=args.dedup_shape, dedup_tokens=tuple(args.dedup_tokens), gemm_shapes=tuple(args.gemm_shapes),
        gemm_experts=args.gemm_experts, rows_per_expert=tuple(args.rows_per_expert), repeats=args.repeats,
        warmup=args.warmup, seed=args.seed, command=command)
    settings.validate()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but torch sees no GPU (use --device cpu)")
    run_in_group(lambda: run_commbench(settings), args.device, world, args.timeout_s, deadline_s=3600.0)
    return 0


if __name__ == "__main__":
    sys.exit(run_main("commbench", main))
