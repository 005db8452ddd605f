"""GPU benchmark of the EP runtime kernels against their references and `torch._grouped_mm`.

    python -m occult.harness.kernel_bench --out results/bench/kernels.csv
    TRITON_INTERPRET=1 python -m occult.harness.kernel_bench --smoke --out /tmp/kernels.csv

Workload (default: the OLMoE layer, D=2048, F=1024, 64 experts, top-8, 2^14 tokens per rank, 2
ranks): every token of every rank is routed; the benchmark plays rank 0, which owns experts
[0, E/ranks) and receives one row per (token, rank 0) in dedup mode, i.e. M ≈ tokens·ranks·k/2
(token, local expert) pairs. Routing is `uniform` (random top-k) or `skewed` (Zipf-popular experts,
the popular ones on rank 0: the hot rank). `combine` runs on a source rank: T = tokens per rank,
J = ranks.

Before timing, each Triton op is checked in bf16 against its fp32 reference (relative Frobenius
error of the output and every gradient, must be ≤ 1e-2). Timing: `triton.testing.do_bench`
(median, 20% and 80% quantiles), forward and forward+backward, for `triton`, `reference` (the
plain-torch references, fp32 inside) and `grouped_mm` (`torch._grouped_mm` with torch gathers /
index_add, where available). Rows are appended to a long-format CSV (GPU name, versions, commit,
timestamp; provenance in a `.meta.json` sidecar); a short table is printed last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
import torch.nn.functional as F
import triton
from tqdm import tqdm

from occult.logs import run_main
from occult.provenance import atomic_path, git_commit, provenance, seed_everything, write_json

from occult.kernels.combine import combine
from occult.kernels.gemm_configs import tma_disabled
from occult.kernels.grouped_down_reduce import grouped_down_reduce
from occult.kernels.grouped_swiglu import grouped_swiglu
from occult.kernels.reference import combine_ref, grouped_down_reduce_ref, grouped_swiglu_ref

REL_ERR_LIMIT = 1e-2


@dataclass(frozen=True)
class BenchShape:
    tokens_per_rank: int
    ranks: int
    experts: int
    top_k: int
    hidden: int
    ffn: int


@dataclass(frozen=True)
class Workload:
    """Rank 0's expert-side inputs and a source rank's combine inputs."""

    routing: str
    x_RD: torch.Tensor
    pair_row_M: torch.Tensor
    pair_gate_M: torch.Tensor
    expert_offsets: torch.Tensor
    w_gate_up_E2FD: torch.Tensor
    w_down_EDF: torch.Tensor
    z_SD: torch.Tensor
    brim0_TJ: torch.Tensor


def route(shape: BenchShape, routing: str, num_tokens: int, gen: torch.Generator, zipf: float) -> torch.Tensor:
    """Top-k expert ids [num_tokens, k] (distinct per token) by Gumbel top-k over log-popularity."""
    if routing == "uniform":
        log_pop = torch.zeros(shape.experts)
    elif routing == "skewed":
        log_pop = -zipf * torch.log(torch.arange(1, shape.experts + 1, dtype=torch.float32))
    else:
        raise ValueError(f"--routing: unknown routing {routing!r} (uniform | skewed)")
    gumbel = -torch.log(-torch.log(torch.rand(num_tokens, shape.experts, generator=gen).clamp_min(1e-20)))
    return (log_pop + gumbel).topk(shape.top_k, dim=1).indices


def build_workload(shape: BenchShape, routing: str, dtype: torch.dtype, device: torch.device, seed: int,
                   zipf: float) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    local_experts = shape.experts // shape.ranks
    # Rank 0's received rows: every token of every rank that picked an expert on rank 0.
    ids_TK = route(shape, routing, shape.tokens_per_rank * shape.ranks, gen, zipf)
    gates_TK = torch.softmax(torch.randn(ids_TK.shape, generator=gen), dim=1)
    local_TK = ids_TK < local_experts
    received_T = local_TK.any(dim=1)
    row_of_token = torch.cumsum(received_T.long(), 0) - 1
    token_M, slot_M = local_TK.nonzero(as_tuple=True)
    expert_M = ids_TK[token_M, slot_M]
    order = torch.argsort(expert_M, stable=True)
    pair_row_M = row_of_token[token_M[order]]
    pair_gate_M = gates_TK[token_M[order], slot_M[order]]
    counts = torch.bincount(expert_M, minlength=local_experts)
    expert_offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    num_rows = int(received_T.sum())
    x_RD = torch.randn(num_rows, shape.hidden, generator=gen)
    w_gate_up = torch.randn(local_experts, 2 * shape.ffn, shape.hidden, generator=gen) / math.sqrt(shape.hidden)
    w_down = torch.randn(local_experts, shape.hidden, shape.ffn, generator=gen) / math.sqrt(shape.ffn)
    # A source rank's combine: token t's partial from rank d exists if t picked an expert on d.
    ids_src = ids_TK[: shape.tokens_per_rank]
    has_partial_TJ = torch.stack(
        [((ids_src // local_experts) == d).any(dim=1) for d in range(shape.ranks)], dim=1
    )
    brim0_TJ = torch.full(has_partial_TJ.shape, -1, dtype=torch.long)
    brim0_TJ[has_partial_TJ] = torch.randperm(int(has_partial_TJ.sum()), generator=gen)
    z_SD = torch.randn(int(has_partial_TJ.sum()), shape.hidden, generator=gen)
    return Workload(
        routing=routing,
        x_RD=x_RD.to(device, dtype),
        pair_row_M=pair_row_M.to(device),
        pair_gate_M=pair_gate_M.to(device),
        expert_offsets=expert_offsets.to(device),
        w_gate_up_E2FD=w_gate_up.to(device, dtype),
        w_down_EDF=w_down.to(device, dtype),
        z_SD=z_SD.to(device, dtype),
        brim0_TJ=brim0_TJ.to(device),
    )


# ----------------------------------------------------------------------------------------------
# The implementations compared
# ----------------------------------------------------------------------------------------------


def swiglu_grouped_mm(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD):
    ffn = w_gate_up_E2FD.shape[1] // 2
    gate_up = torch._grouped_mm(x_RD[pair_row_M], w_gate_up_E2FD.transpose(1, 2),
                                offs=expert_offsets[1:].to(torch.int32))
    return F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]


def down_reduce_grouped_mm(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF, num_rows):
    y_MD = torch._grouped_mm(h_MF, w_down_EDF.transpose(1, 2), offs=expert_offsets[1:].to(torch.int32))
    y_MD = y_MD.float() * pair_gate_M.float()[:, None]
    out = torch.zeros(num_rows, y_MD.shape[1], dtype=torch.float32, device=h_MF.device)
    return out.index_add_(0, pair_row_M, y_MD).to(h_MF.dtype)


def row_table(pair_row_M: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[R, K] positions of each row's pairs (−1 = none), K = the most pairs of a row: the table the
    layer's packed rows give the expert side."""
    order = torch.argsort(pair_row_M, stable=True)
    rows_sorted = pair_row_M[order]
    counts = torch.bincount(pair_row_M, minlength=num_rows)
    slots = max(int(counts.max()) if counts.numel() else 1, 1)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=order.device) - first[rows_sorted]
    table = torch.full((num_rows, slots), -1, dtype=torch.long, device=pair_row_M.device)
    table[rows_sorted, rank] = order
    return table


