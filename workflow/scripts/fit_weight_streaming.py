"""Print the rate at which decode-sized Occult expert calls stream their weights, per shape.

The simulator fits the same rate itself from the `kernel_stream` file a simulator.yaml names
(`occult.sim.measured.fit_weight_streaming`: time = intercept + active experts' weight bytes / rate over
the `occult-compute-graph` uniform rows of at most `--max-tokens` tokens) and uses the median over
shapes. Usage:
  python workflow/scripts/fit_weight_streaming.py results/nvidia-h200/kernels_decode_v1/small_compute_uniform_D1.csv
"""
from __future__ import annotations

import argparse

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    from occult.sim.measured import fit_weight_streaming

    fits = fit_weight_streaming(args.csv, args.max_tokens, field=args.csv)
    for fit in fits:
        print(f"{fit['shape']:9s} rate {fit['rate_gbps']:.0f} GB/s  intercept {fit['intercept_ms']:.3f} ms  "
              f"({fit['rows']} rows)")
    print(f"median rate {np.median([fit['rate_gbps'] for fit in fits]):.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
