"""Config sweep of the EP runtime's six grouped GEMM kernels: which tile config is fastest at a shape.

    python -m occult.harness.kernel_tune --out results/<machine>/tune_v1/tune.csv
    TRITON_INTERPRET=1 python -m occult.harness.kernel_tune --smoke --out /tmp/tune.csv

The autotuner of each kernel picks among 4–5 hand-chosen configs. This sweep times many more, one
at a time, each forced through `forced_gemm_meta` (the autotuner is bypassed) while the op that
launches the kernel runs as the layer runs it:

| kernel | op run (everything else in the op is the same for every config) | GEMM FLOPs |
|---|---|---|
| `_swiglu_fwd_kernel` | `grouped_swiglu_forward`, pre-activations saved | 2·M·D·2F |
| `_down_fwd_kernel` | `grouped_down_reduce_forward` with the row table (+ the row reduction pass) | 2·M·F·D |
| `_swiglu_bwd_dx_kernel` | `grouped_swiglu_backward`, dx only, materialised [dg, du] (+ that pass, + row reduction) | 2·M·2F·D |
| `_swiglu_bwd_dw_kernel` | the same, dW only | 2·M·2F·D |
| `_down_bwd_dh_kernel` | `grouped_down_reduce_backward`, dh and dgate | 2·M·D·F |
| `_down_bwd_dw_kernel` | the same, dW only | 2·M·D·F |

Workload: `bench_kernels.build_workload` (rank 0's pairs of the OLMoE layer, 2^14 tokens × 2 ranks,
uniform routing by default). Each candidate's outputs are checked against the autotuned default's
on the same inputs (relative Frobenius error ≤ 1e-2, else status `wrong`; the default itself is
checked against fp32 by `bench_kernels` and the tests). A config that does not fit the GPU
(shared memory, registers) is recorded `out_of_resources`. Timing: `triton.testing.do_bench`
(median, 20/80 % quantiles) of the whole op, so `tflops` = the kernel's GEMM FLOPs over the op's time.

Candidates: every (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a grid whose shared-memory tiles fit
`--smem-kib` and whose fp32 accumulators need ≤ 128 registers a thread, the autotuner's own configs
first, then a seeded shuffle, cut at `--max-configs` per kernel. `--time-limit-s` is shared out over
the kernels (time one leaves goes to the next); past its share a kernel starts no new config. Rows are appended to a long-format CSV with provenance; the
best configs per kernel are printed last. Nothing is changed in the kernels: a winning config is
copied into their config lists by hand, with the CSV it came from.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import itertools
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
import triton

from occult.logs import run_main
from occult.provenance import atomic_path, git_commit, provenance, seed_everything, write_json

from occult.harness.kernel_bench import (BenchShape, Workload, add_workload_args, build_workload, check_workload_args, rel_err,
                            row_table, time_ms)
from occult.kernels.combine import interpreting
from occult.kernels.gemm_configs import forced_gemm_meta
from occult.kernels.grouped_down_reduce import grouped_down_reduce_backward, grouped_down_reduce_forward
from occult.kernels.grouped_swiglu import grouped_swiglu_forward
from occult.kernels.grouped_swiglu_backward import grouped_swiglu_backward

# The package re-exports the ops under the modules' names: import the modules themselves.
configs_module = importlib.import_module("occult.kernels.gemm_configs")
KERNEL_MODULES = tuple(importlib.import_module(f"occult.kernels.{name}")
                       for name in ("grouped_swiglu", "grouped_swiglu_backward", "grouped_down_reduce"))
REL_ERR_LIMIT = 1e-2
META_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "GROUP_SIZE")
ACC_REGISTER_LIMIT = 128          # fp32 accumulator registers per thread a config may need


@dataclass(frozen=True)
class KernelSpec:
    """One GEMM kernel: its tiles (for the candidate filter), how to run it, its FLOPs."""

    name: str                     # the triton.jit function's name (the key of forced_gemm_meta)
    a_tiles: int                  # A tiles [BLOCK_M, BLOCK_K] loaded per K step
    b_tiles: int                  # B tiles [BLOCK_K, BLOCK_N] loaded per K step
    accumulators: int             # fp32 [BLOCK_M, BLOCK_N] accumulators
    grouped: bool                 # takes GROUP_SIZE (swizzled M tiles)
    current: tuple                # the autotuner's configs (triton.Config)
    flops: Callable[[int, int, int], float]     # (pairs M, hidden D, ffn F) -> GEMM FLOPs


KERNELS = {
    "swiglu_fwd": KernelSpec("_swiglu_fwd_kernel", 1, 2, 2, True, configs_module.SWIGLU_FWD_CONFIGS,
                             lambda m, d, f: 2.0 * m * d * 2 * f),
    "down_fwd": KernelSpec("_down_fwd_kernel", 1, 1, 1, True, configs_module.SINGLE_ACC_CONFIGS,
                           lambda m, d, f: 2.0 * m * f * d),
    "swiglu_dx": KernelSpec("_swiglu_bwd_dx_kernel", 2, 2, 1, True, configs_module.SWIGLU_DX_CONFIGS,
                            lambda m, d, f: 2.0 * m * 2 * f * d),
    "swiglu_dw": KernelSpec("_swiglu_bwd_dw_kernel", 2, 1, 2, False, configs_module.SWIGLU_DW_CONFIGS,
                            lambda m, d, f: 2.0 * m * 2 * f * d),
    "down_dh": KernelSpec("_down_bwd_dh_kernel", 1, 1, 1, True, configs_module.SINGLE_ACC_CONFIGS,
                          lambda m, d, f: 2.0 * m * d * f),
    "down_dw": KernelSpec("_down_bwd_dw_kernel", 1, 1, 1, False, configs_module.SINGLE_ACC_CONFIGS,
                          lambda m, d, f: 2.0 * m * d * f),
}
assert all(any(hasattr(module, spec.name) for module in KERNEL_MODULES) for spec in KERNELS.values())


def config_meta(config) -> dict[str, int]:
    """A triton.Config as the flat meta dict `forced_gemm_meta` takes."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def fits(spec: KernelSpec, meta: dict[str, int], elem_bytes: int, smem_kib: float) -> bool:
    """Shared memory of the pipelined tiles ≤ smem_kib and accumulators ≤ the register budget."""
    bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    smem = meta["num_stages"] * (spec.a_tiles * bm * bk + spec.b_tiles * bk * bn) * elem_bytes
    registers = spec.accumulators * bm * bn / (32 * meta["num_warps"])
    return smem <= smem_kib * 1024 and registers <= ACC_REGISTER_LIMIT


