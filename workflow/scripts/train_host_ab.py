"""Host time of one eager training step, Occult against the naive EP, arms interleaved in ONE process.

The lent hosts' CPU speed moves between processes by more than the effects sought here
(docs/performance.md, v17), so every arm of every (shape, batch) runs in one process, step by step:
each round times, in alternating order, one training step per arm as `occult.harness.sweep` times it (the
GPU drained, CUDA events around the step, the host time of the step itself): forward of the layer
plus the shape's shared expert, backward from a fixed output gradient. Arms:
  occult               the eager `occult.ep.ep_moe` at D = 1 (Triton backend), as the code runs it
  occult-tuned-normal  the same with `occult.kernels.launch.FAST_TUNED_LAUNCH` off: autotuned kernels
                       through the autotuner's `tuned[grid](...)` (the code before session 27)
  occult-normal-launch also `FAST_LAUNCH` off: every kernel through Triton's `kernel[grid](...)`
  occult-customop      also `occult.kernels.combine.EAGER_FUNCTIONS` off: the forward that records
                       autograd goes through the torch custom ops (the code before session 25)
  naive                `occult.harness.baselines.naive.NaiveEP` (torch._grouped_mm)
Inputs are `occult.harness.sweep.inputs.make_inputs` of the sweep's synthetic router. One CSV row per step.
Usage (one GPU):
  python workflow/scripts/train_host_ab.py --rounds 200 --batch 1 2 4 --out train_host_ab.csv
"""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch

SHAPES = ("olmoe", "qwen", "deepseek")
# arm -> (EAGER_FUNCTIONS, FAST_LAUNCH, FAST_TUNED_LAUNCH) for the Occult arms
OCCULT_ARMS = {"occult": (True, True, True), "occult-tuned-normal": (True, True, False),
               "occult-normal-launch": (True, False, False), "occult-customop": (False, False, False)}
ARMS = (*OCCULT_ARMS, "naive")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from occult.harness.baselines import ExpertWeights, get_shape
    from occult.harness.baselines.naive import NaiveEP
    from occult.harness.sweep.inputs import SharedExpert, SyntheticRouter, derive_seed, make_inputs
    from occult.harness.sweep.occult_method import OccultEP
    from occult.harness.sweep.timing import interleaved_ab, train_step

    combine_module = importlib.import_module("occult.kernels.combine")   # the package exports a function `combine`
    launch_module = importlib.import_module("occult.kernels.launch")
    device, dtype = torch.device("cuda"), torch.bfloat16
    steps = {}
    for name in args.shapes:
        shape = get_shape(name)
        weights = ExpertWeights.random(shape, derive_seed(args.seed, "train_host_ab", name), device, dtype)
        shared = SharedExpert(shape, args.seed, device, dtype) if shape.shared_ffn else None
        router = SyntheticRouter.make(shape, args.seed)
        methods = {}
        for arm in args.arms:
            method = NaiveEP() if arm == "naive" else OccultEP(torch.zeros(shape.num_experts, dtype=torch.long), "triton")
            method.setup(shape, None, dtype, device, weights)
            methods[arm] = method
        for batch in args.batch:
            inputs = make_inputs(shape, router, batch * args.seq_len, derive_seed(args.seed, name, batch), device,
                                 dtype, [None], None, with_grad_output=True)
            ids, gate = inputs.routes[None]
            for arm, method in methods.items():
                params = method.expert_parameters() + (list(shared.parameters()) if shared is not None else [])

                def step(method=method, params=params, inputs=inputs, ids=ids, gate=gate, shared=shared,
                         flags=OCCULT_ARMS.get(arm, OCCULT_ARMS["occult"])) -> None:
                    (combine_module.EAGER_FUNCTIONS[0], launch_module.FAST_LAUNCH[0],
                     launch_module.FAST_TUNED_LAUNCH[0]) = flags
                    train_step(method, inputs.x_TD, ids, gate, shared, inputs.dy_TD, params)

                steps[(name, batch, arm)] = step
    try:
        interleaved_ab(steps, args.rounds, args.warmup, device, args.out, ("shape", "batch", "arm"))
    finally:
        combine_module.EAGER_FUNCTIONS[0] = launch_module.FAST_LAUNCH[0] = launch_module.FAST_TUNED_LAUNCH[0] = True

    import pandas as pd

    table = pd.read_csv(args.out).groupby(["shape", "batch", "arm"])[["host_us", "step_us"]].median().unstack("arm")
    print(table.round(0).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
