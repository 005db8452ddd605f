"""The sweep run on CPU (gloo ranks, tiny shapes, fp32): CLI smoke runs at D=1, 2, 4 and 8, status
rows for missing or broken methods, the training kind's gradient check, memory freed between methods,
JSON progress, host profiles and stream-timed rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import occult.harness.sweep.run as run
from occult.harness.baselines import Method, make_method
from occult.shapes import SHAPES
from occult.harness.ranks import run_ranks
from occult.harness.sweep import inputs, points, settings
from occult.provenance import REPO_ROOT


CLI_METHODS = ["occult", "occult-nd1", "naive", "fsdp", "megablocks", "tutel", "deepspeed"]


def run_cli(tmp_path: Path, world: int, *extra: str) -> pd.DataFrame:
    out = tmp_path / f"sweep_D{world}.csv"
    cmd = [sys.executable, "-m", "occult.harness.sweep", "--device", "cpu", "--dtype", "float32", "--D", str(world),
           "--kind", "prefill", "--shapes", "tiny", "tiny-shared", "--sizes", "8", "24",
           "--repeats", "3", "--warmup", "1", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "median ms per step" in proc.stdout
    return pd.read_csv(out)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_cli_smoke_writes_every_row_with_the_expected_columns(tmp_path, world):
    methods = CLI_METHODS + (["hf"] if world == 2 else [])
    frame = run_cli(tmp_path, world, "--methods", *methods)
    assert list(frame.columns) == list(settings.COLUMNS)
    assert len(frame) == 2 * len(methods) * 2                      # shapes x methods x sizes
    assert set(frame["D"]) == {world} and set(frame["tokens_per_gpu"]) == {8, 24}
    assert frame["commit"].notna().all() and frame["command"].str.contains("occult.harness.sweep").all()
    assert frame["version_torch"].str.startswith(torch.__version__.split("+")[0]).all()

    ran = frame[frame["method"].isin(["occult", "occult-nd1", "naive", "fsdp"])]
    assert (ran["status"] == "ok").all(), ran[["method", "status"]]
    assert (ran["median_ms"] > 0).all() and (ran["p10_ms"] <= ran["median_ms"]).all()
    assert (ran["median_ms"] <= ran["p90_ms"]).all()
    assert (ran["host_ms"] > 0).all() and ran["host_ms"].notna().all()      # on CPU host time is the time
    assert (ran["host_probe_us"] > 0).all() and (ran["host_launch_us"] > 0).all()
    assert (ran["max_rel_err"] < settings.REL_TOLERANCE["float32"]).all()
    occult = frame[frame["method"] == "occult"]
    assert occult["mean_devices_per_token"].between(1, min(world, 3)).all()
    assert (frame.loc[frame["method"] == "occult-nd1", "mean_devices_per_token"] == 1).all()
    if world == 1:
        assert (ran["bytes_sent"] == 0).all()
    else:
        assert (ran["bytes_sent"] > 0).all()
        assert frame.loc[frame["method"] == "hf", "status"].str.startswith("unsupported:").all()
    for name in ("megablocks", "deepspeed"):
        rows = frame[frame["method"] == name]
        if make_method(name).available()[0]:          # installed here (deepspeed: the test extras): it runs
            assert (rows["status"] == "ok").all() and (rows["median_ms"] > 0).all(), rows[["status"]]
            assert (rows["max_rel_err"] < settings.REL_TOLERANCE["float32"]).all()
            assert ((rows["bytes_sent"] > 0) == (world > 1)).all()
        else:
            assert rows["status"].str.startswith("unavailable: ").all() and rows["status"].str.len().gt(15).all()
            assert rows["median_ms"].isna().all()

    # The library settings each baseline ran with; none for methods that have none to choose.
    configs = frame.groupby("method")["baseline_config"].agg(lambda c: set(c.fillna("")))
    assert configs["megablocks"] == {"grouped_gemm=cublas"} and configs["deepspeed"] == {"drop_tokens=False"}
    assert configs["tutel"] == {"capacity_factor=0"}
    assert configs["occult"] == configs["naive"] == {""}
    assert set(frame["routing"]) == {"synthetic"}
    # Every point runs each method once, at the position its recorded seed gives.
    for (shape, tokens), point in frame.groupby(["shape", "tokens_per_gpu"]):
        assert point["order_seed"].nunique() == 1
        ordered = point.sort_values("order_position")
        assert ordered["order_position"].tolist() == list(range(len(methods)))
        assert ordered["method"].tolist() == points.method_order(methods, int(point["order_seed"].iloc[0]))
    assert frame.groupby(["shape", "tokens_per_gpu"])["order_seed"].first().nunique() == 4

    meta = json.loads(Path(str(tmp_path / f"sweep_D{world}.csv") + ".meta.json").read_text())
    assert meta["commit"] and meta["settings"]["world"] == world and meta["stage"] == "sweep"


def test_cli_rejects_bad_arguments_naming_them(tmp_path):
    with pytest.raises(settings.SweepError, match="shapes: shape: 'nope'"):
        run.main(["--device", "cpu", "--shapes", "nope", "--out", str(tmp_path / "x.csv")])
    with pytest.raises(settings.SweepError, match="methods: method 'bogus'"):
        run.main(["--device", "cpu", "--shapes", "tiny", "--methods", "bogus", "--out", str(tmp_path / "x.csv")])
    with pytest.raises(settings.SweepError, match="repeats"):
        run.main(["--device", "cpu", "--shapes", "tiny", "--repeats", "0", "--out", str(tmp_path / "x.csv")])


class BrokenSetup(Method):
    name = "broken"

    def setup(self, shape, group, dtype, device, weights):
        raise RuntimeError("this method cannot be set up")


class WrongOutput(Method):
    name = "wrong"

    def setup(self, shape, group, dtype, device, weights):
        self.calls = 0

    def forward(self, x_TD, ids_TK, weights_TK):
        self.calls += 1
        return x_TD * 2.0


def test_a_throwing_or_wrong_method_gets_a_status_row_and_the_sweep_goes_on(tmp_path, monkeypatch):
    real_build = points.build_method

    def build(name, placement, backend):
        if name == "megablocks":
            return BrokenSetup()
        if name == "tutel":
            return WrongOutput()
        return real_build(name, placement, backend)

    monkeypatch.setattr(points, "build_method", build)   # inherited by the forked ranks
    out = tmp_path / "broken.csv"

    def body(rank, world):
        rows = run.run_sweep("decode", ["tiny"], ["megablocks", "tutel", "naive"], world, [2, 5], out,
                               repeats=2, warmup=0, device="cpu", dtype="float32")
        return [(r["method"], r["status"]) for r in rows]

    per_rank = run_ranks(body, 2, timeout_s=60)
    assert per_rank[0] == per_rank[1]
    frame = pd.read_csv(out)
    status = dict(zip(frame["method"] + "@" + frame["batch"].astype(str), frame["status"]))
    assert status["megablocks@2"].startswith("error: setup: rank 0: RuntimeError: this method cannot be set up")
    assert status["tutel@5"].startswith("failed: max_rel_err")
    assert status["naive@2"] == status["naive@5"] == "ok"
    assert frame.loc[frame["method"] == "tutel", "median_ms"].isna().all()


def test_train_kind_checks_gradients_and_times_forward_backward(tmp_path):
    out = tmp_path / "train.csv"

    def body(rank, world):
        return run.run_sweep("train", ["tiny-shared"], ["occult", "naive", "fsdp"], world, [1, 2], out,
                               repeats=2, warmup=1, device="cpu", dtype="float32", seq_len=8)

    run_ranks(body, 2, timeout_s=60)
    frame = pd.read_csv(out)
    assert (frame["status"] == "ok").all(), frame[["method", "status"]]
    assert sorted(set(frame["tokens_per_gpu"])) == [8, 16] and sorted(set(frame["batch"])) == [1, 2]
    assert (frame["seq_len"] == 8).all() and (frame["shared_ffn"] == SHAPES["tiny-shared"].shared_ffn).all()
    assert (frame["max_rel_err"] < 1e-4).all()


def test_each_method_is_measured_after_the_previous_ones_are_freed(tmp_path, monkeypatch):
    """`peak_mem_gib` counts what is resident: the weights of methods measured before (at this size
    or the one before) must be gone when the next one is timed."""
    import gc
    import weakref

    real_measure = points.measure

    def measure(shape_run, name, method, size):
        gc.collect()
        still_alive = sorted({other for other, ref in seen if ref() is not None})
        seen.extend((name, weakref.ref(t)) for t in method.expert_parameters())
        leaks.append((name, still_alive))
        return real_measure(shape_run, name, method, size)

    seen: list = []
    leaks: list = []
    monkeypatch.setattr(points, "measure", measure)
    methods = ["occult", "occult-nd1", "occult-balanced", "naive", "fsdp"]

    def body(rank, world):
        run.run_sweep("prefill", ["tiny"], methods, world, [8, 12], tmp_path / "mem.csv", repeats=1, warmup=0,
                      device="cpu", dtype="float32")
        return leaks

    measured = run_ranks(body, 1, timeout_s=60)[0]
    assert sorted(name for name, _ in measured) == sorted(methods * 2)
    assert all(not alive for _, alive in measured), measured


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_sweep_runs_at_the_4_and_8_gpu_degrees_on_cpu_ranks(tmp_path, world):
    """The harness and every Occult variant run at D = 4 and 8 on gloo ranks."""
    out = tmp_path / f"sweep_D{world}.csv"
    methods = ["occult", "occult-static", "occult-pe", "occult-nd2", "occult-nd1", "occult-balanced",
               "occult-latency", "naive"]
    cmd = [sys.executable, "-m", "occult.harness.sweep", "--device", "cpu", "--dtype", "float32", "--D", str(world),
           "--kind", "prefill", "--shapes", "tiny", "--sizes", "6", "--repeats", "2", "--warmup", "1",
           "--out", str(out), "--methods", *methods]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frame = pd.read_csv(out).set_index("method")
    assert (frame["D"] == world).all()
    # tiny: E=8, k=2 -> N_d = 1 leaves N_d*E/D = 8/D < 2 experts per token at D >= 8 (or 2 at D=4).
    for name in methods:
        nd = inputs.routing_key(name)
        if nd is not None and nd * 8 // world < 2:
            assert frame.loc[name, "status"].startswith("unsupported: N_d*E/D"), frame.loc[name, "status"]
        else:
            assert frame.loc[name, "status"] == "ok", (name, frame.loc[name, "status"])
            assert frame.loc[name, "max_rel_err"] < settings.REL_TOLERANCE["float32"]
            assert frame.loc[name, "mean_devices_per_token"] <= min(world, 2) if name.startswith("occult") else True


def test_sweep_writes_json_progress_and_a_failed_record(tmp_path):
    log = tmp_path / "sweep.jsonl"
    run_cli(tmp_path, 1, "--methods", "occult", "naive", "--log-json", str(log))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    points = [r for r in records if r.get("event") == "progress" and r.get("method")]
    assert {r["method"] for r in points} == {"occult", "naive"} and all("median_ms" in r for r in points)
    assert records[-1]["event"] == "done"
    bad = tmp_path / "bad.jsonl"
    proc = subprocess.run([sys.executable, "-m", "occult.harness.sweep", "--device", "cpu", "--D", "1", "--methods",
                           "occult-fast", "--log-json", str(bad)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "occult-fast" in proc.stderr
    failed = [json.loads(line) for line in bad.read_text().splitlines()][-1]
    assert failed["event"] == "failed" and "occult-fast" in failed["message"]


def test_host_profile_writes_one_python_profile_per_row(tmp_path):
    out, prof = tmp_path / "p.csv", tmp_path / "prof"
    run.main(["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--methods", "occult", "naive",
                "--sizes", "8", "--repeats", "2", "--warmup", "0", "--out", str(out), "--host-profile", str(prof)])
    files = sorted(p.name for p in prof.iterdir())
    assert files == ["host_prefill_tiny_naive_8.txt", "host_prefill_tiny_occult_8.txt"]
    text = (prof / "host_prefill_tiny_occult_8.txt").read_text()
    assert text.startswith("# 2 steps, rank 0") and "ep_moe" in text and "tottime" in text
    assert "ep_moe" not in (prof / "host_prefill_tiny_naive_8.txt").read_text()


def test_stream_timing_rows_say_so_and_the_simulator_skips_them(tmp_path):
    from occult.sim.columns import SimulateError
    from occult.sim.measured import read_measured

    out = tmp_path / "stream.csv"

    def body(rank, world):
        return run.run_sweep("prefill", ["tiny"], ["occult", "naive"], world, [8], out,
                               repeats=2, warmup=1, device="cpu", dtype="float32", timing="stream")

    run_ranks(body, 2, timeout_s=60)
    frame = pd.read_csv(out)
    assert (frame["status"] == "ok").all() and (frame["timing"] == "stream").all()
    assert (frame["median_ms"] > 0).all()
    with pytest.raises(SimulateError, match="selects no ok, step-timed"):
        read_measured([str(out)])
    with pytest.raises(settings.SweepError, match="timing: 'burst'"):
        run.run_sweep("prefill", ["tiny"], ["naive"], 1, [8], tmp_path / "x.csv", device="cpu", timing="burst")


def test_method_order_is_seeded_per_point_and_recorded(tmp_path):
    """The methods of a point run in the order of a seed derived from (routing, shape, size): the
    same seed gives the same order (reruns, every rank), other points get other orders, and the rows
    record seed and position so the order can be rebuilt."""
    methods = ["occult", "occult-nd1", "occult-nd2", "naive", "fsdp", "megablocks", "tutel", "deepspeed"]
    seeds = {(r, s, n): points.order_seed(0, r, s, n) for r in ("synthetic", "uniform") for s in ("olmoe", "qwen")
             for n in (1024, 2048, 4096)}
    assert len(set(seeds.values())) == len(seeds)
    orders = {key: tuple(points.method_order(methods, seed)) for key, seed in seeds.items()}
    assert len(set(orders.values())) > len(orders) // 2               # most points differ
    assert all(sorted(order) == sorted(methods) for order in orders.values())
    seed = seeds[("uniform", "qwen", 2048)]
    assert points.method_order(methods, seed) == points.method_order(list(methods), seed)
    assert points.order_seed(0, "uniform", "qwen", 2048) == seed != points.order_seed(1, "uniform", "qwen", 2048)

    out = tmp_path / "order.csv"
    names = ["occult", "occult-nd1", "naive", "fsdp"]
    run.main(["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--methods", *names, "--sizes", "4", "8",
              "16", "--repeats", "1", "--warmup", "0", "--routings", "synthetic", "uniform", "--out", str(out)])
    frame = pd.read_csv(out)
    ran = {}
    for (routing, size), point in frame.groupby(["routing", "tokens_per_gpu"]):
        seed = int(point["order_seed"].iloc[0])
        assert seed == points.order_seed(0, routing, "tiny", size)
        ran[(routing, size)] = point.sort_values("order_position")["method"].tolist()
        assert ran[(routing, size)] == points.method_order(names, seed)
    assert len(set(map(tuple, ran.values()))) > 1


def test_every_routing_runs_in_one_invocation_and_a_trace_that_does_not_fit_says_so(tmp_path):
    """--routings synthetic uniform trace: every method at every routing, a `routing` column on every
    row; the trace (top-1 of 4 experts) widens to tiny (E=8, k=2) but not to tiny-shared (k=3),
    whose trace rows are `unsupported: routing trace: ...` rather than missing."""
    from tests.harness.sweep.test_inputs import write_trace

    write_trace(tmp_path / "routing_heldout.npz", 4, 1, 40, seed=1)
    out = tmp_path / "routings.csv"
    names = ["occult", "naive", "deepspeed"]
    run.main(["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "tiny-shared", "--methods", *names,
              "--sizes", "8", "--repeats", "1", "--warmup", "0", "--routings", "synthetic", "uniform", "trace",
              "--trace", str(tmp_path / "routing_heldout.npz"), "--out", str(out)])
    frame = pd.read_csv(out)
    assert len(frame) == 3 * 2 * len(names)
    assert frame.groupby(["routing", "shape"]).size().eq(len(names)).all()
    misfit = frame[(frame["routing"] == "trace") & (frame["shape"] == "tiny-shared")]
    assert misfit["status"].str.startswith("unsupported: routing trace: ").all()
    assert misfit["status"].str.contains("tiny-shared").all()
    ran = frame.drop(misfit.index)
    assert (ran["status"] == "ok").all(), ran[["routing", "shape", "method", "status"]]
    assert (ran["max_rel_err"] < settings.REL_TOLERANCE["float32"]).all()
