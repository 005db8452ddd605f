"""docs/results.md names every column of every kind of CSV the study writes: checked against the
committed files' headers, so a new column without its line in the page fails here."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# One committed file of each kind the page documents; a kind with no committed file is left out.
FILES = [
    "results/paper/claims.csv",
    "results/tiny/model/pretrain_log.csv",
    "results/tiny/finetune/sft_log.csv",
    "results/tiny/placement/expected_ct.csv",
    "results/tiny/placement/study.csv",
    "results/tiny/placement/study_sensitivity.csv",
    "results/tiny/bench/ep_cpu.csv",
    "results/tiny/tables/ct_ablation.csv",
    "results/tiny/tables/placement_summary.csv",
    "results/tiny/simulate/validation.csv",
    "results/tiny/simulate/validation_history.csv",
    "results/tiny/simulate/predictions.csv",
    "results/tiny/simulate/predictions_D4_D8.csv",
    "results/nvidia-h200/sweeps_v43/sweep_prefill_D1.csv",
    "results/nvidia-h200/sweeps_v43/speedups.csv",
    "results/nvidia-h200/sweeps_v43/train_host_ab.csv",
    "results/nvidia-h200-x2/ep_v7/summary.csv",
    "results/nvidia-h200-x2/ep_v7/targets.csv",
    "results/nvidia-h200-x2/ep_v7/peak.csv",
    "results/nvidia-h200/kernels_v19/kernels.csv",
    "results/nvidia-h200/kernels_v19/summary.csv",
    "results/nvidia-h200-x2/comm_v1/alltoall.csv",
    "results/nvidia-h200-x2/comm_v1/gemm.csv",
    "results/nvidia-h200/quality_upcycle_v4/tables/replicates.csv",
    "results/nvidia-h200/quality_upcycle_v4/tables/inheritance.csv",
    "results/nvidia-h200/quality_upcycle_v4/tables/verdicts_pooled.csv",
    "results/nvidia-h200/quality_upcycle_v4/tables/verdicts_pooled_bases.csv",
    "results/cpu-x86/placement_latency_v7/study.csv",
    "results/cpu-x86/placement_latency_v7/latency_summary.csv",
    "results/cpu-x86/placement_latency_v7/latency_replicas.csv",
    "results/cpu-x86/placement_latency_v7/latency_tradeoff_first_layer.csv",
    "results/cpu-x86/placement_latency_drop_v2/latency_summary.csv",
    "results/nvidia-h200/index.csv",
]
# Columns the page names as a family rather than one by one.
FAMILIES = {"version_": "`version_*`", "_stderr": "`<task>_stderr`"}


@pytest.mark.parametrize("relative", FILES)
def test_every_column_of_the_file_is_named_in_the_page(relative):
    page = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([^`]+)`", page))
    path = REPO / relative
    assert path.is_file(), f"{relative}: listed here but not in the tree (drop it from FILES or commit it)"
    with open(path, newline="") as handle:
        header = next(csv.reader(handle))
    missing = [c for c in header if c not in named
               and not any(part in c and token in page for part, token in FAMILIES.items())]
    assert not missing, f"docs/results.md does not name these columns of {relative}: {missing}"