def swiglu_materialized(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD):
    """The Triton op whose backward forms [dg | du] in one elementwise pass (mode taken at forward)."""
    import importlib

    module = importlib.import_module("occult.kernels.grouped_swiglu_backward")
    saved, module.SWIGLU_BWD_MODE = module.SWIGLU_BWD_MODE, "materialized"
    try:
        return grouped_swiglu(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD)
    finally:
        module.SWIGLU_BWD_MODE = saved


def with_pointer_operands(op: Callable) -> Callable:
    """`op` with the forward GEMMs loading weights (and h) through pointers, not tensor
    descriptors: the A/B of the TMA operands in the same run."""
    def run(*args):
        with tma_disabled():
            return op(*args)
    return run


# Ceilings: not the op. The same GEMM FLOPs without what makes the op hard: `grouped_mm_sorted`
# reads rows already in expert order (no gather) and returns per-pair rows (no reduction);
# `dense_mm` also gives every pair expert 0's weights (one cuBLAS GEMM). Forward only.
_PREPARED: dict = {}


def _prepared(kind: str, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`make()` once per (kind, key): inputs that the timed calls take ready-made, built outside
    the timing (one entry per kind, the latest)."""
    if _PREPARED.get(kind, (None,))[0] != key:
        _PREPARED[kind] = (key, make())
    return _PREPARED[kind][1]


def _rows_in_expert_order(x_RD: torch.Tensor, pair_row_M: torch.Tensor) -> torch.Tensor:
    """x[pair_row], as the layer never materialises it."""
    key = (x_RD.data_ptr(), x_RD._version, pair_row_M.data_ptr(), tuple(x_RD.shape), pair_row_M.numel())
    return _prepared("sorted_rows", key, lambda: x_RD.detach()[pair_row_M])


def swiglu_grouped_mm_sorted(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD):
    ffn = w_gate_up_E2FD.shape[1] // 2
    gate_up = torch._grouped_mm(_rows_in_expert_order(x_RD, pair_row_M), w_gate_up_E2FD.transpose(1, 2),
                                offs=expert_offsets[1:].to(torch.int32))
    return F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]


def swiglu_dense_mm(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD):
    ffn = w_gate_up_E2FD.shape[1] // 2
    gate_up = _rows_in_expert_order(x_RD, pair_row_M) @ w_gate_up_E2FD[0].T
    return F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]


def down_grouped_mm_sorted(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF, num_rows):
    y_MD = torch._grouped_mm(h_MF, w_down_EDF.transpose(1, 2), offs=expert_offsets[1:].to(torch.int32))
    return y_MD * pair_gate_M.to(y_MD.dtype)[:, None]


def down_dense_mm(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF, num_rows):
    return (h_MF @ w_down_EDF[0].T) * pair_gate_M.to(h_MF.dtype)[:, None]


def _cached_row_table(pair_row_M: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`row_table`, as the layer gets it for free from its packed rows."""
    key = (pair_row_M.data_ptr(), pair_row_M.numel(), num_rows)
    return _prepared("row_table", key, lambda: row_table(pair_row_M, num_rows))


def swiglu_row_table(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD):
    """The Triton op as the EP layer calls it: with the row table of its packed rows (dx reduction)."""
    return grouped_swiglu(x_RD, pair_row_M, expert_offsets, w_gate_up_E2FD,
                          row_pairs_RK=_cached_row_table(pair_row_M, x_RD.shape[0]))


def down_row_table(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF, num_rows):
    """The Triton op as the EP layer calls it: the pair rows reduced through the row table."""
    return grouped_down_reduce(h_MF, pair_row_M, pair_gate_M, expert_offsets, w_down_EDF, num_rows,
                               row_pairs_RK=_cached_row_table(pair_row_M, num_rows))


SWIGLU_IMPLS = {"triton": grouped_swiglu, "triton_materialized": swiglu_materialized,
                "triton_row_table": swiglu_row_table,
                "triton_pointers": with_pointer_operands(grouped_swiglu),
                "reference": grouped_swiglu_ref, "grouped_mm": swiglu_grouped_mm,
                "grouped_mm_sorted": swiglu_grouped_mm_sorted, "dense_mm": swiglu_dense_mm}
DOWN_IMPLS = {"triton": grouped_down_reduce, "triton_materialized": grouped_down_reduce,
              "triton_row_table": down_row_table,
              "triton_pointers": with_pointer_operands(grouped_down_reduce),
              "reference": grouped_down_reduce_ref, "grouped_mm": down_reduce_grouped_mm,
              "grouped_mm_sorted": down_grouped_mm_sorted, "dense_mm": down_dense_mm}
FORWARD_ONLY_IMPLS = ("grouped_mm_sorted", "dense_mm")
# Forward impls also timed in a burst (pass "fwd_burst", as `dense_peak` times cuBLAS's burst rate):
# the like-for-like partner of `pct_of_burst_peak`.
BURST_IMPLS = ("triton", "dense_mm")
COMBINE_IMPLS = {"triton": combine, "reference": combine_ref}


@dataclass(frozen=True)
class Case:
    """One op: `run(impl, leaves)` is its forward on the differentiable inputs `leaves`."""

    op: str
    run: Callable[[str, tuple[torch.Tensor, ...]], torch.Tensor]
    leaves: tuple[torch.Tensor, ...]
    impls: tuple[str, ...]
    flops_fwd: float
    bytes_fwd: float
    bytes_bwd: float


def make_cases(work: Workload) -> list[Case]:
    rows, offsets, brim = work.pair_row_M, work.expert_offsets, work.brim0_TJ
    x, gates, w_gu, w_down, z = (t.detach().requires_grad_() for t in (
        work.x_RD, work.pair_gate_M, work.w_gate_up_E2FD, work.w_down_EDF, work.z_SD))
    num_pairs, num_rows = rows.numel(), x.shape[0]
    experts, two_f, hidden = w_gu.shape
    ffn = two_f // 2
    with torch.no_grad():
        h = grouped_swiglu_ref(x, rows, offsets, w_gu).requires_grad_()
    size = x.element_size()
    swiglu_bytes = size * (num_pairs * hidden + experts * two_f * hidden + num_pairs * ffn)
    down_bytes = size * (num_pairs * ffn + experts * hidden * ffn + num_rows * hidden)
    named, tokens = int((brim >= 0).sum()), brim.shape[0]

    def swiglu(impl, leaves):
        return SWIGLU_IMPLS[impl](leaves[0], rows, offsets, leaves[1])

    def down(impl, leaves):
        return DOWN_IMPLS[impl](leaves[0], rows, leaves[1], offsets, leaves[2], num_rows)

    def expert_ffn(impl, leaves):
        h_MF = SWIGLU_IMPLS[impl](leaves[0], rows, offsets, leaves[2])
        return DOWN_IMPLS[impl](h_MF, rows, leaves[1], offsets, leaves[3], num_rows)

    def combine_case(impl, leaves):
        return COMBINE_IMPLS[impl](leaves[0], brim)

    return [
        Case("grouped_swiglu", swiglu, (x, w_gu), tuple(SWIGLU_IMPLS),
             2.0 * num_pairs * hidden * two_f, swiglu_bytes, 2 * swiglu_bytes),
        Case("grouped_down_reduce", down, (h, gates, w_down), tuple(DOWN_IMPLS),
             2.0 * num_pairs * ffn * hidden, down_bytes, 2 * down_bytes),
        Case("expert_ffn", expert_ffn, (x, gates, w_gu, w_down), tuple(DOWN_IMPLS),
             2.0 * num_pairs * hidden * (two_f + ffn), swiglu_bytes + down_bytes, 2 * (swiglu_bytes + down_bytes)),
        Case("combine", combine_case, (z,), tuple(COMBINE_IMPLS),
             0.0, size * (named + tokens) * hidden, size * (tokens + 2 * z.shape[0]) * hidden),
    ]


# ----------------------------------------------------------------------------------------------
# Checking and timing
# ----------------------------------------------------------------------------------------------


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def check_against_reference(case: Case, impl: str = "triton") -> float:
    """Largest relative error of a Triton implementation's output and gradients vs the reference
    run on fp32 copies of the same inputs."""
    out = case.run(impl, case.leaves)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, case.leaves, grad_out)
    leaves32 = tuple(leaf.detach().float().requires_grad_() for leaf in case.leaves)
    out_ref = case.run("reference", leaves32)
    grads_ref = torch.autograd.grad(out_ref, leaves32, grad_out.float())
    return max(rel_err(got, want) for got, want in zip((out, *grads), (out_ref, *grads_ref)))


