"""Keep `--tokens` tokens of a routing trace, in `--stretches` runs of consecutive tokens spread over
the whole trace (`occult.routing.profiling.sample_routing`; `--stretches 1`: its first tokens): a
real trace small enough to commit beside a run's results, with the whole trace's mix of sources,
for the EP benchmark's trace routing (`occult.harness.sweep --routing trace --trace FILE`) and the
placement study of a GPU run.

    python -m occult.harness.routing_sample --src work/upcycle/profile/routing_heldout.npz \\
        --out results/upcycle/profile/routing_heldout_sample.npz --tokens 16384
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from occult.logs import run_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.routing_sample", description=__doc__.split("\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="routing_*.npz of occult.routing.profiling")
    parser.add_argument("--out", type=Path, required=True, help="the sample (.npz)")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--stretches", type=int,
                        help="runs of consecutive tokens (default: profiling.SAMPLE_STRETCHES, 16; 1: the first tokens)")
    parser.add_argument("--log-json", metavar="PATH", help="append JSON-lines logs here (default: $OCCULT_LOG_JSON)")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens {args.tokens}: expected 1 or more")
    if args.stretches is not None and args.stretches < 1:
        parser.error(f"--stretches {args.stretches}: expected 1 or more")
    from occult.routing.profiling import SAMPLE_STRETCHES, sample_routing

    record = sample_routing(args.src, args.out, args.tokens, args.stretches or SAMPLE_STRETCHES)
    print(f"{record.ids.shape[1]} tokens of {len(record.layers)} layers -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("routing_sample", main))
