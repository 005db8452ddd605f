"""The sweep harness on CPU (gloo ranks, tiny shapes, fp32): CLI smoke runs at D=1 and D=2,
status rows for missing or broken methods, the training kind's gradient check, and inputs."""

from __future__ import annotations

import json
import time
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import occult.harness.sweep as sweep
from occult.harness.baselines import SHAPES, Method, make_method
from occult.harness.ranks import run_ranks
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


@pytest.mark.parametrize("world", [1, 2])
def test_cli_smoke_writes_every_row_with_the_expected_columns(tmp_path, world):
    methods = CLI_METHODS + (["hf"] if world == 2 else [])
    frame = run_cli(tmp_path, world, "--methods", *methods)
    assert list(frame.columns) == list(sweep.COLUMNS)
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
    assert (ran["max_rel_err"] < sweep.REL_TOLERANCE["float32"]).all()
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
            assert (rows["max_rel_err"] < sweep.REL_TOLERANCE["float32"]).all()
            assert ((rows["bytes_sent"] > 0) == (world > 1)).all()
        else:
            assert rows["status"].str.startswith("unavailable: ").all() and rows["status"].str.len().gt(15).all()
            assert rows["median_ms"].isna().all()

    meta = json.loads(Path(str(tmp_path / f"sweep_D{world}.csv") + ".meta.json").read_text())
    assert meta["commit"] and meta["settings"]["world"] == world and meta["stage"] == "sweep"


