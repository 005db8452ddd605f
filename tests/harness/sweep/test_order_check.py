"""The order seed apart from the data seed (`--order-seed`), the order check's driver
(`occult.harness.sweep.order_check`) and its Snakemake target (`run_order_check`)."""

from __future__ import annotations

import hashlib
import json
import shlex

import pandas as pd
import pytest
import torch

import occult.harness.sweep.run as run
from occult.harness.sweep import order_check, parts, points, settings


def digest(*tensors: torch.Tensor | None) -> str:
    sha = hashlib.sha1()
    for tensor in tensors:
        if tensor is not None:
            sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


def sweep_with_order_seed(tmp_path, monkeypatch, order_seed: int | None) -> tuple[pd.DataFrame, dict, dict]:
    """A CPU sweep in this process, with the checksums of what each point ran on: the shape's weights,
    placement and check inputs, and every timed input set."""
    shared: dict = {}
    timed: dict = {}
    real_run_point, real_make_inputs = points.run_point, points.make_inputs

    def run_point(shape_run, name, size):
        key = (shape_run.routing, shape_run.shape.name, size, name)
        shared[key] = digest(shape_run.weights.w_gate_up_E2FD, shape_run.weights.w_down_EDF, shape_run.placement,
                             shape_run.balanced, shape_run.check.x_TD, *shape_run.check.routes[None])
        return real_run_point(shape_run, name, size)

    def make_inputs(shape, router, tokens, seed, *args, **kwargs):
        made = real_make_inputs(shape, router, tokens, seed, *args, **kwargs)
        routes = [tensor for nd in sorted(made.routes, key=str) for tensor in made.routes[nd]]
        timed.setdefault((shape.name, tokens, seed), set()).add(digest(made.x_TD, *routes))
        return made

    monkeypatch.setattr(points, "run_point", run_point)
    monkeypatch.setattr(points, "make_inputs", make_inputs)
    out = tmp_path / f"order{order_seed}.csv"
    run.run_sweep("prefill", ["tiny", "tiny-shared"], ["occult", "occult-nd1", "occult-balanced", "naive"], 1, [8, 16], out,
                  repeats=1, warmup=0, device="cpu", dtype="float32", routings=("synthetic", "uniform"),
                  input_sets=1, order_seed=order_seed)
    return pd.read_csv(out), shared, timed


def test_order_seeds_change_the_order_but_not_the_data(tmp_path, monkeypatch):
    runs = {seed: sweep_with_order_seed(tmp_path, monkeypatch, seed) for seed in (None, 0, 5)}
    point = ["routing", "shape", "tokens_per_gpu"]
    orders = {seed: frame.sort_values(point + ["order_position"]).groupby(point)["method"].agg(tuple)
              for seed, (frame, _, _) in runs.items()}
    assert orders[None].equals(orders[0])                      # no --order-seed: drawn from --seed (0), as before
    assert (orders[5] != orders[0]).sum() >= len(orders[0]) // 2   # another order seed: most points reordered
    for seed, (frame, _, _) in runs.items():
        expected = [points.order_seed(0 if seed is None else seed, r, s, n)
                    for r, s, n in frame[point].itertuples(index=False)]
        assert frame["order_seed"].tolist() == expected
    (_, shared0, timed0), (_, shared5, timed5) = runs[0], runs[5]
    assert shared0 == shared5 and len(shared0) == 2 * 2 * 2 * 4       # routings x shapes x sizes x methods
    assert timed0 == timed5 and len(timed0) == 2 * (2 + 1)        # shapes x (sizes + the check batch)
    ok = runs[5][0][runs[5][0]["status"] == "ok"]
    assert len(ok) == 32 and (ok["max_rel_err"] < settings.REL_TOLERANCE["float32"]).all()


def test_the_parts_runner_follows_the_order_seed_and_passes_it_on():
    parser = parts.build_parts_parser()
    base = ["--device", "cpu", "--kind", "decode", "--shapes", "tiny", "--sizes", "2", "5",
            "--methods", "occult", "naive", "fsdp", "megablocks", "tutel"]
    for extra, seed in (([], 0), (["--seed", "4"], 4), (["--seed", "4", "--order-seed", "9"], 9)):
        args = parser.parse_args(base + extra)
        assert settings.order_base_seed(args.seed, args.order_seed) == seed
        sequence = parts.point_sequence(args, ["occult", "naive", "fsdp"], [2, 5], 1)
        assert [name for *_, name in sequence[:3]] == points.method_order(["occult", "naive", "fsdp"],
                                                                          points.order_seed(seed, "synthetic", "tiny", 2))
    assert parts.sweep_argv(parser, args)[-4:] == ["--seed", "4", "--order-seed", "9"]
    with pytest.raises(settings.SweepError, match="order_seed: must be >= 0"):
        settings.SweepSettings(kind="prefill", shapes=("tiny",), methods=("occult",), world=1, sizes=(8,),
                               out_csv="x.csv", order_seed=-1).validate()


