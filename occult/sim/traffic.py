"""Traffic of one EP MoE layer: rows, (token, expert) pairs and bytes per (source, destination) device.

From a routing trace (`ids_NK`, global expert ids), a placement (expert → device) and a dispatch
mode, `traffic` counts per (source, destination) device the rows, the (token, expert) pairs and
the bytes on the wire, in the runtime's exact format (`occult.ep.layer`):

  * `dedup` (Occult, exact or N_d-pruned routing): one packed row per (token, device): the hidden
    vector (padded to 4 B) + 8 B per metadata slot (`slots` = most pairs any row carries), padded
    to 64 B; one returned row (hidden vector) per sent row. The static-shape plan (`-static`,
    `-graph`) sends a fixed T rows to every device (`static_traffic`).
  * `per_expert` (the same runtime, one row per (token, expert)): slots = 1, same padding.
  * `naive` (`occult.harness.baselines.naive`): one bare hidden vector per (token, expert), each way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from occult.shapes import MoEShape
from occult.kernels.wire_format import META_BYTES_PER_PAIR, packed_row_layout
from occult.sim.columns import SimulateError

MODES = ("dedup", "per_expert", "naive")
PASSES = ("fwd", "train")


def wire_row_bytes(mode: str, hidden: int, elem_bytes: int, slots: int) -> tuple[int, int]:
    """(bytes of one dispatched row, bytes of one returned row) in `mode`'s wire format."""
    if mode not in MODES:
        raise SimulateError(f"mode: {mode!r} is not one of {MODES}")
    vector = hidden * elem_bytes
    if mode == "naive":
        return vector, vector
    return packed_row_layout(hidden, elem_bytes, max(slots, 1))[1], vector


@dataclass(frozen=True)
class Traffic:
    """One layer's exchange among D devices; every [D, D] array is indexed [source, destination].

    Counts are floats so that a sampled trace can be scaled to another number of tokens.
    `return_bytes_SD[s, d]` is what device s sends back to d (its partial results for d's tokens).
    """

    mode: str
    rows_SD: np.ndarray
    pairs_SD: np.ndarray
    dispatch_bytes_SD: np.ndarray
    return_bytes_SD: np.ndarray
    tokens_per_source: float
    mean_devices_per_token: float
    slots: int
    active_experts_D: np.ndarray | None = None   # local experts with ≥ 1 pair per device (None: all)

    @property
    def num_devices(self) -> int:
        return self.rows_SD.shape[0]

    def scaled(self, factor: float) -> "Traffic":
        return dataclasses.replace(
            self, rows_SD=self.rows_SD * factor, pairs_SD=self.pairs_SD * factor,
            dispatch_bytes_SD=self.dispatch_bytes_SD * factor, return_bytes_SD=self.return_bytes_SD * factor,
            tokens_per_source=self.tokens_per_source * factor)

    @property
    def pairs_in_D(self) -> np.ndarray:
        """(token, expert) pairs each device computes."""
        return self.pairs_SD.sum(0)

    @property
    def row_work_D(self) -> np.ndarray:
        """Rows each device handles: mean of rows it sends (pack, combine) and receives (experts)."""
        return (self.rows_SD.sum(1) + self.rows_SD.sum(0)) / 2

    def remote(self, bytes_SD: np.ndarray) -> np.ndarray:
        return bytes_SD * (1 - np.eye(self.num_devices))

    def sweep_bytes_sent(self, hidden: int, elem_bytes: int) -> float:
        """Mean over ranks of `occult.harness.sweep`'s `bytes_sent` accounting (hidden vectors unpadded,
        8 B per remote pair for the runtime; bare vectors for naive), for comparison with a sweep."""
        off = 1 - np.eye(self.num_devices)
        rows_out = (self.rows_SD * off).sum(1)
        rows_back = (self.rows_SD * off).sum(0)
        meta = 0.0 if self.mode == "naive" else META_BYTES_PER_PAIR * (self.pairs_SD * off).sum(1)
        return float(np.mean((rows_out + rows_back) * hidden * elem_bytes + meta))


