"""The calls docs/library.md names, run by tests/test_wheel.py with an installed occult (not the
checkout): every `occult.*` name on the page resolves, and each function runs on small inputs.

    python library_calls.py docs/library.md
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

import numpy as np
import torch


def resolve(dotted: str):
    """The module or attribute a dotted name such as `occult.routing.placement.expected_ct` names."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def check_names(page: Path) -> int:
    names = sorted(set(re.findall(r"\b(occult(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", page.read_text())))
    for dotted in names:
        resolve(dotted)
    return len(names)


def check_calls() -> None:
    from occult.config import load_config, preset_names
    from occult.ep import ep_moe
    from occult.ep.graph import GraphedForward  # noqa: F401  (GPU path: importable here)
    from occult.ep.hf import use_ep
    from occult.routing.placement import (contiguous, expected_ct, greedy_occult, max_device_load_over_mean,
                                          swap_search)
    from occult.routing.placement_methods import (eplb_load_only, hierarchical, load_aware_swap, metis_partition,
                                                  synthetic_preset)
    from occult.routing.profiling import coactivation_counts
    from occult.routing.pruning import prune_router_score, prune_similarity

    # the GPU-side arguments the page names (use_ep and EPStats run in examples/communicate_less.py)
    assert {"static_capacity"} <= set(inspect.signature(ep_moe).parameters)
    assert {"mode", "backend", "stats"} <= set(inspect.signature(use_ep).parameters)
    assert {"tiny", "mini", "upcycle"} <= set(preset_names()), preset_names()
    cfg = load_config("tiny")
    assert (cfg.num_experts, cfg.top_k) == (16, 4)

    calib_LNK, heldout_LNK = synthetic_preset("olmoe", 300, 1, seed=0)
    calib, heldout = calib_LNK[0], heldout_LNK[0]
    experts, devices = 64, 4
    coact = coactivation_counts(torch.as_tensor(calib), experts)
    placements = {
        "contiguous": contiguous(experts, devices),
        "greedy": greedy_occult(coact, devices),
        "swap": swap_search(calib, devices, greedy_occult(coact, devices), rounds=2, seed=0),
        "load_aware_swap": load_aware_swap(calib, devices, contiguous(experts, devices), eps=0.1, rounds=2, seed=0),
        "hierarchical": hierarchical(calib, nodes=2, gpus_per_node=2, num_experts=experts, rounds=2).device_of_expert,
        "metis": metis_partition(coact, devices, seed=0),
        "eplb": eplb_load_only(np.bincount(calib.ravel(), minlength=experts), devices),
    }
    for name, device_of_expert in placements.items():
        assert np.bincount(device_of_expert, minlength=devices).tolist() == [experts // devices] * devices, name
        assert 1 <= expected_ct(heldout, device_of_expert) <= devices, name
        assert max_device_load_over_mean(heldout, device_of_expert, devices) >= 1, name

    logits = torch.randn(32, experts, generator=torch.Generator().manual_seed(0))
    device_of_expert = torch.as_tensor(placements["greedy"])
    for _, ids in (prune_router_score(logits, 8, device_of_expert, max_devices=2),
                   prune_similarity(logits, 8, device_of_expert, 2, torch.as_tensor(coact, dtype=torch.float32))):
        assert ids.shape == (32, 8)
        assert max(len(set(device_of_expert[row].tolist())) for row in ids) <= 2


def main() -> None:
    import occult

    site = Path(sys.prefix).resolve()
    assert site in Path(occult.__file__).resolve().parents, f"occult comes from {occult.__file__}, not {site}"
    names = check_names(Path(sys.argv[1]))
    check_calls()
    print(f"library calls ok ({names} names on the page)")


if __name__ == "__main__":
    main()
