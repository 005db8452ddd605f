"""The paper-claims table on small hand-made result files: verdicts, spreads, references, the
quality rows it takes from the pooled verdicts (and which model family decides), and errors that
name the spec field or the file."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from occult.report import claims, claims_pooled
from occult.report.quality_pooled import claims_at
from occult.report.quality_pooled import verdict as pooled_verdict


@pytest.fixture(autouse=True)
def fresh_tables():
    claims._table.cache_clear()
    claims._pooled_table.cache_clear()
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


def test_spread_over_a_column_of_several_runs_counts_each_run_s_own_values(tmp_path):
    new, old = tmp_path / "v3", tmp_path / "v2"
    for run, table in ((new, {"synthetic": 1.5, "uniform": 1.7, "trace": 1.6}), (old, {"synthetic": 1.4})):
        run.mkdir()
        pd.DataFrame([{"routing": r, "speedup": v} for r, v in table.items()]).to_csv(run / "speedups.csv", index=False)
    entry = {"id": "s", "claim": "faster", "unit": "x", "paper": {"value": 1.7, "source": "fig. X"},
             "latest": str(new), "earlier": [str(old)], "holds_if": {"above": 1.45},
             "measure": {"point": {"file": "speedups.csv", "where": {"routing": "synthetic"}, "column": "speedup"}},
             "spread": {"column": "routing"}}
    (row,) = run_claims(tmp_path, [entry]).to_dict("records")
    assert row["our_value"] == pytest.approx(1.5)                 # the headline keeps its own where
    assert row["our_spread"] == "[1.4, 1.7] over 4 readings (routing values of 2 runs)"
    assert row["verdict"] == "mixed" and "3 of 4 readings" in row["note"]


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


POOLED_HEADER = ["model_family", "claim", "estimate_pp", "stderr_pp", "between_base_sd_pp", "base_models", "verdict"]


def write_pooled(run: Path, rows: list[tuple]) -> Path:
    """tables/verdicts_pooled.csv of `run`, one row per tuple in POOLED_HEADER's order."""
    path = run / "tables" / "verdicts_pooled.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=POOLED_HEADER).to_csv(path, index=False)
    return path


NEAR = "N_d=2 near SFT (kept gates)"


def pooled_claim(cid: str, latest: Path, earlier: list[Path] = (), **body) -> dict:
    return {"id": cid, "claim": f"claim {cid}", "unit": "points", "paper": {"source": "table 2"},
            "latest": str(latest), "earlier": [str(r) for r in earlier],
            "measure": {"pooled": {"claim": NEAR, **body}}}


@pytest.mark.parametrize("pooled, expect, ours", [
    ("holds", None, "reproduced"),
    ("holds (one base model)", None, "reproduced"),
    ("does not hold", None, "refuted"),
    ("does not hold (one base model)", None, "refuted"),
    ("not settled", None, "not measurable here"),
    ("mixed", None, "mixed"),
    ("renormalised better", "renormalised", "reproduced"),
    ("kept better (one base model)", "renormalised", "refuted"),
    ("no difference beyond the margin", "renormalised", "refuted"),
    ("no difference beyond the margin (one base model)", "no difference", "reproduced"),
    ("kept better", "no difference", "refuted"),
    ("not settled (one base model)", "no difference", "not measurable here"),
])
def test_pooled_verdicts_map_onto_the_claims_vocabulary(pooled, expect, ours):
    assert claims_pooled.claim_verdict(pooled, expect) == ours


@pytest.mark.parametrize("pooled, expect, message", [
    ("holds", "kept", "one-sided"),
    ("kept better", None, "two-sided"),
    ("probably", None, "not one of"),
])
def test_a_verdict_outside_the_vocabulary_or_a_wrong_expect_is_an_error(pooled, expect, message):
    with pytest.raises(ValueError, match=message):
        claims_pooled.claim_verdict(pooled, expect)


