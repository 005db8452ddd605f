"""Host time of one eager training step, Occult against the naive EP, arms interleaved in ONE process.

The lent hosts' CPU speed moves between processes by more than the effects sought here
(docs/performance.md, v17), so every arm of every (shape, batch) runs in one process, step by step:
each round times, in alternating order, one training step per arm as `occult.sweep` times it (the
GPU drained, CUDA events around the step, the host time of the step itself): forward of the layer
plus the shape's shared expert, backward from a fixed output gradient. Arms:
  occult               the eager `occult.ep.ep_moe` at D = 1 (Triton backend), as the code runs it
  occult-normal-launch the same with `occult.kernels.launch.FAST_LAUNCH` off: every kernel through
                       Triton's `kernel[grid](...)`
  occult-customop      also `occult.kernels.combine.EAGER_FUNCTIONS` off: the forward that records
                       autograd goes through the torch custom ops (the code before session 25)
  naive                `occult.baselines.naive.NaiveEP` (torch._grouped_mm)
Inputs are `occult.sweep.make_inputs` of the sweep's synthetic router. One CSV row per step.
Usage (one GPU):
  python workflow/scripts/train_host_ab.py --rounds 200 --batch 1 2 4 --out train_host_ab.csv
"""
from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

SHAPES = ("olmoe", "qwen", "deepseek")
# arm -> (EAGER_FUNCTIONS, FAST_LAUNCH) for the Occult arms
OCCULT_ARMS = {"occult": (True, True), "occult-normal-launch": (True, False), "occult-customop": (False, False)}
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

    from occult.baselines import ExpertWeights, get_shape
    from occult.baselines.naive import NaiveEP
    import importlib
    from occult.sweep import OccultEP, SharedExpert, SyntheticRouter, derive_seed, host_launch_us, make_inputs

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
                         flags=OCCULT_ARMS.get(arm, (True, True))) -> None:
                    combine_module.EAGER_FUNCTIONS[0], launch_module.FAST_LAUNCH[0] = flags
                    for p in params:
                        p.grad = None
                    x = inputs.x_TD.detach().requires_grad_()
                    g = gate.detach().requires_grad_()
                    y = method.forward(x, ids, g)
                    if shared is not None:
                        y = y + shared(x)
                    y.backward(inputs.dy_TD)

                steps[(name, batch, arm)] = step
    for step in steps.values():                      # compile and warm up every variant
        for _ in range(args.warmup):
            step()
    torch.cuda.synchronize()

    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows, began = [], time.monotonic()
    for round_ in range(args.rounds):
        launch_us = host_launch_us(device)
        order = list(steps) if round_ % 2 == 0 else list(reversed(steps))   # no arm always first
        for key in order:
            torch.cuda.synchronize()
            start_event.record()
            t0 = time.perf_counter()
            steps[key]()
            host_us = 1e6 * (time.perf_counter() - t0)
            end_event.record()
            end_event.synchronize()
            rows.append((round_, *key, round(host_us, 1), round(1e3 * start_event.elapsed_time(end_event), 1),
                         round(launch_us, 1)))
        if round_ % 50 == 0:
            print(f"round {round_}/{args.rounds} ({time.monotonic() - began:.0f} s)", flush=True)
    combine_module.EAGER_FUNCTIONS[0] = launch_module.FAST_LAUNCH[0] = True
    tmp = args.out.with_suffix(".tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["round", "shape", "batch", "arm", "host_us", "step_us", "host_launch_us"])
        writer.writerows(rows)
    tmp.replace(args.out)

    import pandas as pd

    table = pd.read_csv(args.out).groupby(["shape", "batch", "arm"])[["host_us", "step_us"]].median().unstack("arm")
    print(table.round(0).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