def candidates(spec: KernelSpec, *, blocks: tuple[int, ...], block_k: tuple[int, ...], warps: tuple[int, ...],
               stages: tuple[int, ...], group_sizes: tuple[int, ...], elem_bytes: int, smem_kib: float,
               limit: int, seed: int) -> list[dict[str, int]]:
    """The autotuner's configs, then a seeded shuffle of the grid's fitting configs; `limit` in all."""
    groups = group_sizes if spec.grouped else (None,)
    own = [config_meta(cfg) for cfg in spec.current]
    if spec.grouped:                   # the autotuner launches them with the module's GROUP_M
        own = [{**meta, "GROUP_SIZE": configs_module.GROUP_M} for meta in own]
    grid = []
    for bm, bn, bk, nw, ns, group in itertools.product(blocks, blocks, block_k, warps, stages, groups):
        meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns}
        if group is not None:
            meta["GROUP_SIZE"] = group
        if meta not in own and fits(spec, meta, elem_bytes, smem_kib):
            grid.append(meta)
    random.Random(seed).shuffle(grid)
    return (own + grid)[:limit]


@dataclass
class Inputs:
    """Everything the six ops take, built once per workload."""

    x: torch.Tensor
    rows: torch.Tensor
    gates: torch.Tensor
    offsets: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    table: torch.Tensor
    h: torch.Tensor
    preact: torch.Tensor
    dh: torch.Tensor
    dy: torch.Tensor


