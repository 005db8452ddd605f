"""The one parser of method names: what each name means, and one clear error for bad ones."""

import pytest

from occult.method_names import BASELINES, MethodNameError, is_occult, parse_method


@pytest.mark.parametrize("name, placement", [
    ("occult", "greedy"), ("occult-nd2", "greedy"), ("occult-trivial", "contiguous"), ("naive", "contiguous"),
    ("occult-balanced", "balanced"), ("occult-latency", "latency"), ("occult-graph-latency", "latency"),
])
def test_names_say_their_placement(name, placement):
    spec = parse_method(name)
    assert spec.placement == placement and spec.latency == (placement == "latency")


@pytest.mark.parametrize("name, family, mode, nd, static, contiguous, balanced", [
    ("occult", "occult", "dedup", None, False, False, False),
    ("occult-latency", "occult", "dedup", None, False, False, False),
    ("occult-nd2", "occult", "dedup", 2, False, False, False),
    ("occult-nd1-graph", "occult-graph", "dedup", 1, True, False, False),
    ("occult-graph-balanced", "occult-graph", "dedup", None, True, False, True),
    ("occult-balanced-graph", "occult-graph", "dedup", None, True, False, True),
    ("occult-pe", "occult-pe", "per_expert", None, False, False, False),
    ("occult-static", "occult-static", "dedup", None, True, False, False),
    ("occult-trivial", "occult", "dedup", None, False, True, False),
    ("occult-compute-graph", "occult-compute", "dedup", None, True, False, False),
    ("naive", "naive", "naive", None, False, True, False),
])
def test_names_mean_what_the_sweep_runs(name, family, mode, nd, static, contiguous, balanced):
    spec = parse_method(name)
    assert (spec.family, spec.mode, spec.max_devices, spec.static, spec.contiguous, spec.balanced) == (
        family, mode, nd, static, contiguous, balanced)


def test_baselines_are_not_occult():
    for name in BASELINES:
        assert not parse_method(name).is_occult and not is_occult(name)
    assert is_occult("occult-nd2-graph") and not is_occult("occult-bogus")


@pytest.mark.parametrize("name, why", [
    ("occult-bogus", "unknown option 'bogus'"),
    ("occult-graph-nd2", "must come first"),
    ("occult-nd0", "must come first"),
    ("occult-graph-graph", "given twice"),
    ("occult-pe-graph", "no static plan"),
    ("occult-nd2-balanced", "exact routing"),
    ("occult-trivial-balanced", "exact routing"),
    ("occult-nd1-latency", "-latency is a placement of exact routing"),
    ("occult-latency-trivial", "-latency is a placement of exact routing"),
    ("occult-balanced-latency", "two placements"),
    ("occult-nd2-trivial", "contiguous"),
    ("megablock", "expected occult"),
])
def test_bad_names_get_one_error_naming_them(name, why):
    with pytest.raises(MethodNameError, match=why) as err:
        parse_method(name)
    assert repr(name) in str(err.value)


@pytest.mark.parametrize("name, system, settings", [
    ("megablocks", "megablocks", {"grouped_gemm": "cublas", "mlp_impl": "grouped"}),
    ("megablocks:grouped_gemm=cutlass", "megablocks", {"grouped_gemm": "cutlass", "mlp_impl": "grouped"}),
    ("megablocks:mlp_impl=sparse", "megablocks", {"grouped_gemm": "cublas", "mlp_impl": "sparse"}),
    ("tutel:adaptive_r=0,megablocks_size=1", "tutel", {"adaptive_r": "0", "megablocks_size": "1"}),
    ("deepspeed:use_tutel=1", "deepspeed", {"use_tutel": "1"}),
    ("naive", "naive", {}),
])
def test_baseline_settings_are_filled_with_defaults(name, system, settings):
    spec = parse_method(name)
    assert spec.system == system and spec.name == name and not spec.is_occult
    assert dict(spec.settings) == settings
    assert spec.family == system and spec.mode == "naive"


@pytest.mark.parametrize("name, why", [
    ("naive:x=1", "naive has no settings"),
    ("megablocks:grouped_gemm=fast", "'fast' is not one of cublas, cutlass"),
    ("megablocks:cutlass", "expected <key>=<value>"),
    ("tutel:capacity_factor=-1", "a key of tutel: adaptive_r, megablocks_size"),
    ("tutel:adaptive_r=0,adaptive_r=1", "adaptive_r given twice"),
    ("megablocks:mlp_impl=sparse,grouped_gemm=cutlass", "no grouped_gemm to choose"),
    ("megablock:grouped_gemm=cutlass", "expected occult"),
])
def test_bad_baseline_settings_are_named(name, why):
    with pytest.raises(MethodNameError, match=why) as err:
        parse_method(name)
    assert repr(name) in str(err.value)
