"""The bench stage on synthetic trace/placement files: rows, E[C_T], bytes, checks, failures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import occult.stages.bench as bench
from occult.config import load_config
from occult.harness.ranks import RankFailure

E, K, D, LAYERS, TRACE_TOKENS = 8, 2, 2, (0, 2), 300


def tiny_config(cases=("trivial", "placed", "prune1"), tokens=(0, 8, 24)):
    return load_config(Path(__file__).resolve().parents[2] / "config" / "config.yaml", {
        "model": {"hidden_size": 16, "expert_ffn": 8, "num_experts": E, "top_k": K, "num_heads": 2},
        "placement": {"devices": [D]},
        "finetune": {"devices": D, "variants": ["raw"]},
        "bench": {"devices": D, "tokens_per_rank": list(tokens), "repeats": 1, "warmup": 0, "cases": list(cases)},
    })


def write_inputs(tmp_path, with_swap: bool = True):
    """A routing trace where experts {0..3} and {4..7} co-activate, and a placement that knows it."""
    rng = np.random.default_rng(0)
    group = rng.integers(0, 2, (len(LAYERS), TRACE_TOKENS))
    ids = np.stack([
        np.stack([rng.choice(np.arange(4) + 4 * g, K, replace=False) if rng.random() < 0.8
                  else rng.choice(E, K, replace=False) for g in row])
        for row in group
    ]).astype(np.int16)
    np.savez(tmp_path / "routing_heldout.npz", ids=ids, layers=np.array(LAYERS))
    greedy = [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]]
    swap = [[1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1]]
    methods = {"greedy": greedy, "swap": swap} if with_swap else {"greedy": greedy}
    for method, table in methods.items():
        (tmp_path / f"D{D}_{method}.json").write_text(json.dumps(
            {"devices": D, "method": method, "num_experts": E, "top_k": K, "layers": list(LAYERS),
             "device_of_expert": table}))
    return ids.astype(np.int64)


def python_ct(ids_NK: np.ndarray, placement: list[int]) -> float:
    return float(np.mean([len({placement[e] for e in row}) for row in ids_NK]))


def test_bench_writes_checked_rows(tmp_path):
    trace = write_inputs(tmp_path)
    cfg = tiny_config()
    out = tmp_path / "out" / "bench.csv"
    bench.run_bench(cfg, tmp_path, tmp_path, out)
    frame = pd.read_csv(out)
    meta = json.loads((tmp_path / "out" / "bench.csv.meta.json").read_text())
    assert meta["config_hash"] == cfg.hash() and meta["stage"] == "bench"

    # trivial, placed (greedy), placed (swap), prune1 × layers × T × modes
    assert len(frame) == 4 * len(LAYERS) * 3 * 2
    assert set(frame.placement) == {"contiguous", "greedy", "swap"}
    assert (frame.max_abs_err_out <= 1e-4).all() and (frame.max_abs_err_grad <= 1e-3).all()
    assert (frame.checked_tokens_per_rank == 8).all()

    sample = bench.sample_tokens(trace, D * 24, cfg.seed)
    placements = {"contiguous": [0, 0, 0, 0, 1, 1, 1, 1], "greedy": [0, 0, 0, 0, 1, 1, 1, 1],
                  "swap": {0: [1, 1, 1, 1, 0, 0, 0, 0], 2: [0, 0, 0, 0, 1, 1, 1, 1]}}
    for row in frame[(frame.case != "prune1") & (frame.tokens_per_rank > 0)].itertuples():
        li = LAYERS.index(row.layer)
        placement = placements[row.placement]
        placement = placement[row.layer] if isinstance(placement, dict) else placement
        want = python_ct(sample[li, : D * row.tokens_per_rank], placement)
        assert row.mean_devices_per_token == pytest.approx(want, rel=1e-5), row
    assert (frame[frame.case == "prune1"].query("tokens_per_rank > 0").mean_devices_per_token == 1.0).all()

    key = ["layer", "case", "placement", "tokens_per_rank"]
    paired = frame.pivot_table(index=key, columns="mode", values="bytes_dispatch_remote_per_rank")
    assert (paired["dedup"] <= paired["per_expert"]).all()
    assert (paired.xs(0, level="tokens_per_rank") == 0).all().all()
    busy = frame[frame.tokens_per_rank > 0]
    assert (busy.fwd_ms > 0).all() and (busy.fwd_bwd_ms > 0).all()
    # per_expert rows carry one (expert id, gate) slot behind the fp32 hidden vector, padded to
    # the packed-row alignment: hidden 16 × 4 B + 8 B → 128 B per remote row
    from occult.kernels.wire_format import packed_row_layout

    row_bytes = packed_row_layout(16, torch.float32.itemsize, 1)[1]
    assert row_bytes == 128
    per_expert = frame[frame["mode"] == "per_expert"]
    np.testing.assert_allclose(per_expert.bytes_dispatch_remote_per_rank,
                               per_expert.rows_remote_per_rank * row_bytes, rtol=1e-5)


def test_bench_stops_loudly_on_a_wrong_result(tmp_path, monkeypatch):
    write_inputs(tmp_path, with_swap=False)
    monkeypatch.setattr(bench, "REL_TOLERANCE", -1.0)   # inherited by the forked ranks
    with pytest.raises(RankFailure, match="differs from moe_dense_ref"):
        bench.run_bench(tiny_config(cases=("trivial",), tokens=(8,)), tmp_path, tmp_path, tmp_path / "b.csv")
    assert not (tmp_path / "b.csv").exists()


def test_bad_inputs_name_the_file(tmp_path):
    cfg = tiny_config(cases=("placed",), tokens=(8,))
    with pytest.raises(bench.BenchInputError, match="routing_heldout.npz"):
        bench.run_bench(cfg, tmp_path, tmp_path, tmp_path / "b.csv")
    np.savez(tmp_path / "routing_heldout.npz", ids=np.zeros((1, 5, 3), np.int16), layers=np.array([0]))
    with pytest.raises(bench.BenchInputError, match="top-k 3"):
        bench.run_bench(cfg, tmp_path, tmp_path, tmp_path / "b.csv")
    np.savez(tmp_path / "routing_heldout.npz", ids=np.zeros((1, 5, K), np.int16), layers=np.array([0]))
    with pytest.raises(ValueError, match="D2_greedy.json"):
        bench.run_bench(cfg, tmp_path, tmp_path, tmp_path / "b.csv")


def test_router_score_pruning_keeps_first_devices():
    placement = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    ids = torch.tensor([[0, 2, 4, 6], [2, 3, 0, 7], [6, 0, 7, 1]])
    pruned = bench.prune_router_score(ids, placement, 4, 2, torch.Generator().manual_seed(0))
    for before, after in zip(ids.tolist(), pruned.tolist()):
        allowed = []
        for e in before:
            if int(placement[e]) not in allowed and len(allowed) < 2:
                allowed.append(int(placement[e]))
        assert len(set(after)) == 4
        assert {int(placement[e]) for e in after} <= set(allowed)
        kept = [e for e in before if int(placement[e]) in allowed]
        assert after[: len(kept)] == kept            # the trace's own experts stay first, in order
