"""Run a command while `nvidia-smi` samples its GPUs' clocks, power, temperature and clock-limit
reasons every `--interval-ms` (what sets a kernel's rate under sustained load; the kernel
benchmark's rows hold their start and end times, `started_unix_ms`/`ended_unix_ms`, to match).

    python -m occult.harness.telemetry --out telemetry.csv -- python -m occult.harness.kernel_bench --out kernels.csv

Samples the GPUs of CUDA_VISIBLE_DEVICES where it lists GPU indices (nvidia-smi itself ignores
that variable), else every GPU. Exits with the command's exit code; the CSV is written whole or
not at all.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

FIELDS = "timestamp,index,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu"
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")   # newer drivers, older drivers


def sampler_command(interval_ms: int, env: dict[str, str]) -> list[str]:
    """The nvidia-smi command line that samples this job's GPUs."""
    reasons = REASONS[0]
    probe = subprocess.run(["nvidia-smi", f"--query-gpu={reasons}", "--format=csv"], capture_output=True, text=True)
    if probe.returncode != 0:
        reasons = REASONS[1]
    command = ["nvidia-smi", f"--query-gpu={FIELDS},{reasons}", "--format=csv", f"-lms={interval_ms}"]
    visible = [item.strip() for item in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if item.strip()]
    if visible and all(item.isdigit() for item in visible):
        command.append(f"--id={','.join(visible)}")
    return command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult.harness.telemetry", description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s --out CSV [--interval-ms MS] -- COMMAND [ARGS ...]")
    parser.add_argument("--out", type=Path, required=True, help="CSV of the samples")
    parser.add_argument("--interval-ms", type=int, default=200)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if args.interval_ms < 10:
        parser.error(f"--interval-ms {args.interval_ms}: expected 10 or more")
    if shutil.which("nvidia-smi") is None:
        parser.error("nvidia-smi not found: telemetry needs an NVIDIA driver")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp{os.getpid()}")
    with tmp.open("w") as sink:
        sampler = subprocess.Popen(sampler_command(args.interval_ms, dict(os.environ)), stdout=sink,
                                   stderr=subprocess.STDOUT)
        try:
            code = subprocess.call(command)
        except OSError as err:
            print(f"telemetry: error: cannot run {command[0]!r}: {err}", file=sys.stderr)
            code = 127
        finally:
            sampler.terminate()
            sampler.wait(timeout=30)
    if code == 0:
        os.replace(tmp, args.out)
    else:
        tmp.unlink(missing_ok=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
