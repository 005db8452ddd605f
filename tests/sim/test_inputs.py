"""The simulator's inputs from the results tree: simulator.yaml files of the runs the index marks
`simulator`, sets assembled across runs in place order, special roles, one error naming the file and
field of a bad spec, and the committed tree's specs."""

import dataclasses
from pathlib import Path

import pandas as pd
import pytest
import yaml

from occult.config import load_config
from occult.sim.columns import SimulateError
from occult.sim.inputs import SPEC_NAME, discover, read_sets, simulator_settings
from tests.report.test_results_index import row, write_machine
from tests.sim.test_measured import fake_sweep

REPO = Path(__file__).resolve().parents[2]
SIMULATE = load_config(REPO / "config" / "config.yaml").simulate


def write_spec(root: Path, run: str, spec, machine: str = "gpu-a") -> Path:
    path = root / machine / run / SPEC_NAME
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Four runs that feed the simulator and one that does not: the headline set spans r1 and r2
    (r2 first), the history set `old` spans r3 and r1; r4 holds the special roles."""
    root = tmp_path / "results"
    write_machine(root, "gpu-a", [row(r, used_by="simulator") for r in ("r1", "r2", "r3", "r4")] + [row("r5")])
    for run in ("r1", "r2", "r3", "r5"):
        fake_sweep(root / "gpu-a" / run, "sweep.csv")
    fake_sweep(root / "gpu-a" / "r1", "extra.csv")
    for name in ("alltoall.csv", "gemm.csv", "stream.csv", "with.csv", "without.csv", "sweep_prefill_D4.csv"):
        (root / "gpu-a" / "r4" / name).write_text("x\n1\n")
    (root / "gpu-a" / "r4" / "peak.csv").write_text("gpu,op,median_ms,tflops\nG,bf16 matmul,1.0,640.5\n")
    write_spec(root, "r1", {"sets": [
        {"in": {"headline": 2}, "measured": ["sweep.csv@methods=naive"], "calibration": ["sweep.csv@tokens_per_gpu=64"]},
        {"in": {"old": 7}, "measured": ["extra.csv", "sweep.csv"]}]})
    write_spec(root, "r2", {"sets": [{"in": {"headline": 1}, "measured": ["sweep.csv"], "calibration": ["sweep.csv"]}]})
    write_spec(root, "r3", {"sets": [{"in": {"old": 3, "older": 1}, "measured": ["sweep.csv"],
                                      "calibration": ["sweep.csv@tokens_per_gpu=64,1024"]}]})
    write_spec(root, "r4", {"alltoall": "alltoall.csv", "gemm": "gemm.csv", "kernel_stream": "stream.csv",
                            "dense_peak": "peak.csv", "shared_ab": [["with.csv", "without.csv"]],
                            "prediction_check": ["sweep_prefill_D4.csv"]})
    return root


def test_sets_span_runs_in_place_order_and_roles_are_found(tree):
    inputs = discover(tree)
    run = f"{tree}/gpu-a"
    assert [s.name for s in inputs.sets] == ["headline", "older", "old"]       # headline, then by first place
    headline, older, old = inputs.sets
    assert headline.measured == (f"{run}/r2/sweep.csv", f"{run}/r1/sweep.csv@methods=naive")
    assert headline.calibration == (f"{run}/r2/sweep.csv", f"{run}/r1/sweep.csv@tokens_per_gpu=64")
    assert headline.specs == (f"{run}/r2/{SPEC_NAME}", f"{run}/r1/{SPEC_NAME}")
    assert old.measured == (f"{run}/r3/sweep.csv", f"{run}/r1/extra.csv", f"{run}/r1/sweep.csv")
    assert older.measured == (f"{run}/r3/sweep.csv",)
    assert (inputs.alltoall, inputs.gemm, inputs.kernel_stream, inputs.dense_peak) == (
        f"{run}/r4/alltoall.csv", f"{run}/r4/gemm.csv", f"{run}/r4/stream.csv", f"{run}/r4/peak.csv")
    assert inputs.shared_ab == ((f"{run}/r4/with.csv", f"{run}/r4/without.csv"),)
    assert inputs.prediction_check == (f"{run}/r4/sweep_prefill_D4.csv",)
    assert f"{run}/r5/sweep.csv" not in inputs.files()                         # r5 is not marked simulator
    assert {f"{run}/r{i}/{SPEC_NAME}" for i in range(1, 5)} <= set(inputs.files())

    settings = simulator_settings(SIMULATE, tree)
    assert settings.dense_tflops == 640.5 and settings.measured == headline.measured
    assert [s.name for s in settings.history] == ["older", "old"] and settings.alltoall_csv == inputs.alltoall
    assert simulator_settings(dataclasses.replace(SIMULATE, dense_tflops=700), tree).dense_tflops == 700


def test_read_sets_gives_each_set_its_roles_and_refuses_a_set_that_calibrates_nothing(tree):
    settings = simulator_settings(SIMULATE, tree)
    frames = read_sets(settings)
    assert list(frames) == ["headline", "older", "old"]
    headline = frames["headline"]
    assert set(headline.loc[headline["source"].str.contains("/r2/"), "role"]) == {"calibration"}
    from_r1 = headline[headline["source"].str.contains("/r1/")]
    assert set(from_r1["method"]) == {"naive"}
    assert set(from_r1.loc[from_r1["role"] == "calibration", "tokens_per_gpu"]) == {64}
    assert "host_scale" in headline
    write_spec(tree, "r3", {"sets": [{"in": {"old": 3, "older": 1}, "measured": ["sweep.csv"],
                                      "calibration": ["sweep.csv@tokens_per_gpu=7"]}]})
    with pytest.raises(SimulateError, match=r"sets\.older: its calibration entries select no row"):
        read_sets(simulator_settings(SIMULATE, tree))


@pytest.mark.parametrize("spec, field", [
    ("sets: [\n", "not valid YAML"),
    ({"set": []}, r"set: unknown key \(allowed: sets, alltoall"),
    ({"sets": {"headline": 1}}, "sets: expected a list"),
    ({"sets": [{"in": {"headline": 1}}]}, r"sets\[0\]: expected a mapping with in, measured"),
    ({"sets": [{"in": {"headline": 1}, "measured": ["sweep.csv"], "order": 1}]}, r"sets\[0\]\.order: unknown key"),
    ({"sets": [{"in": ["headline"], "measured": ["sweep.csv"]}]}, r"sets\[0\]\.in: expected a mapping"),
    ({"sets": [{"in": {"headline": "1"}, "measured": ["sweep.csv"]}]}, r"sets\[0\]\.in\.headline: expected an integer"),
    ({"sets": [{"in": {"a b": 1}, "measured": ["sweep.csv"]}]}, r"sets\[0\]\.in: 'a b' is not a set name"),
    ({"sets": [{"in": {"headline": 1}, "measured": ["nowhere.csv"]}]}, r"sets\[0\]\.measured\[0\]: .*nowhere.csv does not exist"),
    ({"sets": [{"in": {"headline": 1}, "measured": ["../r1/sweep.csv"]}]}, r"sets\[0\]\.measured\[0\]: .* must be a file of the run"),
    ({"sets": [{"in": {"headline": 1}, "measured": ["sweep.csv@batch=2"]}]}, r"sets\[0\]\.measured\[0\]: .*expected FILE"),
    ({"sets": [{"in": {"headline": 1}, "measured": ["sweep.csv@methods=occult-bogus"]}]}, r"sets\[0\]\.measured\[0\]: .*bogus"),
    ({"sets": [{"in": {"headline": 1}, "measured": ["sweep.csv"], "calibration": ["other.csv"]}]},
     r"sets\[0\]\.calibration\[0\]: .*other.csv"),
    ({"sets": [{"in": {"headline": 1}, "measured": ["sweep.csv"], "calibration": ["peak.csv"]}]},
     r"sets\[0\]\.calibration\[0\]: .*peak.csv is not one of the block's measured files"),
    ({"sets": [{"in": {"headline": 1}, "measured": ["sweep.csv"]}, {"in": {"headline": 5}, "measured": ["sweep.csv"]}]},
     r"sets\[1\]\.in\.headline: another block of the file is in this set"),
    ({"shared_ab": [["sweep.csv"]]}, r"shared_ab\[0\]: expected \[file with shared experts, file without\]"),
    ({"shared_ab": [["sweep.csv@methods=naive", "sweep.csv"]]}, r"shared_ab\[0\]: .*row selectors"),
    ({"alltoall": ["sweep.csv"]}, r"alltoall: expected a file of the run"),
    ({"prediction_check": ["sweep.csv@tokens_per_gpu=64"]}, r"prediction_check\[0\]: .*row selectors"),
])
def test_a_bad_spec_names_its_file_and_field(tree, spec, field):
    (tree / "gpu-a" / "r3" / "peak.csv").write_text("tflops\n1\n")
    path = write_spec(tree, "r3", spec)
    with pytest.raises(SimulateError, match=rf"{path}: {field}"):
        discover(tree)


def test_sets_and_runs_that_do_not_fit_together_are_named(tree):
    write_spec(tree, "r3", {"sets": [{"in": {"old": 7}, "measured": ["sweep.csv"], "calibration": ["sweep.csv"]}]})
    with pytest.raises(SimulateError, match=rf"{tree}/gpu-a/r1/{SPEC_NAME} and {tree}/gpu-a/r3/{SPEC_NAME}: both put "
                                            "entries of set 'old' at place 7"):
        discover(tree)
    write_spec(tree, "r3", {"sets": [{"in": {"old": 3}, "measured": ["sweep.csv"]}]})
    with pytest.raises(SimulateError, match=rf"r3/{SPEC_NAME}, .*r1/{SPEC_NAME}: set 'old' has no calibration entry"):
        discover(tree)
    write_spec(tree, "r3", {"sets": [{"in": {"old": 3}, "measured": ["sweep.csv"], "calibration": ["sweep.csv"]}],
                            "alltoall": "sweep.csv"})
    with pytest.raises(SimulateError, match=rf"r3/{SPEC_NAME} and .*r4/{SPEC_NAME}: both name the alltoall file"):
        discover(tree)
    write_spec(tree, "r3", {"sets": [{"in": {"old": 3}, "measured": ["sweep.csv"], "calibration": ["sweep.csv"]}]})
    write_spec(tree, "r5", {"sets": [{"in": {"old": 4}, "measured": ["sweep.csv"], "calibration": ["sweep.csv"]}]})
    with pytest.raises(SimulateError, match=rf"r5/{SPEC_NAME}: the run's row in gpu-a/index.csv does not list simulator"):
        discover(tree)
    (tree / "gpu-a" / "r5" / SPEC_NAME).unlink()
    (tree / "gpu-a" / "r4" / SPEC_NAME).unlink()
    with pytest.raises(SimulateError, match=r"gpu-a/r4: gpu-a/index.csv lists simulator in its used_by, but it has no"):
        discover(tree)
    write_spec(tree, "r4", {"gemm": "gemm.csv"})
    with pytest.raises(SimulateError, match="simulate.dense_tflops: not set, and no simulator.yaml names a dense_peak"):
        simulator_settings(SIMULATE, tree)
    for run in ("r1", "r2"):
        write_spec(tree, run, {"gemm": "extra.csv"} if run == "r1" else {"alltoall": "sweep.csv"})
    write_spec(tree, "r4", {"dense_peak": "peak.csv"})
    with pytest.raises(SimulateError, match="no simulator.yaml puts entries in the headline set"):
        simulator_settings(SIMULATE, tree)


def test_the_committed_specs_parse_and_name_existing_files():
    """Every committed simulator.yaml belongs to a run the index marks `simulator` (and every such run
    has one), parses, and names files of its run; the headline set and the roles the default model
    needs are there."""
    results = REPO / "results"
    inputs = discover(results)
    specs = sorted(str(p) for p in results.glob(f"*/*/{SPEC_NAME}"))
    assert specs and sorted(inputs.specs) == specs
    for name in inputs.files():
        assert Path(name).is_file(), name
    assert inputs.sets[0].name == "headline" and all(s.calibration for s in inputs.sets)
    assert None not in (inputs.alltoall, inputs.gemm, inputs.kernel_stream, inputs.dense_peak) and inputs.shared_ab
    default = simulator_settings(SIMULATE)
    assert [f"{REPO}/{m}" for m in default.measured] == list(inputs.sets[0].measured)    # named from the repository
    frame = pd.read_csv(inputs.dense_peak)
    assert default.dense_tflops == float(frame["tflops"].iloc[0])
