"""The `bench` stage: the model's MoE layer in expert parallelism on CPU gloo ranks, per_expert
versus dedup dispatch, on the model's real routing.

For every MoE layer of the held-out routing trace (`profile_dir/routing_heldout.npz`: `ids`
[L, N, k], `layers`), every `cfg.bench.tokens_per_rank` T and every case of `cfg.bench.cases`:

  * `trivial`  — the contiguous placement (plain EP);
  * `placed`   — `placement_dir/D{D}_greedy.json`, and again with `D{D}_swap.json` when present;
  * `prune<N>` — the greedy placement with router-score pruning to N devices per token,

the layer (cfg.model hidden_size, expert_ffn, num_experts, top_k; random fp32 weights) runs in
both modes on `cfg.bench.devices` ranks, each rank with T tokens. Routing: a seeded sample of
D*T trace tokens (cycled if the trace is shorter), the same tokens for every layer, so E[C_T] is
the model's own; gate weights are a random softmax. All layers run in turn (one row each); the
report can average them.

Measured per row: E[C_T] over all tokens; bytes each rank sends (forward; dispatch = hidden
rows + 8 B metadata per (token, expert), combine = returned rows; both remote only, the bytes a
rank routes to itself listed apart); forward time (no grad) and forward+backward time, each the
median of `repeats` after `warmup`, then the max over ranks.

Correctness, once per (layer, case) and mode, at the smallest non-zero T (the dense reference
gathers a weight matrix per token and would dominate the run at larger T): the max abs error of
the output and of every gradient (x, gate weights, expert weights) against `moe_dense_ref` on the
full batch (each rank checks its tokens; expert-weight gradients are summed over the ranks). The
errors are copied to the case's rows; an error above tolerance stops the bench.

Router-score pruning needs router scores, which the trace does not store: the trace's top-k get
descending scores in their order and every other expert a random lower score, so the kept
experts are the trace's own and the refills are random experts of the kept devices.
"""

from __future__ import annotations

import statistics
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from occult.config import Config, parse_bench_case
from occult.provenance import provenance, write_csv

MODES = ("per_expert", "dedup")
REL_TOLERANCE = 1e-4          # error <= REL_TOLERANCE * (1 + max |reference|), fp32
REF_CHUNK_BYTES = 64 << 20    # memory of one token chunk of the dense reference's gathered weights


class BenchInputError(ValueError):
    """A routing trace or placement file is missing or malformed; the message names it."""


@dataclass(frozen=True)
class BenchCase:
    name: str                 # trivial | placed | prune<N>
    placement: str            # contiguous | greedy | swap
    max_devices: int | None   # N_d of router-score pruning, None = unpruned


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    ffn: int
    num_experts: int
    top_k: int

    @classmethod
    def of(cls, cfg: Config) -> "LayerShape":
        """The MoE layer shape; E and k come from the checkpoint when there is one."""
        return cls(cfg.model.hidden_size, cfg.model.expert_ffn, cfg.num_experts, cfg.top_k)


@dataclass(frozen=True)
class BenchJob:
    """Everything a rank needs; inherited by the forked ranks (nothing is pickled)."""

    shape: LayerShape
    devices: int
    tokens_per_rank: tuple[int, ...]
    cases: tuple[BenchCase, ...]
    layers: tuple[int, ...]
    trace_LNK: np.ndarray                       # int64 [L, D*max(T), k], sampled trace tokens
    placements: dict[str, dict[int, np.ndarray]]  # method -> layer -> device_of_expert [E]
    repeats: int
    warmup: int
    seed: int
    backend: str


# ----------------------------------------------------------------------------------------------
# Inputs


def bench_cases(names: Sequence[str], has_swap: bool) -> list[BenchCase]:
    cases = []
    for name in names:
        kind, max_devices = parse_bench_case(name)
        if kind == "trivial":
            cases.append(BenchCase(name, "contiguous", None))
        elif kind == "placed":
            cases.append(BenchCase(name, "greedy", None))
            if has_swap:
                cases.append(BenchCase(name, "swap", None))
        elif kind == "prune":
            cases.append(BenchCase(name, "greedy", max_devices))
        else:
            raise BenchInputError(f"bench.cases: unknown case {name!r}")
    return cases


