"""The configuration reference page: every schema key gets a row, and the committed
docs/configuration.md is what the schema gives today."""

from __future__ import annotations

from pathlib import Path

import pytest

from occult.report import config_reference

REPO = Path(__file__).resolve().parents[2]

SCHEMA = {
    "description": "Test schema.",
    "required": ["run", "train"],
    "properties": {
        "run": {"type": "string", "pattern": "^[a-z]+$", "description": "name; outputs go to <run>"},
        "train": {
            "type": "object", "description": "training", "required": ["steps", "modules"],
            "properties": {
                "steps": {"type": "integer", "minimum": 0, "description": "optimiser steps"},
                "modules": {"enum": ["moe", "all"]},
                "grid": {"type": "boolean", "default": False, "description": "every arm"},
                "sizes": {"type": "array", "minItems": 1, "uniqueItems": True, "items": {"enum": [1, 2]}},
                "history": {"type": "array", "items": {"type": "object", "required": ["name"],
                                                       "properties": {"name": {"type": "string"}}}},
                "check": {"type": "object", "description": "a nested part",
                          "properties": {"limit": {"type": ["number", "null"], "exclusiveMinimum": 0}}},
            },
        },
    },
}


def test_every_key_gets_a_row_with_its_type_default_and_description():
    page = config_reference.reference_markdown(SCHEMA, {"run": "tiny", "train": {"steps": 5, "modules": "moe",
                                                                                   "sizes": [1, 2]}})
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| `")}
    assert set(rows) == {f"`{k}`" for k in ("run", "train.steps", "train.modules", "train.grid", "train.sizes",
                                            "train.history", "train.history[].name", "train.check",
                                            "train.check.limit")}
    assert "`\"tiny\"`" in rows["`run`"] and "&lt;run&gt;" in rows["`run`"]
    assert "integer ≥ 0" in rows["`train.steps`"] and "`5`" in rows["`train.steps`"]
    assert "one of `moe`, `all`" in rows["`train.modules`"]
    assert "`false` (built in)" in rows["`train.grid`"] and "(optional) every arm" in rows["`train.grid`"]
    assert "list of values from `1`, `2`, at least 1, no repeats" in rows["`train.sizes`"]
    assert "number or null > 0" in rows["`train.check.limit`"]
    assert "## `train`" in page and "Training." in page


def test_bad_inputs_name_the_file(tmp_path):
    schema = tmp_path / "schema.yaml"
    schema.write_text("type: object\n")
    defaults = tmp_path / "config.yaml"
    defaults.write_text("run: x\n")
    with pytest.raises(ValueError, match="schema.yaml"):
        config_reference.render(schema, defaults)
    with pytest.raises(FileNotFoundError, match="nowhere.yaml"):
        config_reference.render(tmp_path / "nowhere.yaml", defaults)


def test_the_committed_page_is_up_to_date():
    page = REPO / "docs" / "configuration.md"
    expected = config_reference.render(REPO / "config" / "schema.yaml", REPO / "config" / "config.yaml")
    assert page.read_text(encoding="utf-8") == expected, (
        f"docs/configuration.md is out of date with config/schema.yaml: run `{config_reference.COMMAND}`")
