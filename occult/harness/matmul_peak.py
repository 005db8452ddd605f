"""The bf16 dense matmul rate of this GPU (cuBLAS, 8192³, `occult.harness.kernel_bench.dense_peak`'s
burst timing: median of 20 single calls after 10), written as the `peak.csv` that the EP
benchmark's report divides expert rates by (`occult.report.gpu_runs --ep`). One GPU:

    python -m occult.harness.matmul_peak --out results/<machine>/ep_<v>/peak.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from occult.logs import run_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.matmul_peak", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="CSV: gpu, op, median_ms, tflops")
    parser.add_argument("--size", type=int, default=8192, help="M = N = K of the matmul")
    parser.add_argument("--log-json", metavar="PATH", help="append JSON-lines logs here (default: $OCCULT_LOG_JSON)")
    args = parser.parse_args(argv)
    if args.size < 256:
        parser.error(f"--size {args.size}: expected 256 or more")
    import torch

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    from occult.harness.kernel_bench import dense_peak
    from occult.provenance import atomic_path

    burst = dense_peak(25, 200, size=args.size)["cublas_burst"]
    with atomic_path(args.out) as tmp:
        tmp.write_text(f"gpu,op,median_ms,tflops\n{torch.cuda.get_device_name()},bf16 matmul {args.size}^3,"
                             f"{burst['median_ms']:.4f},{burst['tflops']:.1f}\n")
    print(f"bf16 peak: {burst['tflops']:.0f} TFLOP/s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("matmul_peak", main))
