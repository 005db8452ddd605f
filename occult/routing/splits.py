"""A model's routing traces, split into calibration and held-out tokens (the placement study's input)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RoutingSplits:
    """Calibration and held-out routing [L, N, k] of one model (or synthetic shape).

    `sources` [N] index `source_names` (as in occult.routing.profiling's routing files); empty when unknown.
    `shape`: the MoE layer shape that prices it (`occult.shapes.MoEShape`; None:
    `placement_latency.trace_shape`'s default).
    """

    calib_LNK: np.ndarray
    heldout_LNK: np.ndarray
    num_experts: int
    layers: tuple[int, ...] = ()
    calib_sources: np.ndarray | None = None
    heldout_sources: np.ndarray | None = None
    source_names: tuple[str, ...] = ()
    shape: Any = None
