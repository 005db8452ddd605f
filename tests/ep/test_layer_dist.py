"""`ep_moe` forward and gradients equal the dense reference on 1, 2 and 4 gloo ranks, and
`run_ranks` never hangs on a failing rank."""

from __future__ import annotations

import os
import time

import pytest
import torch

from occult.harness.ranks import RankFailure, run_ranks
from occult.ep.layer import EPStats, ep_moe, get_backend
from occult.ep.plan import contiguous_placement, experts_of_device
from occult.kernels.reference import moe_dense_ref

HIDDEN, FFN = 16, 8
MODES = ("dedup", "per_expert")
CASES = (*MODES, "static")   # static = dedup through the static-shape plan (no host sync)


def make_weights(num_experts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(num_experts, 2 * FFN, HIDDEN, generator=gen) / HIDDEN**0.5
    w_down = torch.randn(num_experts, HIDDEN, FFN, generator=gen) / FFN**0.5
    return w_gate_up, w_down


def make_tokens(
    kind: str, num_tokens: int, num_experts: int, top_k: int, placement: torch.Tensor, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_TD, ids_TK, weights_TK) of one routing pattern."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if kind == "hot":                       # one expert gets every token
        scores[:, 1] = 2.0
    elif kind == "empty":                   # the upper half of the experts gets nothing
        scores[:, num_experts // 2 :] = -1.0
    elif kind == "device0":                 # every expert used lives on device 0: the rest receive nothing
        scores = scores + (placement[None, :] == 0) * 2.0
    elif kind == "one_device":              # N_d = 1 pruned routing
        home = torch.randint(0, int(placement.max()) + 1, (num_tokens,), generator=gen)
        scores = scores + (placement[None, :] == home[:, None]) * 2.0
    ids = scores.topk(top_k, dim=1).indices
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=1)
    return x, ids, weights


# kind, E, k, tokens per rank (indexed by rank, cycled)
SCENARIOS = [
    ("random", 8, 2, [7, 5, 3, 6]),
    ("random", 8, 3, [1, 0, 4, 1]),       # T=1 and T=0 ranks, uneven splits
    ("hot", 8, 2, [9, 4, 6, 2]),
    ("empty", 12, 3, [6, 8, 0, 5]),
    ("one_device", 8, 2, [8, 6, 5, 7]),
    ("device0", 8, 2, [5, 3, 0, 4]),
    ("random", 8, 1, [6, 3, 4, 5]),
]


def placement_for(num_experts: int, world: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return contiguous_placement(num_experts, world)[torch.randperm(num_experts, generator=gen)]


def check_scenarios(rank: int, world: int, backend: str = "torch") -> list[dict]:
    """On every rank: run each scenario in both modes and compare with the dense full batch."""
    reports = []
    for index, (kind, num_experts, top_k, tokens) in enumerate(SCENARIOS):
        placement = placement_for(num_experts, world, seed=index)
        w_gate_up, w_down = make_weights(num_experts, seed=index)
        batches = [
            make_tokens(kind, tokens[r % len(tokens)], num_experts, top_k, placement, seed=100 * index + r)
            for r in range(world)
        ]
        gen = torch.Generator().manual_seed(7 + index)
        dys = [torch.randn(b[0].shape[0], HIDDEN, generator=gen) for b in batches]

        # Dense reference on the full batch (every rank can build it: inputs are seeded).
        x_full = torch.cat([b[0] for b in batches]).requires_grad_()
        weights_full = torch.cat([b[2] for b in batches]).requires_grad_()
        wgu_full, wd_full = w_gate_up.clone().requires_grad_(), w_down.clone().requires_grad_()
        y_full = moe_dense_ref(x_full, torch.cat([b[1] for b in batches]), weights_full, wgu_full, wd_full)
        (y_full * torch.cat(dys)).sum().backward()
        start = sum(b[0].shape[0] for b in batches[:rank])
        mine = slice(start, start + batches[rank][0].shape[0])
        local = experts_of_device(placement, rank)

        capacity = max(b[0].shape[0] for b in batches) + 1       # > T everywhere: padding rows too
        for case in CASES:
            mode = "dedup" if case == "static" else case
            static = {"static_capacity": capacity} if case == "static" else {}
            x, ids, weights = (t.clone() for t in batches[rank])
            x.requires_grad_()
            weights.requires_grad_()
            wgu = w_gate_up[local].clone().requires_grad_()
            wd = w_down[local].clone().requires_grad_()
            stats = EPStats()
            y = ep_moe(x, ids, weights, placement, wgu, wd, mode=mode, stats=stats, backend=backend, **static)
            (y * dys[rank]).sum().backward()

            def err(a: torch.Tensor, b: torch.Tensor) -> float:
                return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0

            c_t = sum(len({int(placement[e]) for e in row.tolist()}) for row in ids)
            reports.append({
                "scenario": index, "mode": case, "rank": rank,
                "y": err(y, y_full[mine]),
                "grad_x": err(x.grad, x_full.grad[mine]),
                "grad_weights": err(weights.grad, weights_full.grad[mine]),
                "grad_w_gate_up": err(wgu.grad, wgu_full.grad[local]),
                "grad_w_down": err(wd.grad, wd_full.grad[local]),
                "c_t_ok": stats.devices_per_token_sum == c_t and stats.tokens == len(ids),
                "bytes": stats.bytes_dispatch_remote,
                "rows": stats.rows_remote,
                "pairs": stats.pairs_remote,
                "top_k": top_k,
            })
    return reports


def assert_reports(reports: list[dict], atol: float = 2e-5) -> None:
    for rep in reports:
        for field in ("y", "grad_x", "grad_weights", "grad_w_gate_up", "grad_w_down"):
            assert rep[field] <= atol, f"{field} off by {rep[field]:.2e} in {rep}"
        assert rep["c_t_ok"], rep
        # Packed rows carry the hidden vector and 8 bytes per metadata slot (k slots at most),
        # padded to 64 bytes.
        row_bytes = HIDDEN * 4
        assert rep["bytes"] >= rep["rows"] * row_bytes + rep["pairs"] * 8, rep
        assert rep["bytes"] <= rep["rows"] * (-(-(row_bytes + 8 * rep["top_k"]) // 64) * 64), rep
    by_key = {(r["scenario"], r["rank"], r["mode"]): r for r in reports}
    for (scenario, rank, mode), rep in by_key.items():
        if mode != "dedup":
            continue
        per_expert = by_key[(scenario, rank, "per_expert")]
        assert rep["rows"] <= per_expert["rows"], (rep, per_expert)
        assert rep["pairs"] == per_expert["pairs"], (rep, per_expert)
        if rep["top_k"] == 1:
            assert rep["bytes"] == per_expert["bytes"], (rep, per_expert)


def test_single_device_matches_dense():
    assert_reports(check_scenarios(0, 1))


@pytest.mark.parametrize("world", [2, 4])
def test_multi_rank_matches_dense(world):
    results = run_ranks(check_scenarios, world, timeout_s=60)
    reports = [rep for per_rank in results for rep in per_rank]
    assert_reports(reports)
    # Communication happened: some rank sent remote bytes in every scenario but N_d=1-free ones.
    assert any(rep["bytes"] > 0 for rep in reports)


def test_triton_backend_on_two_ranks_matches_dense_with_gradients():
    """The kernels (interpreter on CPU) in every dispatch case, static shapes included."""
    get_backend("triton")
    for reports in run_ranks(check_scenarios, 2, "triton", timeout_s=240):
        assert_reports(reports, atol=1e-4)


def test_shared_expert_is_added_and_bad_input_is_named():
    placement = torch.zeros(4, dtype=torch.long)
    w_gate_up, w_down = make_weights(4)
    x, ids, weights = make_tokens("random", 5, 4, 2, placement, seed=0)
    shared = torch.nn.Linear(HIDDEN, HIDDEN)
    y = ep_moe(x, ids, weights, placement, w_gate_up, w_down)
    y_shared = ep_moe(x, ids, weights, placement, w_gate_up, w_down, shared_expert=shared)
    torch.testing.assert_close(y_shared, y + shared(x))
    with pytest.raises(ValueError, match="w_gate_up_local"):
        ep_moe(x, ids, weights, placement, w_gate_up[:3], w_down[:3])
    with pytest.raises(ValueError, match="weights_TK"):
        ep_moe(x, ids, weights[:, :1], placement, w_gate_up, w_down)
    with pytest.raises(ValueError, match="backend"):
        ep_moe(x, ids, weights, placement, w_gate_up, w_down, backend="cuda")
    with pytest.raises(ValueError, match="mode"):
        ep_moe(x, ids, weights, placement, w_gate_up, w_down, mode="tutel")


def test_triton_backend_matches_or_fails_clearly():
    try:
        get_backend("triton")
    except RuntimeError as err:
        assert "occult.kernels" in str(err)
        return
    placement = torch.zeros(4, dtype=torch.long)
    w_gate_up, w_down = make_weights(4)
    x, ids, weights = make_tokens("random", 6, 4, 2, placement, seed=1)
    for case in CASES:
        mode = "dedup" if case == "static" else case
        static = {"static_capacity": 8} if case == "static" else {}
        expected = moe_dense_ref(x, ids, weights, w_gate_up, w_down)
        got = ep_moe(x, ids, weights, placement, w_gate_up, w_down, mode=mode, backend="triton", **static)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _fails_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one gives up")
    torch.distributed.barrier()


def _dies_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    torch.distributed.barrier()


def _sleeps(rank: int, world: int) -> None:
    time.sleep(60)


@pytest.mark.parametrize(
    "fn,match",
    [(_fails_on_rank_one, "rank one gives up"), (_dies_on_rank_one, "rank"), (_sleeps, "did not finish")],
)
def test_run_ranks_never_hangs(fn, match):
    start = time.monotonic()
    with pytest.raises(RankFailure, match=match):
        run_ranks(fn, 2, timeout_s=5, deadline_s=3)
    assert time.monotonic() - start < 15


def test_run_ranks_returns_in_rank_order():
    assert run_ranks(lambda rank, world, base: (rank, world, base), 3, 10) == [(0, 3, 10), (1, 3, 10), (2, 3, 10)]


def _rendezvous_fails_once(marker, real_init):
    """An init_process_group whose first call (in whichever rank gets there first) fails like a
    lost gloo connection; every later call is the real one."""
    def init(*args, **kwargs):
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return real_init(*args, **kwargs)
        raise RuntimeError("Gloo connectFullMesh failed: Connection closed by peer (simulated)")
    return init


def test_run_ranks_retries_a_failed_rendezvous_but_never_a_failing_fn(monkeypatch, tmp_path):
    import occult.harness.ranks as dist_module

    real_init = torch.distributed.init_process_group
    attempts = dist_module.RENDEZVOUS_ATTEMPTS
    monkeypatch.setattr(dist_module.dist, "init_process_group",
                        _rendezvous_fails_once(tmp_path / "failed_once", real_init))
    calls = tmp_path / "calls"

    def count_and_reduce(rank: int, world: int) -> float:
        with open(calls, "a") as out:
            out.write(f"{rank}\n")
        value = torch.tensor([float(rank + 1)])
        torch.distributed.all_reduce(value)
        return value.item()

    assert run_ranks(count_and_reduce, 2, timeout_s=5) == [3.0, 3.0]
    assert (tmp_path / "failed_once").exists()
    assert sorted(calls.read_text().split()) == ["0", "1"]          # fn ran once per rank, in the retry

    monkeypatch.setattr(dist_module, "RENDEZVOUS_ATTEMPTS", 1)      # no second attempt: the error names it
    (tmp_path / "failed_once").unlink()
    with pytest.raises(RankFailure, match="(?s)rendezvous failed 1 times.*connectFullMesh"):
        run_ranks(count_and_reduce, 2, timeout_s=5)

    def fails_in_rank_one(rank: int, world: int) -> None:
        with open(calls, "a") as out:
            out.write(f"fn{rank}\n")
        if rank == 1:
            raise ValueError("rank one gives up")

    # the real rendezvous with its retries back (a loaded CI host can lose a real gloo connect too)
    monkeypatch.setattr(dist_module.dist, "init_process_group", real_init)
    monkeypatch.setattr(dist_module, "RENDEZVOUS_ATTEMPTS", attempts)
    with pytest.raises(RankFailure, match="rank one gives up"):
        run_ranks(fails_in_rank_one, 2, timeout_s=5)
    assert calls.read_text().split().count("fn1") == 1                # an error of fn is not retried


def test_run_in_group_names_a_group_size_that_does_not_match_the_launch(monkeypatch, tmp_path):
    from occult.harness.ranks import run_in_group

    called = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(KeyError, match="differs from torchrun's WORLD_SIZE 2"):
        run_in_group(lambda: called.append(1), "cpu", 4, timeout_s=5, error=KeyError)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match="needs torchrun --nproc_per_node=2"):
        run_in_group(lambda: called.append(1), "cuda", 2, timeout_s=5)
    assert not called

    def mark() -> None:            # runs in each forked gloo rank
        group = torch.distributed
        (tmp_path / f"rank{group.get_rank()}_of{group.get_world_size()}").touch()

    run_in_group(mark, "cpu", 2, timeout_s=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0_of2", "rank1_of2"]


def test_one_device_makes_no_host_sync(monkeypatch):
    """On one device the split sizes follow from the shapes: the Triton path makes no `.tolist()`,
    `.item()` or `int()` of a tensor, forward or backward (each would stall the GPU once per MoE
    layer; the plain-torch reference backend loops over experts on the host by design)."""
    backend = "triton"
    get_backend(backend)
    placement = torch.zeros(6, dtype=torch.long)
    w_gate_up, w_down = make_weights(6)
    cases = [(mode, tokens) for mode in ("dedup", "per_expert") for tokens in (0, 1, 7)]
    inputs = [make_tokens("random", tokens, 6, 3, placement, seed=tokens) for _, tokens in cases]

    def no_sync(*args, **kwargs):
        raise AssertionError("host sync on one device")

    placement_values = placement.tolist()
    x, ids, weights = inputs[1]      # builds the placement's tables once (memoised, on the host)
    ep_moe(x, ids, weights, placement_values, w_gate_up, w_down, backend=backend)
    for name in ("tolist", "item", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    outputs = []
    for (mode, _), (x, ids, weights) in zip(cases, inputs):
        x = x.clone().requires_grad_(True)
        # the placement as host values: reading a CPU tensor's values is no device sync, but the
        # patch below cannot tell a CPU tensor from a GPU one
        y = ep_moe(x, ids, weights, placement_values, w_gate_up, w_down, mode=mode, backend=backend)
        y.sum().backward()
        outputs.append((y.detach(), x.grad))
    monkeypatch.undo()
    for (x, ids, weights), (y, grad_x) in zip(inputs, outputs):
        x = x.clone().requires_grad_(True)
        expected = moe_dense_ref(x, ids, weights, w_gate_up, w_down)
        expected.sum().backward()
        torch.testing.assert_close(y, expected.detach(), atol=1e-4, rtol=1e-4)
        if x.shape[0]:
            torch.testing.assert_close(grad_x, x.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_one_device_makes_no_host_sync_on_the_gpu():
    """The same on a GPU, by CUDA's own sync detector, in bf16 as the fused experts path runs."""
    placement = list(range(1)) * 8
    gen = torch.Generator().manual_seed(0)
    w_gate_up = (torch.randn(8, 2 * 32, HIDDEN, generator=gen) * 0.1).cuda().bfloat16().requires_grad_(True)
    w_down = (torch.randn(8, HIDDEN, 32, generator=gen) * 0.1).cuda().bfloat16().requires_grad_(True)
    x = torch.randn(64, HIDDEN, generator=gen).cuda().bfloat16().requires_grad_(True)
    logits = torch.randn(64, 8, generator=gen).cuda()
    weights, ids = torch.topk(logits.softmax(-1), 2, dim=-1)
    ep_moe(x, ids, weights, placement, w_gate_up, w_down, backend="triton").sum().backward()   # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = ep_moe(x, ids, weights, placement, w_gate_up, w_down, backend="triton")
        y.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(y).all()
