"""Where the EP layer's time goes on GPUs: `ep_moe` fwd and fwd+bwd times per mode, the
single-GPU expert-compute time of the same pairs (the compute floor the layer is measured
against), and a torch.profiler table of the forward.

Run with `torchrun --nproc_per_node=D -m occult.harness.ep_profile --tokens 16384 --out DIR`.
Uniform routing over the OLMoE layer shape (d=2048, expert ffn 1024, E=64, k=8) by default, bf16.
Rank 0 prints, per mode, the forward and fwd+bwd medians (CUDA events), the top CUDA and CPU ops,
then a summary table; it writes the tables and `summary.csv` to DIR.
"""

from __future__ import annotations

import argparse
import os
import sys
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from occult.logs import run_main


def _time_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _expert_only(tokens: int, world: int, E: int, k: int, D: int, F: int, repeats: int, dev) -> dict[str, float]:
    """Single-GPU grouped_swiglu + grouped_down_reduce on the pairs rank 0 receives under uniform
    routing of `world * tokens` tokens (experts 0..E/world-1 local), fwd and fwd+bwd medians in ms."""
    from occult.ep.plan import build_pairs_from_slots
    from occult.kernels.grouped_down_reduce import grouped_down_reduce
    from occult.kernels.grouped_swiglu import grouped_swiglu

    gen = torch.Generator(device=dev).manual_seed(123)
    per_rank = E // world
    ids = torch.rand(world * tokens, E, device=dev, generator=gen).topk(k, dim=1).indices
    local = ids < per_rank
    ids = ids[local.any(1)]                                   # rows that reach rank 0 (setup: syncs)
    code_RK = torch.sort(torch.where(ids < per_rank, ids, E), dim=1).values
    code_RK = torch.where(code_RK < E, code_RK, -1)
    num_pairs = int((code_RK >= 0).sum())
    flat, pair_row, offsets, table = build_pairs_from_slots(code_RK, num_pairs, per_rank)
    x = torch.randn(code_RK.shape[0], D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gate = torch.rand(num_pairs, device=dev, requires_grad=True)
    w_gu = (torch.randn(per_rank, 2 * F, D, device=dev) * D ** -0.5).bfloat16().requires_grad_()
    w_dn = (torch.randn(per_rank, D, F, device=dev) * F ** -0.5).bfloat16().requires_grad_()
    dy = torch.randn(x.shape, device=dev, dtype=torch.bfloat16)

    def fwd():
        h = grouped_swiglu(x, pair_row, offsets, w_gu, row_pairs_RK=table)
        return grouped_down_reduce(h, pair_row, gate, offsets, w_dn, x.shape[0], row_pairs_RK=table)

    def fwd_bwd():
        torch.autograd.backward(fwd(), dy)

    with torch.no_grad():
        for _ in range(3):
            fwd()
        fwd_ms = _time_ms(fwd, repeats)
    for _ in range(2):
        fwd_bwd()
    fwd_bwd_ms = _time_ms(fwd_bwd, max(repeats // 2, 3))
    flops = 2 * num_pairs * 3 * D * F
    return {"pairs": num_pairs, "rows": x.shape[0], "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
            "fwd_tflops": flops / fwd_ms / 1e9, "fwd_bwd_tflops": 3 * flops / fwd_bwd_ms / 1e9}


def main(argv: list[str] | None = None) -> None:
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--log-json", help="JSON-lines log of this run (occult.logs)")
    args = p.parse_args(argv)

    from occult.ep.layer import ep_moe
    from occult.ep.plan import contiguous_placement
    from occult.routing.pruning import prune_router_score

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    torch.manual_seed(rank)
    E, k, D, F = args.experts, args.top_k, args.hidden, args.ffn
    per_rank = E // world
    w_gu = (torch.randn(per_rank, 2 * F, D, device=dev) * D ** -0.5).bfloat16().requires_grad_()
    w_dn = (torch.randn(per_rank, D, F, device=dev) * F ** -0.5).bfloat16().requires_grad_()
    x = torch.randn(args.tokens, D, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(args.tokens, E, device=dev)
    placement = contiguous_placement(E, world)
    weights, ids = torch.topk(torch.softmax(logits, -1), k)
    w1, ids1 = prune_router_score(logits, k, placement.to(dev), 1, num_devices=world)
    cases = {
        "per_expert": (ids, weights, "per_expert"),
        "dedup": (ids, weights, "dedup"),
        "dedup_nd1": (ids1, w1, "dedup"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    lines = ["case,fwd_ms,fwd_bwd_ms"]
    x_grad = x.clone().requires_grad_()
    dy = torch.randn_like(x)
    for name, (ids_c, w_c, mode) in cases.items():
        w_c = w_c.to(torch.bfloat16)
        w_grad = w_c.clone().requires_grad_()

        def fwd():
            return ep_moe(x, ids_c, w_c, placement, w_gu, w_dn, group=None, mode=mode, backend="triton")

        def fwd_bwd():
            y = ep_moe(x_grad, ids_c, w_grad, placement, w_gu, w_dn, group=None, mode=mode, backend="triton")
            torch.autograd.backward(y, dy)

        for _ in range(2):
            fwd_bwd()
        torch.cuda.synchronize()
        import warnings                   # name every host sync of one forward (expect one)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            fwd()
            torch.cuda.set_sync_debug_mode("default")
        if rank == 0:
            print(f"{name}: {len(caught)} host syncs in one forward")
            for warning in caught:
                print("   ", str(warning.message).splitlines()[0][:160], "@", warning.filename, warning.lineno)
        ms_bwd = _time_ms(fwd_bwd, max(args.repeats // 2, 3))
        with torch.no_grad():
            for _ in range(3):
                fwd()
            torch.cuda.synchronize()
            ms = _time_ms(fwd, args.repeats)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fwd()
                torch.cuda.synchronize()
        if rank == 0:
            table_cuda = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
            table_cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=12)
            (args.out / f"profile_{name}.txt").write_text(table_cuda + "\n\n" + table_cpu)
            lines.append(f"{name},{ms:.3f},{ms_bwd:.3f}")
            print(f"===== {name}: forward median {ms:.3f} ms, fwd+bwd {ms_bwd:.3f} ms (5 fwd profiled)")
            print(table_cuda)
            print(table_cpu)
    with torch.no_grad():                 # two code paths (row table vs one pair per row) must agree
        y_dedup = ep_moe(x, ids, weights.bfloat16(), placement, w_gu, w_dn, mode="dedup", backend="triton")
        y_per_expert = ep_moe(x, ids, weights.bfloat16(), placement, w_gu, w_dn, mode="per_expert", backend="triton")
    rel = float((y_dedup.float() - y_per_expert.float()).norm() / y_per_expert.float().norm())
    if rank == 0:
        print(f"dedup vs per_expert output: relative Frobenius difference {rel:.2e}")
        lines.append(f"dedup_vs_per_expert_rel_diff,{rel:.2e},")
        expert = _expert_only(args.tokens, world, E, k, D, F, args.repeats, dev)
        floor_ms = 2 * expert["pairs"] * 3 * D * F / 770e9
        lines.append(f"expert_only_rank0,{expert['fwd_ms']:.3f},{expert['fwd_bwd_ms']:.3f}")
        lines.append(f"compute_floor_770TFLOPs,{floor_ms:.3f},{3 * floor_ms:.3f}")
        (args.out / "summary.csv").write_text("\n".join(lines) + "\n")
        print(f"expert only (rank 0 pairs M={expert['pairs']}, R={expert['rows']}): "
              f"fwd {expert['fwd_tflops']:.0f} TFLOP/s, fwd+bwd {expert['fwd_bwd_tflops']:.0f} TFLOP/s")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(run_main("ep_profile", main))