def time_ms(fn: Callable[[], object], on_gpu: bool, warmup_ms: int, rep_ms: int) -> tuple[float, float, float]:
    """(median, 20%, 80%) milliseconds."""
    if on_gpu:
        median, low, high = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return float(median), float(low), float(high)
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return samples[1], samples[0], samples[2]


def burst_ms(fn: Callable[[], object], calls: int = 30, skip: int = 10) -> tuple[float, float, float]:
    """(median, 20%, 80%) ms of single calls after 1 s of idle: `skip` untimed calls, then
    `calls - skip` timed ones (≈ the first tens of ms of load, before the clocks settle lower)."""
    torch.cuda.synchronize()
    time.sleep(1.0)
    samples = []
    for i in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= skip:
            samples.append(start.elapsed_time(end))
    samples.sort()
    n = len(samples)
    return samples[n // 2], samples[n // 5], samples[(4 * n) // 5]


def bench_case(case: Case, on_gpu: bool, warmup_ms: int, rep_ms: int) -> list[dict]:
    rows = []
    for impl in case.impls:
        passes = ("fwd",) if impl in FORWARD_ONLY_IMPLS else ("fwd", "fwd+bwd")
        if on_gpu and impl in BURST_IMPLS:
            passes += ("fwd_burst",)
        for pass_name in passes:
            if pass_name in ("fwd", "fwd_burst"):
                def fn(impl=impl):
                    with torch.no_grad():
                        return case.run(impl, case.leaves)
            else:
                with torch.no_grad():
                    grad_out = torch.randn_like(case.run("reference", case.leaves))

                def fn(impl=impl, grad_out=grad_out):
                    return torch.autograd.grad(case.run(impl, case.leaves), case.leaves, grad_out)
            started_ms = round(time.time() * 1e3)     # to line rows up with telemetry sampled beside the run
            try:
                if pass_name == "fwd_burst":
                    median, low, high = burst_ms(fn)
                else:
                    median, low, high = time_ms(fn, on_gpu, warmup_ms, rep_ms)
                error = ""
            except Exception as exc:  # a baseline that this torch/GPU cannot run: record, go on
                median = low = high = float("nan")
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            flops = case.flops_fwd * (3 if pass_name == "fwd+bwd" else 1)
            moved = case.bytes_fwd + (case.bytes_bwd if pass_name == "fwd+bwd" else 0)
            rows.append({
                "op": case.op, "impl": impl, "pass": pass_name, "started_unix_ms": started_ms,
                "ended_unix_ms": round(time.time() * 1e3),
                "median_ms": median, "p20_ms": low, "p80_ms": high,
                "tflops": flops / (median * 1e-3) / 1e12 if flops else float("nan"),
                "gbps": moved / (median * 1e-3) / 1e9,
                "error": error,
            })
    return rows


def dense_peak(warmup_ms: int, rep_ms: int, size: int = 8192) -> dict[str, dict]:
    """The bf16 dense matmul rate of this GPU (cuBLAS, size³), timed two ways: `cublas` like every
    kernel here (`do_bench`: back to back for rep_ms, so at the clocks the GPU sustains under that
    load; what `pct_of_peak` divides by) and `cublas_burst` (median of 20 single calls after 10,
    ≈40 ms of load: the "measured peak" of the earlier runs; `gpu_ep_bench.sh` writes it to peak.csv)."""
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    timings = {"cublas": time_ms(lambda: a @ b, True, warmup_ms, rep_ms), "cublas_burst": burst_ms(lambda: a @ b)}
    return {impl: {"median_ms": median, "p20_ms": low, "p80_ms": high,
                   "tflops": 2.0 * size**3 / (median * 1e-3) / 1e12,
                   "gbps": 3 * size * size * 2 / (median * 1e-3) / 1e9, "error": "", "rel_err_vs_fp32": float("nan")}
            for impl, (median, low, high) in timings.items()}


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="long-format CSV (rows are appended)")
    parser.add_argument("--log-json", help="JSON-lines log of this run (occult.logs)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU with TRITON_INTERPRET=1")
    add_workload_args(parser, routing_nargs="+", routing_default=["uniform", "skewed"])
    ops = ["grouped_swiglu", "grouped_down_reduce", "expert_ffn", "combine"]
    parser.add_argument("--ops", nargs="+", default=ops, choices=ops)
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    check_workload_args(parser, args)
    return args


