"""The all-to-all table shipped as package data: its source line, the curve the simulator builds
from it, and malformed tables named."""

from importlib import resources

import numpy as np
import pytest

from occult.sim.builtin_alltoall import (BUILTIN_ALLTOALL_FILE, BUILTIN_ALLTOALL_SOURCE, builtin_alltoall_table,
                                         parse_alltoall_table)
from occult.sim.columns import SimulateError
from occult.sim.cost_model import builtin_alltoall_curve
from occult.sim.measured import alltoall_curves


def test_the_shipped_table_says_where_it_was_measured():
    first = resources.files("occult.sim").joinpath(BUILTIN_ALLTOALL_FILE).read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("#") and all(fact in first for fact in ("H200", "NCCL", "all_to_all_single", "20"))
    table = builtin_alltoall_table()
    assert len(table) >= 2 and all(b[0] > a[0] for a, b in zip(table, table[1:]))
    assert BUILTIN_ALLTOALL_FILE in BUILTIN_ALLTOALL_SOURCE


def test_the_curve_is_the_table_with_half_of_each_buffer_remote():
    curve = builtin_alltoall_curve()
    for size, gbps in builtin_alltoall_table():
        assert curve(size / 2) == pytest.approx(size / (gbps * 1e9) * 1e3)
    assert alltoall_curves(None)[2](np.float64(3e8)) == curve(3e8)


@pytest.mark.parametrize("text, match", [
    ("size,algbw_gbps\n1,2\n", "lacks column.*buffer_bytes_per_rank"),
    ("buffer_bytes_per_rank,algbw_gbps\n1,fast\n", "not a number"),
    ("buffer_bytes_per_rank,algbw_gbps\n4,2\n2,3\n", "strictly increasing"),
    ("# only a comment\nbuffer_bytes_per_rank,algbw_gbps\n", "≥ 1 row"),
    ("buffer_bytes_per_rank,algbw_gbps\n4,0\n", "positive"),
])
def test_a_malformed_table_is_named(text, match):
    with pytest.raises(SimulateError, match=f"table.csv: .*{match}"):
        parse_alltoall_table(text, "table.csv")
