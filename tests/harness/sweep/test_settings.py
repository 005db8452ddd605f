"""Sweep settings: bad method names and option combinations are rejected, naming the field."""

from __future__ import annotations

import pytest

from occult.harness.sweep import occult_method, settings


def test_bad_occult_method_names_are_named():
    with pytest.raises(settings.SweepError, match="occult-fast"):
        settings.SweepSettings(kind="prefill", shapes=("tiny",), methods=("occult-fast",), world=1, sizes=(4,),
                            out_csv="x.csv").validate()
    with pytest.raises(settings.SweepError, match="trivial"):
        settings.SweepSettings(kind="prefill", shapes=("tiny",), methods=("occult-nd1-trivial",), world=1,
                            sizes=(4,), out_csv="x.csv").validate()
    with pytest.raises(settings.SweepError, match="pe"):
        occult_method.OccultEP(None, "torch", ("pe", "static"))


def test_balanced_combines_with_exact_routing_only():
    for name, why in [("occult-nd1-balanced", "-balanced is a placement of exact routing"),
                      ("occult-trivial-balanced", r"not -trivial")]:
        with pytest.raises(settings.SweepError, match=why):
            settings.SweepSettings(kind="prefill", shapes=("tiny",), methods=(name,), world=2, sizes=(8,),
                                out_csv="x.csv").validate()
