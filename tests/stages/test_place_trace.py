"""`occult place-trace`: a user's routing trace in, placements in the runtime's format and a table out;
one clear error naming the array for each kind of bad input, and never a half-written folder."""

from __future__ import annotations

import copy
import json

import numpy as np
import pandas as pd
import pytest
import torch

from occult.cli import main
from occult.ep.hf import placements_from_json
from occult.ep.plan import check_placement
from occult.routing.placement import load_placement_layers
from occult.routing.placement_methods import synthetic_trace
from occult.stages import place_trace


def write_trace(path, num_experts=8, top_k=2, tokens=300, layers=2, **replace):
    arrays = {"calib": np.stack([synthetic_trace((num_experts, top_k), tokens, seed=i, clusters=2)
                                 for i in range(layers)]),
              "heldout": np.stack([synthetic_trace((num_experts, top_k), tokens, seed=i, clusters=2, draw=1)
                                   for i in range(layers)])}
    arrays.update(replace)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


def run_cli(*args: str) -> int:
    return main(["place-trace", *args])


def test_round_trip_into_the_runtimes_format(tmp_path):
    trace = write_trace(tmp_path / "trace.npz", layers=2)
    np.savez(trace, **dict(np.load(trace)), layers=np.array([1, 3]))
    out = tmp_path / "placements"
    assert run_cli("--trace", str(trace), "--devices", "1", "2", "4", "--out", str(out), "--hidden", "256",
                   "--ffn", "128", "--swap-rounds", "3") == 0
    table = pd.read_csv(out / "placement.csv")
    assert {"expected_ct_heldout", "max_device_load_over_mean", "predicted_ms", "seconds"} <= set(table.columns)
    assert len(table) == 3 * 2 * len(place_trace.TRACE_METHODS) and set(table["layer"]) == {1, 3}
    for (layer, num_devices), rows in table.groupby(["layer", "D"]):
        rows = rows.set_index("method")
        others = rows.drop(index="latency")["predicted_ms_calibration"]
        assert rows.loc["latency", "predicted_ms_calibration"] <= others.min() * (1 + 1e-12)
        if num_devices == 1:
            assert rows["predicted_ms"].nunique() == 1
    for method in place_trace.TRACE_METHODS:
        for num_devices in (1, 2, 4):
            path = out / f"D{num_devices}_{method}.json"
            layers, table_LE = load_placement_layers(path, num_experts=8, num_devices=num_devices)
            assert layers == [1, 3]
            for layer, row in placements_from_json(json.loads(path.read_text())).items():
                check_placement(row, num_devices)
    assert (out / "placement.csv.meta.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_written_placement_drives_use_ep(tmp_path):
    """One device (no process group): the model patched with the file's placement gives the same logits."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from occult.ep.hf import use_ep

    trace = write_trace(tmp_path / "trace.npz", layers=2)
    out = tmp_path / "out"
    assert run_cli("--trace", str(trace), "--devices", "1", "--methods", "greedy", "latency", "--out", str(out),
                   "--hidden", "32", "--ffn", "16") == 0
    torch.manual_seed(0)
    model = OlmoeForCausalLM(OlmoeConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, num_experts=8,
                                         num_experts_per_tok=2, max_position_embeddings=32)).float()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        placements = placements_from_json(json.loads((out / "D1_latency.json").read_text()))
        got = use_ep(copy.deepcopy(model), placements)(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("arrays, flags, message", [
    ({"calib": np.zeros((300, 2), dtype=np.int64)}, [], "'calib' must have shape [layers, tokens, k]"),
    ({}, ["--experts", "6"], "expert id 7 >= --experts 6"),
    ({"calib": np.tile([[[0, 1, 2]]], (2, 5, 1)), "heldout": np.tile([[[0, 1, 2]]], (2, 5, 1))}, ["--experts", "2"],
     "k=3 experts per token, more than E=2"),
    ({}, ["--devices", "3"], "D=3 does not divide the 8 experts"),
    ({"heldout": np.zeros((2, 0, 2), dtype=np.int64)}, [], "'heldout' is empty"),
    ({"heldout": None}, [], "missing array(s) heldout"),
    ({"calib": np.zeros((2, 5, 2), dtype=np.float32)}, [], "'calib' must hold integer expert ids"),
    ({"heldout": np.zeros((2, 5, 2), dtype=np.int64)}, [], "'heldout' lists one expert twice"),
])
def test_bad_input_gives_one_error_and_no_output(tmp_path, capsys, arrays, flags, message):
    trace = write_trace(tmp_path / "trace.npz", **arrays)
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("an earlier run")
    args = ["--trace", str(trace), "--out", str(out), "--hidden", "64", "--ffn", "32"]
    if "--devices" not in flags:
        args += ["--devices", "2"]
    assert run_cli(*args, *flags) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "failed" in line or "Error" in line]
    assert any(message in line for line in err), err
    assert sorted(p.name for p in out.iterdir()) == ["kept.txt"]            # the earlier folder untouched
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]     # no temporary folder left


def test_the_shape_must_match_the_trace_and_be_given(tmp_path, capsys):
    trace = write_trace(tmp_path / "trace.npz")
    assert run_cli("--trace", str(trace), "--devices", "2", "--out", str(tmp_path / "o"), "--shape", "olmoe") == 1
    assert "olmoe has top-8 of 64 experts, the trace top-2 of 8" in capsys.readouterr().err
    assert run_cli("--trace", str(trace), "--devices", "2", "--out", str(tmp_path / "o")) == 1
    assert "--shape olmoe|qwen|deepseek, or --hidden and --ffn" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_failure_while_writing_leaves_the_old_folder(tmp_path, monkeypatch):
    trace = write_trace(tmp_path / "trace.npz")
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("an earlier run")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("occult.provenance.write_csv", broken)
    with pytest.raises(OSError, match="disk full"):
        place_trace.main(["--trace", str(trace), "--devices", "2", "--methods", "greedy", "--out", str(out),
                          "--hidden", "64", "--ffn", "32"])
    assert sorted(p.name for p in out.iterdir()) == ["kept.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
