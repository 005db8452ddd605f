"""Is the eager layer's host time a property of the layer or of the host CPU at that moment?

Runs, for `--seconds`, rounds of three host-side workloads back to back on one GPU and writes one
CSV row per round (monotonic time stamp, microseconds of each, the CPU the round ended on):
  * `python_us`: a fixed pure-Python loop (`occult.harness.sweep.timing.host_probe_us`, no torch, no
    GPU): the CPU's single-thread speed;
  * `launch_us`: `--launches` tiny CUDA kernels issued without a sync
    (`occult.harness.sweep.timing.host_launch_us`): the driver's launch path;
  * `layer_us`: one eager `occult.ep.ep_moe` call at D = 1 (decode batch, DeepSeek-MoE shape by
    default, no sync inside the call), the GPU drained before it, as `occult.harness.sweep` times a step.
If `layer_us` moves with `python_us` over time, the sweeps' host-bound points move with the CPU
and not with the code. One GPU (Snakemake: rule probe_host):

    python -m occult.harness.host_probe --seconds 60 --out host_probe.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

from occult.logs import run_main


def current_cpu() -> int:
    """The CPU this thread last ran on (field 39 of /proc/self/stat; -1 where there is none)."""
    try:
        return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.host_probe", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--python-iters", type=int, default=20000)
    parser.add_argument("--launches", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--log-json", metavar="PATH", help="append JSON-lines logs here (default: $OCCULT_LOG_JSON)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")

    from occult.ep import ep_moe
    from occult.harness.sweep.timing import host_launch_us, host_probe_us

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    dtype = torch.bfloat16
    x = torch.randn(args.tokens, args.hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(args.tokens, args.experts, generator=gen, device=device)
    weights, ids = torch.softmax(logits, dim=-1).topk(args.top_k, dim=-1)
    w_gate_up = (torch.randn(args.experts, 2 * args.ffn, args.hidden, generator=gen, device=device) * 0.02).to(dtype)
    w_down = (torch.randn(args.experts, args.hidden, args.ffn, generator=gen, device=device) * 0.02).to(dtype)
    placement = torch.zeros(args.experts, dtype=torch.long)

    def layer() -> None:
        with torch.no_grad():
            ep_moe(x, ids, weights, placement, w_gate_up, w_down, backend="triton")

    for _ in range(20):   # compile and warm up
        layer()
    torch.cuda.synchronize()
    rows = []
    start = time.monotonic()
    while time.monotonic() - start < args.seconds:
        python_us = host_probe_us(args.python_iters)
        torch.cuda.synchronize()
        launch_us = host_launch_us(device, args.launches)     # drains its launches itself
        t4 = time.perf_counter()
        layer()
        t5 = time.perf_counter()
        torch.cuda.synchronize()
        rows.append((round(time.monotonic() - start, 4), round(python_us, 1), round(launch_us, 1),
                     round(1e6 * (t5 - t4), 1), current_cpu()))
    tmp = args.out.with_suffix(".tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["t_s", "python_us", "launch_us", "layer_us", "cpu"])
        writer.writerows(rows)
    tmp.replace(args.out)
    print(f"{len(rows)} rounds in {args.seconds:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("host_probe", main))