def test_cli_rejects_bad_arguments_naming_them(tmp_path):
    with pytest.raises(sweep.SweepError, match="shapes: shape: 'nope'"):
        sweep.main(["--device", "cpu", "--shapes", "nope", "--out", str(tmp_path / "x.csv")])
    with pytest.raises(sweep.SweepError, match="methods: 'bogus'"):
        sweep.main(["--device", "cpu", "--shapes", "tiny", "--methods", "bogus", "--out", str(tmp_path / "x.csv")])
    with pytest.raises(sweep.SweepError, match="repeats"):
        sweep.main(["--device", "cpu", "--shapes", "tiny", "--repeats", "0", "--out", str(tmp_path / "x.csv")])


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
    real_build = sweep.build_method

    def build(name, placement, backend):
        if name == "megablocks":
            return BrokenSetup()
        if name == "tutel":
            return WrongOutput()
        return real_build(name, placement, backend)

    monkeypatch.setattr(sweep, "build_method", build)   # inherited by the forked ranks
    out = tmp_path / "broken.csv"

    def body(rank, world):
        rows = sweep.run_sweep("decode", ["tiny"], ["megablocks", "tutel", "naive"], world, [2, 5], out,
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
        return sweep.run_sweep("train", ["tiny-shared"], ["occult", "naive", "fsdp"], world, [1, 2], out,
                               repeats=2, warmup=1, device="cpu", dtype="float32", seq_len=8)

    run_ranks(body, 2, timeout_s=60)
    frame = pd.read_csv(out)
    assert (frame["status"] == "ok").all(), frame[["method", "status"]]
    assert sorted(set(frame["tokens_per_gpu"])) == [8, 16] and sorted(set(frame["batch"])) == [1, 2]
    assert (frame["seq_len"] == 8).all() and (frame["shared_ffn"] == SHAPES["tiny-shared"].shared_ffn).all()
    assert (frame["max_rel_err"] < 1e-4).all()


def test_each_method_is_measured_after_the_previous_ones_are_freed(tmp_path, monkeypatch):
    """`peak_mem_gib` counts what is resident: the weights of methods measured before must be gone
    (up to sweeps_v39 every Occult variant's weights stayed alive for the rest of the shape)."""
    import gc
    import weakref

    real_measure = sweep._measure

    def measure(settings, shape, name, method, *args, **kwargs):
        gc.collect()
        still_alive = sorted({other for other, ref in seen if other != name and ref() is not None})
        seen.extend((name, weakref.ref(t)) for t in method.expert_parameters())
        leaks.append((name, still_alive))
        return real_measure(settings, shape, name, method, *args, **kwargs)

    seen: list = []
    leaks: list = []
    monkeypatch.setattr(sweep, "_measure", measure)

    def body(rank, world):
        sweep.run_sweep("prefill", ["tiny"], ["occult", "occult-nd1", "occult-balanced", "naive", "fsdp"], world,
                        [8], tmp_path / "mem.csv", repeats=1, warmup=0, device="cpu", dtype="float32")
        return leaks

    measured = run_ranks(body, 1, timeout_s=60)[0]
    assert [name for name, _ in measured] == ["occult", "occult-nd1", "occult-balanced", "naive", "fsdp"]
    assert all(not alive for _, alive in measured), measured


def test_inputs_are_the_same_for_every_method_and_fresh_per_set():
    shape = SHAPES["tiny"]
    router = sweep.SyntheticRouter.make(shape, seed=0)
    placement = torch.arange(shape.num_experts) % 2

    def make(seed):
        return sweep.make_inputs(shape, router, 32, seed, torch.device("cpu"), torch.float32, [None, 1],
                                 placement, with_grad_output=False)

    a, b, c = make(11), make(11), make(12)
    assert torch.equal(a.x_TD, b.x_TD) and torch.equal(a.routes[None][0], b.routes[None][0])
    assert not torch.equal(a.x_TD, c.x_TD)
    ids, weights = a.routes[None]
    assert ids.shape == (32, shape.top_k) and torch.all(weights[:, :-1] >= weights[:, 1:])
    pruned_ids, _ = a.routes[1]
    assert torch.all(placement[pruned_ids] == placement[pruned_ids[:, :1]])   # one device per token
    assert sweep.derive_seed("x", 1) == sweep.derive_seed("x", 1) != sweep.derive_seed("x", 2)


def test_quantile_interpolates():
    assert sweep.quantile([4.0, 1.0, 3.0, 2.0, 5.0], 0.5) == 3.0
    assert sweep.quantile([1.0, 2.0], 0.1) == pytest.approx(1.1)
    assert sweep.quantile([7.0], 0.9) == 7.0


def write_trace(path: Path, experts: int, top_k: int, tokens: int, seed: int) -> None:
    """A routing npz in occult.routing.profiling's layout: ids [L, N, k] of distinct experts per token."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((2, tokens, experts)), axis=-1)[..., :top_k].astype("int16")
    np.savez(path, ids=ids, layers=np.arange(2))


def test_occult_options_and_trace_routing_run_on_two_ranks(tmp_path):
    write_trace(tmp_path / "routing_heldout.npz", 4, 1, 40, seed=1)
    write_trace(tmp_path / "routing_calibration.npz", 4, 1, 40, seed=2)
    out = tmp_path / "trace.csv"
    methods = ["occult", "occult-pe", "occult-static", "occult-trivial", "occult-compute", "occult-nd1"]
    cmd = [sys.executable, "-m", "occult.harness.sweep", "--device", "cpu", "--dtype", "float32", "--D", "2",
           "--kind", "prefill", "--shapes", "tiny", "--sizes", "12", "--repeats", "2", "--warmup", "3",
           "--routing", "trace", "--trace", str(tmp_path / "routing_heldout.npz"), "--out", str(out),
           "--methods", *methods]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frame = pd.read_csv(out).set_index("method")
    assert (frame["status"] == "ok").all(), frame["status"]
    assert set(frame["routing"]) == {"trace"}
    checked = frame.drop(index="occult-compute")
    assert (checked["max_rel_err"] < sweep.REL_TOLERANCE["float32"]).all()
    assert pd.isna(frame.loc["occult-compute", "max_rel_err"])          # no output to check
    # The static plan sends T rows to the other device whatever the routing; exact dedup sends
    # at most that many, per_expert at least as many rows as dedup.
    assert frame.loc["occult-static", "bytes_sent"] >= frame.loc["occult", "bytes_sent"]
    assert frame.loc["occult-pe", "bytes_sent"] >= frame.loc["occult", "bytes_sent"]
    assert (frame["pairs_received_max"] > 0).all()
    assert frame.loc["occult-nd1", "mean_devices_per_token"] == 1


def test_trace_router_keeps_the_trace_and_rejects_shapes_it_cannot_widen(tmp_path):
    write_trace(tmp_path / "routing_heldout.npz", 4, 1, 30, seed=3)
    router = sweep.TraceRouter.load(tmp_path / "routing_heldout.npz", SHAPES["tiny"], seed=0)  # E=8, k=2
    assert router.ids_NK.shape == (60, 2) and int(router.ids_NK.max()) < 8
    # Both sub-experts of a token come from the trace's one expert of that token.
    assert torch.equal(router.ids_NK[:, 0] // 2, router.ids_NK[:, 1] // 2)
    assert (router.ids_NK[:, 0] != router.ids_NK[:, 1]).all()
    gen = torch.Generator().manual_seed(0)
    logits = router.logits(torch.zeros(5, 32), gen)
    top = logits.topk(2, dim=1).indices.sort(dim=1).values
    window = [row for row in router.ids_NK.sort(dim=1).values.tolist()]
    assert all(row in window for row in top.tolist())
    write_trace(tmp_path / "wide.npz", 16, 4, 10, seed=4)
    with pytest.raises(sweep.SweepError, match="wide.npz"):
        sweep.TraceRouter.load(tmp_path / "wide.npz", SHAPES["tiny"], seed=0)


def test_bad_occult_method_names_are_named():
    with pytest.raises(sweep.SweepError, match="occult-fast"):
        sweep.SweepSettings(kind="prefill", shapes=("tiny",), methods=("occult-fast",), world=1, sizes=(4,),
                            out_csv="x.csv").validate()
    with pytest.raises(sweep.SweepError, match="trivial"):
        sweep.SweepSettings(kind="prefill", shapes=("tiny",), methods=("occult-nd1-trivial",), world=1,
                            sizes=(4,), out_csv="x.csv").validate()
    with pytest.raises(sweep.SweepError, match="pe"):
        sweep.OccultEP(None, "torch", ("pe", "static"))


@pytest.mark.parametrize("world", [4, 8])
def test_sweep_runs_at_the_4_and_8_gpu_degrees_on_cpu_ranks(tmp_path, world):
    """Issue 8's run needs D = 4 and 8: the harness and every Occult variant work at those D on gloo."""
    out = tmp_path / f"sweep_D{world}.csv"
    methods = ["occult", "occult-static", "occult-pe", "occult-nd2", "occult-nd1", "occult-balanced", "naive"]
    cmd = [sys.executable, "-m", "occult.harness.sweep", "--device", "cpu", "--dtype", "float32", "--D", str(world),
           "--kind", "prefill", "--shapes", "tiny", "--sizes", "6", "--repeats", "2", "--warmup", "1",
           "--out", str(out), "--methods", *methods]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frame = pd.read_csv(out).set_index("method")
    assert (frame["D"] == world).all()
    # tiny: E=8, k=2 -> N_d = 1 leaves N_d*E/D = 8/D < 2 experts per token at D >= 8 (or 2 at D=4).
    for name in methods:
        nd = sweep.routing_key(name)
        if nd is not None and nd * 8 // world < 2:
            assert frame.loc[name, "status"].startswith("unsupported: N_d*E/D"), frame.loc[name, "status"]
        else:
            assert frame.loc[name, "status"] == "ok", (name, frame.loc[name, "status"])
            assert frame.loc[name, "max_rel_err"] < sweep.REL_TOLERANCE["float32"]
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


@pytest.mark.parametrize("shape_name, world", [("olmoe", 2), ("qwen", 4), ("deepseek", 4)])
def test_balanced_placement_bounds_the_busiest_device_where_greedy_does_not(shape_name, world):
    """The sweep's skewed router makes greedy_occult put 1.7-2.8x the mean pairs on one device
    (sweeps_v5: 221k of 262k pairs on one GPU of two); -balanced keeps it <= 1.1x on fresh tokens,
    with every device holding E/D experts and fewer devices per token than the contiguous layout."""
    from occult.ep.plan import contiguous_placement

    shape = sweep.get_shape(shape_name)
    router = sweep.SyntheticRouter.make(shape, 0)
    greedy = sweep.occult_placement(shape, router, world, 0)
    balanced = sweep.occult_placement(shape, router, world, 0, balanced=True)
    contiguous = contiguous_placement(shape.num_experts, world)
    assert torch.bincount(balanced, minlength=world).tolist() == [shape.num_experts // world] * world
    inputs = sweep.make_inputs(shape, router, 4096, 123, torch.device("cpu"), torch.float32, [None], None, False)
    ids = inputs.routes[None][0]

    def imbalance_and_spread(placement):
        device_TK = placement[ids]
        load = torch.bincount(device_TK.flatten(), minlength=world).float()
        spread = torch.zeros(len(ids), world).scatter_(1, device_TK, 1.0).sum(1).mean()
        return (load.max() / load.mean()).item(), spread.item()

    greedy_load, greedy_spread = imbalance_and_spread(greedy)
    balanced_load, balanced_spread = imbalance_and_spread(balanced)
    _, contiguous_spread = imbalance_and_spread(contiguous)
    assert greedy_load > 1.5 and balanced_load <= 1 + sweep.BALANCE_EPS + 0.05
    assert greedy_spread <= balanced_spread < contiguous_spread


def test_balanced_combines_with_exact_routing_only():
    for name, why in [("occult-nd1-balanced", "exact routing only"), ("occult-trivial-balanced", "two different")]:
        with pytest.raises(sweep.SweepError, match=why):
            sweep.SweepSettings(kind="prefill", shapes=("tiny",), methods=(name,), world=2, sizes=(8,),
                                out_csv="x.csv").validate()


def test_host_profile_writes_one_python_profile_per_row(tmp_path):
    out, prof = tmp_path / "p.csv", tmp_path / "prof"
    sweep.main(["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--methods", "occult", "naive",
                "--sizes", "8", "--repeats", "2", "--warmup", "0", "--out", str(out), "--host-profile", str(prof)])
    files = sorted(p.name for p in prof.iterdir())
    assert files == ["host_prefill_tiny_naive_8.txt", "host_prefill_tiny_occult_8.txt"]
    text = (prof / "host_prefill_tiny_occult_8.txt").read_text()
    assert text.startswith("# 2 steps, rank 0") and "ep_moe" in text and "tottime" in text
    assert "ep_moe" not in (prof / "host_prefill_tiny_naive_8.txt").read_text()


@pytest.mark.gpu
def test_compute_graph_replays_the_eager_compute_forward_and_backward():
    """`occult-compute-graph` (the simulator's host-free kernel rows) gives the eager
    `occult-compute` outputs and row gradients on fresh inputs, every input set its own graph."""
    from occult.harness.baselines import ExpertWeights

    device, shape = torch.device("cuda"), SHAPES["tiny"]
    weights = ExpertWeights.random(shape, seed=3, device=device, dtype=torch.bfloat16)
    placement = torch.zeros(shape.num_experts, dtype=torch.long)
    methods = {}
    for name in ("occult-compute", "occult-compute-graph"):
        methods[name] = sweep.build_method(name, placement, "triton")
        methods[name].setup(shape, None, torch.bfloat16, device, weights)
        for p in methods[name].expert_parameters():
            p.requires_grad_(True)
    gen = torch.Generator(device=device).manual_seed(4)
    for train in (False, True):
        for _ in range(2):                 # two input sets: two graphs side by side
            tokens = 64
            x = torch.randn(tokens, shape.hidden, device=device, generator=gen).bfloat16()
            ids = torch.rand(tokens, shape.num_experts, device=device, generator=gen).topk(shape.top_k, 1).indices
            gate = torch.rand(tokens, shape.top_k, device=device, generator=gen)
            got = {}
            for name, method in methods.items():
                with torch.set_grad_enabled(train):
                    for _ in range(3):      # capture, then replays
                        y = method.forward(x, ids, gate)
                        if train:
                            received = method._received[(x.data_ptr(), tuple(x.shape), ids.data_ptr())]
                            received.x_RD.grad = None
                            y.float().square().sum().backward()
                got[name] = (y.detach().clone(), received.x_RD.grad.clone() if train else None)
            eager, graphed = got["occult-compute"], got["occult-compute-graph"]
            torch.testing.assert_close(graphed[0], eager[0], atol=0, rtol=0)
            if train:
                assert graphed[1].abs().sum() > 0
                torch.testing.assert_close(graphed[1], eager[1], atol=0, rtol=0)


def test_stream_timing_issues_blocks_of_steps_back_to_back():
    """`time_stream`: the warm-up steps, then `STREAM_BLOCKS` blocks of `steps` steps in order, one
    time per block (ms per step), host time per step beside it."""
    calls: list[int] = []

    def step(i: int) -> None:
        calls.append(i)
        time.sleep(0.002)

    hosts: list[float] = []
    probes: list[tuple[float, float]] = []
    times = sweep.time_stream(step, 4, 2, torch.device("cpu"), 1, hosts, probes)
    assert calls == list(range(2 + sweep.STREAM_BLOCKS * 4))
    assert len(times) == len(hosts) == len(probes) == sweep.STREAM_BLOCKS
    assert all(p > 0 and q > 0 for p, q in probes)
    assert all(2.0 <= t < 50.0 for t in times)          # one step, not a block: 2 ms of sleep each


def test_host_probe_scales_with_its_work():
    """`host_probe_us` times a fixed pure-Python loop: more iterations take longer (the probe is not a
    constant), and its time is microseconds, not seconds."""
    small = min(sweep.host_probe_us(2000) for _ in range(5))
    large = min(sweep.host_probe_us(40000) for _ in range(5))
    assert 0 < small < large
    assert large > 5 * small
    few = min(sweep.host_launch_us(torch.device("cpu"), 5) for _ in range(5))
    many = min(sweep.host_launch_us(torch.device("cpu"), 500) for _ in range(5))
    assert 0 < few < many


def test_stream_timing_rows_say_so_and_the_simulator_skips_them(tmp_path):
    from occult.sim.simulator import SimulateError, read_measured

    out = tmp_path / "stream.csv"

    def body(rank, world):
        return sweep.run_sweep("prefill", ["tiny"], ["occult", "naive"], world, [8], out,
                               repeats=2, warmup=1, device="cpu", dtype="float32", timing="stream")

    run_ranks(body, 2, timeout_s=60)
    frame = pd.read_csv(out)
    assert (frame["status"] == "ok").all() and (frame["timing"] == "stream").all()
    assert (frame["median_ms"] > 0).all()
    with pytest.raises(SimulateError, match="selects no ok, step-timed"):
        read_measured([str(out)])
    with pytest.raises(sweep.SweepError, match="timing: 'burst'"):
        sweep.run_sweep("prefill", ["tiny"], ["naive"], 1, [8], tmp_path / "x.csv", device="cpu", timing="burst")


def test_interleaved_ab_alternates_the_order_and_writes_one_row_per_step(monkeypatch, tmp_path):
    """`interleaved_ab` (the host-speed-controlled A/B of workflow/scripts/*_host_ab.py): every step
    warmed up, then timed once per round, in reversed order every other round, one CSV row per step."""
    import occult.harness.sweep as sweep_module

    class Event:
        def __init__(self, **_kwargs):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, _other):
            return 0.25

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_args: None)
    monkeypatch.setattr(sweep_module, "host_launch_us", lambda _device: 3.0)
    calls: list[str] = []
    steps = {("olmoe", 1, arm): (lambda arm=arm: calls.append(arm)) for arm in ("a", "b", "c")}
    out = tmp_path / "ab.csv"
    sweep_module.interleaved_ab(steps, rounds=2, warmup=2, device=torch.device("cpu"), out_csv=out,
                                key_columns=("shape", "batch", "arm"))
    assert calls == ["a", "a", "b", "b", "c", "c", "a", "b", "c", "c", "b", "a"]
    import pandas as pd

    table = pd.read_csv(out)
    assert list(table.columns) == ["round", "shape", "batch", "arm", "host_us", "step_us", "host_launch_us"]
    assert table.arm.tolist() == ["a", "b", "c", "c", "b", "a"] and (table.step_us == 250.0).all()
    assert not (tmp_path / "ab.tmp").exists()
