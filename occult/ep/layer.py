"""The expert-parallel MoE layer: dispatch, expert compute, combine, with autograd throughout.

`ep_moe` runs on every rank of an EP group of D ranks, each with its own tokens and the experts
the placement gives it:

  1. plan on the device (`occult.ep.plan.count_dedup_plan`, sort-free; `count_plan` for
     per_expert): rows in send order, per-device counts;
  2. exchange the counts (one small all-to-all) and read send + receive split sizes in the
     layer's ONE host sync; finish the plan (BRIM_0, packed-row slots) without further syncs;
  3. dispatch: ONE all-to-all of packed rows (hidden vector + each pair's local expert id and
     fp32 gate in a fixed tail, padded to 64 bytes);
  4. expert side: BRIM_1 and the row → pairs table (`build_pairs_from_slots`), grouped SwiGLU,
     grouped down projection scaled by the gates and summed per received row in fp32 (`dedup`:
     one returned row per (token, device));
  5. return the rows with the inverse all-to-all and combine the C_T partials per token.

On one device in dedup mode steps 1–3 and 5 vanish: the tokens are the rows (`_local_pairs`).
Backward runs the same indices the other way: the transposed all-to-alls swap dispatch and
combine (row gradients summed per token by the combine op over BRIM_0), and the gate-weight
gradient is formed on the expert side (from `pair_gate_M`) and travels back in a small
all-to-all. Placement tables are memoised per placement value (`placement_tables`). The expert
compute and combine are a pluggable backend: "torch" (the plain references of
`occult.kernels.reference`, and the plain-torch plan, pack and BRIM_1 above) or "triton"
(`occult.kernels.grouped_swiglu`, `grouped_down_reduce`, `combine`, and
`occult.kernels.dispatch_plan`: steps 1–2's plan with the pack in two launches and BRIM_1 by a
counting sort; imported on first use).
"""

from __future__ import annotations

import functools
import importlib
import os
import types
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from occult.kernels.wire_format import packed_row_layout
from occult.ep.plan import (
    MODES,
    DispatchPlan,
    build_pairs_from_slots,
    check_placement,
    check_static_capacity,
    count_dedup_plan,
    count_plan,
    finish_dedup_plan,
    finish_plan,
    local_expert_ids,
    static_plan,
    static_slots,
)

BACKENDS = ("torch", "triton")
KERNEL_NAMES = ("grouped_swiglu", "grouped_down_reduce", "combine")


@dataclass(frozen=True)
class ExpertBackend:
    """The three ops of the expert side and the combine, with the signatures of the references."""

    name: str
    grouped_swiglu: Callable[..., torch.Tensor]
    grouped_down_reduce: Callable[..., torch.Tensor]
    combine: Callable[..., torch.Tensor]
    takes_row_table: bool = False    # the grouped ops accept `row_pairs_RK=` (reduce without a sort)
    # The exact dedup plan and packed send buffer on the device in two launches (`dedup_count`
    # before the host sync, `dedup_plan_pack` after it); None: the plain-torch plan and pack.
    dedup_count: Callable[..., object] | None = None
    dedup_plan_pack: Callable[..., object] | None = None
    # BRIM_1 on the expert side with `build_pairs_from_slots`' signature; None: that function.
    group_pairs: Callable[..., tuple[torch.Tensor, ...]] | None = None


def _resolve_kernel(name: str) -> Callable[..., torch.Tensor]:
    package = importlib.import_module("occult.kernels")
    found = getattr(package, name, None)
    if found is None:
        found = importlib.import_module(f"occult.kernels.{name}")
    if isinstance(found, types.ModuleType):
        found = getattr(found, name)
    if not callable(found):
        raise TypeError(f"occult.kernels.{name} is not callable")
    return found