def make_inputs(work: Workload, seed: int) -> Inputs:
    gen = torch.Generator(device=work.x_RD.device).manual_seed(seed)
    x, rows, offsets = work.x_RD, work.pair_row_M, work.expert_offsets
    table = row_table(rows, x.shape[0])
    h, preact = grouped_swiglu_forward(x, rows, offsets, work.w_gate_up_E2FD, True)
    dh = torch.randn(h.shape, generator=gen, device=h.device).to(h.dtype)
    dy = torch.randn(x.shape, generator=gen, device=x.device).to(x.dtype)
    return Inputs(x, rows, work.pair_gate_M, offsets, work.w_gate_up_E2FD, work.w_down_EDF, table, h, preact, dh, dy)


def op_runner(kernel: str, inp: Inputs) -> Callable[[], tuple[torch.Tensor, ...]]:
    """The op that launches `kernel`, as a no-argument call returning the outputs it is judged on."""
    num_rows = inp.x.shape[0]
    if kernel == "swiglu_fwd":
        return lambda: grouped_swiglu_forward(inp.x, inp.rows, inp.offsets, inp.w_gate_up, True)
    if kernel == "down_fwd":
        return lambda: (grouped_down_reduce_forward(inp.h, inp.rows, inp.gates, inp.offsets, inp.w_down, num_rows,
                                                    inp.table),)
    if kernel in ("swiglu_dx", "swiglu_dw"):
        need_dx = kernel == "swiglu_dx"
        return lambda: tuple(t for t in grouped_swiglu_backward(
            inp.dh, inp.x, inp.rows, inp.offsets, inp.w_gate_up, inp.preact, need_dx, not need_dx, inp.table,
            "materialized") if t.numel())
    if kernel in ("down_dh", "down_dw"):
        need_dh = kernel == "down_dh"
        return lambda: tuple(t for t in grouped_down_reduce_backward(
            inp.dy, inp.h, inp.rows, inp.gates, inp.offsets, inp.w_down, need_dh, not need_dh) if t.numel())
    raise ValueError(f"--kernels: unknown kernel {kernel!r} (one of {sorted(KERNELS)})")


def classify(exc: BaseException) -> str:
    """Status of a config that raised: out_of_resources (does not fit this GPU) or error: <what>."""
    if isinstance(exc, triton.runtime.errors.OutOfResources) or "out of resource" in str(exc).lower():
        return "out_of_resources"
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def sweep_kernel(kernel: str, inp: Inputs, metas: list[dict[str, int]], flops: float, on_gpu: bool,
                 warmup_ms: int, rep_ms: int, deadline: float) -> list[dict]:
    """The autotuner's pick, the pinned default (`TUNED_GEMM_META`) where one applies, then each
    forced config: status, times, error vs the autotuner's outputs."""
    spec = KERNELS[kernel]
    run = op_runner(kernel, inp)
    autotuned = _autotuner_only(run)
    want = autotuned()
    pinned = pinned_meta(spec.name, run)
    labelled = [("autotuned", None), *([("pinned", dict(pinned))] if pinned else []), *[("forced", m) for m in metas]]
    rows = []
    for index, (label, meta) in enumerate(labelled):
        if time.monotonic() > deadline:
            print(f"tune_kernels: time limit reached in {kernel} after {index - 1} configs", file=sys.stderr)
            break
        forced_index = index - (len(labelled) - len(metas))        # position among `metas`
        row = {"kernel": kernel, "kernel_fn": spec.name, "config": label,
               "in_autotune_set": label == "autotuned" or (label == "forced" and forced_index < len(spec.current)),
               **{key: (meta or {}).get(key) for key in
                  ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "GROUP_SIZE")},
               "extra_meta": " ".join(f"{k}={v}" for k, v in (meta or {}).items() if k not in META_KEYS) or None}
        try:
            if label == "autotuned":
                got, fn = want, autotuned
            elif label == "pinned":       # what the op launches by default: TUNED_GEMM_META
                got, fn = run(), run
            else:
                with forced_gemm_meta(spec.name, meta):
                    got = run()
                fn = _forced(run, spec.name, meta)
            error = max((rel_err(g, w) for g, w in zip(got, want)), default=0.0)
            if not error <= REL_ERR_LIMIT:
                row.update(status="wrong", rel_err_vs_default=error)
            else:
                median, low, high = time_ms(fn, on_gpu, warmup_ms, rep_ms)
                row.update(status="ok", rel_err_vs_default=error, median_ms=median, p20_ms=low, p80_ms=high,
                           tflops=flops / (median * 1e-3) / 1e12)
        except Exception as exc:       # a config this GPU cannot run: record it, go on
            row.update(status=classify(exc))
        rows.append(row)
    return rows


