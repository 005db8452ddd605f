"""occult.routing.variants.routing_for_variant follows each model family's own top-k rule: pruning to all
D devices (nothing to prune) must give exactly the model's own output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from occult.config import load_config
from occult.models.moe import moe_layers, set_routing
from occult.routing.variants import routing_for_variant
from tests.models.test_moe import tiny_hf_model

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arch", ["olmoe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("method", ["router", "sim"])
def test_pruning_to_every_device_equals_the_models_own_routing(tmp_path, arch, method):
    model = tiny_hf_model(arch, 64)
    layers = moe_layers(model)
    experts, k = layers[0].num_experts, layers[0].top_k
    placements, profile = tmp_path / "placement", tmp_path / "profile"
    placements.mkdir()
    (placements / "D2_contiguous.json").write_text(json.dumps({
        "devices": 2, "method": "contiguous", "num_experts": experts, "top_k": k,
        "layers": [layer.layer_index for layer in layers],
        "device_of_expert": [[e * 2 // experts for e in range(experts)] for _ in layers]}))
    if method == "sim":        # any valid profile: with nothing pruned no expert is replaced
        profile.mkdir()
        L, rng = len(layers), np.random.default_rng(0)
        vectors = rng.standard_normal((L, experts, 5))
        load = rng.integers(1, 50, (L, experts))
        coactivation = np.zeros((L, experts, experts), dtype=np.int64)
        coactivation[:, np.arange(experts), np.arange(experts)] = load
        np.savez(profile / "profile.npz", coactivation=coactivation, load=load,
                 logit_gram=vectors @ vectors.transpose(0, 2, 1), logit_sum=vectors.sum(-1), tokens=np.int64(100),
                 layers=np.array([layer.layer_index for layer in layers]), top_k=np.int64(k),
                 num_experts=np.int64(experts))
    cfg = load_config(REPO / "config" / "config.yaml", overrides={
        "model": {"num_experts": experts, "top_k": k},
        "placement": {"devices": [2], "methods": ["contiguous"]},
        "finetune": {"devices": 2, "placement_method": "contiguous", "gate_weights": "keep"},
        "bench": {"devices": 2, "cases": ["trivial"]},
    })
    x = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(x).logits
        set_routing(model, routing_for_variant(cfg, f"prune2-{method}", placements, profile, model))
        got = model(x).logits
        set_routing(model, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_core_quality_arms_keep_one_d_with_the_gate_ablation():
    import yaml

    from occult.config import merge
    from occult.routing.variants import quality_arms

    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg = load_config(merge(base, {"model": {"num_experts": 64, "top_k": 8}, "placement": {"devices": [2, 4, 8]},
                                   "finetune": {"devices": 8, "quality_grid": True, "quality_arms": "core"},
                                   "bench": {"devices": 2}}))
    assert [a.name for a in quality_arms(cfg)] == [
        "raw", "sft-moe", "prune1-router-D8-keep-moe", "prune1-sim-D8-keep-moe", "prune2-router-D8-keep-moe",
        "prune2-sim-D8-keep-moe", "prune2-sim-D8-renormalise-moe", "prune1-sim-D8-renormalise-moe"]
