"""The rate at which decode-sized Occult expert calls stream their weights (simulate.kernel_stream_gbps).

Reads an `occult.sweep` CSV of `occult-compute-graph` rows with uniform routing at small token counts
(results/nvidia-h200/kernels_decode_v1/small_compute_uniform_D1.csv), takes each row's expected active
experts under uniform top-k routing, E·(1 − (1 − k/E)^T), and fits, per shape, time = intercept +
weight bytes / rate over the rows of at most `--max-tokens` tokens (before every expert is active).
Prints a row per shape and the median rate. Usage:
  python workflow/scripts/fit_weight_streaming.py results/nvidia-h200/kernels_decode_v1/small_compute_uniform_D1.csv
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    from occult.baselines import get_shape
    from occult.simulate import expert_weight_bytes

    frame = pd.read_csv(args.csv)
    frame = frame[(frame["status"] == "ok") & (frame["method"] == "occult-compute-graph")]
    if frame.empty or set(frame["routing"]) != {"uniform"}:
        sys.exit(f"{args.csv}: expected ok occult-compute-graph rows with uniform routing")
    rates = []
    for name, rows in frame.groupby("shape"):
        shape = get_shape(name)
        rows = rows.sort_values("tokens_per_gpu")
        active = shape.num_experts * (1 - (1 - shape.top_k / shape.num_experts) ** rows["tokens_per_gpu"].to_numpy())
        weight_bytes = active * expert_weight_bytes(shape, shape.ffn)
        small = rows["tokens_per_gpu"].to_numpy() <= args.max_tokens
        slope, intercept = np.polyfit(weight_bytes[small], rows["median_ms"].to_numpy()[small], 1)
        rates.append(1e-9 / (slope * 1e-3))
        print(f"{name:9s} rate {rates[-1]:.0f} GB/s  intercept {intercept:.3f} ms  ({small.sum()} rows)")
    print(f"median rate {np.median(rates):.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