def test_every_verdict_quality_pooled_can_write_has_a_claims_verdict():
    """Each claim of quality_pooled, on intervals on both sides of and across its bounds, with one
    and with several base models: the verdict maps (two-sided claims with an `expect`)."""
    seen = set()
    for claim in claims_at(8):
        expect = claim.labels[0] if claim.kind == "either" else None
        for estimate in (-5.0, -1.0, 0.0, 0.5, 5.0):
            for per_base in ([(estimate, 0.3)], [(estimate, 0.3), (estimate, 0.3)], [(3.0, 0.5), (-3.0, 0.5)]):
                text = pooled_verdict(claim, estimate, 0.3, per_base)
                seen.add(claims_pooled.claim_verdict(text, expect))
    assert seen == set(claims.VERDICTS)


def test_a_pooled_claim_takes_the_virtual_groups_row_and_marks_one_base_model_provisional(tmp_path):
    run = tmp_path / "q4"
    write_pooled(run, [("virtual_groups", NEAR, -0.25, 0.5, float("nan"), 1, "holds (one base model)"),
                       ("virtual_groups", "SFT beats the raw model", 1.6, 0.35, 0.2, 2, "holds")])
    sft = {**pooled_claim("sft", run), "measure": {"pooled": {"claim": "SFT beats the raw model"}}}
    near, beats = run_claims(tmp_path, [pooled_claim("near", run), sft]).to_dict("records")
    assert near["our_value"] == pytest.approx(-0.25) and near["verdict"] == "reproduced"
    assert near["our_spread"] == "±0.5; one base model"
    assert near["source_file"] == str(run / "tables" / "verdicts_pooled.csv") and near["source_run"] == str(run)
    assert "Model family virtual_groups" in near["note"] and "Provisional: one base model" in near["note"]
    assert beats["our_spread"] == "±0.35; between-base SD 0.2 over 2 base models"
    assert "Provisional" not in beats["note"]


def test_a_pooled_row_names_its_family_s_inheritance_and_perplexity_where_the_table_has_them(tmp_path):
    with_it, without = tmp_path / "q5", tmp_path / "q4"
    path = write_pooled(with_it, [("drop", NEAR, -0.5, 0.4, 0.3, 2, "holds"),
                                  ("virtual_groups", NEAR, 0.1, 0.2, 0.1, 2, "holds")])
    table = pd.read_csv(path)
    table["inheritance_index"], table["inheritance_basis"] = [0.013, 0.458], ["reference", "inherited"]
    table["base_heldout_ppl"] = [6.412, 5.119]
    table.to_csv(path, index=False)
    write_pooled(without, [("virtual_groups", NEAR, 0.1, 0.2, 0.1, 2, "holds")])    # a table without the columns
    first, second = run_claims(tmp_path, [pooled_claim("a", with_it), pooled_claim("b", without)]).to_dict("records")
    assert ("pooled verdict holds; its routing's inheritance index 0.01 (reference), "
            "base models' held-out perplexity 6.41") in first["note"]
    assert "inheritance index 0.46 (inherited), base models' held-out perplexity 5.12" in first["note"]  # context
    assert "inheritance" not in second["note"] and "perplexity" not in second["note"]


def test_a_drop_row_decides_and_the_virtual_groups_row_becomes_context(tmp_path):
    groups, drop, both = tmp_path / "q4", tmp_path / "drop_v1", tmp_path / "q5"
    write_pooled(groups, [("virtual_groups", NEAR, -0.25, 0.5, float("nan"), 1, "holds (one base model)")])
    write_pooled(drop, [("drop", NEAR, -2.5, 0.4, 0.3, 3, "does not hold")])
    write_pooled(both, [("virtual_groups", NEAR, 0.1, 0.2, 0.1, 3, "holds"),
                        ("drop", NEAR, -0.5, 0.6, 0.2, 2, "not settled")])
    first, second = run_claims(tmp_path, [pooled_claim("a", groups, [drop]),
                                          pooled_claim("b", both, [drop, groups])]).to_dict("records")
    # a: the drop table is listed after the virtual_groups one and still decides
    assert first["our_value"] == pytest.approx(-2.5) and first["verdict"] == "refuted"
    assert first["source_run"] == str(drop) and first["our_spread"] == "±0.4; between-base SD 0.3 over 3 base models"
    assert "Model family drop" in first["note"] and "Provisional" not in first["note"]
    assert f"Context, virtual_groups family ({groups}): -0.25" in first["note"]
    # b: one table with both families; each family's row comes from the first table that has it
    assert second["our_value"] == pytest.approx(-0.5) and second["verdict"] == "not measurable here"
    assert second["source_run"] == str(both) and "Provisional" not in second["note"]
    assert f"Context, virtual_groups family ({both}): +0.1" in second["note"]
    assert str(groups) not in second["note"]
    assert claims.spec_inputs(tmp_path / "spec.yaml")[:2] == [str(groups / "tables" / "verdicts_pooled.csv"),
                                                              str(drop / "tables" / "verdicts_pooled.csv")]


