"""Traffic per device pair: wire-format byte counts by hand, dedup vs per-expert vs naive rows,
scaling, the static-shape plan and traffic rebuilt from a row's own accounting; bad inputs named."""

import numpy as np
import pytest

from occult.shapes import get_shape
from occult.sim.columns import SimulateError
from occult.sim.traffic import recorded_traffic, static_traffic, traffic, wire_row_bytes

PLACEMENT = np.array([0, 0, 1, 1])
IDS = np.array([[0, 1], [0, 2], [2, 3]])
SOURCE = np.array([0, 0, 1])
HIDDEN = 64                     # bf16: 128-byte vectors


def test_wire_row_bytes_match_the_runtime_format():
    assert wire_row_bytes("dedup", 2048, 2, 8) == (4160, 4096)       # 4096 + 64 B of slots
    assert wire_row_bytes("per_expert", 2048, 2, 1) == (4160, 4096)  # 4104 padded to 64
    assert wire_row_bytes("naive", 2048, 2, 1) == (4096, 4096)
    assert wire_row_bytes("dedup", 64, 2, 2) == (192, 128)           # 128 + 16 → 192
    with pytest.raises(SimulateError, match="mode"):
        wire_row_bytes("bogus", 8, 2, 1)


def test_traffic_dedup_counts_one_row_per_token_and_device():
    t = traffic(IDS, PLACEMENT, 2, "dedup", HIDDEN, source_N=SOURCE)
    np.testing.assert_array_equal(t.rows_SD, [[2, 1], [0, 1]])
    np.testing.assert_array_equal(t.pairs_SD, [[3, 1], [0, 2]])
    assert t.slots == 2
    np.testing.assert_array_equal(t.dispatch_bytes_SD, np.array([[2, 1], [0, 1]]) * 192)
    np.testing.assert_array_equal(t.return_bytes_SD, np.array([[2, 0], [1, 1]]) * 128)
    assert t.mean_devices_per_token == pytest.approx(4 / 3)
    np.testing.assert_array_equal(t.pairs_in_D, [3, 3])
    # sweep accounting of rank 0: 1 remote row out (128 B) + 1 remote pair (8 B); rank 1: 1 row back
    assert t.sweep_bytes_sent(HIDDEN, 2) == pytest.approx(((128 + 8) + 128) / 2)


def test_traffic_per_expert_and_naive_send_one_row_per_pair():
    per_expert = traffic(IDS, PLACEMENT, 2, "per_expert", HIDDEN, source_N=SOURCE)
    naive = traffic(IDS, PLACEMENT, 2, "naive", HIDDEN, source_N=SOURCE)
    for t in (per_expert, naive):
        np.testing.assert_array_equal(t.rows_SD, [[3, 1], [0, 2]])
    np.testing.assert_array_equal(per_expert.dispatch_bytes_SD, np.array([[3, 1], [0, 2]]) * 192)  # 136 → 192
    np.testing.assert_array_equal(naive.dispatch_bytes_SD, np.array([[3, 1], [0, 2]]) * 128)
    assert per_expert.slots == 1


def test_traffic_of_nd1_routing_stays_on_one_device():
    pruned = np.array([[0, 1], [0, 1], [2, 3]])
    t = traffic(pruned, PLACEMENT, 2, "dedup", HIDDEN, source_N=SOURCE)
    np.testing.assert_array_equal(t.rows_SD, [[2, 0], [0, 1]])
    assert t.mean_devices_per_token == 1.0
    assert t.remote(t.dispatch_bytes_SD).sum() == 0


def test_traffic_scaling_and_bad_inputs():
    t = traffic(IDS, PLACEMENT, 2, "dedup", HIDDEN, source_N=SOURCE).scaled(10)
    np.testing.assert_array_equal(t.rows_SD, [[20, 10], [0, 10]])
    with pytest.raises(SimulateError, match="device_of_expert_E"):
        traffic(IDS, np.array([0, 0, 1, 2]), 2, "dedup", HIDDEN)
    with pytest.raises(SimulateError, match="ids_NK"):
        traffic(np.array([[0, 4]]), PLACEMENT, 2, "dedup", HIDDEN)


def test_static_and_recorded_traffic():
    base = traffic(IDS, PLACEMENT, 2, "dedup", HIDDEN, source_N=np.array([0, 1, 1]))
    fixed = static_traffic(base, HIDDEN)
    np.testing.assert_array_equal(fixed.rows_SD, np.full((2, 2), 1.5))          # T rows to every device
    np.testing.assert_array_equal(fixed.pairs_SD, base.pairs_SD)
    shape = get_shape("olmoe")
    rec = recorded_traffic(2, 1024, "dedup", shape, bytes_sent=100 * (4160 + 4096), mean_devices_per_token=1.5,
                           pairs_received_max=5000)
    assert rec.rows_SD[0, 1] == pytest.approx(100) and rec.rows_SD.sum(1)[0] == pytest.approx(1024 * 1.5)
    np.testing.assert_allclose(rec.pairs_in_D, [5000, 5000])
    with pytest.raises(SimulateError, match="recorded traffic"):
        recorded_traffic(1, 1024, "dedup", shape, 0.0, 1.0, 10.0)