def get_backend(name: str) -> ExpertBackend:
    """"torch" = plain references through autograd; "triton" = the kernels (never a silent fallback).
    With $OCCULT_FUSED_PLAN=0 the Triton backend keeps the plain-torch plan, pack and BRIM_1 (to
    measure the dispatch-plan kernels against them, or to rule them out)."""
    if name == "torch":
        from occult.kernels.reference import combine_ref, grouped_down_reduce_ref, grouped_swiglu_ref

        return ExpertBackend("torch", grouped_swiglu_ref, grouped_down_reduce_ref, combine_ref)
    if name == "triton":
        try:
            ops = [_resolve_kernel(op) for op in KERNEL_NAMES]
        except (ImportError, AttributeError, TypeError) as err:
            raise RuntimeError(
                f"backend='triton' needs occult.kernels.{{{', '.join(KERNEL_NAMES)}}} "
                f"(the folder kernels/), which could not be loaded: {err}"
            ) from err
        if os.environ.get("OCCULT_FUSED_PLAN", "1") == "0":   # A/B switch: the plain-torch plan and BRIM_1
            return ExpertBackend("triton", *ops, takes_row_table=True)
        from occult.kernels.dispatch_plan import dedup_plan_count, dedup_plan_pack, group_pairs_by_expert

        return ExpertBackend("triton", *ops, takes_row_table=True, dedup_count=dedup_plan_count,
                             dedup_plan_pack=dedup_plan_pack, group_pairs=group_pairs_by_expert)
    raise ValueError(f"backend: {name!r} is not one of {BACKENDS}")


@dataclass
class EPStats:
    """Traffic of `ep_moe` calls on one rank, accumulated over calls (forward only).

    Remote bytes cross the network; self bytes are the rows a rank routes to its own experts
    (a copy, listed apart). Dispatch bytes = packed rows: the hidden vector (padded to 4 bytes)
    plus 8 bytes per metadata slot, `slots` = the most pairs any row of the call carries.
    """

    calls: int = 0
    tokens: int = 0
    devices_per_token_sum: int = 0   # sum of C_T over the tokens
    rows_remote: int = 0             # rows dispatched to other ranks
    rows_self: int = 0
    pairs_remote: int = 0
    pairs_received: int = 0          # (row, expert) pairs this rank's experts computed
    bytes_dispatch_remote: int = 0
    bytes_combine_remote: int = 0    # partial rows this rank returns to other ranks
    bytes_self: int = 0              # dispatch + combine bytes that stay on this rank

    @property
    def mean_devices_per_token(self) -> float:
        """E[C_T] over the tokens seen (nan before any token)."""
        return self.devices_per_token_sum / self.tokens if self.tokens else float("nan")

    @property
    def bytes_remote(self) -> int:
        return self.bytes_dispatch_remote + self.bytes_combine_remote

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "mean_devices_per_token": self.mean_devices_per_token}


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits; its backward is the transposed all-to-all."""

    @staticmethod
    def forward(ctx, x, recv_splits: list[int], send_splits: list[int], group):  # type: ignore[override]
        ctx.recv_splits, ctx.send_splits, ctx.group = recv_splits, send_splits, group
        return _all_to_all(x, recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_to_all(grad, ctx.send_splits, ctx.recv_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    if group_size_and_rank(group)[0] == 1:
        return x                        # a single device (or a group of one): nothing to exchange
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(D, rank); `group=None` without an initialised process group is a single device."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


@dataclass(frozen=True)
class PlacementTables:
    """What `ep_moe` derives from a placement, on the compute device (built once per placement)."""

    placement_E: torch.Tensor        # int64 [E] device of each expert
    local_id_E: torch.Tensor         # int64 [E] index of each expert among its device's experts
    experts_here: int                # experts on this rank
    placement_cpu: torch.Tensor      # int64 [E] the same placement on the host
    world: int                       # ranks of the group
    static_slots_by_k: dict[int, int] = field(default_factory=dict, compare=False, hash=False)  # memo

    def static_slots(self, top_k: int) -> int:
        """`occult.ep.plan.static_slots` of this placement, computed once per k (no host work per call)."""
        if top_k not in self.static_slots_by_k:
            self.static_slots_by_k[top_k] = static_slots(self.placement_cpu, self.world, top_k)
        return self.static_slots_by_k[top_k]


@functools.lru_cache(maxsize=64)
def _placement_tables(values: tuple[int, ...], world: int, rank: int, device: torch.device) -> PlacementTables:
    placement_cpu = check_placement(torch.tensor(values, dtype=torch.long), world)
    return PlacementTables(
        placement_E=placement_cpu.to(device),
        local_id_E=local_expert_ids(placement_cpu, world).to(device),
        experts_here=int((placement_cpu == rank).sum()),
        placement_cpu=placement_cpu,
        world=world,
    )


def placement_tables(
    device_of_expert_E: torch.Tensor, world: int, rank: int, device: torch.device
) -> PlacementTables:
    """Placement-derived tables on `device`, memoised by value (a pure function of its inputs).

    Reading a CPU placement costs ~µs and no sync; a placement on the GPU costs one sync per
    call (keep it on the CPU). The copies to the device happen once per placement.
    """
    values = device_of_expert_E
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.is_floating_point():
            check_placement(values.detach().cpu(), world)        # raises, naming the field
        key = tuple(values.detach().tolist())                   # Python ints already
    else:
        key = tuple(int(v) for v in values)
    return _placement_tables(key, world, rank, torch.device(device))


def _pack_rows(x_TD: torch.Tensor, gate_P: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """uint8 [S, row bytes]: each sent row = its hidden vector, then `slots` int32 local expert
    ids (−1 = empty) and `slots` fp32 gates."""
    hidden, slots = x_TD.shape[1], plan.slots
    hidden_bytes, row_bytes = packed_row_layout(hidden, x_TD.dtype.itemsize, slots)
    buf = torch.empty(plan.num_rows, row_bytes, dtype=torch.uint8, device=x_TD.device)
    x_view = buf[:, : hidden * x_TD.element_size()].view(x_TD.dtype)
    if plan.capacity is None:
        torch.index_select(x_TD, 0, plan.send_token_S, out=x_view)
    else:                    # static: token t in row t of every destination's block (rows ≥ T unset)
        x_view.view(plan.num_devices, plan.capacity, hidden)[:, : x_TD.shape[0]] = x_TD
    meta = buf[:, hidden_bytes:].view(torch.int32)
    meta[:, :slots].fill_(-1)
    meta[:, slots:].zero_()                                   # gates and the alignment padding
    rank_P = plan.pair_rank_P
    meta.index_put_((plan.pair_row_P, rank_P), (plan.pair_code_P >> 1).to(torch.int32))
    meta.index_put_((plan.pair_row_P, rank_P + slots), gate_P.float().contiguous().view(torch.int32))
    return buf


def _unpack_rows(
    buf: torch.Tensor, hidden: int, dtype: torch.dtype, slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_RD, code_RK int32, gate_RK fp32): strided views into a packed buffer."""
    hidden_bytes, _ = packed_row_layout(hidden, dtype.itemsize, slots)
    meta = buf[:, hidden_bytes:].view(torch.int32)
    return buf[:, : hidden * dtype.itemsize].view(dtype), meta[:, :slots], meta[:, slots : 2 * slots].view(torch.float32)