def pinned_meta(name: str, run: Callable[[], object]):
    """The `TUNED_GEMM_META` config the op launches by default for this workload, or None: one
    default run of the op, then its launcher's choice for kernel `name` (`LAST_LAUNCH_META`)."""
    run()
    meta = configs_module.LAST_LAUNCH_META.get(name)
    return meta if any(meta is tuned for tuned in configs_module.TUNED_GEMM_META.values()) else None


def _autotuner_only(run: Callable[[], object]) -> Callable[[], object]:
    def call():
        with configs_module.pinned_configs_disabled():
            return run()
    return call


def _forced(run: Callable[[], object], name: str, meta: dict[str, int]) -> Callable[[], object]:
    def call():
        with forced_gemm_meta(name, meta):
            return run()
    return call


def parse_config(text: str) -> dict[str, int]:
    """`128x256x64:w8:s4:PERSISTENT=1` as a forced meta dict (blocks, warps, stages, constexprs)."""
    blocks, *rest = text.split(":")
    try:
        bm, bn, bk = (int(v) for v in blocks.split("x"))
        meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
        for item in rest:
            if item[:1] in "ws" and item[1:].isdigit():
                meta["num_warps" if item[0] == "w" else "num_stages"] = int(item[1:])
            else:
                key, value = item.split("=", 1)
                meta[key] = int(value)
    except ValueError:
        raise ValueError(f"{text!r} is not BMxBNxBK:wW:sS[:KEY=INT...]") from None
    if "num_warps" not in meta or "num_stages" not in meta:
        raise ValueError(f"{text!r} names no warps (wN) or stages (sN)")
    return meta


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="long-format CSV (rows are appended)")
    parser.add_argument("--log-json", help="JSON-lines log of this run (occult.logs)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and blocks; CPU with TRITON_INTERPRET=1")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    add_workload_args(parser, routing_nargs=None, routing_default="uniform")
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256], help="BLOCK_M and BLOCK_N values")
    parser.add_argument("--block-k", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 5])
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[8])
    parser.add_argument("--smem-kib", type=float, default=220.0, help="shared memory a config's tiles may use")
    parser.add_argument("--max-configs", type=int, default=24, help="candidates per kernel (the autotuner's first)")
    parser.add_argument("--time-limit-s", type=float, default=480.0, help="start no config after this")
    parser.add_argument("--warmup-ms", type=int, default=10)
    parser.add_argument("--rep-ms", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", nargs="+", default=None, metavar="BMxBNxBK:wW:sS[:KEY=INT...]",
                        help="time exactly these configs (e.g. 128x256x64:w8:s4:PERSISTENT=1) instead of the grid")
    parser.add_argument("--extra-meta", nargs="+", default=[], metavar="KEY=INT",
                        help="constexprs added to every forced config, e.g. WARP_SPEC=1 (the kernel must take them)")
    args = parser.parse_args(argv)
    try:
        args.extra_meta = {key: int(value) for key, value in (item.split("=", 1) for item in args.extra_meta)}
    except ValueError:
        parser.error(f"--extra-meta: expected KEY=INT items, got {args.extra_meta}")
    check_workload_args(parser, args)
    if args.configs is not None:
        try:
            args.configs = [parse_config(item) for item in args.configs]
        except ValueError as exc:
            parser.error(f"--configs: {exc}")
    if args.max_configs < 0:
        parser.error(f"--max-configs must be >= 0, got {args.max_configs}")
    if args.smoke:
        args.blocks, args.block_k, args.warps, args.stages = [16, 32], [16], [4], [2]
        args.max_configs = min(args.max_configs, 7)      # reaches past the autotuner's own configs
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not (interpreting() and args.smoke):
        sys.exit("tune_kernels: needs a CUDA device; on CPU only `TRITON_INTERPRET=1 ... --smoke` runs")
    seed_everything(args.seed)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float16     # the interpreter computes bf16 wrongly
    shape = BenchShape(args.tokens_per_rank, args.ranks, args.experts, args.top_k, args.hidden, args.ffn)
    work = build_workload(shape, args.routing, dtype, device, args.seed, args.zipf)
    inp = make_inputs(work, args.seed)
    num_pairs = inp.rows.numel()
    meta_cols = {
        "routing": args.routing, **asdict(shape), "M": num_pairs, "R": inp.x.shape[0],
        "gpu": torch.cuda.get_device_name(0) if on_gpu else "cpu (triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(),
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "dtype": str(dtype).removeprefix("torch."), "smoke": args.smoke,
    }
    start, results = time.monotonic(), []
    for position, kernel in enumerate(args.kernels):
        # Each kernel may run until its share of the limit is used; time a kernel leaves goes on.
        deadline = start + args.time_limit_s * (position + 1) / len(args.kernels)
        spec = KERNELS[kernel]
        if args.configs is not None:
            metas = [dict(meta) for meta in args.configs]
        else:
            metas = candidates(spec, blocks=tuple(args.blocks), block_k=tuple(args.block_k), warps=tuple(args.warps),
                               stages=tuple(args.stages), group_sizes=tuple(args.group_sizes),
                               elem_bytes=inp.x.element_size(), smem_kib=args.smem_kib, limit=args.max_configs,
                               seed=args.seed)
        metas = [{**meta, **args.extra_meta} for meta in metas]
        print(f"tune_kernels: {kernel}: {len(metas)} configs + the autotuner's pick (+ the pinned default)", file=sys.stderr, flush=True)
        flops = spec.flops(num_pairs, args.hidden, args.ffn)
        for row in sweep_kernel(kernel, inp, metas, flops, on_gpu, args.warmup_ms, args.rep_ms, deadline):
            results.append({**meta_cols, **row})
    frame = pd.DataFrame(results)
    if args.out.exists():
        frame = pd.concat([pd.read_csv(args.out), frame], ignore_index=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out) as tmp:
        frame.to_csv(tmp, index=False, float_format="%.6g")
    write_json(Path(str(args.out) + ".meta.json"), provenance(None, args.seed, tune_args=vars(args)))
    print(summary(pd.DataFrame(results)).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


def summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Per kernel: the autotuner's time, the pinned default's (if any), the best forced config and
    the autotuner's time over the best's."""
    out = []
    for kernel, group in frame.groupby("kernel", sort=False):
        ok = group[group["status"] == "ok"]
        default = ok[ok["config"] == "autotuned"]
        forced = ok[ok["config"] == "forced"]
        entry = {"kernel": kernel, "tried": int((group["config"] == "forced").sum()),
                 "failed": int(((group["config"] == "forced") & (group["status"] != "ok")).sum()),
                 "autotuned_ms": float(default["median_ms"].iloc[0]) if len(default) else float("nan")}
        pinned = ok[ok["config"] == "pinned"]
        if len(pinned):
            entry["pinned_ms"] = float(pinned["median_ms"].iloc[0])
        if len(forced):
            best = forced.loc[forced["median_ms"].idxmin()]
            entry.update(best_ms=float(best["median_ms"]), best_tflops=float(best["tflops"]),
                         best=f"{best['BLOCK_M']:.0f}x{best['BLOCK_N']:.0f}x{best['BLOCK_K']:.0f} "
                              f"w{best['num_warps']:.0f} s{best['num_stages']:.0f}"
                              + (f" g{best['GROUP_SIZE']:.0f}" if pd.notna(best.get("GROUP_SIZE")) else ""),
                         speedup=entry["autotuned_ms"] / float(best["median_ms"]))
        out.append(entry)
    return pd.DataFrame(out)


if __name__ == "__main__":
    sys.exit(run_main("kernel_tune", main))
