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


def sweep_settings(**fields) -> settings.SweepSettings:
    base = dict(kind="prefill", shapes=("tiny",), methods=("occult",), world=1, sizes=(8,), out_csv="x.csv")
    return settings.SweepSettings(**{**base, **fields})


@pytest.mark.parametrize("fields, why", [
    ({"methods": ("megablocks", "megablocks:grouped_gemm=cublas")}, "are the same method"),
    ({"methods": ("megablocks", "megablocks:grouped_gemm=cutlass")}, "need a process each"),
    ({"methods": ("tutel:adaptive_r=2",)}, "'2' is not one of"),
    ({"methods": ()}, "methods: none given"),
    ({"routings": ("synthetic", "synthetic")}, "routings: need distinct"),
    ({"routings": ("measured",)}, "routings: need distinct"),
    ({"routings": ("uniform", "trace")}, "trace: routing trace needs"),
    ({"methods": ("megablocks:grouped_gemm=cutlass",), "grouped_gemm_dir": "."}, "grouped_gemm_dir: . has no gg-cutlass"),
    ({"skip_points": "no-such.csv"}, "skip_points: 'no-such.csv' is not a file"),
])
def test_bad_settings_are_named(fields, why):
    with pytest.raises(settings.SweepError, match=why):
        sweep_settings(**fields).validate()


def test_the_grouped_gemm_build_of_a_process_follows_its_megablocks_methods():
    assert sweep_settings(methods=("occult", "naive")).grouped_gemm_mode() == ""
    assert sweep_settings(methods=("megablocks", "megablocks:mlp_impl=sparse")).grouped_gemm_mode() == "cublas"
    assert sweep_settings(methods=("megablocks:grouped_gemm=cutlass",)).grouped_gemm_mode() == "cutlass"
    assert sweep_settings(methods=("megablocks:mlp_impl=sparse",)).grouped_gemm_mode() == ""
    sweep_settings(methods=settings.DEFAULT_METHODS).validate()