def add_workload_args(parser: argparse.ArgumentParser, routing_nargs: str | None, routing_default) -> None:
    """The workload's shape and routing options (shared with `tune_kernels`)."""
    parser.add_argument("--tokens-per-rank", type=int, default=2**14)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--routing", nargs=routing_nargs, default=routing_default, choices=["uniform", "skewed"])
    parser.add_argument("--zipf", type=float, default=1.2, help="popularity exponent of the skewed routing")


def check_workload_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject shapes the workload cannot build; `--smoke` swaps in the tiny interpreter shape."""
    if args.experts % args.ranks:
        parser.error(f"--experts {args.experts} is not divisible by --ranks {args.ranks}")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if args.smoke:
        args.tokens_per_rank, args.experts, args.top_k, args.hidden, args.ffn = 48, 8, 2, 32, 16


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("bench_kernels: no CUDA device; on CPU run `TRITON_INTERPRET=1 python -m "
                 "occult.harness.kernel_bench --smoke --out ...`")
    if not on_gpu and not args.smoke:
        sys.exit("bench_kernels: without a GPU only --smoke is supported")
    seed_everything(args.seed)
    device = torch.device("cuda" if on_gpu else "cpu")
    # bf16 on the GPU; the interpreter computes bf16 wrongly, so the CPU smoke run uses fp16.
    dtype = torch.bfloat16 if on_gpu else torch.float16
    shape = BenchShape(args.tokens_per_rank, args.ranks, args.experts, args.top_k, args.hidden, args.ffn)
    meta = {
        "gpu": torch.cuda.get_device_name(0) if on_gpu else "cpu (triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(),
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "dtype": str(dtype).removeprefix("torch."), "smoke": args.smoke,
    }
    results, failures = [], []
    for routing in args.routing:
        work = build_workload(shape, routing, dtype, device, args.seed, args.zipf)
        workload_cols = {"routing": routing, **asdict(shape), "local_experts": args.experts // args.ranks,
                         "M": work.pair_row_M.numel(), "R": work.x_RD.shape[0],
                         "max_expert_pairs": int((work.expert_offsets[1:] - work.expert_offsets[:-1]).max()),
                         "T": work.brim0_TJ.shape[0], "S": work.z_SD.shape[0]}
        cases = [case for case in make_cases(work) if case.op in args.ops]
        for case in tqdm(cases, desc=f"bench_kernels {routing}", file=sys.stderr):
            errors = {impl: check_against_reference(case, impl) for impl in case.impls if impl.startswith("triton")}
            for impl, error in errors.items():
                if not error <= REL_ERR_LIMIT:
                    failures.append(f"{routing}/{case.op}/{impl}: relative error {error:.3g} > {REL_ERR_LIMIT}")
            for row in bench_case(case, on_gpu, args.warmup_ms, args.rep_ms):
                row["rel_err_vs_fp32"] = errors.get(row["impl"], float("nan"))
                results.append({**workload_cols, **row, **meta})
    if on_gpu:   # the denominators of "% of peak", measured in the same run
        started_ms = round(time.time() * 1e3)
        peaks = dense_peak(args.warmup_ms, args.rep_ms)
        span = {"started_unix_ms": started_ms, "ended_unix_ms": round(time.time() * 1e3)}     # both timings
        results += [{"op": "matmul_8192", "impl": impl, "pass": "fwd", **span, **row, **meta}
                    for impl, row in peaks.items()]
        peak, burst_peak = peaks["cublas"]["tflops"], peaks["cublas_burst"]["tflops"]
        for row in results:
            row["pct_of_peak"] = 100.0 * row["tflops"] / peak
            row["pct_of_burst_peak"] = 100.0 * row["tflops"] / burst_peak
    frame = pd.DataFrame(results)
    if args.out.exists():
        frame = pd.concat([pd.read_csv(args.out), frame], ignore_index=True)
    with atomic_path(args.out) as tmp:
        frame.to_csv(tmp, index=False, float_format="%.6g")
    write_json(Path(str(args.out) + ".meta.json"), provenance(None, args.seed, bench_args=vars(args)))
    table = pd.DataFrame(results).pivot_table(index=["routing", "op", "pass"], columns="impl", values="median_ms")
    if on_gpu:
        print(f"bf16 dense peak (cuBLAS 8192^3): {peak:.0f} TFLOP/s sustained (do_bench), {burst_peak:.0f} in a "
              f"40 ms burst; % of the sustained one, forward:")
        forward = pd.DataFrame(results).query("`pass` == 'fwd' and op != 'matmul_8192' and op != 'combine'")
        print(forward.pivot_table(index=["routing", "op"], columns="impl", values="pct_of_peak")
              .to_string(float_format=lambda v: f"{v:.1f}"))
        bursts = pd.DataFrame(results).query("`pass` == 'fwd_burst'")
        if len(bursts):
            print("each timed in a burst like cuBLAS's, % of the burst peak:")
            print(bursts.pivot_table(index=["routing", "op"], columns="impl", values="pct_of_burst_peak")
                  .to_string(float_format=lambda v: f"{v:.1f}"))
    print(f"\nmedian ms ({meta['gpu']}, {meta['dtype']}, torch {meta['torch']}, triton {meta['triton']}); "
          f"rows appended to {args.out}")
    print(table.to_string(float_format=lambda v: f"{v:.3f}"))
    for failure in failures:
        print(f"CORRECTNESS FAILURE: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run_main("kernel_bench", main))
