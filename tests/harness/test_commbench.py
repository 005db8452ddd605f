"""The communication/GEMM microbenchmark: CPU smoke run on 2 gloo ranks, and what the simulator
reads back from it."""

import pandas as pd
import pytest

from occult.harness.commbench import ALLTOALL_COLUMNS, GEMM_COLUMNS, main
from occult.sim.measured import alltoall_curves


def test_commbench_smoke_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "comm"
    assert main(["--device", "cpu", "--D", "2", "--out", str(out), "--sizes", "65536", "1048576",
                 "--dtypes", "bfloat16", "uint8", "--dedup-shape", "tiny", "--dedup-tokens", "64",
                 "--gemm-shapes", "tiny", "--rows-per-expert", "4", "16", "--repeats", "2", "--warmup", "1",
                 "--timeout-s", "60"]) == 0
    a2a = pd.read_csv(out / "alltoall.csv")
    gemm = pd.read_csv(out / "gemm.csv")
    assert tuple(a2a.columns) == ALLTOALL_COLUMNS and tuple(gemm.columns) == GEMM_COLUMNS
    assert len(a2a) == 2 * 2 + 1 and set(a2a["pattern"]) == {"equal", "dedup"}
    equal = a2a[a2a["pattern"] == "equal"]
    assert (equal["bytes_remote_per_rank"] * 2 == equal["bytes_per_rank"]).all()
    assert (a2a["median_ms"] > 0).all() and (a2a["D"] == 2).all()
    assert set(gemm["pass"]) == {"fwd", "fwd+bwd"} and (gemm["tflops"] > 0).all()
    assert (out / "alltoall.csv.meta.json").exists()
    curve = alltoall_curves(str(out / "alltoall.csv"))[2]
    assert curve(1.0) > 0


def test_commbench_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="dedup_tokens"):
        main(["--device", "cpu", "--D", "1", "--out", str(tmp_path), "--dedup-tokens", "0",
              "--dedup-shape", "tiny", "--gemm-shapes", "tiny"])
    with pytest.raises(ValueError, match="shape"):
        main(["--device", "cpu", "--D", "1", "--out", str(tmp_path), "--gemm-shapes", "nope"])
