"""What does the shared expert add to an eager decode step, with the host's speed held fixed?

The sweeps' A/B of the shared expert (`--no-shared`) runs its two arms in separate processes, and
the lent hosts' CPU speed moves between processes by more than the difference sought
(docs/simulator.md). Here both arms of every shape run in ONE process, interleaved step by step:
each round times, for each shape (OLMoE, Qwen1.5-MoE, DeepSeek-MoE shapes of `occult.harness.baselines`)
and each arm (`layer`: the eager `occult.ep.ep_moe` call at D = 1; `layer+shared`: the same plus
`occult.harness.sweep.inputs.SharedExpert` added to its output, as `occult.harness.sweep` does), one step as the sweep
times it: the GPU drained, CUDA events around the call, the host time of the call itself. A
launch probe (`occult.harness.sweep.timing.host_launch_us`) opens each round. One CSV row per step.
Usage (one GPU):
  python workflow/scripts/shared_host_ab.py --rounds 400 --batch 8 --out shared_host_ab.csv
"""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

SHAPES = ("olmoe", "qwen", "deepseek")
ARMS = ("layer", "layer+shared")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from occult.harness.baselines import get_shape
    from occult.ep import ep_moe
    from occult.harness.sweep.inputs import SharedExpert, derive_seed
    from occult.harness.sweep.timing import interleaved_ab

    device, dtype = torch.device("cuda"), torch.bfloat16
    steps = {}
    for name in SHAPES:
        shape = get_shape(name)
        gen = torch.Generator(device=device).manual_seed(derive_seed(args.seed, "shared_host_ab", name))
        w_gate_up = (torch.randn(shape.num_experts, 2 * shape.ffn, shape.hidden, generator=gen, device=device)
                     * 0.02).to(dtype)
        w_down = (torch.randn(shape.num_experts, shape.hidden, shape.ffn, generator=gen, device=device) * 0.02).to(dtype)
        placement = torch.zeros(shape.num_experts, dtype=torch.long)
        shared = SharedExpert(shape, args.seed, device, dtype) if shape.shared_ffn else None
        for batch in args.batch:
            x = torch.randn(batch, shape.hidden, generator=gen, device=device).to(dtype)
            logits = torch.randn(batch, shape.num_experts, generator=gen, device=device)
            weights, ids = torch.softmax(logits, dim=-1).topk(shape.top_k, dim=-1)

            def step(with_shared: bool, x=x, ids=ids, weights=weights, w_gate_up=w_gate_up, w_down=w_down,
                     placement=placement, shared=shared) -> torch.Tensor:
                with torch.no_grad():
                    y = ep_moe(x, ids, weights, placement, w_gate_up, w_down, backend="triton")
                    return y + shared(x) if with_shared else y

            for arm in ARMS:
                if arm == "layer+shared" and shared is None:
                    continue
                steps[(name, batch, arm)] = (step, arm == "layer+shared")
    interleaved_ab({key: functools.partial(fn, with_shared) for key, (fn, with_shared) in steps.items()},
                   args.rounds, args.warmup, device, args.out, ("shape", "batch", "arm"), progress_every=100)

    import pandas as pd

    table = pd.read_csv(args.out).groupby(["batch", "shape", "arm"])[["host_us", "step_us"]].median().unstack("arm")
    print(table.round(1).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