def test_each_replicate_gets_its_own_order_seed_and_the_same_data_seed():
    args = order_check.build_parser().parse_args(["--kind", "train", "--D", "2", "--seed", "3", "--out", "x.csv"])
    args.size = order_check.CHECK_SIZES[args.kind]
    words = order_check.replicate_argv(args, 4, "r4.csv")
    parsed = parts.build_parts_parser().parse_args(words)
    assert (parsed.seed, parsed.order_seed, parsed.sizes, parsed.D) == (3, 4, [8], 2)
    assert parsed.methods == list(order_check.CHECK_METHODS) and parsed.routings == ["synthetic"]
    args.replicates = 0
    with pytest.raises(settings.SweepError, match="replicates: must be at least 1"):
        order_check.validate(args)


@pytest.mark.slow
def test_order_check_runs_its_replicates_on_cpu_into_one_csv(tmp_path):
    out = tmp_path / "run" / "order_check_decode_D1.csv"
    methods = ["occult", "naive", "fsdp"]
    order_check.main(["--device", "cpu", "--dtype", "float32", "--kind", "decode", "--shapes", "tiny",
                      "--methods", *methods, "--size", "4", "--replicates", "2", "--repeats", "2", "--warmup", "0",
                      "--out", str(out)])
    frame = pd.read_csv(out)
    assert list(frame.columns) == [*settings.COLUMNS, *order_check.EXTRA_COLUMNS]
    assert len(frame) == 2 * len(methods) and (frame["status"] == "ok").all()
    assert sorted(frame["replicate"].unique()) == [0, 1]
    assert (frame["replicate"] == frame["replicate_order_seed"]).all() and (frame["batch"] == 4).all()
    for replicate, rows in frame.groupby("replicate"):
        assert rows.sort_values("order_position")["method"].tolist() == points.method_order(
            methods, points.order_seed(replicate, "synthetic", "tiny", 4))
    meta = json.loads((out.parent / (out.name + ".meta.json")).read_text())
    assert [r["order_seed"] for r in meta["replicates"]] == [0, 1] and meta["stage"] == "order_check"
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, out.name + ".meta.json"]


def test_the_order_check_target_dry_runs_with_its_gpus_one_rank_per_gpu_and_six_replicates(tmp_path):
    from tests.workflow.test_gpu_targets import jobs
    from tests.workflow.test_profiles import PROFILES, snakemake

    out = snakemake(tmp_path, "-n", "-p", "--workflow-profile", str(PROFILES / "gpu"), "--resources", "gpus=8", "--",
                    "results/box/sweeps_v1/order_check_train_D2.csv")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    (job,) = jobs(log)["run_order_check"]
    assert "resources: " in job and " gpus=2" in job.split("resources: ")[1].splitlines()[0]
    assert "occult.harness.gpu_slots --gpus 2 -- python -m occult.harness.sweep.order_check " in job
    assert "--launch 'torchrun --nproc_per_node=2 --nnodes=1' --kind train --D 2 " in job
    assert "--replicates 6 " in job
    command = job.split("python -m occult.harness.sweep.order_check ")[1].split(" > ")[0]
    args = order_check.build_parser().parse_args(shlex.split(command))
    sweep_job = jobs(snakemake(tmp_path, "-n", "-p", "--workflow-profile", str(PROFILES / "gpu"), "--resources",
                               "gpus=8", "--", "results/box/sweeps_v1/sweep_train_D2.csv").stdout)["run_gpu_sweep"][0]
    assert f"--methods {' '.join(args.methods)} " in sweep_job      # the sweep's methods, in its order
    assert {"occult", "megablocks", "megablocks:grouped_gemm=cutlass", "tutel"} <= set(args.methods)
    assert (args.size, args.shapes, args.routing) == (None, ["olmoe", "qwen", "deepseek"], "synthetic")
    assert order_check.CHECK_SIZES == {"prefill": 16384, "decode": 64, "train": 8}   # the sizes it then runs
