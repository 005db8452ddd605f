"""occult.harness.trainbench on CPU (TRITON_INTERPRET=1): both expert kernels train the same model side by side."""

import contextlib
import io

import pandas as pd
import pytest
import yaml

from occult.config import merge
from occult.harness.trainbench import main
from tests.stages.test_quality_prep import BASE, MICRO

# the micro model on one 8-token sequence: each Triton step costs seconds in the interpreter
SMALL_BATCH = {"pretrain": {"batch_size": 1, "seq_len": 8}}


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> tuple[pd.DataFrame, str]:
    """One run of both kernels (1 warm-up + 2 timed steps each): its table and what it printed."""
    folder = tmp_path_factory.mktemp("trainbench")
    config = folder / "micro.yaml"
    config.write_text(yaml.safe_dump(merge(merge(BASE, MICRO), SMALL_BATCH)))
    out, printed = folder / "trainbench.csv", io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--config", str(config), "--out", str(out), "--steps", "2", "--warmup", "1",
                     "--vocab-size", "64"]) == 0
    return pd.read_csv(out), printed.getvalue()


def test_trainbench_times_both_kernels_on_the_same_model(bench):
    table, printed = bench
    assert list(table["experts_kernel"]) == ["grouped", "triton"]
    assert (table["steps"] == 2).all() and (table["median_ms"] > 0).all()
    assert table["first_loss_diff"].abs().max() < 1e-4            # the same model, the same first batch
    assert table["speedup_vs_first"].iloc[0] == pytest.approx(1.0)
    assert "triton" in printed


def test_trainbench_refuses_no_steps(tmp_path):
    config = tmp_path / "micro.yaml"
    config.write_text(yaml.safe_dump(merge(BASE, MICRO)))
    with pytest.raises(ValueError, match="--steps"):
        main(["--config", str(config), "--out", str(tmp_path / "x.csv"), "--steps", "0"])
    assert not (tmp_path / "x.csv").exists()


def test_trainbench_leaves_sync_columns_empty_on_a_cpu(bench):
    table, _ = bench
    assert table["host_syncs_per_step"].isna().all()        # CUDA's sync debug mode needs CUDA


@pytest.mark.gpu
def test_sync_sites_names_the_line_of_a_sync():
    import torch

    from occult.harness.trainbench import sync_sites

    x = torch.ones(8, device="cuda")
    sites = sync_sites(lambda: (x * 2).sum().item())     # one .item(): one sync, on this line
    assert sum(sites.values()) >= 1 and any(site.startswith("test_trainbench.py:") for site in sites)
    assert sync_sites(lambda: (x * 2).sum()) == {}        # no sync
