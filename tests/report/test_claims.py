"""The paper-claims table on small hand-made result files: verdicts, spreads, references, the
quality verdicts it takes from the quality study, and errors that name the spec field or the file."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from occult.report import claims
from occult.routing.variants import Arm


@pytest.fixture(autouse=True)
def fresh_tables():
    claims._table.cache_clear()
    claims._quality_verdicts.cache_clear()
    yield


def write_sweep(run: Path, times: dict[str, float], shape: str = "olmoe", extra: list[dict] | None = None) -> None:
    """sweep_prefill_D1.csv: one row per method at 2^14 tokens (plus `extra` rows)."""
    run.mkdir(parents=True, exist_ok=True)
    rows = [{"kind": "prefill", "shape": shape, "method": m, "D": 1, "tokens_per_gpu": 16384, "median_ms": t,
             "status": "ok"} for m, t in times.items()]
    pd.DataFrame(rows + (extra or [])).to_csv(run / "sweep_prefill_D1.csv", index=False)


def speedup(shape: str = "olmoe") -> dict:
    point = {"file": "sweep_prefill_D1.csv", "column": "median_ms"}
    where = {"shape": shape, "tokens_per_gpu": 16384, "status": "ok"}
    return {"ratio": [{"point": {**point, "where": {**where, "method": "megablocks"}}},
                      {"point": {**point, "where": {**where, "method": "occult"}}}]}


def claim(cid: str, latest: str, earlier: list[str] = (), **fields) -> dict:
    return {"id": cid, "claim": f"claim {cid}", "unit": "speedup, x", "paper": {"value": 1.7, "source": "fig. X"},
            "latest": latest, "earlier": list(earlier), "measure": speedup(), "holds_if": {"above": 1.0}, **fields}


def write_spec(path: Path, entries: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"claims": entries}, sort_keys=False))
    return path


def run_claims(tmp_path: Path, entries: list[dict]) -> pd.DataFrame:
    out = tmp_path / "paper" / "claims.csv"
    claims.make_claims(write_spec(tmp_path / "spec.yaml", entries), out, tmp_path / "paper" / "claims.png")
    return pd.read_csv(out, keep_default_na=False)


def test_verdict_follows_every_run_and_the_value_is_the_latest(tmp_path):
    a, b, c = (tmp_path / r for r in ("v1", "v2", "v3"))
    write_sweep(a, {"occult": 2.0, "megablocks": 3.0})       # 1.5x
    write_sweep(b, {"occult": 2.0, "megablocks": 2.4})       # 1.2x
    write_sweep(c, {"occult": 2.0, "megablocks": 1.6})       # 0.8x
    table = run_claims(tmp_path, [claim("all", str(b), [str(a)]), claim("some", str(c), [str(a), str(b)]),
                                  claim("none", str(c)), {**claim("below", str(c)), "holds_if": {"below": 1.0}}])
    assert list(table.columns) == list(claims.COLUMNS)
    rows = table.set_index("claim")
    assert rows.at["claim all", "verdict"] == "reproduced" and rows.at["claim all", "our_value"] == pytest.approx(1.2)
    assert rows.at["claim all", "our_spread"] == "[1.2, 1.5] over 2 runs"
    assert rows.at["claim some", "verdict"] == "mixed" and "2 of 3 readings" in rows.at["claim some", "note"]
    assert rows.at["claim some", "our_spread"] == "[0.8, 1.5] over 3 runs"
    assert rows.at["claim none", "verdict"] == "refuted" and rows.at["claim none", "our_spread"] == "one run"
    assert rows.at["claim below", "verdict"] == "reproduced"
    assert rows.at["claim all", "source_run"] == str(b)
    assert rows.at["claim all", "source_file"] == str(b / "sweep_prefill_D1.csv")
    assert (tmp_path / "paper" / "claims.png").stat().st_size > 1000


def test_replicate_rows_of_a_point_fold_into_their_median(tmp_path):
    run = tmp_path / "v1"
    write_sweep(run, {"occult": 2.0, "megablocks": 3.0},
                extra=[{"kind": "prefill", "shape": "olmoe", "method": "occult", "D": 1, "tokens_per_gpu": 16384,
                        "median_ms": m, "status": s} for m, s in ((4.0, "ok"), (3.0, "ok"), (0.1, "failed"))])
    (row,) = run_claims(tmp_path, [claim("x", str(run))]).to_dict("records")
    assert row["our_value"] == pytest.approx(1.0)            # occult: median of 2, 4, 3 = 3; the failed row is left out


def test_spread_over_a_column_and_a_reference_bound(tmp_path):
    run = tmp_path / "q"
    run.mkdir()
    rows = [{"trace": "t", "D": 4, "layer": layer, "method": method, "ct": ct}
            for layer, greedy, contiguous in (("0", 2.0, 3.0), ("1", 2.8, 2.6), ("mean", 2.4, 2.8))
            for method, ct in (("greedy", greedy), ("contiguous", contiguous))]
    pd.DataFrame(rows).to_csv(run / "study.csv", index=False)
    entry = {"id": "p", "claim": "placement lowers E[C_T]", "unit": "devices", "paper": {"value": 3.02, "source": "p. 6"},
             "latest": str(run), "holds_if": {"below": "reference"},
             "measure": {"point": {"file": "study.csv", "where": {"method": "greedy", "layer": "mean"}, "column": "ct"}},
             "reference": {"label": "contiguous placement", "where": {"method": "contiguous"}},
             "spread": {"column": "layer", "exclude": ["mean"]}}
    (row,) = run_claims(tmp_path, [entry]).to_dict("records")
    assert row["our_value"] == pytest.approx(2.4)
    assert row["our_spread"] == "[2, 2.8] over 2 layer values"
    assert row["verdict"] == "mixed"                              # layer 1: greedy 2.8 is not below contiguous 2.6
    assert "Contiguous placement: 2.8" in row["note"]


def test_a_claim_without_runs_is_not_measurable_and_says_why(tmp_path):
    entry = {"id": "d4", "claim": "1.70x at D=4", "unit": "speedup, x", "paper": {"value": 1.7, "source": "fig. X"},
             "unmeasured": "needs 4 GPUs: run rule run_gpu_sweep at D=4"}
    (row,) = run_claims(tmp_path, [entry]).to_dict("records")
    assert row["verdict"] == "not measurable here" and "needs 4 GPUs" in row["note"]
    assert row["our_value"] == "" and row["paper_value"] == pytest.approx(1.7)
    with pytest.raises(claims.SpecError, match=r"\(d4\).*'unmeasured'"):
        claims.load_spec(write_spec(tmp_path / "bad.yaml", [{k: v for k, v in entry.items() if k != "unmeasured"}]))


def test_a_missing_result_file_is_named_and_nothing_is_written(tmp_path):
    good, missing = tmp_path / "v1", tmp_path / "v9"
    write_sweep(good, {"occult": 2.0, "megablocks": 3.0})
    out = tmp_path / "paper" / "claims.csv"
    with pytest.raises(FileNotFoundError, match=str(missing / "sweep_prefill_D1.csv")):
        claims.make_claims(write_spec(tmp_path / "spec.yaml", [claim("a", str(good)), claim("b", str(good), [str(missing)])]),
                           out, tmp_path / "paper" / "claims.png")
    assert not out.exists() and not (tmp_path / "paper" / "claims.png").exists()
    assert claims.spec_inputs(tmp_path / "spec.yaml") == [str(good / "sweep_prefill_D1.csv"),
                                                           str(missing / "sweep_prefill_D1.csv")]


def test_rows_a_selection_does_not_find_are_an_error_naming_file_and_selection(tmp_path):
    run = tmp_path / "v1"
    write_sweep(run, {"occult": 2.0, "megablocks": 3.0}, shape="qwen")
    with pytest.raises(ValueError, match=r"sweep_prefill_D1\.csv: no rows where .*olmoe"):
        run_claims(tmp_path, [claim("a", str(run))])


@pytest.mark.parametrize("change, field", [
    ({"holds_if": {"beside": 1}}, "holds_if"),
    ({"holds_if": {"below": "reference"}}, "holds_if"),
    ({"measure": {"point": {"file": "x.csv"}}}, "measure"),
    ({"paper": {"value": "1.7x", "source": "fig"}}, "paper.value"),
    ({"colour": "red"}, "unknown field"),
])
def test_spec_errors_name_the_claim_and_the_field(tmp_path, change, field):
    with pytest.raises(claims.SpecError, match=rf"\(c\).*{field}"):
        claims.load_spec(write_spec(tmp_path / "spec.yaml", [{**claim("c", "runs/v1"), **change}]))


def _summary(arm: Arm, correct: list[int]) -> dict:
    bits = "".join(str(b) for b in correct)
    acc = sum(correct) / len(correct)
    return {"variant": arm.variant, "arm": arm.name,
            "setting": {"devices": arm.devices, "gate_weights": arm.gate_weights, "train_modules": arm.train_modules},
            "scores": [{"task": "piqa", "acc": acc, "acc_stderr": (acc * (1 - acc) / len(correct)) ** 0.5, "chance": 0.5}],
            "per_doc": {"piqa": bits}}


def write_quality_run(run: Path, pruned_right: int) -> None:
    """raw and SFT right on 60 of 100 documents; both N_d=2 arms on `pruned_right` of them."""
    (run / "evaluate").mkdir(parents=True)
    sft = [1] * 60 + [0] * 40
    pruned = [1] * pruned_right + [0] * (100 - pruned_right)
    for arm, correct in ((Arm("raw", 4), sft), (Arm("sft", 4), sft), (Arm("prune2-router", 4), pruned),
                         (Arm("prune2-sim", 4), pruned)):
        (run / "evaluate" / f"{arm.name}.json").write_text(json.dumps(_summary(arm, correct)))


def test_quality_claims_take_each_runs_verdict_from_the_quality_study(tmp_path):
    holds, fails = tmp_path / "q2", tmp_path / "q1"
    write_quality_run(holds, 59)            # one document fewer than SFT: within 2 paired errors
    write_quality_run(fails, 40)            # 20 fewer: far outside
    entry = {"id": "nd2", "claim": "N_d=2 near SFT", "unit": "points", "paper": {"source": "table 2"},
             "measure": {"quality": {"claim": "pruning within 2 devices is about as good as standard fine-tuning"}}}
    table = run_claims(tmp_path, [{**entry, "id": "one", "latest": str(holds)},
                                  {**entry, "id": "two", "claim": "both", "latest": str(holds), "earlier": [str(fails)]}])
    one, two = table.to_dict("records")
    assert one["verdict"] == "reproduced" and one["our_value"] == pytest.approx(-1.0)
    assert two["verdict"] == "mixed" and two["our_spread"] == "[-20, -1] over 2 runs"
    assert f"{fails}: does not hold" in two["note"] and two["paper_value"] == ""
    with pytest.raises(claims.SpecError, match="holds_if"):
        claims.load_spec(write_spec(tmp_path / "bad.yaml", [{**entry, "latest": str(holds), "holds_if": {"above": 0}}]))


def test_the_committed_spec_is_valid_and_names_committed_files():
    spec = Path(__file__).resolve().parents[2] / "results" / "paper" / "claims_spec.yaml"
    listed = claims.load_spec(spec)
    assert len({c.id for c in listed}) == len(listed)
    root = spec.parents[2]
    assert all((root / f).exists() for f in claims.spec_inputs(spec))


def test_each_claims_latest_run_is_a_current_run_of_the_results_index():
    from occult.report.results_index import load_index

    root = Path(__file__).resolve().parents[2]
    index = load_index(root / "results").set_index(["machine", "run"])
    for entry in claims.load_spec(root / "results" / "paper" / "claims_spec.yaml"):
        if entry.latest:
            machine, run = Path(entry.latest).parts[-2:]
            assert index.at[(machine, run), "status"] == "current", f"{entry.id}: {entry.latest} is not current"
