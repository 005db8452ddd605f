"""The GEMM config sweep (`occult.harness.kernel_tune`): candidates, forcing, checking, CSV."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from occult.harness import kernel_tune as tune_kernels
from occult.harness.kernel_tune import KERNELS, candidates, fits, row_table

configs_module = tune_kernels.configs_module
GRID = dict(blocks=(64, 128, 256), block_k=(32, 64, 128), warps=(4, 8), stages=(2, 3, 4, 5), group_sizes=(4, 8),
            elem_bytes=2, smem_kib=220.0)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_candidates_start_with_the_autotuner_configs_and_all_fit(kernel):
    spec = KERNELS[kernel]
    metas = candidates(spec, **GRID, limit=30, seed=1)
    own = [tune_kernels.config_meta(cfg) for cfg in spec.current]
    assert len(metas) == 30
    for meta, want in zip(metas, own):
        assert {key: meta[key] for key in want} == want
        assert meta.get("GROUP_SIZE") == (configs_module.GROUP_M if spec.grouped else None)
    rest = metas[len(own):]
    assert all(fits(spec, meta, 2, 220.0) for meta in rest)
    assert all(("GROUP_SIZE" in meta) == spec.grouped for meta in metas)
    assert len({tuple(sorted(meta.items())) for meta in metas}) == len(metas)
    assert candidates(spec, **GRID, limit=30, seed=1) == metas            # seeded
    assert candidates(spec, **GRID, limit=30, seed=2) != metas


def test_fits_rejects_tiles_beyond_shared_memory_or_registers():
    spec = KERNELS["swiglu_fwd"]                     # one A tile, two B tiles, two accumulators
    small = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    assert fits(spec, small, 2, 220.0)               # 3 * (8192 + 16384) * 2 B = 144 KiB
    assert not fits(spec, {**small, "num_stages": 5}, 2, 220.0)            # 240 KiB
    assert not fits(spec, {**small, "num_warps": 4}, 2, 220.0)             # 256 accumulator registers
    assert fits(KERNELS["down_fwd"], {**small, "num_warps": 4}, 2, 220.0)  # one accumulator: 128


def test_forced_meta_wins_and_is_restored():
    name = "_down_fwd_kernel"
    meta = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2}
    before = configs_module.fixed_gemm_meta(torch.bfloat16, 10**6, name)
    with configs_module.forced_gemm_meta(name, meta):
        assert dict(configs_module.fixed_gemm_meta(torch.bfloat16, 10**6, name)) == meta
        assert configs_module.fixed_gemm_meta(torch.bfloat16, 10**6, "_swiglu_fwd_kernel") == before
    assert configs_module.fixed_gemm_meta(torch.bfloat16, 10**6, name) == before
    with pytest.raises(ValueError, match="BLOCK_K"):
        with configs_module.forced_gemm_meta(name, {"BLOCK_M": 16, "BLOCK_N": 16}):
            pass


def test_row_table_lists_each_rows_pairs():
    gen = torch.Generator().manual_seed(3)
    pair_row = torch.randint(0, 9, (40,), generator=gen)
    table = row_table(pair_row, 11)                   # rows 9 and 10 have no pairs
    assert table.shape[0] == 11
    for row in range(11):
        listed = sorted(int(p) for p in table[row] if p >= 0)
        assert listed == sorted(torch.nonzero(pair_row == row).flatten().tolist())


def test_a_config_that_changes_the_result_is_marked_wrong(monkeypatch):
    """The check compares with the default: a forced launch that computes something else is caught."""
    x = torch.randn(8, 4)

    def fake_runner(kernel, inp):
        return lambda: (x + (1.0 if configs_module._FORCED_META else 0.0),)

    monkeypatch.setattr(tune_kernels, "op_runner", fake_runner)
    monkeypatch.setattr(tune_kernels, "pinned_meta", lambda name, run: None)     # no real launch here
    metas = [{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2, "GROUP_SIZE": 8}]
    rows = tune_kernels.sweep_kernel("down_fwd", None, metas, 1.0, False, 1, 1, deadline=float("inf"))
    assert [row["status"] for row in rows] == ["ok", "wrong"]
    assert rows[1]["rel_err_vs_default"] > 0.1
    assert rows[1]["BLOCK_M"] == 16 and rows[0]["config"] == "autotuned"


@pytest.mark.slow
def test_smoke_sweep_writes_checked_rows_for_every_kernel(tmp_path):
    out = tmp_path / "tune" / "tune.csv"
    assert tune_kernels.main(["--smoke", "--out", str(out), "--max-configs", "6"]) == 0
    frame = pd.read_csv(out)
    assert set(frame["kernel"]) == set(KERNELS)
    assert (frame["status"] == "ok").all(), frame[frame["status"] != "ok"][["kernel", "status"]]
    assert (frame["rel_err_vs_default"] <= 1e-2).all()
    per_kernel = frame.groupby("kernel")
    assert (per_kernel.size() == 7).all()                               # the default + 6 forced
    assert (per_kernel["config"].first() == "autotuned").all()
    forced = frame[frame["config"] == "forced"]
    # past the autotuner's own configs, the smoke grid's 16/32-wide blocks run
    assert (forced["BLOCK_M"] <= 32).any() and not forced["in_autotune_set"].all()
    grouped = forced["kernel"].map(lambda k: KERNELS[k].grouped)
    assert forced.loc[grouped, "GROUP_SIZE"].notna().all() and forced.loc[~grouped, "GROUP_SIZE"].isna().all()
    assert (frame["median_ms"] > 0).all() and frame["commit"].notna().all()
    meta = json.loads((tmp_path / "tune" / "tune.csv.meta.json").read_text())
    assert meta["tune_args"]["smoke"] is True
    # appending: a second run adds rows, keeps the first
    assert tune_kernels.main(["--smoke", "--out", str(out), "--kernels", "down_dw", "--max-configs", "1"]) == 0
    assert len(pd.read_csv(out)) == len(frame) + 2


def test_without_a_gpu_only_the_interpreted_smoke_runs(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="TRITON_INTERPRET"):
        tune_kernels.main(["--out", str(tmp_path / "t.csv")])


def test_measured_configs_are_pinned_only_for_their_shape_dtype_size_and_architecture(monkeypatch):
    """TUNED_GEMM_META applies to 16-bit inputs of its (D, F) on its architecture from
    AUTOTUNE_MIN_PAIRS pairs on; everything else keeps the fixed or autotuned path."""
    monkeypatch.setattr(configs_module, "interpreting", lambda: False)
    capability = [(9, 0)]
    monkeypatch.setattr(configs_module, "capability_major", lambda device: capability[0][0])
    cuda, many = torch.device("cuda", 0), 10**6
    name = "_swiglu_bwd_dx_kernel"
    pinned = configs_module.TUNED_GEMM_META[(name, 9, 2048, 1024, False)]
    meta = configs_module.fixed_gemm_meta
    assert meta(torch.bfloat16, many, name, (2048, 1024), cuda) is pinned
    assert meta(torch.float16, many, name, (2048, 1024), cuda) is pinned
    assert meta(torch.bfloat16, many, name, (2048, 512), cuda) is None                  # other shape: autotune
    assert meta(torch.bfloat16, many, "_down_fwd_kernel", (2048, 1024), cuda) is None   # not measured
    assert meta(torch.bfloat16, many, name, (2048, 1024), torch.device("cpu")) is None
    assert meta(torch.float32, many, name, (2048, 1024), cuda) is configs_module.FP32_GEMM_META
    assert meta(torch.bfloat16, 100, name, (2048, 1024), cuda) is configs_module.SMALL_GEMM_META
    with configs_module.pinned_configs_disabled():
        assert meta(torch.bfloat16, many, name, (2048, 1024), cuda) is None
    assert meta(torch.bfloat16, many, name, (2048, 1024), cuda) is pinned
    forced = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
    with configs_module.forced_gemm_meta(name, forced):                                   # the sweep's forcing wins
        assert dict(meta(torch.bfloat16, many, name, (2048, 1024), cuda)) == forced
    fwd = "_swiglu_fwd_kernel"                                                           # pinned per operand path
    assert meta(torch.bfloat16, many, fwd, (2048, 1024), cuda, True) is configs_module.TUNED_GEMM_META[(fwd, 9, 2048, 1024, True)]
    assert meta(torch.bfloat16, many, fwd, (2048, 1024), cuda) is configs_module.TUNED_GEMM_META[(fwd, 9, 2048, 1024, False)]
    assert meta(torch.bfloat16, many, name, (2048, 1024), cuda, True) is configs_module.TUNED_GEMM_META[(name, 9, 2048, 1024, True)]
    down = "_down_fwd_kernel"
    assert meta(torch.bfloat16, many, down, (2048, 1024), cuda, True) is configs_module.TUNED_GEMM_META[(down, 9, 2048, 1024, True)]
    assert meta(torch.bfloat16, many, down, (2048, 1024), cuda) is None                 # pointer path: autotune
    # F = 1408 (Qwen1.5-MoE, DeepSeek-MoE): both forward and both dW pins; the rest autotunes
    dw = "_swiglu_bwd_dw_kernel"
    down_dw = "_down_bwd_dw_kernel"
    assert meta(torch.bfloat16, many, down_dw, (2048, 1408), cuda, True)["X_TMA"] == 1
    assert meta(torch.bfloat16, many, down, (2048, 1408), cuda, True) is configs_module.TUNED_GEMM_META[(down, 9, 2048, 1408, True)]
    assert meta(torch.bfloat16, many, dw, (2048, 1408), cuda, True) is configs_module.TUNED_GEMM_META[(dw, 9, 2048, 1408, True)]
    assert meta(torch.bfloat16, many, fwd, (2048, 1408), cuda, True)["ONE_ACC"] == 1
    assert meta(torch.bfloat16, many, fwd, (2048, 1408), cuda) is None                  # pointer path: autotune
    assert meta(torch.bfloat16, many, dw, (2048, 1408), cuda) is None                   # pointer path: autotune
    capability[0] = (8, 0)
    assert meta(torch.bfloat16, many, name, (2048, 1024), cuda) is None


def test_explicit_configs_are_parsed_and_timed_as_given(tmp_path):
    assert tune_kernels.parse_config("128x256x64:w8:s4:PERSISTENT=1") == {
        "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4, "PERSISTENT": 1}
    for bad in ("128x256:w8:s4", "128x256x64:w8", "128x256x64:w8:s4:PERSISTENT"):
        with pytest.raises(ValueError, match="BMxBNxBK|warps"):
            tune_kernels.parse_config(bad)
    with pytest.raises(SystemExit):
        tune_kernels.parse_args(["--out", "x.csv", "--configs", "16x16:w4:s2"])
    out = tmp_path / "tune.csv"
    assert tune_kernels.main(["--smoke", "--out", str(out), "--kernels", "down_fwd", "--configs", "16x16x16:w4:s2",
                              "16x32x16:w4:s2:PERSISTENT=1"]) == 0
    forced = pd.read_csv(out).query("config == 'forced'")
    assert forced["BLOCK_N"].tolist() == [16, 32] and (forced["status"] == "ok").all()
    assert forced["extra_meta"].fillna("").tolist() == ["", "PERSISTENT=1"]


def test_the_pinned_row_is_the_config_the_op_launched(monkeypatch):
    """`pinned_meta` reports what the op's launcher chose: a TUNED_GEMM_META entry, else None."""
    tuned = configs_module.TUNED_GEMM_META[("_down_fwd_kernel", 9, 2048, 1024, True)]
    monkeypatch.setitem(configs_module.LAST_LAUNCH_META, "_down_fwd_kernel", None)

    def run_with(meta):
        return lambda: configs_module.LAST_LAUNCH_META.__setitem__("_down_fwd_kernel", meta)

    assert tune_kernels.pinned_meta("_down_fwd_kernel", run_with(tuned)) is tuned
    assert tune_kernels.pinned_meta("_down_fwd_kernel", run_with(dict(tuned))) is None      # equal, not pinned
    assert tune_kernels.pinned_meta("_down_fwd_kernel", run_with(configs_module.SMALL_GEMM_META)) is None