def traffic(ids_NK: np.ndarray | torch.Tensor, device_of_expert_E: np.ndarray | torch.Tensor, num_devices: int,
            mode: str, hidden: int, elem_bytes: int = 2, source_N: np.ndarray | None = None) -> Traffic:
    """Rows, pairs and bytes between every pair of devices for one layer's routing trace.

    `source_N[n]` is the device token n starts on (default: D equal contiguous blocks).
    """
    ids_NK = np.asarray(ids_NK.cpu() if isinstance(ids_NK, torch.Tensor) else ids_NK, dtype=np.int64)
    placement_E = np.asarray(device_of_expert_E.cpu() if isinstance(device_of_expert_E, torch.Tensor)
                             else device_of_expert_E, dtype=np.int64)
    if ids_NK.ndim != 2:
        raise SimulateError(f"ids_NK: expected [N, k], got shape {ids_NK.shape}")
    if placement_E.ndim != 1 or (placement_E.size and (placement_E.min() < 0 or placement_E.max() >= num_devices)):
        raise SimulateError(f"device_of_expert_E: expected devices in [0, {num_devices}), got {placement_E}")
    if ids_NK.size and (ids_NK.min() < 0 or ids_NK.max() >= placement_E.size):
        raise SimulateError(f"ids_NK: expert ids must lie in [0, {placement_E.size})")
    num_tokens = ids_NK.shape[0]
    if source_N is None:
        source_N = np.arange(num_tokens) * num_devices // max(num_tokens, 1)
    source_N = np.asarray(source_N, dtype=np.int64)
    if source_N.shape != (num_tokens,) or (num_tokens and (source_N.min() < 0 or source_N.max() >= num_devices)):
        raise SimulateError(f"source_N: expected {num_tokens} devices in [0, {num_devices})")
    dev_NK = placement_E[ids_NK]
    pairs_ND = np.zeros((num_tokens, num_devices), dtype=np.int64)
    np.add.at(pairs_ND, (np.repeat(np.arange(num_tokens), ids_NK.shape[1]), dev_NK.reshape(-1)), 1)
    hit_ND = pairs_ND > 0
    rows_ND = hit_ND.astype(np.int64) if mode == "dedup" else pairs_ND
    slots = int(pairs_ND.max(initial=1)) if mode == "dedup" else 1

    def by_source(values_ND: np.ndarray) -> np.ndarray:
        out_SD = np.zeros((num_devices, num_devices), dtype=np.float64)
        np.add.at(out_SD, source_N, values_ND.astype(np.float64))
        return out_SD

    rows_SD, pairs_SD = by_source(rows_ND), by_source(pairs_ND)
    sent_row, back_row = wire_row_bytes(mode, hidden, elem_bytes, slots)
    hit_E = np.bincount(ids_NK.reshape(-1), minlength=placement_E.size) > 0
    return Traffic(
        mode=mode, rows_SD=rows_SD, pairs_SD=pairs_SD, dispatch_bytes_SD=rows_SD * sent_row,
        return_bytes_SD=rows_SD.T * back_row, tokens_per_source=num_tokens / num_devices,
        mean_devices_per_token=float(hit_ND.sum(1).mean()) if num_tokens else float("nan"), slots=slots,
        active_experts_D=np.bincount(placement_E[hit_E], minlength=num_devices).astype(np.float64))


def static_traffic(base: Traffic, hidden: int, elem_bytes: int = 2) -> Traffic:
    """The static-shape plan's exchange (`ep_moe(static_capacity=T)`): every source sends a fixed
    T rows (one per token, empty or not) to every device and gets T rows back; pairs unchanged."""
    num_devices = base.num_devices
    capacity = base.tokens_per_source
    rows_SD = np.full((num_devices, num_devices), capacity, dtype=np.float64)
    sent_row, back_row = wire_row_bytes("dedup", hidden, elem_bytes, base.slots)
    return dataclasses.replace(base, rows_SD=rows_SD, dispatch_bytes_SD=rows_SD * sent_row,
                               return_bytes_SD=rows_SD.T * back_row)


def recorded_traffic(num_devices: int, tokens_per_gpu: float, mode: str, shape: MoEShape, bytes_sent: float,
                     mean_devices_per_token: float, pairs_received_max: float) -> Traffic:
    """A symmetric exchange rebuilt from a measured row's own accounting (for routing the CPU cannot
    regenerate): `bytes_sent` per rank (remote rows out + their returns, `EPStats`), E[C_T] and
    the busiest rank's pairs, which every device is given (the busiest sets the pace)."""
    values = (tokens_per_gpu, bytes_sent, mean_devices_per_token, pairs_received_max)
    if num_devices < 2 or not all(np.isfinite(v) and v >= 0 for v in values):
        raise SimulateError("recorded traffic: need D ≥ 2 and finite bytes_sent, mean_devices_per_token, "
                            "pairs_received_max")
    slots = shape.top_k if mode == "dedup" else 1
    sent_row, back_row = wire_row_bytes(mode, shape.hidden, 2, slots)
    rows_per_source = tokens_per_gpu * (mean_devices_per_token if mode == "dedup" else shape.top_k)
    remote = min(bytes_sent / (sent_row + back_row), rows_per_source)
    rows_SD = np.full((num_devices, num_devices), remote / (num_devices - 1))
    np.fill_diagonal(rows_SD, rows_per_source - remote)
    pairs_SD = np.full((num_devices, num_devices), pairs_received_max / num_devices)
    return Traffic(mode=mode, rows_SD=rows_SD, pairs_SD=pairs_SD, dispatch_bytes_SD=rows_SD * sent_row,
                   return_bytes_SD=rows_SD.T * back_row, tokens_per_source=float(tokens_per_gpu),
                   mean_devices_per_token=float(mean_devices_per_token), slots=slots)