class _Dispatch(torch.autograd.Function):
    """Send each planned row (hidden vector + its pairs' expert ids and gates) in ONE all-to-all.

    Backward: the row gradients travel back (one all-to-all) and are summed per token by the
    combine op over BRIM_0 (each token's rows; deterministic); the gate gradients travel back
    (one small all-to-all) and land in their (t, j) slots (a permutation: no accumulation).
    """

    @staticmethod
    def forward(ctx, x_TD, weights_TK, plan: DispatchPlan, recv_rows: list[int], group, combine,  # type: ignore[override]
                packed: torch.Tensor | None = None):
        if packed is None:       # else the rows were packed on the device with the plan
            gate_P = weights_TK.reshape(-1)
            packed = _pack_rows(x_TD, gate_P if plan.pairs_in_token_order else gate_P[plan.pair_slot_P], plan)
        recv = _all_to_all(packed, recv_rows, plan.rows_per_device, group)
        x_RD, code_RK, gate_RK = _unpack_rows(recv, x_TD.shape[1], x_TD.dtype, plan.slots)
        ctx.plan, ctx.recv_rows, ctx.group, ctx.combine = plan, recv_rows, group, combine
        ctx.x_dtype, ctx.w_dtype, ctx.w_shape = x_TD.dtype, weights_TK.dtype, weights_TK.shape
        ctx.mark_non_differentiable(code_RK)
        return x_RD, code_RK, gate_RK

    @staticmethod
    def backward(ctx, dx_RD, _dcode, dgate_RK):  # type: ignore[override]
        plan: DispatchPlan = ctx.plan
        send_rows, recv_rows = plan.rows_per_device, ctx.recv_rows
        dx_TD = dweights_TK = None
        if ctx.needs_input_grad[0]:
            dx_SD = _all_to_all(dx_RD.to(ctx.x_dtype).contiguous(), send_rows, recv_rows, ctx.group)
            with torch.no_grad():
                dx_TD = ctx.combine(dx_SD, plan.brim0_TJ)
        if ctx.needs_input_grad[1]:
            dgate_SK = _all_to_all(dgate_RK.float().contiguous(), send_rows, recv_rows, ctx.group)
            dgate_P = dgate_SK[plan.pair_row_P, plan.pair_rank_P]
            if plan.pairs_in_token_order:
                flat = dgate_P
            else:
                flat = dgate_P.new_zeros(plan.pair_slot_P.numel())
                flat[plan.pair_slot_P] = dgate_P
            dweights_TK = flat.view(ctx.w_shape).to(ctx.w_dtype)
        return dx_TD, dweights_TK, None, None, None, None, None


