"""Latency placement: the expert → device map that minimises the predicted time of one MoE layer.

E[C_T] counts bytes; the busiest device's expert work counts compute. Neither alone is the time of a
layer: a placement that keeps collaborating experts together can pile the popular ones onto one
device, and a load-only placement sends every token everywhere. `LayerCost` prices a placement
with the scale simulator's calibrated cost model (`occult.sim`): the all-to-alls from the bytes per
device pair (over NVLink inside a node of `gpus_per_node`, over the network between nodes), the
busiest device's expert kernels and other GPU work from its (token, expert) pairs and rows, and the
fixed costs (split-size exchange, shared expert, host terms). `latency_search` starts from the
placement of lowest predicted time among the given ones (the other methods' placements), then
descends by swaps of two experts between devices, priced incrementally (`_LatencyState`): a
swap touches two devices' columns of the per-device-pair row table and two devices' loads, so every
candidate swap of an expert is priced from per-expert tables, not by a pass over the trace.

The search fits the trace it is given, sampling noise in the expert loads included. So it runs on a
fit part of the trace, and its result replaces the start placement of lowest predicted time on the
whole trace (the data every start was placed from) only where it is also faster on the rest
(`validation_runs`: the mean predicted time over the held-back stretches of the trace, each priced
as a batch of its own) and not slower on the whole trace. A stretch is consecutive tokens, so
documents and sources whose experts differ weigh as they would in a batch drawn from them, and a
result balanced only for the fit part's pooled mix does not win on that alone. Stretches shorter
than `MIN_STRETCH_TOKENS` are priced together. The starts are compared on the whole trace, not on
the stretches: each was placed from all of it, and on short stretches their differences are mostly
sampling noise.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from occult.routing.placement import (
    kicked,
    _as_ids,
    _check_distinct_rows,
    _experts_per_device,
    _single_threaded_blas,
    _validated_placement,
    device_counts,
)

DEFAULT_TOKENS_PER_GPU = 16384     # the objective's batch: 2^14 tokens per GPU, forward
PATH_POINTS = 400                  # at most this many candidates kept of the search's path
VALIDATION_BLOCKS = 16             # the trace cut into this many runs of consecutive tokens ...
VALIDATION_EVERY = 4               # ... every 4th of which is the validation part (1/4 of the tokens)
MIN_STRETCH_TOKENS = 256           # shorter validation runs are priced together, as one batch


@dataclass(frozen=True)
class Prediction:
    """One placement's predicted layer call (ms) and the routing facts behind it."""

    predicted_ms: float            # the layer call: host terms and GPU time (`occult.sim.cost_model.layer_time`)
    gpu_ms: float                  # GPU time: busiest device's kernels + other work, all-to-alls, shared expert
    kernels_ms: float
    other_gpu_ms: float
    comm_ms: float
    expected_ct: float
    max_load_over_mean: float

    def key(self) -> tuple[float, float]:
        """Order of placements: predicted time (a layer without host terms: its GPU time), then GPU time."""
        return (self.predicted_ms if math.isfinite(self.predicted_ms) else self.gpu_ms, self.gpu_ms)


