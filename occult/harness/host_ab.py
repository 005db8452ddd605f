"""Host-time A/B runs with the host's speed held fixed: every arm of every (shape, batch) in ONE
process, interleaved step by step (`occult.harness.sweep.timing.interleaved_ab`: per round, in
alternating order, one step per arm as `occult.harness.sweep` times it: the GPU drained, CUDA
events around the step, the host time of the step itself; a launch probe opens each round). A
host's CPU speed can move between processes by more than the effects sought, which is why the
sweeps' separate processes cannot answer these questions. One CSV row per step; one GPU.

`train`: host time of one eager training step (forward of the layer plus the shape's shared
expert, backward from a fixed output gradient), inputs from the sweep's synthetic router
(`occult.harness.sweep.inputs.make_inputs`). Arms:
  occult               the eager `occult.ep.ep_moe` at D = 1 (Triton backend), as the code runs it
  occult-tuned-normal  the same with `occult.kernels.launch.FAST_TUNED_LAUNCH` off: autotuned kernels
                       launched through the autotuner's `tuned[grid](...)`
  occult-normal-launch also `FAST_LAUNCH` off: every kernel through Triton's `kernel[grid](...)`
  occult-customop      also `occult.kernels.combine.EAGER_FUNCTIONS` off: the forward that records
                       autograd goes through the torch custom ops
  naive                `occult.harness.baselines.naive.NaiveEP` (torch._grouped_mm)

`shared`: what the shared expert adds to an eager decode step: per shape, `layer` (the eager
`ep_moe` call at D = 1) against `layer+shared` (the same plus
`occult.shapes.SharedExpert` added to its output, as the sweep does).

    python -m occult.harness.host_ab train --rounds 200 --batch 1 2 4 --out train_host_ab.csv
    python -m occult.harness.host_ab shared --rounds 400 --batch 8 --out shared_host_ab.csv

(Snakemake: rules compare_train_host and compare_shared_host.)
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from occult.logs import run_main

SHAPES = ("olmoe", "qwen", "deepseek")
# arm -> (EAGER_FUNCTIONS, FAST_LAUNCH, FAST_TUNED_LAUNCH) for the Occult arms of `train`
OCCULT_ARMS = {"occult": (True, True, True), "occult-tuned-normal": (True, True, False),
               "occult-normal-launch": (True, False, False), "occult-customop": (False, False, False)}
TRAIN_ARMS = (*OCCULT_ARMS, "naive")
SHARED_ARMS = ("layer", "layer+shared")
KEY_COLUMNS = ("shape", "batch", "arm")


def train_steps(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[tuple, Callable[[], None]]:
    """(shape, batch, arm) -> one training step of that arm, with the arm's launch switches set."""
    from occult.harness.baselines import ExpertWeights
    from occult.shapes import get_shape
    from occult.harness.baselines.naive import NaiveEP
    from occult.harness.sweep.inputs import SyntheticRouter, make_inputs
    from occult.shapes import SharedExpert
    from occult.provenance import derive_seed
    from occult.harness.sweep.occult_method import OccultEP
    from occult.harness.sweep.timing import train_step

    combine_module = importlib.import_module("occult.kernels.combine")   # the package exports a function `combine`
    launch_module = importlib.import_module("occult.kernels.launch")
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
    return steps


def restore_launch_switches() -> None:
    """The switches `train_steps` flips, back to the code's defaults."""
    combine_module = importlib.import_module("occult.kernels.combine")
    launch_module = importlib.import_module("occult.kernels.launch")
    combine_module.EAGER_FUNCTIONS[0] = launch_module.FAST_LAUNCH[0] = launch_module.FAST_TUNED_LAUNCH[0] = True


def shared_steps(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[tuple, Callable[[], None]]:
    """(shape, batch, arm) -> one decode step of the eager layer, with or without the shared expert."""
    from occult.ep import ep_moe
    from occult.shapes import get_shape
    from occult.shapes import SharedExpert
    from occult.provenance import derive_seed

    def step(x, ids, weights, placement, w_gate_up, w_down, shared) -> torch.Tensor:
        with torch.no_grad():
            y = ep_moe(x, ids, weights, placement, w_gate_up, w_down, backend="triton")
            return y + shared(x) if shared is not None else y

    steps = {}
    for name in args.shapes:
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
            for arm in args.arms:
                if arm == "layer+shared" and shared is None:
                    continue
                steps[(name, batch, arm)] = functools.partial(step, x, ids, weights, placement, w_gate_up, w_down,
                                                              shared if arm == "layer+shared" else None)
    return steps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.host_ab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="study", required=True)
    for study, arms, rounds, batch, warmup in (("train", TRAIN_ARMS, 200, [1, 2, 4], 10),
                                               ("shared", SHARED_ARMS, 400, [8], 20)):
        one = sub.add_parser(study, help=f"the {study} A/B (module docstring)")
        one.add_argument("--rounds", type=int, default=rounds)
        one.add_argument("--batch", type=int, nargs="+", default=batch,
                         help="sequences per step" + (" of --seq-len tokens" if study == "train" else " (one token each)"))
        one.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
        one.add_argument("--arms", nargs="+", default=list(arms), choices=arms)
        one.add_argument("--warmup", type=int, default=warmup)
        one.add_argument("--seed", type=int, default=0)
        one.add_argument("--out", type=Path, required=True)
        one.add_argument("--log-json", metavar="PATH", help="append JSON-lines logs here (default: $OCCULT_LOG_JSON)")
        if study == "train":
            one.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args(argv)
    for name in ("rounds", "batch"):
        values = getattr(args, name)
        if min(values if isinstance(values, list) else [values]) < 1:
            parser.error(f"--{name}: expected values of 1 or more, got {values}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from occult.harness.sweep.timing import interleaved_ab

    device, dtype = torch.device("cuda"), torch.bfloat16
    if args.study == "train":
        try:
            interleaved_ab(train_steps(args, device, dtype), args.rounds, args.warmup, device, args.out, KEY_COLUMNS)
        finally:
            restore_launch_switches()
    else:
        interleaved_ab(shared_steps(args, device, dtype), args.rounds, args.warmup, device, args.out, KEY_COLUMNS,
                       progress_every=100)

    import pandas as pd

    table = pd.read_csv(args.out).groupby(["shape", "batch", "arm"])[["host_us", "step_us"]].median().unstack("arm")
    print(table.round(1).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(run_main("host_ab", main))