def ep_moe(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    device_of_expert_E: torch.Tensor,
    w_gate_up_local: torch.Tensor,
    w_down_local: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    mode: str = "dedup",
    backend: str | ExpertBackend = "torch",
    shared_expert: Callable[[torch.Tensor], torch.Tensor] | None = None,
    stats: EPStats | None = None,
    static_capacity: int | None = None,
    phase: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """MoE output [T, D] for this rank's tokens, experts spread over the ranks of `group`.

    `ids_TK` are global expert ids, `weights_TK` their gate weights; `device_of_expert_E`
    (best kept on the CPU) maps each expert to a rank of `group`. This rank holds the experts
    `experts_of_device(device_of_expert_E, rank)` stacked in `w_gate_up_local` [E_r, 2F, D] and
    `w_down_local` [E_r, D, F]. Every rank of the group must call this together. `shared_expert`,
    if given, is computed locally and added. `stats`, if given, accumulates the traffic (one more
    host sync for the C_T sum).

    Per call: 3 all-to-alls (counts; packed rows; returned partials) and ONE host sync (the
    receive split sizes, read together with the send split sizes). On one device (no group, or a
    group of one) there is neither, and in dedup mode no plan, pack or combine either: the tokens
    are the rows, used in place, and only BRIM_1 is built (`_local_pairs`).

    `static_capacity=C` (dedup only; every rank passes the same C ≥ its T) selects the static-shape
    plan (`occult.ep.plan.static_plan`): 2 equal-split all-to-alls of D·C rows, NO host sync, so
    the call can be captured in a CUDA graph (`occult.ep.graph`); the wire then carries C·(D−1)
    remote rows each way whatever the routing. `phase`, if given, is called with "dispatched",
    "computed" and "combined" as each part has been issued (benchmarks record CUDA events there).
    """
    world, rank = group_size_and_rank(group)
    ops = get_backend(backend) if isinstance(backend, str) else backend
    _check_inputs(x_TD, ids_TK, weights_TK, w_gate_up_local, w_down_local, mode)
    device = x_TD.device
    tables = placement_tables(device_of_expert_E, world, rank, device)
    if w_gate_up_local.shape[0] != tables.experts_here:
        raise ValueError(
            f"w_gate_up_local: holds {w_gate_up_local.shape[0]} experts but device_of_expert_E puts "
            f"{tables.experts_here} on rank {rank}"
        )

    received = dispatch_to_experts(
        x_TD, ids_TK, weights_TK, tables, group, mode, ops, static_capacity, world, rank
    )
    if phase is not None:
        phase("dispatched")
    y_RD = expert_compute(received, w_gate_up_local, w_down_local, ops)
    if phase is not None:
        phase("computed")
    if received.plan is None:           # one device, dedup: row t is token t's output already
        z_SD = y_TD = y_RD
    else:
        z_SD = y_RD if world == 1 else AllToAll.apply(y_RD, received.send_rows, received.recv_rows, group)
        y_TD = ops.combine(z_SD, received.plan.brim0_TJ)
    if phase is not None:
        phase("combined")

    if shared_expert is not None:
        y_TD = y_TD + shared_expert(x_TD)
    if stats is not None:
        _record(stats, received, rank, x_TD, z_SD)
    return y_TD


@dataclass
class Received:
    """What an expert rank holds after the dispatch: its rows, their pairs grouped by expert
    (BRIM_1) and the row → pairs table; plus the source-side plan and split sizes (`plan` None:
    one device in dedup mode, where the rows are the tokens themselves and nothing was packed)."""

    x_RD: torch.Tensor
    pair_row_M: torch.Tensor
    pair_gate_M: torch.Tensor
    expert_offsets: torch.Tensor
    row_pairs_RK: torch.Tensor
    plan: DispatchPlan | None
    send_rows: list[int]
    recv_rows: list[int]


def dispatch_to_experts(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    tables: PlacementTables,
    group: dist.ProcessGroup | None,
    mode: str,
    ops: ExpertBackend,
    static_capacity: int | None,
    world: int,
    rank: int,
) -> Received:
    """Plan, exchange counts (exact plans: the one host sync), send the packed rows, build BRIM_1.
    On one device in dedup mode there is nothing to plan or send (`_local_pairs`)."""
    if world == 1 and mode == "dedup":
        return _local_pairs(x_TD, ids_TK, weights_TK, tables, ops, static_capacity)
    packed = None
    if static_capacity is None:
        fused = mode == "dedup" and ops.dedup_count is not None and ops.dedup_plan_pack is not None
        if fused:               # two launches on the device (occult.kernels.dispatch_plan)
            counts = ops.dedup_count(ids_TK, tables.placement_E, world)
        elif mode == "dedup":   # sort-free: the same rows as count_plan's, in fewer launches
            counts = count_dedup_plan(ids_TK, tables.placement_E, world, tables.local_id_E)
        else:
            counts = count_plan(ids_TK, tables.placement_E, world, tables.local_id_E, mode)
        if world == 1:
            # One device, per_expert (dedup took `_local_pairs`): one row per pair, so the sizes
            # follow from the shape; no host sync.
            send_rows = send_pairs = recv_rows = recv_pairs = [ids_TK.numel()]
            most_pairs = [1 if ids_TK.numel() else 0]
        else:
            recv_counts_D3 = _all_to_all(counts.counts_D3, [1] * world, [1] * world, group)
            # The one host sync: send and receive split sizes (and every rank's most pairs per row).
            send_rows, send_pairs, _, recv_rows, recv_pairs, most_pairs = (
                torch.cat([counts.counts_D3, recv_counts_D3], 1).t().tolist()
            )
        slots = max(max(most_pairs, default=1), 1)
        if fused:
            plan, packed = ops.dedup_plan_pack(counts, ids_TK, weights_TK.detach(), x_TD.detach(), tables.placement_E,
                                               tables.local_id_E, send_rows, send_pairs, slots)
        else:
            finish = finish_dedup_plan if mode == "dedup" else finish_plan
            plan = finish(counts, send_rows, send_pairs, slots)
        num_recv_pairs: int | None = sum(recv_pairs)
    else:
        if mode != "dedup":
            raise ValueError(f"static_capacity: needs mode='dedup' (got {mode!r}): per-expert rows have no bound below T*k")
        slots = tables.static_slots(ids_TK.shape[1])
        plan = static_plan(ids_TK, tables.placement_E, world, tables.local_id_E, int(static_capacity), slots)
        send_rows = recv_rows = plan.rows_per_device
        num_recv_pairs = None                           # padded: the kernels read the count on the device

    x_RD, code_RK, gate_RK = _Dispatch.apply(x_TD, weights_TK, plan, recv_rows, group, ops.combine, packed)
    grouper = ops.group_pairs or build_pairs_from_slots
    pair_flat_M, pair_row_M, expert_offsets, pair_pos_RK = grouper(code_RK, num_recv_pairs, tables.experts_here)
    pair_gate_M = torch.index_select(gate_RK.reshape(-1), 0, pair_flat_M)
    return Received(x_RD, pair_row_M, pair_gate_M, expert_offsets, pair_pos_RK, plan, send_rows, recv_rows)


def _local_pairs(x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, tables: PlacementTables,
                 ops: ExpertBackend, static_capacity: int | None) -> Received:
    """One device, dedup: each token is its own row (x_RD = x_TD, no copy), its k slots hold its
    experts (local ids = global ids on one device) and gates; only BRIM_1 is built. No host sync,
    static shapes (T·k pairs), so it also serves the static-shape (CUDA-graph) call."""
    tokens, top_k = ids_TK.shape
    if static_capacity is not None:
        check_static_capacity(static_capacity, tokens)
    grouper = ops.group_pairs or build_pairs_from_slots
    pair_flat_M, pair_row_M, expert_offsets, pair_pos_RK = grouper(ids_TK, tokens * top_k, tables.experts_here)
    pair_gate_M = torch.index_select(weights_TK.float().reshape(-1), 0, pair_flat_M)
    return Received(x_TD, pair_row_M, pair_gate_M, expert_offsets, pair_pos_RK, None, [tokens], [tokens])


def expert_compute(
    received: Received, w_gate_up_local: torch.Tensor, w_down_local: torch.Tensor, ops: ExpertBackend
) -> torch.Tensor:
    """y_RD: grouped SwiGLU, then the gate-scaled down projection summed per received row (fp32)."""
    table = {"row_pairs_RK": received.row_pairs_RK} if ops.takes_row_table else {}
    h_MF = ops.grouped_swiglu(received.x_RD, received.pair_row_M, received.expert_offsets, w_gate_up_local, **table)
    return ops.grouped_down_reduce(
        h_MF, received.pair_row_M, received.pair_gate_M, received.expert_offsets, w_down_local,
        received.x_RD.shape[0], **table
    )


def _check_inputs(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w_gate_up_local: torch.Tensor,
    w_down_local: torch.Tensor,
    mode: str,
) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {MODES}")
    if x_TD.dim() != 2:
        raise ValueError(f"x_TD: expected [T, D], got shape {tuple(x_TD.shape)}")
    if ids_TK.dim() != 2 or ids_TK.shape[0] != x_TD.shape[0] or ids_TK.is_floating_point():
        raise ValueError(f"ids_TK: expected integer [T={x_TD.shape[0]}, k], got {ids_TK.dtype} {tuple(ids_TK.shape)}")
    if weights_TK.shape != ids_TK.shape:
        raise ValueError(f"weights_TK: shape {tuple(weights_TK.shape)} differs from ids_TK {tuple(ids_TK.shape)}")
    hidden = x_TD.shape[1]
    if w_gate_up_local.dim() != 3 or w_gate_up_local.shape[2] != hidden or w_gate_up_local.shape[1] % 2:
        raise ValueError(f"w_gate_up_local: expected [E_r, 2F, {hidden}], got {tuple(w_gate_up_local.shape)}")
    ffn = w_gate_up_local.shape[1] // 2
    if w_down_local.shape != (w_gate_up_local.shape[0], hidden, ffn):
        raise ValueError(
            f"w_down_local: expected {(w_gate_up_local.shape[0], hidden, ffn)}, got {tuple(w_down_local.shape)}"
        )


def _record(stats: EPStats, received: Received, rank: int, x_TD: torch.Tensor, z_SD: torch.Tensor) -> None:
    plan, recv_rows = received.plan, received.recv_rows
    if plan is None:                    # one device, rows used in place: no bytes moved
        stats.calls += 1
        stats.tokens += x_TD.shape[0]
        stats.devices_per_token_sum += x_TD.shape[0]
        stats.rows_self += x_TD.shape[0]
        stats.pairs_received += int(received.expert_offsets[-1])       # host sync
        return
    _, row_bytes = packed_row_layout(x_TD.shape[1], x_TD.dtype.itemsize, plan.slots)   # packed: hidden + slots
    back_bytes = x_TD.shape[1] * z_SD.element_size()
    rows, pairs = plan.rows_per_device, plan.pairs_per_device
    if plan.capacity is not None:       # static: every row is on the wire; count the pairs (sync)
        pairs = torch.bincount(plan.pair_row_P // plan.capacity, minlength=plan.num_devices).tolist()
    remote_rows = sum(rows) - rows[rank]
    remote_pairs = sum(pairs) - pairs[rank]
    stats.calls += 1
    stats.tokens += x_TD.shape[0]
    stats.devices_per_token_sum += int(plan.devices_per_token_T.sum())  # host sync
    stats.rows_remote += remote_rows
    stats.rows_self += rows[rank]
    stats.pairs_remote += remote_pairs
    stats.pairs_received += int(received.expert_offsets[-1])           # host sync
    stats.bytes_dispatch_remote += remote_rows * row_bytes
    stats.bytes_combine_remote += (sum(recv_rows) - recv_rows[rank]) * back_bytes
    stats.bytes_self += rows[rank] * (row_bytes + back_bytes)