@dataclass(frozen=True)
class LayerCost:
    """The time of one EP layer call of `method` (an eager, exact-routing Occult dedup layer) on
    `shape` at `tokens_per_gpu` tokens per GPU, `pass_` fwd or train, by the calibrated `cost`."""

    cost: object                   # occult.sim.cost_model.CostModel
    shape: object                  # occult.shapes.MoEShape
    tokens_per_gpu: float = DEFAULT_TOKENS_PER_GPU
    pass_: str = "fwd"
    method: str = "occult"

    def __post_init__(self) -> None:
        from occult.sim.cost_model import method_spec

        spec = method_spec(self.method)
        if spec.family != "occult" or spec.max_devices is not None:
            raise ValueError(f"method: the latency objective prices an eager exact Occult layer, not {self.method!r}")
        if self.pass_ not in ("fwd", "train"):
            raise ValueError(f"pass_: {self.pass_!r} is not fwd or train")
        if not self.tokens_per_gpu > 0:
            raise ValueError(f"tokens_per_gpu: must be positive, got {self.tokens_per_gpu}")
        if self.cost.kernel_tflops is None:
            raise ValueError("cost model: no kernel throughput curve (an uncalibrated model)")

    @property
    def spec(self):
        from occult.sim.cost_model import method_spec

        return method_spec(self.method)

    def layer_ms(self, gpu_ms: float, num_devices: int) -> float:
        from occult.sim.cost_model import layer_time

        return layer_time(gpu_ms, self.spec, self.pass_, num_devices, self.cost,
                          self.cost.shared_host_ms(self.shape, self.pass_))["layer_ms"]

    def predict(self, ids_NK: np.ndarray, device_of_expert: np.ndarray, num_devices: int) -> Prediction:
        """The simulator's own prediction: `occult.sim.traffic.traffic` of the trace scaled to
        `tokens_per_gpu`, then `gpu_components` and `layer_time`. `device_of_expert` may hold more
        entries than the shape's experts (replica copies as extra ids, `occult.routing.replicas`)."""
        from occult.sim.cost_model import gpu_components
        from occult.sim.traffic import traffic

        ids_NK = np.asarray(ids_NK, dtype=np.int64)
        base = traffic(ids_NK, np.asarray(device_of_expert, dtype=np.int64), num_devices, "dedup", self.shape.hidden)
        scaled = base.scaled(self.tokens_per_gpu / base.tokens_per_source)
        parts = gpu_components(scaled, self.shape, self.spec, self.pass_, self.cost, self.tokens_per_gpu)
        pairs_D = base.pairs_in_D
        return Prediction(self.layer_ms(parts["gpu_ms"], num_devices), parts["gpu_ms"], parts["kernels_ms"],
                          parts["other_gpu_ms"], parts["comm_ms"], base.mean_devices_per_token,
                          float(pairs_D.max() / pairs_D.mean()))


@dataclass
class LatencyResult:
    """A latency search: the placement, where it started, what it predicts, and its path.

    `start`, `final` and `starts` are predictions on the whole trace; `validation` holds each
    candidate's (every start and "search", the search's own result) mean predicted time over the
    validation stretches (ms; `validation_runs`), and `chosen` names the one returned: "search"
    where it is faster there than the start of lowest predicted time on the whole trace and not
    slower than that start on the whole trace, else that start."""

    device_of_expert: np.ndarray
    start_method: str
    start: Prediction
    final: Prediction
    starts: dict[str, Prediction]
    path: dict[str, np.ndarray]    # expected_ct, max_load_over_mean, predicted_ms, accepted: candidates visited
    swaps: int
    seconds: float                 # the search (the start placements are the caller's)
    validation: dict[str, float] = dataclasses.field(default_factory=dict)
    chosen: str = "search"

    @property
    def gain(self) -> float:
        """Predicted time of the start over that of the result, on the whole trace (> 1: faster)."""
        return self.start.key()[0] / self.final.key()[0]


# ----------------------------------------------------------------------------------------------
# The incremental state


