"""Structured logs: JSON lines parse and carry their fields; progress writes records at most every
`every_s` and at the end; a failing stage exits nonzero with one `failed` record naming the file or
field, the frame in our code and the traceback; SIGTERM is recorded; every Snakemake rule that
calls occult declares a JSON log and passes it."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
import pytest
import yaml

from occult import logs
from occult.cli import build_parser, main
from occult.logs import log_event, offending_file, progress, run_main, setup_logging
from tests.models.test_moe import tiny_model_cfg, write_standin_data
from tests.routing.test_placement import write_profile
from tests.workflow.test_profiles import SNAKEMAKE, directive, rule_blocks, snakemake

REPO = Path(__file__).resolve().parent.parent
OCCULT = str(Path(sys.executable).parent / "occult")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def only(recs: list[dict], event: str) -> dict:
    found = [r for r in recs if r["event"] == event]
    assert len(found) == 1, [r["event"] for r in recs]
    return found[0]


def write_config(tmp_path: Path, **sections) -> Path:
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for section, values in sections.items():
        raw[section] = {**raw[section], **values}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@contextlib.contextmanager
def unit_logging(tmp_path: Path) -> Iterator[Path]:
    """Logging of a stage "unit" with its JSON log; set up inside the test, where stderr is captured."""
    setup = setup_logging("unit", tmp_path / "logs" / "unit.jsonl")
    try:
        yield tmp_path / "logs" / "unit.jsonl"
    finally:
        setup.remove()


# ---------------------------------------------------------------------------------------------
# records


def test_json_lines_parse_and_carry_fields(tmp_path, capsys):
    with unit_logging(tmp_path) as json_log:
        logging.getLogger("occult.somewhere").warning("plain %s", "text")
        log_event("step", "step 3", step=3, loss=float("nan"), tokens_per_s=np.float32(12.5), path=Path("a/b.csv"),
                  shape=np.array([2, 3]))
        log_event("secret", "json only", json_only=True, stage="other")
    plain, step, secret = records(json_log)
    for rec in (plain, step, secret):
        assert list(rec)[:7] == ["ts", "level", "stage", "event", "message", "logger", "pid"]
        ts = dt.datetime.fromisoformat(rec["ts"].replace("Z", "+00:00"))
        assert ts.utcoffset() == dt.timedelta(0) and abs((dt.datetime.now(dt.timezone.utc) - ts).total_seconds()) < 60
    assert plain == {**plain, "level": "WARNING", "stage": "unit", "event": "log", "message": "plain text",
                     "logger": "occult.somewhere"}
    assert step == {**step, "event": "step", "level": "INFO", "step": 3, "loss": "nan", "tokens_per_s": 12.5,
                    "path": "a/b.csv", "shape": [2, 3]}
    assert secret["stage"] == "other"
    err = capsys.readouterr().err
    assert "plain text" in err and "step 3" in err and "json only" not in err


def test_setup_twice_does_not_double_lines_and_reads_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(logs.ENV_LOG_JSON, str(tmp_path / "env.jsonl"))
    first = setup_logging("a")
    second = setup_logging("b")
    try:
        logging.getLogger("occult").info("once")
        assert capsys.readouterr().err.count("once") == 1
        assert [r["stage"] for r in records(tmp_path / "env.jsonl")] == ["b"]
        assert first.json_path == second.json_path == tmp_path / "env.jsonl"
    finally:
        second.remove()
    monkeypatch.setenv(logs.ENV_LOG_JSON, "")
    assert logs.json_log_path(None) is None


# ---------------------------------------------------------------------------------------------
# progress


def test_progress_records_every_step_when_every_s_is_zero(tmp_path):
    with unit_logging(tmp_path) as json_log:
        for _ in progress(range(5), desc="loop", every_s=0.0, unit="batch"):
            pass
    recs = [r for r in records(json_log) if r["event"] == "progress"]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 5]
    assert [r["final"] for r in recs] == [False] * 5 + [True]
    assert all(r["total"] == 5 and r["desc"] == "loop" and r["unit"] == "batch" and r["stage"] == "unit"
               for r in recs)
    assert recs[-1]["rate"] > 0 and recs[-1]["elapsed_s"] >= 0 and recs[-1]["eta_s"] == 0


def test_progress_is_rate_limited_and_carries_metrics(tmp_path, capsys):
    with unit_logging(tmp_path) as json_log:
        with progress(100, stage="train", desc="steps", every_s=3600.0) as bar:
            for step in range(100):
                bar.log(loss=1.0 / (step + 1), tokens_per_s=1000)
                bar.update(1)
        progress(range(3), desc="quiet", every_s=0.0, disable=True).close()
    (rec,) = [r for r in records(json_log) if r["event"] == "progress"]
    assert rec == {**rec, "stage": "train", "step": 100, "total": 100, "final": True, "loss": 0.01,
                   "tokens_per_s": 1000}
    assert "steps: 100/100 it" not in capsys.readouterr().err, "progress records stay out of the text log"


def test_progress_without_total(tmp_path):
    with unit_logging(tmp_path) as json_log:
        bar = progress(None, desc="open ended", every_s=0.0)
        bar.update(2)
        bar.close()
    recs = [r for r in records(json_log) if r["event"] == "progress"]
    assert [(r["step"], r["total"], r["eta_s"]) for r in recs] == [(2, None, None), (2, None, None)]


def test_resumed_progress_counts_from_its_initial_step(tmp_path):
    with unit_logging(tmp_path) as json_log:
        for _ in progress(range(6, 10), desc="resumed", total=10, initial=6, every_s=0.0):
            pass
    recs = [r for r in records(json_log) if r["event"] == "progress"]
    assert [r["step"] for r in recs] == [7, 8, 9, 10, 10] and recs[-1]["total"] == 10


# ---------------------------------------------------------------------------------------------
# failure description


@pytest.mark.parametrize("message, path", [
    ("config file /tmp/x/absent.yaml does not exist", "/tmp/x/absent.yaml"),
    ("work/tiny/profile/profile.npz: unreadable or truncated npz (BadZipFile: bad)", "work/tiny/profile/profile.npz"),
    ("checkpoint work/tiny/model/base: not a directory", "work/tiny/model/base"),
    ("data/instructions.jsonl:12: not an instruction pair", "data/instructions.jsonl"),
    ("placement.devices: 64 experts are not divisible by 3 devices", None),
    ("max_devices*E/D = 1*16/8 < k = 4", None),
    ("see https://example.org/a/b", None),
])
def test_offending_file_in_messages(message, path):
    assert offending_file(ValueError(message)) == path


def test_offending_file_of_an_os_error():
    assert offending_file(FileNotFoundError(2, "No such file or directory", "/x/y.bin")) == "/x/y.bin"


# ---------------------------------------------------------------------------------------------
# the occult CLI


def test_every_stage_accepts_log_json(capsys):
    (subcommands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    stages = set(subcommands.choices)
    assert {"data", "pretrain", "profile", "place", "finetune", "evaluate", "bench", "report"} <= stages
    for stage in sorted(stages):
        with pytest.raises(SystemExit):
            main([stage, "--help"])
        assert "--log-json" in capsys.readouterr().out, stage


def place_args(tmp_path: Path, profile: Path, config: Path | None = None) -> list[str]:
    return ["place", "--config", str(config or REPO / "config" / "config.yaml"), "--profile", str(profile),
            "--out", str(tmp_path / "pl"), "--table", str(tmp_path / "pl" / "t.csv"),
            "--log-json", str(tmp_path / "logs" / "place.jsonl")]


def test_truncated_profile_exits_1_with_a_failed_record_naming_the_file(tmp_path, capsys):
    write_profile(tmp_path / "profile")
    npz = tmp_path / "profile" / "profile.npz"
    npz.write_bytes(npz.read_bytes()[:200])
    assert main(place_args(tmp_path, tmp_path / "profile")) == 1
    recs = records(tmp_path / "logs" / "place.jsonl")
    assert [r["event"] for r in recs] == ["start", "config", "failed"]
    failed = recs[-1]
    assert failed["level"] == "ERROR" and failed["stage"] == "place" and failed["exit_code"] == 1
    assert failed["exception_type"] == "occult.routing.placement.PlacementFileError"
    assert failed["file"] == str(npz) and str(npz) in failed["exception_message"]
    assert failed["where"]["file"] == "occult/routing/placement.py" and failed["where"]["line"] > 0
    assert "Traceback (most recent call last)" in failed["traceback"] and failed["elapsed_s"] >= 0
    err_lines = [line for line in capsys.readouterr().err.splitlines() if " occult INFO " not in line]
    assert err_lines == [failed["message"]] and err_lines[0].startswith("occult place: error: ")


def test_bad_config_exits_2_with_a_failed_record_naming_the_field(tmp_path):
    config = write_config(tmp_path, placement={"devices": [3]})
    assert main(place_args(tmp_path, tmp_path / "profile", config)) == 2
    failed = only(records(tmp_path / "logs" / "place.jsonl"), "failed")
    assert failed["field"] == "placement.devices" and failed["exit_code"] == 2
    assert failed["exception_type"] == "occult.config.ConfigError" and failed["where"]["file"] == "occult/config.py"


def test_unexpected_error_prints_its_traceback_and_is_recorded(tmp_path, capsys, monkeypatch):
    import occult.stages.place

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(occult.stages.place, "run_placement", broken)
    assert main(place_args(tmp_path, tmp_path / "profile")) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.rstrip().splitlines()[-1].startswith("occult place: error: boom [RuntimeError at occult/cli.py:")
    failed = only(records(tmp_path / "logs" / "place.jsonl"), "failed")
    assert failed["exception_type"] == "RuntimeError" and failed["field"] is None and failed["file"] is None
    assert failed["where"]["file"] == "occult/cli.py" and failed["where"]["function"] == "_place"
    assert "test_logs.py" in failed["traceback"]


def test_successful_stage_writes_progress_and_done(tmp_path, capsys):
    write_profile(tmp_path / "profile")
    methods = ["contiguous", "greedy", "swap"]
    config = write_config(tmp_path, placement={"devices": [2, 4], "swap_rounds": 2, "methods": methods},
                          finetune={"devices": 4}, bench={"devices": 2})
    assert main(place_args(tmp_path, tmp_path / "profile", config)) == 0
    recs = records(tmp_path / "logs" / "place.jsonl")
    assert recs[0]["event"] == "start" and recs[-1]["event"] == "done"
    assert not [r for r in recs if r["event"] == "failed"]
    done = recs[-1]
    assert done["outputs"] == [str(tmp_path / "pl"), str(tmp_path / "pl" / "t.csv")]
    assert done["missing_outputs"] == [] and done["elapsed_s"] > 0
    final = [r for r in recs if r["event"] == "progress" and r["final"]]
    assert len(final) == 1 and final[0]["step"] == final[0]["total"] == 2 * 3 * len(methods)
    assert {"D", "method", "layer", "expected_ct_heldout"} <= set(final[0])
    assert "stage place done in" in capsys.readouterr().err


def test_unwritable_json_log_is_a_bad_argument(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(place_args(tmp_path, tmp_path / "profile")[:-1] + [str(tmp_path / "file" / "x.jsonl")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("occult place: error: --log-json: cannot open ")


def test_console_script_failure_through_the_environment_variable(tmp_path):
    env = {**os.environ, logs.ENV_LOG_JSON: str(tmp_path / "env.jsonl")}
    out = subprocess.run([OCCULT, "bench", "--config", str(REPO / "config" / "config.yaml"),
                          "--profile", str(tmp_path / "nope"), "--placements", str(tmp_path / "nope"),
                          "--out", str(tmp_path / "b.csv")], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    failed = only(records(tmp_path / "env.jsonl"), "failed")
    assert failed["stage"] == "bench" and failed["file"] == str(tmp_path / "nope" / "routing_heldout.npz")


# ---------------------------------------------------------------------------------------------
# module entry points (run_main)


def test_run_main_records_done_and_failure(tmp_path, capsys):
    log = tmp_path / "m.jsonl"

    def fine(argv):
        Path(argv[argv.index("--out") + 1]).write_text("x")

    def bad_field(argv):
        raise ValueError("methods: 'bogus' is not a method")

    assert run_main("mod", fine, ["--out", str(tmp_path / "o.txt"), "--log-json", str(log)]) == 0
    assert run_main("mod", bad_field, ["--log-json", str(log)]) == 1
    assert run_main("mod", lambda argv: 3, ["--log-json", str(log)]) == 3
    done, first, second = [r for r in records(log) if r["event"] in ("done", "failed")]
    assert done["event"] == "done" and done["outputs"] == [str(tmp_path / "o.txt")]
    assert first["event"] == "failed" and first["exception_message"].startswith("methods:")
    assert second["exception_type"] == "SystemExit" and second["exit_code"] == 3
    assert "occult.mod: error: methods: 'bogus'" in capsys.readouterr().err


def test_placement_study_module_failure_names_the_file(tmp_path):
    log = tmp_path / "study.jsonl"
    out = subprocess.run([sys.executable, "-m", "occult.stages.placement_study", "--profile-dir", str(tmp_path / "none"),
                          "--out", str(tmp_path / "s.csv"), "--synthetic", "--log-json", str(log)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 1, out.stderr[-2000:]
    failed = only(records(log), "failed")
    assert failed["stage"] == "placement_study" and "routing_calibration.npz" in failed["file"]
    assert out.stderr.rstrip().splitlines()[-1] == failed["message"]


SLEEPER = """
import sys, time
from occult.logs import run_main
sys.exit(run_main("sleeper", lambda argv: time.sleep(60), ["--log-json", sys.argv[1]]))
"""


def test_sigterm_is_recorded_as_a_failure(tmp_path):
    log = tmp_path / "sleep.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, str(log)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, "no start record"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    failed = only(records(log), "failed")
    assert failed["exception_type"] == "occult.logs.Terminated" and failed["exit_code"] == 143
    assert "terminated by signal SIGTERM" in failed["message"]


# ---------------------------------------------------------------------------------------------
# the training stages


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> dict[str, Path]:
    """`occult pretrain` of a micro OLMoE (10 steps) on stand-in data, with its JSON log."""
    root = tmp_path_factory.mktemp("micro")
    data = write_standin_data(root / "data")
    words = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")
    (data / "instructions.jsonl").write_text("".join(
        json.dumps({"instruction": f"repeat {w}", "response": f"{w} {w} {w}"}) + "\n" for w in words))
    paths = {"data": data, "config": write_config(
        root, model=dataclasses.asdict(tiny_model_cfg()),
        pretrain={"steps": 10, "batch_size": 4, "seq_len": 32, "warmup_steps": 2},
        finetune={"steps": 3, "batch_size": 4, "seq_len": 32})}
    paths.update(model=root / "model", csv=root / "pretrain_log.csv", json=root / "logs" / "pretrain.jsonl")
    assert main(["pretrain", "--config", str(paths["config"]), "--data", str(data), "--out", str(paths["model"]),
                 "--log", str(paths["csv"]), "--structure", str(root / "structure.json"),
                 "--log-json", str(paths["json"])]) == 0
    return paths


def test_pretraining_writes_progress_records_with_the_loss(micro_model):
    recs = records(micro_model["json"])
    assert recs[0]["event"] == "start" and recs[-1]["event"] == "done"
    bars = [r for r in recs if r["event"] == "progress" and r["desc"] == "pretrain"]
    final = bars[-1]
    assert final["final"] and final["stage"] == "pretrain" and final["step"] == final["total"] == 10
    assert final["unit"] == "step" and final["rate"] > 0
    row = pd.read_csv(micro_model["csv"]).iloc[-1]
    assert final["loss"] == pytest.approx(row["train_loss"], rel=1e-4) and math.isfinite(final["loss"])
    assert final["heldout_ppl"] == pytest.approx(row["heldout_ppl"], rel=1e-4)
    assert final["lr"] == pytest.approx(row["lr"]) and final["aux_loss"] == pytest.approx(row["aux_loss"])


def test_failing_finetune_arm_writes_a_failed_record(micro_model, tmp_path):
    """The arms run as a module: `sft-moe` trains and is saved, then the first pruned arm finds no
    placement; the run exits 1 with a `failed` record naming the placement file."""
    log = tmp_path / "finetune.jsonl"
    out = subprocess.run(
        [sys.executable, "-m", "occult.stages.finetune", "--config", str(micro_model["config"]),
         "--model", str(micro_model["model"]), "--data", str(micro_model["data"]),
         "--profile", str(tmp_path / "profile"), "--placements", str(tmp_path / "no_placements"),
         "--out", str(tmp_path / "arms"), "--logs", str(tmp_path / "arm_logs"), "--log-json", str(log)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 1, out.stderr[-2000:]
    recs = records(log)
    assert recs[0]["event"] == "start" and recs[-1]["event"] == "failed"
    failed = recs[-1]
    assert failed["stage"] == "finetune_arms" and failed["exit_code"] == 1 and failed["level"] == "ERROR"
    assert failed["file"] is not None and failed["file"].startswith(str(tmp_path / "no_placements"))
    assert failed["where"]["file"] in ("occult/routing/placement.py", "occult/routing/variants.py")
    assert out.stderr.rstrip().splitlines()[-1] == failed["message"]
    assert failed["message"].startswith("occult.finetune_arms: error: ")

    assert (tmp_path / "arms" / "sft-moe").is_dir() and not (tmp_path / "arms" / "prune1-router-D4-keep-moe").exists()
    steps = [r for r in recs if r["event"] == "progress" and r["desc"] == "finetune sft-moe"]
    assert steps[-1]["final"] and steps[-1]["step"] == steps[-1]["total"] == 3
    sft_log = pd.read_csv(tmp_path / "arm_logs" / "sft-moe_log.csv")
    assert steps[-1]["loss"] == pytest.approx(sft_log["loss"].iloc[-1], rel=1e-4)
    assert steps[-1]["lr"] == pytest.approx(sft_log["lr"].iloc[-1])
    (arms,) = [r for r in recs if r["event"] == "progress" and r["desc"] == "arms"]
    assert arms["final"] and arms["step"] == 1 and arms["arm"] == "prune1-router-D4-keep-moe"
    assert recs.index(arms) == len(recs) - 2, "the arms bar closes before the failure is recorded"


# ---------------------------------------------------------------------------------------------
# Snakemake rules


GPU_SLOTS = re.compile(r"python -m occult\.harness\.gpu_slots --gpus \S+ --")   # a wrapper, not a stage


def occult_rules() -> dict[str, str]:
    return {name: block for name, block in rule_blocks().items()
            if re.search(r"\boccult [a-z-]+ --config|-m occult\.", GPU_SLOTS.sub("", directive(block, "shell")))}


def test_rules_that_call_occult_declare_and_pass_a_json_log():
    rules = occult_rules()
    assert {"build_data", "pretrain_model", "profile_coactivation", "place_experts", "study_placement",
            "finetune_variant", "eval_variant", "bench_layer", "make_report", "run_gpu_sweep",
            "simulate_scale"} <= set(rules)
    for name, block in rules.items():
        log = directive(block, "log")
        assert re.search(rf'\bjson=f?"logs/{name}/[^"]+\.jsonl"', log), f"rule {name}: no json= log under logs/{name}/"
        assert re.search(rf'\btext=f?"logs/{name}/[^"]+\.log"', log), f"rule {name}: no text= log under logs/{name}/"
        shell = directive(block, "shell")
        assert "--log-json {log.json}" in shell or "OCCULT_LOG_JSON={log.json}" in shell, f"rule {name}"
        assert "{log}" not in shell, f"rule {name}: `{{log}}` would expand to both logs"


def test_dry_run_passes_json_logs_to_every_occult_command():
    out = subprocess.run([SNAKEMAKE, "-n", "-p", "--forceall", "--cores", "1"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    commands = [line for line in out.stdout.splitlines() if re.search(r"\boccult [a-z-]+ --config|-m occult\.", line)]
    assert len(commands) >= 8
    for command in commands:
        assert re.search(r"(--log-json |OCCULT_LOG_JSON=)logs/\w+/\S+\.jsonl", command), command


def test_plot_quality_summarises_a_committed_quality_run_with_a_json_log(tmp_path):
    """Dormant until a results/<machine>/quality_<v>/evaluate/ exists; then `rule all` asks for its
    table and figure, made by `python -m occult.stages.evaluate --summarise` as a logged stage."""
    run_dir = tmp_path / "results" / "box" / "quality_v9"
    (run_dir / "evaluate").mkdir(parents=True)
    (run_dir.parent / "index.csv").write_text(   # committed runs are found through their machine's index
        "run,kind,commit,target,status,superseded_by,in_tree,used_by,note\n"
        "quality_v9,quality,abc1234,snakemake results/box/quality_v9,current,,yes,,\n")
    arms = (("raw", "raw", 0.5), ("sft-moe", "sft", 0.7), ("prune2-sim-D8-keep-moe", "prune2-sim", 0.68))
    for arm, variant, acc in arms:
        scores = [{"task": task, "acc": acc, "acc_stderr": 0.01, "chance": 0.5} for task in ("copa", "piqa")]
        (run_dir / "evaluate" / f"{arm}.json").write_text(json.dumps(
            {"variant": variant, "arm": arm, "scores": scores,
             "setting": {"devices": 8, "gate_weights": "keep", "train_modules": "moe"}}))
    table, figure = run_dir / "tables" / "accuracy.csv", tmp_path / "figures" / "box" / "quality_v9" / "accuracy.png"
    dry = snakemake(tmp_path, "-n", "--cores", "1")
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert re.search(r"plot_quality\s+1\b", dry.stdout), "rule all must ask for the committed run's summary"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run([SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path), "--cores", "1",
                          str(table.relative_to(tmp_path)), str(figure.relative_to(tmp_path)),
                          "--configfile", str(REPO / "config" / "config.yaml")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert list(pd.read_csv(table)["arm"]) == ["raw", "sft-moe", "prune2-sim-D8-keep-moe", "chance"]
    assert figure.stat().st_size > 1000 and (run_dir / "tables" / "verdicts.json").is_file()
    recs = records(tmp_path / "logs" / "plot_quality" / "box_v9.jsonl")
    assert recs[0]["event"] == "start" and recs[-1]["event"] == "done"
    assert recs[-1]["stage"] == "summarise_quality"
    assert recs[-1]["outputs"] == [str(figure.parent.relative_to(tmp_path))] and not recs[-1]["missing_outputs"]
