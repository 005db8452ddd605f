"""The validation table: roles, errors and replicates (the same computation measured again)."""

import numpy as np

from occult.shapes import get_shape
from occult.sim.calibration import build_cost_model
from occult.sim.columns import VALIDATION_COLUMNS
from occult.sim.measured import read_measured
from occult.sim.traces import ShapeTraces
from occult.sim.validation import replicate_key, validate
from tests.sim.test_measured import fake_sweep, gemm_csv, settings


def test_validation_table_separates_calibration_and_validation(tmp_path):
    path = fake_sweep(tmp_path, "sweep.csv")
    cfg = settings(measured=(path,), calibration=(f"{path}@tokens_per_gpu=64,1024",),
                   gemm_csv=gemm_csv(tmp_path / "gemm.csv"))
    measured = read_measured(cfg.measured, cfg.calibration)
    traces = {"tiny": ShapeTraces(get_shape("tiny"), cfg.pool_tokens, 0)}
    table, fitted = validate(cfg, traces, build_cost_model(cfg), measured)
    assert tuple(table.columns) == VALIDATION_COLUMNS
    assert len(table) == 24
    assert set(table.loc[table["tokens_per_gpu"] == 256, "role"]) == {"validation"}
    assert set(table.loc[table["tokens_per_gpu"] != 256, "role"]) == {"calibration"}
    assert {("occult", "fwd", 1), ("occult", "fwd", 2), ("naive", "fwd", 1), ("naive", "fwd", 2)} <= set(fitted.host)
    assert fitted.kernel_tflops is not None and fitted.other_gpu is not None and "fwd" in fitted.naive_ns_per_pair
    assert np.allclose(table["rel_err"], (table["predicted_ms"] - table["measured_ms"]) / table["measured_ms"])
    fitted_rows = table[(table["role"] == "calibration") & (table["family"] == "occult") & (table["D"] == 1)]
    # GPU work is negligible there: the host-bound fit is one constant inside the measured range
    assert len(fitted_rows) == 4 and fitted_rows["predicted_ms"].nunique() <= 2
    assert fitted_rows["measured_ms"].min() < fitted_rows["predicted_ms"].min() <= fitted_rows["predicted_ms"].max() \
        < fitted_rows["measured_ms"].max()
    # at D = 1, occult and occult-nd1 are the same computation: replicates of each other
    d1 = table[(table["D"] == 1) & (table["method"] != "naive")]
    assert set(d1["replicates"]) == {2} and np.allclose(d1["replicate_ratio"], 1.0) and d1["reachable"].all()
    assert set(table.loc[(table["D"] == 2) & (table["method"] == "occult"), "replicates"]) == {1}


def test_rows_without_the_shared_experts_are_not_replicates_of_rows_with_them():
    from types import SimpleNamespace

    def row(method: str, shared_ffn: float) -> SimpleNamespace:
        return SimpleNamespace(kind="decode", shape="qwen", method=method, D=1, tokens_per_gpu=8, routing="synthetic",
                               shared_ffn=shared_ffn)

    shared = get_shape("qwen").shared_ffn
    assert replicate_key(row("occult", shared)) != replicate_key(row("occult", 0))
    assert replicate_key(row("occult", float("nan"))) == replicate_key(row("occult-nd1", shared))   # old files: with
