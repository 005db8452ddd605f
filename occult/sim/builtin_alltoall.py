"""The all-to-all table shipped with the package (`occult/sim/data/alltoall_2xh200.csv`).

The simulator's link curve where no simulator.yaml names an `alltoall` file, and the GPU report's NCCL
curve where a machine has no measured one. The file's first line says where it was measured.
"""

from __future__ import annotations

import csv
import functools
from importlib import resources

from occult.sim.columns import SimulateError

BUILTIN_ALLTOALL_FILE = "data/alltoall_2xh200.csv"
BUILTIN_ALLTOALL_SOURCE = f"occult/sim/{BUILTIN_ALLTOALL_FILE} (built in)"
BUILTIN_ALLTOALL_COLUMNS = ("buffer_bytes_per_rank", "algbw_gbps")


def parse_alltoall_table(text: str, name: str) -> tuple[tuple[float, float], ...]:
    """((whole buffer bytes per rank, algbw GB/s), ...) from the CSV text of `name` ('#' lines are comments)."""
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    reader = csv.DictReader(lines)
    missing = [c for c in BUILTIN_ALLTOALL_COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise SimulateError(f"{name}: lacks column(s) {', '.join(missing)}")
    try:
        table = tuple((float(row["buffer_bytes_per_rank"]), float(row["algbw_gbps"])) for row in reader)
    except (TypeError, ValueError) as err:
        raise SimulateError(f"{name}: a value is not a number ({err})") from None
    sizes = [size for size, _ in table]
    if not table or any(v <= 0 for row in table for v in row) or any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise SimulateError(f"{name}: need ≥ 1 row of positive values with strictly increasing buffer sizes")
    return table


@functools.lru_cache(maxsize=None)
def builtin_alltoall_table() -> tuple[tuple[float, float], ...]:
    """The shipped table: ((whole buffer bytes per rank, algbw GB/s), ...), increasing in size."""
    text = resources.files("occult.sim").joinpath(BUILTIN_ALLTOALL_FILE).read_text(encoding="utf-8")
    return parse_alltoall_table(text, BUILTIN_ALLTOALL_SOURCE)