class _LatencyState:
    """A placement and the tables that price every swap of one expert at once.

    With cnt[t, d] the token's experts on device d, s(t) its source device and R[s, d] the rows
    source s sends to d (tokens with cnt[t, d] > 0), swapping a (on p) with b (on q) changes only
    columns p and q of R:

        ΔR[:, p] = −A[a] + Z[b, :, p] + Cp[b]       ΔR[:, q] = Z[a, :, q] − A[b] + Cq[b]
        Z[e, s, d] = #{t ∋ e, s(t) = s : cnt[t, d] = 0}     A[e, s] = #{t ∋ e, s(t) = s : cnt[t, dev e] = 1}
        Cp[b, s] = #{t ∋ a, b, s(t) = s : cnt[t, p] = 1}    Cq[b, s] = #{t ∋ a, b, s(t) = s : cnt[t, q] = 1}

    (tokens holding both a and b keep their rows), and the loads of p and q by ±(|T_a| − |T_b|).
    A swap updates cnt, R, Z, A from the tokens it touches only. Times are recomputed from these
    integer tables, so the state never drifts.
    """

    CHUNK = 8192

    def __init__(self, ids_NK: np.ndarray, device_of_expert: np.ndarray, num_devices: int, layer: LayerCost):
        from occult.kernels.wire_format import packed_row_layout
        from occult.sim.cost_model import OtherGpuTerms, expert_flops_per_pair

        self.ids_NK, self.layer, self.D = ids_NK, layer, num_devices
        self.E = len(device_of_expert)
        num_tokens, self.top_k = ids_NK.shape
        D = num_devices
        self.source_N = np.arange(num_tokens) * D // num_tokens
        self.factor = layer.tokens_per_gpu * D / num_tokens
        expert_flat = ids_NK.ravel()
        order = np.argsort(expert_flat, kind="stable")
        bounds = np.searchsorted(expert_flat[order], np.arange(self.E + 1))
        token_flat = np.repeat(np.arange(num_tokens), self.top_k)
        self.tokens_of_expert = [token_flat[order[bounds[e]:bounds[e + 1]]] for e in range(self.E)]
        self.ids_of_expert = [ids_NK[t] for t in self.tokens_of_expert]
        self.size_E = np.diff(bounds).astype(np.int64)
        self.active_E = (self.size_E > 0).astype(np.int64)
        cost = layer.cost
        link = cost.link
        node_D = np.arange(D) // link.gpus_per_node
        same = node_D[:, None] == node_D[None, :]
        self.intra_SD = (same & ~np.eye(D, dtype=bool)).astype(np.int64)
        self.inter_SD = (~same).astype(np.int64)
        self.curve = link.curve_for(min(D, link.gpus_per_node))
        self.flops_per_pair = expert_flops_per_pair(layer.shape)
        self.terms = cost.other_gpu or OtherGpuTerms(0.0, 0.0, 1.0, 0)
        self.train = layer.pass_ == "train"
        self.shared_ms = cost.shared_ms(layer.shape, layer.tokens_per_gpu, layer.pass_)
        self.split_ms = link.latency_ms(D)
        self._row_bytes = lambda slots: packed_row_layout(layer.shape.hidden, 2, max(slots, 1))[1]
        self.reset(device_of_expert)

    # -- tables

    def reset(self, device_of_expert: np.ndarray) -> None:
        self.dev = np.asarray(device_of_expert, dtype=np.int64).copy()
        D = self.D
        self.cnt_ND = device_counts(self.ids_NK, self.dev, D)
        self.rows_SD = np.zeros((D, D), dtype=np.int64)
        np.add.at(self.rows_SD, self.source_N, (self.cnt_ND > 0).astype(np.int64))
        self.load_D = np.bincount(self.dev, weights=self.size_E, minlength=D).astype(np.int64)
        self.active_D = np.bincount(self.dev, weights=self.active_E, minlength=D).astype(np.int64)
        self.slot_hist = np.bincount(self.cnt_ND.ravel(), minlength=self.top_k + 1).astype(np.int64)
        self.zeros_ESD = np.zeros((self.E, D, D), dtype=np.int64)
        self.alone_ES = np.zeros((self.E, D), dtype=np.int64)
        for start in range(0, len(self.ids_NK), self.CHUNK):
            z, a = self._tables(np.arange(start, min(start + self.CHUNK, len(self.ids_NK))))
            self.zeros_ESD += z
            self.alone_ES += a

    def _tables(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Contributions of `tokens` to Z [E, D, D] and A [E, D]."""
        D, E = self.D, self.E
        ids_tK = self.ids_NK[tokens]
        cnt_tD = self.cnt_ND[tokens]
        s_t = self.source_N[tokens]
        base_tK = ids_tK * D * D + s_t[:, None] * D
        zero_tKD = np.broadcast_to((cnt_tD == 0)[:, None, :], (*ids_tK.shape, D))
        index = (base_tK[:, :, None] + np.arange(D)[None, None, :])[zero_tKD]
        zeros = np.bincount(index, minlength=E * D * D).reshape(E, D, D)
        alone_tK = np.take_along_axis(cnt_tD, self.dev[ids_tK], axis=1) == 1
        alone = np.bincount((ids_tK * D + s_t[:, None]).ravel(), weights=alone_tK.ravel(), minlength=E * D)
        return zeros, alone.astype(np.int64).reshape(E, D)

    @property
    def slots(self) -> int:
        return int(np.flatnonzero(self.slot_hist)[-1]) if self.slot_hist.any() else 1

    def swap(self, a: int, b: int) -> None:
        """Swap a and b; only the touched tokens' columns p and q of cnt change, and the tables
        with them (Z in those two columns, A where an expert's own device count moved)."""
        D, E = self.D, self.E
        p, q = self.dev[a], self.dev[b]
        tokens_a, tokens_b = self.tokens_of_expert[a], self.tokens_of_expert[b]
        touched = np.union1d(tokens_a, tokens_b)
        ids_tK = self.ids_NK[touched]
        s_t = self.source_N[touched]
        old_pq = self.cnt_ND[touched][:, [p, q]]
        old_alone = np.take_along_axis(self.cnt_ND[touched], self.dev[ids_tK], axis=1) == 1
        self.cnt_ND[tokens_a, p] -= 1
        self.cnt_ND[tokens_a, q] += 1
        self.cnt_ND[tokens_b, q] -= 1
        self.cnt_ND[tokens_b, p] += 1
        self.dev[a], self.dev[b] = q, p
        new_cnt = self.cnt_ND[touched]
        new_pq = new_cnt[:, [p, q]]
        new_alone = np.take_along_axis(new_cnt, self.dev[ids_tK], axis=1) == 1
        flat = (ids_tK * D + s_t[:, None]).ravel()
        top_k = ids_tK.shape[1]
        for column, device in enumerate((p, q)):
            d_zero = (new_pq[:, column] == 0).astype(np.int64) - (old_pq[:, column] == 0)
            self.zeros_ESD[:, :, device] += np.bincount(flat, weights=np.repeat(d_zero, top_k),
                                                        minlength=E * D).astype(np.int64).reshape(E, D)
            d_rows = (new_pq[:, column] > 0).astype(np.int64) - (old_pq[:, column] > 0)
            self.rows_SD[:, device] += np.bincount(s_t, weights=d_rows, minlength=D).astype(np.int64)
        d_alone = new_alone.astype(np.int64) - old_alone
        self.alone_ES += np.bincount(flat, weights=d_alone.ravel(), minlength=E * D).astype(np.int64).reshape(E, D)
        self.slot_hist += (np.bincount(new_pq.ravel(), minlength=self.top_k + 1)
                           - np.bincount(old_pq.ravel(), minlength=self.top_k + 1))
        shift = self.size_E[a] - self.size_E[b]
        self.load_D[p] -= shift
        self.load_D[q] += shift
        moved = self.active_E[a] - self.active_E[b]
        self.active_D[p] -= moved
        self.active_D[q] += moved

    # -- times (vectorised over a leading axis of candidates)

    def _compute_ms(self, load_XD: np.ndarray, active_XD: np.ndarray, row_work_XD: np.ndarray) -> np.ndarray:
        """Each device's expert kernels + other GPU work, as `occult.sim.cost_model.gpu_components`."""
        from occult.sim.cost_model import WEIGHT_PASSES, weight_read_ms

        layer, cost = self.layer, self.layer.cost
        flops = load_XD * self.factor * self.flops_per_pair
        gflop = np.maximum(flops / 1e9, 1e-9)
        train_curve = cost.kernel_curve(layer.shape.ffn, train=True) if self.train else None
        if train_curve is not None:
            kernels = flops / (train_curve.many(gflop) * 1e12) * 1e3
        else:
            kernels = flops / (cost.kernel_curve(layer.shape.ffn).many(gflop) * 1e12) * 1e3
            if self.train:
                kernels = kernels * (cost.kernel_train_scale or float("nan"))
        kernels = kernels + weight_read_ms(active_XD, layer.shape, layer.pass_, cost.hbm_bytes_per_ms)
        stream = weight_read_ms(active_XD, layer.shape, layer.pass_, cost.stream_bytes_per_ms)
        kernels = np.maximum(kernels, stream + cost.kernel_floor_ms * WEIGHT_PASSES[layer.pass_])
        return kernels + self.terms.at(row_work_XD * self.factor, self.train)

    def _alltoall_ms(self, intra_XD: np.ndarray, inter_XD: np.ndarray, row_bytes: float) -> tuple[np.ndarray, np.ndarray]:
        """(collective time [X], per-device times [X, D]) of an exchange whose device x moves
        max(sent, received) rows inside its node and between nodes (`LinkModel.alltoall_ms`)."""
        link = self.layer.cost.link
        intra = intra_XD * (self.factor * row_bytes)
        inter = inter_XD * (self.factor * row_bytes)
        t_intra = np.where(intra > 0, self.curve.many(np.maximum(intra, 1e-30)), 0.0)
        t_inter = np.where(inter > 0, link.inter_node_latency_ms + inter / link.inter_node_bytes_per_ms, 0.0)
        per_device = np.maximum(t_intra, t_inter)
        return per_device.max(axis=-1), per_device

    def _value(self, load_XD, active_XD, row_work_XD, intra_XD, inter_XD) -> tuple[np.ndarray, np.ndarray]:
        """(GPU ms, tie-break) per candidate; the tie-break sums every device's compute and dispatch time."""
        compute = self._compute_ms(load_XD, active_XD, row_work_XD)
        gpu = compute.max(axis=-1) + self.shared_ms
        spread = compute.sum(axis=-1)
        if self.D > 1:
            slots = self.slots
            sent, back = self._row_bytes(slots), self.layer.shape.hidden * 2
            passes = 2.0 if self.train else 1.0
            t_sent, per_device = self._alltoall_ms(intra_XD, inter_XD, sent)
            t_back, _ = self._alltoall_ms(intra_XD, inter_XD, back)
            comm = self.split_ms + passes * (t_sent + t_back)
            if self.train:
                comm = comm + self._alltoall_ms(intra_XD, inter_XD, 4.0 * slots)[0]
            gpu = gpu + comm
            spread = spread + per_device.sum(axis=-1)
        return gpu, spread

    def _link_rows(self, rows_SD: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        intra, inter = rows_SD * self.intra_SD, rows_SD * self.inter_SD
        return np.maximum(intra.sum(1), intra.sum(0)), np.maximum(inter.sum(1), inter.sum(0))

    def value(self) -> tuple[float, float]:
        """(GPU ms, tie-break) of the current placement."""
        rows = self.rows_SD
        intra, inter = self._link_rows(rows)
        gpu, spread = self._value(self.load_D[None], self.active_D[None], ((rows.sum(1) + rows.sum(0)) / 2)[None],
                                  intra[None], inter[None])
        return float(gpu[0]), float(spread[0])

    def facts(self) -> tuple[float, float]:
        """(E[C_T], busiest device's pairs over the mean) of the current placement."""
        return float(self.rows_SD.sum() / len(self.ids_NK)), float(self.load_D.max() / self.load_D.mean())

    def candidates(self, a: int) -> dict[str, np.ndarray]:
        """GPU ms, tie-break, E[C_T] and load over mean of swapping a with every expert [E]
        (meaningless where dev b = dev a)."""
        D, E, dev = self.D, self.E, self.dev
        p = dev[a]
        tokens_a = self.tokens_of_expert[a]
        ids_aK = self.ids_of_expert[a]
        cnt_a = self.cnt_ND[tokens_a]
        flat = (ids_aK * D + self.source_N[tokens_a][:, None]).ravel()
        one_p = np.repeat(cnt_a[:, p] == 1, ids_aK.shape[1])
        one_dev = (np.take_along_axis(cnt_a, dev[ids_aK], axis=1) == 1).ravel()
        c_p = np.bincount(flat, weights=one_p, minlength=E * D).astype(np.int64).reshape(E, D)
        c_q = np.bincount(flat, weights=one_dev, minlength=E * D).astype(np.int64).reshape(E, D)
        d_p = self.zeros_ESD[:, :, p] - self.alone_ES[a][None, :] + c_p          # [b, s]: column p
        d_q = self.zeros_ESD[a][:, dev].T - self.alone_ES + c_q                 # [b, s]: column dev b
        rows = self.rows_SD
        b_idx = np.arange(E)
        # the row table's sums after each swap
        sent_sum = rows.sum(1)[None, :] + d_p + d_q
        recv_sum = np.repeat(rows.sum(0)[None, :], E, axis=0)
        recv_sum[:, p] += d_p.sum(1)
        recv_sum[b_idx, dev] += d_q.sum(1)
        intra_p, intra_q = d_p * self.intra_SD[:, p][None, :], d_q * self.intra_SD[:, dev].T
        inter_p, inter_q = d_p * self.inter_SD[:, p][None, :], d_q * self.inter_SD[:, dev].T
        intra_sent = (rows * self.intra_SD).sum(1)[None, :] + intra_p + intra_q
        inter_sent = (rows * self.inter_SD).sum(1)[None, :] + inter_p + inter_q
        intra_recv = np.repeat((rows * self.intra_SD).sum(0)[None, :], E, axis=0)
        inter_recv = np.repeat((rows * self.inter_SD).sum(0)[None, :], E, axis=0)
        intra_recv[:, p] += intra_p.sum(1)
        intra_recv[b_idx, dev] += intra_q.sum(1)
        inter_recv[:, p] += inter_p.sum(1)
        inter_recv[b_idx, dev] += inter_q.sum(1)
        load = np.repeat(self.load_D[None, :], E, axis=0)
        shift = self.size_E[a] - self.size_E
        load[:, p] -= shift
        load[b_idx, dev] += shift
        active = np.repeat(self.active_D[None, :], E, axis=0)
        moved = self.active_E[a] - self.active_E
        active[:, p] -= moved
        active[b_idx, dev] += moved
        gpu, spread = self._value(load, active, (sent_sum + recv_sum) / 2, np.maximum(intra_sent, intra_recv),
                                  np.maximum(inter_sent, inter_recv))
        expected_ct = (rows.sum() + d_p.sum(1) + d_q.sum(1)) / len(self.ids_NK)
        return {"gpu": gpu, "spread": spread, "expected_ct": expected_ct,
                "load": load.max(axis=1) / load.mean(axis=1)}


# ----------------------------------------------------------------------------------------------
# The search


class _Path:
    """A thinned record of the candidates the search visits (and the moves it makes)."""

    def __init__(self, sample: int, rng: np.random.Generator):
        self.sample, self.rng = sample, rng
        self.parts: list[tuple[np.ndarray, ...]] = []

    def visit(self, cand: dict[str, np.ndarray], valid: np.ndarray, chosen: int | None) -> None:
        pool = np.flatnonzero(valid)
        if not len(pool):
            return
        picked = pool[self.rng.integers(len(pool), size=min(self.sample, len(pool)))]
        accepted = np.zeros(len(picked), dtype=bool)
        if chosen is not None:
            picked, accepted = np.append(picked, chosen), np.append(accepted, True)
        self.parts.append((cand["expected_ct"][picked], cand["load"][picked], cand["gpu"][picked], accepted))

    def table(self, layer: LayerCost, num_devices: int, points: int) -> dict[str, np.ndarray]:
        if not self.parts:
            return {k: np.zeros(0) for k in ("expected_ct", "max_load_over_mean", "predicted_ms", "accepted")}
        ct, load, gpu, accepted = (np.concatenate(c) for c in zip(*self.parts))
        keep = np.unique(np.concatenate([np.linspace(0, len(ct) - 1, min(points, len(ct))).round().astype(int),
                                         np.flatnonzero(accepted)]))
        ms = np.array([layer.layer_ms(float(g), num_devices) for g in gpu[keep]])
        return {"expected_ct": ct[keep], "max_load_over_mean": load[keep], "predicted_ms": ms,
                "accepted": accepted[keep]}


def _descend(state: _LatencyState, rounds: int, rng: np.random.Generator, path: _Path | None) -> int:
    """Best swap per expert while it lowers (GPU ms, then the tie-break); at most `rounds` passes.
    A move is kept only if the exact value of the new state is lower (a swap can raise the packed
    rows' metadata slots, which the candidates are priced at the current value of)."""
    swaps = 0
    for _ in range(rounds):
        moved = False
        for a in rng.permutation(state.E):
            current = state.value()
            cand = state.candidates(a)
            valid = state.dev != state.dev[a]
            gpu = np.where(valid, cand["gpu"], np.inf)
            if not np.isfinite(gpu).any():
                continue
            tol = 1e-9 * max(current[0], 1e-12)
            near = gpu <= gpu.min() + tol
            b = int(np.argmin(np.where(near, cand["spread"], np.inf)))
            better = gpu[b] < current[0] - tol or (gpu[b] <= current[0] + tol
                                                   and cand["spread"][b] < current[1] - 1e-9 * max(current[1], 1e-12))
            if path is not None:
                path.visit(cand, valid, b if better else None)
            if not better:
                continue
            state.swap(a, b)
            after = state.value()
            if after[0] > current[0] + tol or (after[0] >= current[0] - tol and after[1] >= current[1]):
                state.swap(a, b)           # undo
                continue
            swaps += 1
            moved = True
        if not moved:
            break
    return swaps


def validation_runs(num_tokens: int) -> list[np.ndarray]:
    """The validation stretches of a trace of `num_tokens`: cut into `VALIDATION_BLOCKS` runs of
    consecutive tokens, every `VALIDATION_EVERY`-th run (a quarter of the tokens, spread over the
    trace, so a trace ordered by document or source gives both parts of each). Fewer than
    `VALIDATION_BLOCKS` tokens: none (the search then fits and chooses on the whole trace)."""
    if num_tokens < VALIDATION_BLOCKS:
        return []
    block = np.arange(num_tokens) * VALIDATION_BLOCKS // num_tokens
    return [np.flatnonzero(block == b) for b in range(VALIDATION_EVERY - 1, VALIDATION_BLOCKS, VALIDATION_EVERY)]


def stretch_key(layer: LayerCost, stretches: list[np.ndarray], device_of_expert: np.ndarray,
                num_devices: int) -> tuple[float, float]:
    """The mean over the stretches (token-id arrays [n, k]), each priced as a batch of its own, of
    `Prediction.key`: (predicted ms, GPU ms)."""
    keys = np.array([layer.predict(ids, device_of_expert, num_devices).key() for ids in stretches])
    return float(keys[:, 0].mean()), float(keys[:, 1].mean())


def latency_search(ids_NK: np.ndarray, num_devices: int, layer: LayerCost, starts: Mapping[str, np.ndarray],
                   rounds: int = 20, seed: int = 0, kicks: int = 4, kick_swaps: int = 3,
                   path_sample: int = 3, path_points: int = PATH_POINTS, validate: bool = True) -> LatencyResult:
    """The placement of lowest predicted layer time: swap descent on the fit part of the trace,
    kept where it beats the best start on the validation stretches and is not slower on the whole
    trace.

    With `validate` (default), the trace splits into a fit part and a validation part
    (`validation_runs`); otherwise both are the whole trace. The descent begins at the start of
    lowest predicted time on the fit part (ties: the first given): each expert in a seeded order, its
    best swap if it lowers the GPU time, or keeps it and lowers the sum of the devices' times, as in
    `swap_search`; then `kicks` perturb-and-descend restarts, kept when better on the fit part. The
    descent's result and every start are priced on each validation stretch as a batch of its own
    (`stretch_key`). The result returned is the descent's where its mean there is lower than that of
    the start of lowest predicted time on the whole trace (ties: the first given) and it is not slower
    than that start on the whole trace, else that start: the search's gains on the fit tokens count
    only where they carry to stretches of tokens it did not fit, the starts, each placed from the
    whole trace, are compared on all of it, and the result is never predicted slower than the best
    start on the trace it was given. Stretches
    shorter than `MIN_STRETCH_TOKENS` (a sample too small to price a batch's busiest device) are
    priced together, and without validation the one stretch is the whole trace. `path` holds up to
    `path_points` of the candidates visited (`path_sample` random ones per expert visit, and every
    move made): E[C_T] and load of the fit part, and predicted time.
    """
    if not starts:
        raise ValueError("latency_search: no start placement given")
    num_experts = _num_experts(starts)
    ids_NK = _as_ids(ids_NK, num_experts)
    _check_distinct_rows(ids_NK)
    _experts_per_device(num_experts, num_devices)
    if len(ids_NK) == 0:
        raise ValueError("latency_search: the routing trace has no tokens")
    if rounds < 0 or kicks < 0 or kick_swaps < 1:
        raise ValueError(f"rounds={rounds}, kicks={kicks} must be >= 0 and kick_swaps={kick_swaps} >= 1")
    checked = {name: _validated_placement(np.asarray(p, dtype=np.int64), num_experts, num_devices, f"starts[{name}]")
               for name, p in starts.items()}
    if "search" in checked:
        raise ValueError("starts: 'search' names the search's own result; call the start something else")
    begun = time.perf_counter()
    runs = validation_runs(len(ids_NK)) if validate else []
    held = np.concatenate(runs) if runs else np.zeros(0, dtype=np.int64)
    if len(held):
        fit_NK = np.delete(ids_NK, held, axis=0)
        long_enough = min(len(run) for run in runs) >= MIN_STRETCH_TOKENS
        stretches = [ids_NK[run] for run in runs] if long_enough else [ids_NK[held]]
    else:
        fit_NK, stretches = ids_NK, [ids_NK]
    priced = {name: layer.predict(ids_NK, p, num_devices) for name, p in checked.items()}
    on_fit = {name: layer.predict(fit_NK, p, num_devices) for name, p in checked.items()} if len(held) else priced
    start_method = min(on_fit, key=lambda name: on_fit[name].key())
    best = checked[start_method]
    rng = np.random.default_rng(seed)
    path = _Path(path_sample, rng) if path_points > 0 else None
    swaps = 0
    if num_devices > 1 and ids_NK.shape[1] >= 1 and rounds > 0:
        with _single_threaded_blas():
            state = _LatencyState(fit_NK, best, num_devices, layer)
            swaps += _descend(state, rounds, rng, path)
            best, best_value = state.dev.copy(), state.value()
            for _ in range(kicks):
                state.reset(kicked(best, kick_swaps, rng))
                swaps += _descend(state, rounds, rng, path)
                if state.value() < best_value:
                    best, best_value = state.dev.copy(), state.value()
    candidates = {**checked, "search": best}
    keys = {name: stretch_key(layer, stretches, p, num_devices) for name, p in candidates.items()}
    best_start = min(priced, key=lambda name: priced[name].key())
    searched = layer.predict(ids_NK, best, num_devices)
    wins = keys["search"] < keys[best_start] and searched.key() <= priced[best_start].key()
    chosen = "search" if wins else best_start
    validation = {name: key[0] for name, key in keys.items()}
    placed = candidates[chosen]
    final = priced[chosen] if chosen in priced else searched
    table = path.table(layer, num_devices, path_points) if path is not None else {}
    return LatencyResult(placed, start_method, priced[start_method], final, priced, table, swaps,
                         time.perf_counter() - begun, validation, chosen)


def _num_experts(starts: Mapping[str, np.ndarray]) -> int:
    sizes = {len(np.asarray(p)) for p in starts.values()}
    if len(sizes) > 1:
        raise ValueError(f"starts: placements of different expert counts {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def default_starts(ids_NK: np.ndarray, num_experts: int, num_devices: int, swap_rounds: int = 20, seed: int = 0,
                   eps: float = 0.1, kicks: int = 8) -> dict[str, np.ndarray]:
    """The placements a latency search starts from when the caller has none: contiguous, the paper's
    greedy, swap, load_aware (from swap) and EPLB-style."""
    from occult.routing.placement import contiguous, greedy_occult, swap_search
    from occult.routing.placement_methods import coactivation_matrix, eplb_load_only, expert_load, load_aware_swap

    ids_NK = _as_ids(ids_NK, num_experts)
    greedy = greedy_occult(coactivation_matrix(ids_NK, num_experts), num_devices)
    swap = swap_search(ids_NK, num_devices, greedy, swap_rounds, seed, kicks=kicks)
    return {"contiguous": contiguous(num_experts, num_devices), "greedy": greedy, "swap": swap,
            "load_aware": load_aware_swap(ids_NK, num_devices, swap, eps, swap_rounds, seed, kicks=kicks),
            "eplb": eplb_load_only(expert_load(ids_NK, num_experts), num_devices)}


def with_tokens(layer: LayerCost, tokens_per_gpu: float) -> LayerCost:
    """The same layer at another batch."""
    return dataclasses.replace(layer, tokens_per_gpu=tokens_per_gpu)