def test_a_family_with_one_base_model_waits_behind_one_with_several(tmp_path):
    """A drop row of one base model does not overrule a virtual_groups row pooled over three: it is
    context, and the note says when it would decide. Where no family has two base models, the first
    by precedence decides, provisionally."""
    both, alone = tmp_path / "q5", tmp_path / "drop_v1"
    write_pooled(both, [("virtual_groups", NEAR, 0.1, 0.2, 0.1, 3, "holds"),
                        ("drop", NEAR, -0.5, 0.6, float("nan"), 1, "not settled (one base model)")])
    write_pooled(alone, [("virtual_groups", NEAR, 0.3, 0.4, float("nan"), 1, "holds (one base model)"),
                         ("drop", NEAR, -0.5, 0.6, float("nan"), 1, "not settled (one base model)")])
    first, second = run_claims(tmp_path, [pooled_claim("a", both), pooled_claim("b", alone)]).to_dict("records")
    assert first["our_value"] == pytest.approx(0.1) and first["verdict"] == "reproduced"
    assert "Model family virtual_groups: 3 base models" in first["note"] and "Provisional" not in first["note"]
    assert "The drop family (experts that start without the dense model's groups) decides once it has 2 base models; it has 1" in first["note"]
    assert f"Context, drop family ({both}): -0.5" in first["note"]
    assert second["our_value"] == pytest.approx(-0.5) and second["verdict"] == "not measurable here"
    assert "Model family drop" in second["note"] and "Provisional: one base model" in second["note"]


def test_pooled_tables_and_claims_that_do_not_fit_are_named(tmp_path):
    run = tmp_path / "q4"
    path = write_pooled(run, [("virtual_groups", "other claim", 0.0, 0.5, float("nan"), 1, "holds (one base model)")])
    with pytest.raises(ValueError, match=rf"no pooled claim '{re.escape(NEAR)}'.*other claim"):
        run_claims(tmp_path, [pooled_claim("a", run)])
    pd.read_csv(path).drop(columns=["stderr_pp"]).to_csv(path, index=False)
    claims._table.cache_clear()
    claims._pooled_table.cache_clear()
    with pytest.raises(ValueError, match=r"verdicts_pooled\.csv: not a pooled verdicts table.*stderr_pp"):
        run_claims(tmp_path, [pooled_claim("a", run)])
    for change, field in (({"holds_if": {"above": 0}}, "holds_if"), ({"spread": {"column": "claim"}}, "spread")):
        with pytest.raises(claims.SpecError, match=rf"\(a\).*'{field}'"):
            claims.load_spec(write_spec(tmp_path / "bad.yaml", [{**pooled_claim("a", run), **change}]))
    with pytest.raises(claims.SpecError, match=r"\(a\).*pooled: unknown field.*'side'"):
        claims.load_spec(write_spec(tmp_path / "bad.yaml", [pooled_claim("a", run, side="kept")]))


def test_every_committed_pooled_table_is_read_by_the_claims_spec():
    """A committed pooled table (a drop family's, say) changes the quality rows only once the spec
    names its run: this fails until it does."""
    root = Path(__file__).resolve().parents[2]
    read = {str(root / f) for f in claims.spec_inputs(root / "results" / "paper" / "claims_spec.yaml")}
    committed = [*root.glob("results/*/*/tables/verdicts_pooled.csv"),
                 *root.glob("results/*/*/bases/verdicts_pooled.csv")]
    assert committed, "no committed verdicts_pooled.csv"
    missing = [str(p.relative_to(root)) for p in committed if str(p) not in read]
    assert not missing, f"results/paper/claims_spec.yaml does not read {missing}: name their runs in the quality claims"


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
