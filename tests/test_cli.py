"""The `occult` command: help for every stage, exit code 2 and one line for a bad config, one
clear line (no traceback) naming the file when an input is missing. The subcommands mirror the
`occult <stage>` calls of the Snakemake rules."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from occult.cli import main

REPO = Path(__file__).resolve().parent.parent
OCCULT = str(Path(sys.executable).parent / "occult")

# stage -> the path flags its --help must name (the inputs and outputs of its rule)
STAGE_PATHS = {
    "data": ["--out"],
    "pretrain": ["--data", "--out", "--log", "--structure"],
    "import-checkpoint": ["--out"],
    "profile": ["--model", "--data", "--out"],
    "place": ["--profile", "--out", "--table"],
    "finetune": ["--model", "--data", "--profile", "--placements", "--out", "--log", "--variant"],
    "evaluate": ["--model", "--data", "--profile", "--placements", "--out", "--variant"],
    "bench": ["--profile", "--placements", "--out"],
    "report": ["--results", "--figures"],
}


def error_lines(stderr: str) -> list[str]:
    """stderr without logging lines (`<date> occult INFO ...`) and progress bars."""
    return [line for line in stderr.splitlines()
            if line.strip() and " occult INFO " not in line and not re.search(r"\d+%\|", line)]


def test_top_level_help_lists_every_stage():
    out = subprocess.run([OCCULT, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for stage in STAGE_PATHS:
        assert stage in out.stdout, stage
    assert "--config" in out.stdout and "--profile" in out.stdout


@pytest.mark.parametrize("stage", sorted(STAGE_PATHS))
def test_stage_help_names_its_paths(stage, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([stage, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ["--config", *STAGE_PATHS[stage]]:
        assert flag in text, f"{stage} --help does not name {flag}"


def test_every_rule_stage_is_a_subcommand():
    called = set()
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        called |= set(re.findall(r"\boccult ([a-z][a-z-]*) --config", smk.read_text()))
    assert {"data", "pretrain", "profile", "place", "finetune", "evaluate", "bench", "report"} <= called, called
    assert called <= set(STAGE_PATHS), f"rules call unknown stages {called - set(STAGE_PATHS)}"


def write_config(tmp_path: Path, **overrides) -> Path:
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for section, values in overrides.items():
        raw[section] = {**raw[section], **values} if isinstance(values, dict) else values
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("overrides, field", [
    ({"placement": {"devices": [3]}}, "placement.devices"),
    ({"model": {"top_k": 0}}, "model.top_k"),
    ({"bench": {"repeat": 3}}, "bench.repeat"),
    ({"finetune": {"variants": ["prune2-cosine"]}}, "finetune.variants"),
])
def test_bad_config_exits_2_with_one_line_naming_the_field(tmp_path, capsys, overrides, field):
    config = write_config(tmp_path, **overrides)
    code = main(["place", "--config", str(config), "--profile", str(tmp_path), "--out", str(tmp_path),
                 "--table", str(tmp_path / "t.csv")])
    assert code == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert field in lines[0] and "config error" in lines[0]


def test_bad_config_exit_code_through_the_console_script(tmp_path):
    config = write_config(tmp_path, placement={"devices": [3]})
    out = subprocess.run([OCCULT, "place", "--config", str(config), "--profile", str(tmp_path),
                          "--out", str(tmp_path), "--table", str(tmp_path / "t.csv")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert len(error_lines(out.stderr)) == 1 and "placement.devices" in out.stderr


def test_missing_config_file_is_named(tmp_path, capsys):
    missing = tmp_path / "absent.yaml"
    assert main(["report", "--config", str(missing), "--results", str(tmp_path), "--figures", str(tmp_path)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and str(missing) in lines[0]


def missing_input_cases(root: Path) -> dict[str, tuple[list[str], str]]:
    """stage -> (arguments after --config, the path the error must name)."""
    nope = root / "absent"
    out = root / "out"
    return {
        "place": (["--profile", str(nope / "profile"), "--out", str(out), "--table", str(out / "t.csv")],
                  str(nope / "profile" / "profile.npz")),
        "profile": (["--model", str(nope / "model"), "--data", str(nope / "data"), "--out", str(out)],
                    str(nope / "model")),
        "bench": (["--profile", str(nope / "profile"), "--placements", str(nope / "pl"), "--out", str(out / "b.csv")],
                  str(nope / "profile" / "routing_heldout.npz")),
        "pretrain": (["--data", str(nope / "data"), "--out", str(out / "m"), "--log", str(out / "l.csv"),
                      "--structure", str(out / "s.json")], str(nope / "data" / "tokenizer")),
        "finetune": (["--variant", "sft", "--model", str(nope / "model"), "--data", str(nope / "data"),
                      "--profile", str(nope / "p"), "--placements", str(nope / "pl"), "--out", str(out / "f"),
                      "--log", str(out / "f.csv")], str(nope / "model")),
        "evaluate": (["--variant", "raw", "--model", str(nope / "model"), "--data", str(nope / "data"),
                      "--profile", str(nope / "p"), "--placements", str(nope / "pl"), "--out", str(out / "e.json")],
                     str(nope / "model")),
        "report": (["--results", str(nope / "results"), "--figures", str(out / "fig")], str(nope / "results")),
    }


@pytest.mark.parametrize("stage", ["place", "profile", "bench", "pretrain", "finetune", "evaluate", "report"])
def test_missing_input_gives_one_line_naming_the_file(tmp_path, capsys, stage):
    args, named = missing_input_cases(tmp_path)[stage]
    code = main([stage, "--config", str(REPO / "config" / "config.yaml"), *args])
    err = capsys.readouterr().err
    assert code == 1
    lines = error_lines(err)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"occult {stage}: error:") and named in lines[0], lines[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.*")), "no output on failure"


def test_a_paused_pretrain_exits_3_with_one_line(tmp_path, capsys, monkeypatch):
    import occult.stages.pretrain
    from occult.stages.pretrain import PretrainPaused

    def paused(*args, **kwargs):
        raise PretrainPaused("pretraining paused at step 7 of 10; run the same command again to continue")

    monkeypatch.setattr(occult.stages.pretrain, "pretrain", paused)
    out = tmp_path / "out"
    code = main(["pretrain", "--config", str(REPO / "config" / "config.yaml"), "--data", str(tmp_path / "data"),
                 "--out", str(out / "m"), "--log", str(out / "l.csv"), "--structure", str(out / "s.json")])
    err = capsys.readouterr().err
    assert code == 3
    assert "Traceback" not in err
    lines = error_lines(err)
    assert len(lines) == 1 and "paused at step 7" in lines[0], lines