def load_trace(path: Path, shape: LayerShape) -> tuple[list[int], np.ndarray]:
    """(layers, ids [L, N, k] int64) of a routing trace; every error names the file."""
    if not path.exists():
        raise BenchInputError(f"{path}: routing trace does not exist")
    try:
        with np.load(path) as npz:
            missing = {"ids", "layers"} - set(npz.files)
            if missing:
                raise BenchInputError(f"{path}: missing arrays {sorted(missing)}")
            ids, layers = npz["ids"], npz["layers"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        if isinstance(err, BenchInputError):
            raise
        raise BenchInputError(f"{path}: not a readable .npz ({err})") from None
    if ids.ndim != 3 or ids.shape[0] != len(layers) or ids.shape[1] == 0:
        raise BenchInputError(f"{path}: 'ids' must be [L={len(layers)}, N>0, k], got {ids.shape}")
    if ids.shape[2] != shape.top_k:
        raise BenchInputError(f"{path}: top-k {ids.shape[2]} differs from model.top_k {shape.top_k}")
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= shape.num_experts:
        raise BenchInputError(f"{path}: 'ids' must be integers in [0, {shape.num_experts})")
    return [int(layer) for layer in layers], ids.astype(np.int64)


def load_placements(
    placement_dir: Path, devices: int, num_experts: int, layers: Sequence[int], cases: Sequence[BenchCase]
) -> dict[str, dict[int, np.ndarray]]:
    """method -> layer -> device_of_expert for every placement the cases use."""
    from occult.routing.placement import load_placement_layers

    placements: dict[str, dict[int, np.ndarray]] = {}
    for method in sorted({case.placement for case in cases}):
        if method == "contiguous":
            row = np.arange(num_experts) * devices // num_experts
            placements[method] = {layer: row for layer in layers}
            continue
        path = placement_dir / f"D{devices}_{method}.json"
        file_layers, table = load_placement_layers(path, num_experts, devices)
        missing = sorted(set(layers) - set(file_layers))
        if missing:
            raise BenchInputError(f"{path}: no placement for traced layers {missing}")
        placements[method] = {layer: table[file_layers.index(layer)] for layer in layers}
    return placements


def sample_tokens(trace_LNK: np.ndarray, count: int, seed: int) -> np.ndarray:
    """[L, count, k]: a seeded sample of trace tokens (without repeats while the trace lasts)."""
    available = trace_LNK.shape[1]
    order = np.random.default_rng(seed).permutation(available)
    picks = np.resize(order, count)   # cycles when count > available
    return trace_LNK[:, picks]


# ----------------------------------------------------------------------------------------------
# Routing


def prune_router_score(ids_TK, device_of_expert_E, num_devices: int, max_devices: int, generator):
    """ids_TK pruned to `max_devices` devices per token, with synthetic router scores (module doc)."""
    import torch

    num_tokens, top_k = ids_TK.shape
    num_experts = device_of_expert_E.numel()
    scores_TE = torch.rand(num_tokens, num_experts, generator=generator)
    rank_scores = (top_k - torch.arange(top_k, dtype=torch.float32) + 1.0).expand(num_tokens, top_k)
    scores_TE.scatter_(1, ids_TK, rank_scores)                     # trace top-k above all others
    dev_TK = device_of_expert_E[ids_TK]
    seen_before_TK = (dev_TK[:, :, None] == dev_TK[:, None, :]).tril(-1).any(-1)
    first_visit_TK = ~seen_before_TK
    kept_TK = first_visit_TK & (first_visit_TK.long().cumsum(1) <= max_devices)
    allowed_TD = torch.zeros(num_tokens, num_devices, dtype=torch.long).scatter_add_(1, dev_TK, kept_TK.long()) > 0
    allowed_TE = allowed_TD[:, device_of_expert_E]
    return scores_TE.masked_fill(~allowed_TE, float("-inf")).topk(top_k, dim=1).indices


# ----------------------------------------------------------------------------------------------
# Per rank


@dataclass
class RankInputs:
    """One rank's share of a (layer, case, T) setting."""

    placement_E: Any   # torch int64 [E]
    ids_TK: Any
    x_TD: Any
    weights_TK: Any
    dy_TD: Any


def _rank_inputs(job: BenchJob, li: int, case: BenchCase, tokens: int, rank: int, world: int, salt: int) -> RankInputs:
    import torch

    layer = job.layers[li]
    placement = torch.as_tensor(job.placements[case.placement][layer], dtype=torch.long)
    ids_all = torch.as_tensor(job.trace_LNK[li, : world * tokens])
    if case.max_devices is not None:
        prune_gen = torch.Generator().manual_seed(job.seed + salt)
        ids_all = prune_router_score(ids_all, placement, world, case.max_devices, prune_gen)
    gen = torch.Generator().manual_seed(job.seed * 1_000_003 + 101 * salt + rank)
    return RankInputs(
        placement_E=placement,
        ids_TK=ids_all[rank * tokens : (rank + 1) * tokens].contiguous(),
        x_TD=torch.randn(tokens, job.shape.hidden, generator=gen),
        weights_TK=torch.softmax(torch.randn(tokens, job.shape.top_k, generator=gen), dim=1),
        dy_TD=torch.randn(tokens, job.shape.hidden, generator=gen),
    )


def _dense_reference(x_TD, ids_TK, weights_TK, w_gate_up, w_down, dy_TD):
    """moe_dense_ref forward and backward in token chunks: (y, grad x, grad weights, grad w_gu, grad w_d)."""
    import torch

    from occult.kernels.reference import moe_dense_ref

    x = x_TD.detach().clone().requires_grad_()
    weights = weights_TK.detach().clone().requires_grad_()
    wgu = w_gate_up.detach().clone().requires_grad_()
    wd = w_down.detach().clone().requires_grad_()
    chunk = max(1, REF_CHUNK_BYTES // (w_gate_up.shape[1] * w_gate_up.shape[2] * 4))
    outputs = [x_TD.new_zeros(0, x_TD.shape[1])]
    for start in range(0, x.shape[0], chunk):
        part = slice(start, start + chunk)
        y = moe_dense_ref(x[part], ids_TK[part], weights[part], wgu, wd)
        (y * dy_TD[part]).sum().backward()
        outputs.append(y.detach())
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (x, weights, wgu, wd)]
    return (torch.cat(outputs), *grads)


def _max_err(got, want) -> tuple[float, float]:
    """(max abs error, allowed error)."""
    if want.numel() == 0:
        return 0.0, REL_TOLERANCE
    return float((got.detach() - want).abs().max()), REL_TOLERANCE * (1.0 + float(want.abs().max()))


def _check(inputs: RankInputs, w_gate_up, w_down, rank: int, backend, where: str) -> dict[str, tuple[float, float]]:
    """Per mode: (max abs error of the output, of the gradients) over all ranks; raises above tolerance."""
    import torch
    import torch.distributed as dist

    from occult.ep.layer import ep_moe
    from occult.ep.plan import experts_of_device

    local = experts_of_device(inputs.placement_E, rank)
    ref_y, ref_gx, ref_gw, ref_ggu, ref_gd = _dense_reference(
        inputs.x_TD, inputs.ids_TK, inputs.weights_TK, w_gate_up, w_down, inputs.dy_TD)
    dist.all_reduce(ref_ggu)   # expert-weight gradients of the full batch
    dist.all_reduce(ref_gd)
    errors = {}
    for mode in MODES:
        x = inputs.x_TD.clone().requires_grad_()
        weights = inputs.weights_TK.clone().requires_grad_()
        wgu = w_gate_up[local].clone().requires_grad_()
        wd = w_down[local].clone().requires_grad_()
        y = ep_moe(x, inputs.ids_TK, weights, inputs.placement_E, wgu, wd, mode=mode, backend=backend)
        (y * inputs.dy_TD).sum().backward()
        checks = [_max_err(y, ref_y), _max_err(x.grad, ref_gx), _max_err(weights.grad, ref_gw),
                  _max_err(wgu.grad, ref_ggu[local]), _max_err(wd.grad, ref_gd[local])]
        table = torch.tensor([[err for err, _ in checks], [err - tol for err, tol in checks]], dtype=torch.float64)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        if float(table[1].max()) > 0:
            raise RuntimeError(
                f"bench: {where}, mode {mode}: EP differs from moe_dense_ref beyond tolerance (max abs "
                f"errors out/x/gates/w_gate_up/w_down = {', '.join(f'{e:.2e}' for e in table[0].tolist())})"
            )
        errors[mode] = (float(table[0, 0]), float(table[0, 1:].max()))
    return errors


def _measure(inputs: RankInputs, w_gate_up, w_down, rank: int, world: int, mode: str, backend, job: BenchJob):
    """(per-rank counters [world, 6], (fwd ms, fwd+bwd ms) max over ranks)."""
    import torch
    import torch.distributed as dist

    from occult.ep.layer import EPStats, ep_moe
    from occult.ep.plan import experts_of_device

    local = experts_of_device(inputs.placement_E, rank)
    x = inputs.x_TD.clone().requires_grad_()
    weights = inputs.weights_TK.clone().requires_grad_()
    wgu = w_gate_up[local].clone().requires_grad_()
    wd = w_down[local].clone().requires_grad_()
    stats = EPStats()

    def forward(record: bool = False):
        return ep_moe(x, inputs.ids_TK, weights, inputs.placement_E, wgu, wd, mode=mode, backend=backend,
                      stats=stats if record else None)

    samples: dict[str, list[float]] = {"fwd": [], "fwd_bwd": []}
    for kind in samples:
        for it in range(job.warmup + job.repeats):
            for t in (x, weights, wgu, wd):
                t.grad = None
            dist.barrier()
            start = time.perf_counter()
            if kind == "fwd":
                with torch.no_grad():
                    forward(record=it == 0)
            else:
                (forward() * inputs.dy_TD).sum().backward()
            if it >= job.warmup:
                samples[kind].append(time.perf_counter() - start)
    times = torch.tensor([1e3 * statistics.median(samples[k]) for k in samples], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    counters = torch.tensor([stats.tokens, stats.devices_per_token_sum, stats.rows_remote,
                             stats.bytes_dispatch_remote, stats.bytes_combine_remote, stats.bytes_self])
    gathered = [torch.zeros_like(counters) for _ in range(world)]
    dist.all_gather(gathered, counters)
    return torch.stack(gathered).double(), (float(times[0]), float(times[1]))


def _bench_rank(rank: int, world: int, job: BenchJob) -> list[dict[str, Any]]:
    """All settings on one rank; rank 0 returns the rows. The check runs once per (layer, case),
    at the smallest non-zero T; its errors are copied to that case's rows."""
    import torch

    from occult.ep.layer import get_backend
    from occult.logs import progress

    shape = job.shape
    backend = get_backend(job.backend)
    gen = torch.Generator().manual_seed(job.seed)
    w_gate_up = torch.randn(shape.num_experts, 2 * shape.ffn, shape.hidden, generator=gen) / shape.hidden**0.5
    w_down = torch.randn(shape.num_experts, shape.hidden, shape.ffn, generator=gen) / shape.ffn**0.5
    check_tokens = min([t for t in job.tokens_per_rank if t > 0], default=0)

    rows: list[dict[str, Any]] = []
    total = len(job.layers) * len(job.cases) * (1 + len(job.tokens_per_rank) * len(MODES))
    bar = progress(total, desc=f"bench D={world}", unit="step", disable=rank != 0)
    for li, layer in enumerate(job.layers):
        for ci, case in enumerate(job.cases):
            where = f"layer {layer}, case {case.name} ({case.placement})"
            salt = 1000 * li + ci
            errors = _check(_rank_inputs(job, li, case, check_tokens, rank, world, salt),
                            w_gate_up, w_down, rank, backend, f"{where}, T={check_tokens}")
            bar.update(1)
            for tokens in job.tokens_per_rank:
                inputs = _rank_inputs(job, li, case, tokens, rank, world, salt)
                for mode in MODES:
                    per_rank, (fwd_ms, fwd_bwd_ms) = _measure(
                        inputs, w_gate_up, w_down, rank, world, mode, backend, job)
                    rows.append({
                        "devices": world, "layer": layer, "case": case.name, "placement": case.placement,
                        "max_devices": case.max_devices if case.max_devices is not None else "",
                        "mode": mode, "tokens_per_rank": tokens,
                        "mean_devices_per_token": float(per_rank[:, 1].sum() / max(1.0, float(per_rank[:, 0].sum()))),
                        "rows_remote_per_rank": float(per_rank[:, 2].mean()),
                        "bytes_dispatch_remote_per_rank": float(per_rank[:, 3].mean()),
                        "bytes_dispatch_remote_max_rank": float(per_rank[:, 3].max()),
                        "bytes_combine_remote_per_rank": float(per_rank[:, 4].mean()),
                        "bytes_self_per_rank": float(per_rank[:, 5].mean()),
                        "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
                        "max_abs_err_out": errors[mode][0], "max_abs_err_grad": errors[mode][1],
                        "checked_tokens_per_rank": check_tokens,
                    })
                    bar.log(layer=layer, case=case.name, mode=mode, tokens_per_rank=tokens,
                            fwd_ms=fwd_ms, fwd_bwd_ms=fwd_bwd_ms)
                    bar.update(1)
    bar.close()
    return rows


# ----------------------------------------------------------------------------------------------
# Stage


def run_bench(
    cfg: Config,
    profile_dir: Path,
    placement_dir: Path,
    out_csv: Path,
    layers: Sequence[int] | None = None,
    backend: str = "torch",
) -> None:
    """Benchmark the EP MoE layer (see the module doc) and write the long CSV `out_csv` (+ sidecar).

    `layers` restricts the traced layers (default: all of them).
    """
    import pandas as pd

    from occult.harness.ranks import run_ranks

    bench, shape = cfg.bench, LayerShape.of(cfg)
    trace_path = Path(profile_dir) / "routing_heldout.npz"
    trace_layers, trace_LNK = load_trace(trace_path, shape)
    if layers is not None:
        unknown = sorted(set(layers) - set(trace_layers))
        if unknown:
            raise BenchInputError(f"{trace_path}: layers {unknown} are not in the trace {trace_layers}")
        keep = [trace_layers.index(layer) for layer in layers]
        trace_layers, trace_LNK = [trace_layers[i] for i in keep], trace_LNK[keep]
    placement_dir = Path(placement_dir)
    cases = bench_cases(bench.cases, (placement_dir / f"D{bench.devices}_swap.json").exists())
    placements = load_placements(placement_dir, bench.devices, shape.num_experts, trace_layers, cases)
    needed = bench.devices * max(bench.tokens_per_rank)
    job = BenchJob(
        shape=shape, devices=bench.devices, tokens_per_rank=tuple(bench.tokens_per_rank),
        cases=tuple(cases), layers=tuple(trace_layers),
        trace_LNK=sample_tokens(trace_LNK, needed, cfg.seed), placements=placements,
        repeats=bench.repeats, warmup=bench.warmup, seed=cfg.seed, backend=backend,
    )
    settings = len(trace_layers) * len(cases) * len(bench.tokens_per_rank) * len(MODES)
    rows = run_ranks(_bench_rank, bench.devices, job, timeout_s=300, deadline_s=60.0 + 30.0 * settings)[0]
    frame = pd.DataFrame(rows)
    frame.insert(0, "run", cfg.run)
    for column, value in (("hidden_size", shape.hidden), ("expert_ffn", shape.ffn),
                          ("num_experts", shape.num_experts), ("top_k", shape.top_k),
                          ("dtype", "float32"), ("backend", backend),
                          ("repeats", bench.repeats), ("warmup", bench.warmup),
                          ("trace_tokens", trace_LNK.shape[1]), ("rel_tolerance", REL_TOLERANCE)):
        frame[column] = value
    meta = provenance(
        cfg.hash(), cfg.seed, stage="bench", routing_trace=str(trace_path),
        placements={m: str(placement_dir / f"D{bench.devices}_{m}.json") for m in placements if m != "contiguous"},
        layers=list(trace_layers), note="one row per (layer, case, placement, mode, tokens_per_rank)",
    )
    write_csv(out_csv, frame, meta=meta)
