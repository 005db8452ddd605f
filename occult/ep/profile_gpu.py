"""Where the EP layer's time goes on GPUs: a torch.profiler table of `ep_moe` per mode.

Run with `torchrun --nproc_per_node=D -m occult.ep.profile_gpu --tokens 16384 --out DIR`.
Uniform routing over the OLMoE layer shape (d=2048, expert ffn 1024, E=64, k=8) by default, bf16.
Rank 0 prints, per mode, the forward time (CUDA events, median) and the top CUDA and CPU ops, and
writes the tables to DIR.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist


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


def main() -> None:
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
    args = p.parse_args()

    from occult.ep.layer import ep_moe
    from occult.ep.plan import contiguous_placement
    from occult.pruning import prune_router_score

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
    lines = []
    for name, (ids_c, w_c, mode) in cases.items():
        w_c = w_c.to(torch.bfloat16)

        def fwd():
            return ep_moe(x, ids_c, w_c, placement, w_gu, w_dn, group=None, mode=mode, backend="triton")

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
            lines.append(f"{name:12s} fwd median {ms:8.3f} ms")
            print(f"===== {name}: forward median {ms:.3f} ms (5 iterations profiled)")
            print(table_cuda)
    if rank == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
