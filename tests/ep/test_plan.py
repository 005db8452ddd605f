"""Dispatch-plan invariants (BRIM_0, send order, splits, C_T) and BRIM_1, against Python loops."""

from __future__ import annotations

import pytest
import torch

from occult.ep.plan import (
    build_pairs,
    build_pairs_from_slots,
    build_plan,
    check_placement,
    contiguous_placement,
    experts_of_device,
    local_expert_ids,
    static_plan,
    static_slots,
)


def routing(
    kind: str, num_tokens: int, num_experts: int, top_k: int, placement: torch.Tensor, seed: int
) -> torch.Tensor:
    """ids_TK of one routing pattern (distinct experts per token)."""
    gen = torch.Generator().manual_seed(seed)
    if num_tokens == 0:
        return torch.zeros(0, top_k, dtype=torch.long)
    if kind == "random":
        scores = torch.rand(num_tokens, num_experts, generator=gen)
    elif kind == "hot":  # every token picks expert 0 first
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        scores[:, 0] = 2.0
    elif kind == "empty":  # only the first half of the experts is ever used
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        scores[:, num_experts // 2 :] = -1.0
    elif kind == "one_device":  # N_d = 1: all of a token's experts on one device
        home = torch.randint(0, int(placement.max()) + 1, (num_tokens,), generator=gen)
        scores = torch.rand(num_tokens, num_experts, generator=gen) + (placement[None, :] == home[:, None]) * 2.0
    else:
        raise AssertionError(kind)
    return scores.topk(top_k, dim=1).indices


CASES = [
    # kind, T, E, k, D
    ("random", 37, 8, 2, 2),
    ("random", 50, 16, 4, 4),
    ("random", 1, 8, 3, 4),
    ("random", 0, 8, 2, 2),
    ("hot", 20, 8, 2, 2),
    ("empty", 25, 12, 3, 3),
    ("one_device", 30, 16, 4, 4),
    ("random", 19, 8, 1, 4),
    ("random", 13, 8, 8, 2),
]


def shuffled_placement(num_experts: int, num_devices: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return contiguous_placement(num_experts, num_devices)[torch.randperm(num_experts, generator=gen)]


def row_devices(rows_per_device: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(rows_per_device)), torch.tensor(rows_per_device, dtype=torch.long))


@pytest.mark.parametrize("kind,T,E,K,D", CASES)
def test_dedup_plan_sends_each_token_device_pair_once(kind, T, E, K, D):
    placement = shuffled_placement(E, D, seed=T + E)
    ids = routing(kind, T, E, K, placement, seed=1)
    plan = build_plan(ids, placement, D, local_expert_ids(placement, D), "dedup")

    wanted = sorted({(t, int(placement[e])) for t in range(T) for e in ids[t].tolist()})
    dev_of_row = row_devices(plan.rows_per_device)
    sent = [(int(t), int(d)) for t, d in zip(plan.send_token_S, dev_of_row)]
    assert sorted(sent) == wanted and len(set(sent)) == len(sent)
    assert sent == sorted(sent, key=lambda td: (td[1], td[0]))          # grouped by device, then token
    assert plan.num_rows == len(plan.send_token_S) == len(wanted)
    assert sum(plan.pairs_per_device) == T * K == len(plan.pair_code_P)

    assert plan.brim0_TJ.shape == (T, D)
    for t in range(T):
        for d in range(D):
            row = int(plan.brim0_TJ[t, d])
            if (t, d) in wanted:
                assert int(plan.send_token_S[row]) == t and int(dev_of_row[row]) == d
            else:
                assert row == -1

    c_t = [len({int(placement[e]) for e in ids[t].tolist()}) for t in range(T)]
    assert plan.devices_per_token_T.tolist() == c_t
    assert sum(c_t) == plan.num_rows


@pytest.mark.parametrize("kind,T,E,K,D", CASES)
def test_per_expert_plan_sends_each_token_expert_pair_once(kind, T, E, K, D):
    placement = shuffled_placement(E, D, seed=T + E)
    ids = routing(kind, T, E, K, placement, seed=2)
    plan = build_plan(ids, placement, D, local_expert_ids(placement, D), "per_expert")
    dev_of_row = row_devices(plan.rows_per_device)
    assert plan.num_rows == T * K == len(plan.send_token_S)
    assert plan.brim0_TJ.shape == (T, K)
    rows = sorted(plan.brim0_TJ.flatten().tolist())
    assert rows == list(range(T * K))                                  # every (token, expert) once
    for t in range(T):
        for j in range(K):
            row = int(plan.brim0_TJ[t, j])
            assert int(plan.send_token_S[row]) == t
            assert int(dev_of_row[row]) == int(placement[ids[t, j]])
            assert int(plan.pair_slot_P[row]) == t * K + j           # pair m is row m
    for d in range(D):
        assert plan.rows_per_device[d] == int((placement[ids] == d).sum())
    assert plan.devices_per_token_T.tolist() == [len({int(placement[e]) for e in ids[t].tolist()}) for t in range(T)]


@pytest.mark.parametrize("mode", ["dedup", "per_expert"])
@pytest.mark.parametrize("kind,T,E,K,D", CASES)
def test_pair_stream_and_brim1_match_loops(kind, T, E, K, D, mode):
    placement = shuffled_placement(E, D, seed=T * 3 + E)
    local_id = local_expert_ids(placement, D)
    ids = routing(kind, T, E, K, placement, seed=3)
    weights = torch.rand(T, K)
    plan = build_plan(ids, placement, D, local_id, mode)

    # Decode the whole stream: rows by cumulative start flags; each pair names its slot's expert.
    code = plan.pair_code_P.long()
    row_of_pair = torch.cumsum(code & 1, 0) - 1
    for m in range(len(code)):
        t, j = divmod(int(plan.pair_slot_P[m]), K)
        assert int(plan.send_token_S[row_of_pair[m]]) == t
        assert int(code[m] >> 1) == int(local_id[ids[t, j]])

    # Receiver side, one device at a time (as if it received only this rank's pairs).
    gate_P = weights.flatten()[plan.pair_slot_P]
    row_start = pair_start = 0
    for d in range(D):
        n_rows, n_pairs = plan.rows_per_device[d], plan.pairs_per_device[d]
        codes_d = plan.pair_code_P[pair_start : pair_start + n_pairs]
        gates_d = gate_P[pair_start : pair_start + n_pairs]
        experts_here = int((placement == d).sum())
        pair_row, pair_gate, offsets = build_pairs(codes_d, gates_d, experts_here)
        expected = {e: [] for e in range(experts_here)}
        for m in range(n_pairs):
            glob = pair_start + m
            expected[int(code[glob] >> 1)].append((int(row_of_pair[glob]) - row_start, float(gate_P[glob])))
        counts = torch.tensor([len(expected[e]) for e in range(experts_here)], dtype=torch.long)
        assert offsets.tolist() == [0] + counts.cumsum(0).tolist()
        got = [(int(r), float(g)) for r, g in zip(pair_row, pair_gate)]
        assert got == [pair for e in range(experts_here) for pair in expected[e]]
        assert all(0 <= r < n_rows for r, _ in got)
        row_start += n_rows
        pair_start += n_pairs


def test_dedup_rows_never_exceed_per_expert_and_equal_for_k1():
    placement = shuffled_placement(16, 4, seed=0)
    for top_k in (1, 2, 4):
        ids = routing("random", 64, 16, top_k, placement, seed=top_k)
        local_id = local_expert_ids(placement, 4)
        dedup = build_plan(ids, placement, 4, local_id, "dedup")
        per_expert = build_plan(ids, placement, 4, local_id, "per_expert")
        assert all(a <= b for a, b in zip(dedup.rows_per_device, per_expert.rows_per_device))
        assert dedup.pairs_per_device == per_expert.pairs_per_device
        if top_k == 1:
            assert dedup.rows_per_device == per_expert.rows_per_device


def test_build_pairs_of_nothing():
    pair_row, pair_gate, offsets = build_pairs(torch.zeros(0, dtype=torch.int32), torch.zeros(0), 3)
    assert pair_row.numel() == pair_gate.numel() == 0 and offsets.tolist() == [0, 0, 0, 0]


def test_placement_helpers():
    placement = torch.tensor([2, 0, 2, 1, 0, 1])
    assert local_expert_ids(placement, 3).tolist() == [0, 0, 1, 0, 1, 1]
    assert experts_of_device(placement, 2).tolist() == [0, 2]
    assert contiguous_placement(8, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="device_of_expert_E"):
        check_placement(torch.tensor([0, 3]), 2)
    with pytest.raises(ValueError, match="device_of_expert_E"):
        check_placement(torch.tensor([[0, 1]]), 2)
    with pytest.raises(ValueError, match="mode"):
        build_plan(torch.zeros(1, 1, dtype=torch.long), placement, 3, local_expert_ids(placement, 3), "bogus")


@pytest.mark.parametrize("mode", ["dedup", "per_expert"])
@pytest.mark.parametrize("kind,T,E,K,D", CASES)
def test_packed_slots_give_the_same_brim1_and_a_row_table(kind, T, E, K, D, mode):
    """The packed-row metadata (pair_row_P, pair_rank_P) decodes to build_pairs' BRIM_1, and the
    row table lists every pair of every row exactly once."""
    placement = shuffled_placement(E, D, seed=T * 5 + E)
    local_id = local_expert_ids(placement, D)
    ids = routing(kind, T, E, K, placement, seed=4)
    plan = build_plan(ids, placement, D, local_id, mode)
    assert plan.slots == max([1] + [int(r) + 1 for r in plan.pair_rank_P])
    gate_P = torch.rand(T * K).flatten()[plan.pair_slot_P]
    row_start = pair_start = 0
    for d in range(D):
        n_rows, n_pairs = plan.rows_per_device[d], plan.pairs_per_device[d]
        pairs = slice(pair_start, pair_start + n_pairs)
        code_RK = torch.full((n_rows, plan.slots), -1, dtype=torch.int32)
        gate_RK = torch.zeros(n_rows, plan.slots)
        code_RK[plan.pair_row_P[pairs] - row_start, plan.pair_rank_P[pairs]] = (plan.pair_code_P[pairs] >> 1)
        gate_RK[plan.pair_row_P[pairs] - row_start, plan.pair_rank_P[pairs]] = gate_P[pairs]
        assert int((code_RK >= 0).sum()) == n_pairs                   # no two pairs share a slot
        experts_here = int((placement == d).sum())
        flat, pair_row, offsets, table = build_pairs_from_slots(code_RK, n_pairs, experts_here)
        want_row, want_gate, want_offsets = build_pairs(plan.pair_code_P[pairs], gate_P[pairs], experts_here)
        assert torch.equal(pair_row, want_row) and torch.equal(offsets, want_offsets)
        assert torch.equal(gate_RK.flatten()[flat], want_gate)
        for r in range(n_rows):
            listed = sorted(int(m) for m in table[r] if m >= 0)
            assert listed == [m for m in range(n_pairs) if int(pair_row[m]) == r]
        row_start += n_rows
        pair_start += n_pairs


@pytest.mark.parametrize("kind,T,E,K,D", CASES)
def test_static_plan_puts_token_t_in_row_t_of_each_device_block(kind, T, E, K, D):
    placement = contiguous_placement(E, D)[torch.randperm(E, generator=torch.Generator().manual_seed(T))]
    ids = routing(kind, T, E, K, placement, seed=5)
    capacity = T + 2
    slots = static_slots(placement, D, K)
    plan = static_plan(ids, placement, D, local_expert_ids(placement, D), capacity, slots)
    local = local_expert_ids(placement, D)
    assert plan.rows_per_device == [capacity] * D and plan.capacity == capacity
    assert slots == max(min(K, int(torch.bincount(placement, minlength=D).max())), 1)
    codes = {}                       # (row, slot) -> local expert id, from the plan
    for p in range(T * K):
        t, j = divmod(p, K)
        d = int(placement[ids[t, j]])
        row = int(plan.pair_row_P[p])
        assert row == d * capacity + t
        assert 0 <= int(plan.pair_rank_P[p]) < slots
        codes[(row, int(plan.pair_rank_P[p]))] = int(plan.pair_code_P[p]) >> 1
        assert codes[(row, int(plan.pair_rank_P[p]))] == int(local[ids[t, j]])
    assert len(codes) == T * K                        # no two pairs share a (row, slot)
    for t in range(T):
        devices = {int(placement[e]) for e in ids[t].tolist()}
        assert int(plan.devices_per_token_T[t]) == len(devices)
        for d in range(D):
            assert int(plan.brim0_TJ[t, d]) == (d * capacity + t if d in devices else -1)


def test_padded_pairs_from_slots_match_the_exact_ones():
    gen = torch.Generator().manual_seed(3)
    code_RK = torch.randint(-1, 4, (9, 3), generator=gen)
    exact = build_pairs_from_slots(code_RK, int((code_RK >= 0).sum()), 4)
    padded = build_pairs_from_slots(code_RK, None, 4)
    valid = int(exact[2][-1])
    assert torch.equal(exact[2], padded[2])                   # same offsets: padding sits past them
    assert padded[0].numel() == code_RK.numel()
    assert torch.equal(exact[0], padded[0][:valid]) and torch.equal(exact[1], padded[1][:valid])
    assert torch.equal(exact[3], padded[3])                    # empty slots stay -1 in the row table


def test_static_plan_rejects_a_capacity_below_the_tokens():
    placement = contiguous_placement(4, 2)
    with pytest.raises(ValueError, match="static_capacity"):
        static_plan(torch.zeros(5, 2, dtype=torch.long), placement, 2, local_expert_ids(placement, 2), 4, 2)


@pytest.mark.parametrize("kind,T,E,K,D", CASES + [("random", 64, 64, 8, 8), ("random", 9, 6, 2, 1)])
def test_sort_free_dedup_plan_sends_what_build_plan_sends(kind, T, E, K, D):
    """The layer's dedup plan (`count_dedup_plan` + `finish_dedup_plan`, no sort) numbers the rows,
    counts and packs exactly as the pair-stream plan does; only its pair order differs."""
    from occult.ep.layer import _pack_rows
    from occult.ep.plan import count_dedup_plan, finish_dedup_plan

    placement = shuffled_placement(E, D, seed=T + E + 7)
    local_id = local_expert_ids(placement, D)
    ids = routing(kind, T, E, K, placement, seed=5)
    want = build_plan(ids, placement, D, local_id, "dedup")
    counts = count_dedup_plan(ids, placement, D, local_id)
    rows, pairs, most = counts.counts_D3.t().tolist()
    assert rows == want.rows_per_device and pairs == want.pairs_per_device
    assert all(m == (max(want.pair_rank_P.tolist(), default=-1) + 1) for m in most)
    got = finish_dedup_plan(counts, rows, pairs, max(max(most, default=1), 1))
    assert torch.equal(got.send_token_S, want.send_token_S)
    assert torch.equal(got.brim0_TJ, want.brim0_TJ)
    assert torch.equal(got.devices_per_token_T, want.devices_per_token_T)
    assert got.slots == want.slots
    # pair p = t*k + j: its row, slot and code agree with the pair-stream plan's entry for (t, j)
    assert torch.equal(got.pair_slot_P, torch.arange(T * K))
    order = torch.argsort(want.pair_slot_P)
    assert torch.equal(got.pair_row_P, want.pair_row_P[order])
    assert torch.equal(got.pair_rank_P, want.pair_rank_P[order])
    assert torch.equal(got.pair_code_P, want.pair_code_P[order])
    # so the packed rows on the wire are byte for byte the same
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(T, 24, generator=gen, dtype=torch.float16)
    gates = torch.rand(T, K, generator=gen)
    assert torch.equal(_pack_rows(x, gates.reshape(-1)[got.pair_slot_P], got),
                       _pack_rows(x, gates.reshape(-1)[want.pair_slot_P], want))


def test_plans_that_say_token_order_have_it():
    placement = shuffled_placement(16, 4, seed=0)
    local_id = local_expert_ids(placement, 4)
    ids = routing("random", 21, 16, 3, placement, seed=2)
    from occult.ep.plan import count_dedup_plan, finish_dedup_plan

    counts = count_dedup_plan(ids, placement, 4, local_id)
    rows, pairs, most = counts.counts_D3.t().tolist()
    for plan in (finish_dedup_plan(counts, rows, pairs, max(most)),
                 static_plan(ids, placement, 4, local_id, 21, static_slots(placement, 4, 3))):
        assert plan.pairs_in_token_order and torch.equal(plan.pair_slot_P, torch.arange(21 * 3))
    assert not build_plan(ids, placement, 4, local_id, "dedup").pairs_in_token_order
