"""`use_ep` on tiny random OLMoE, Qwen2-MoE and DeepSeek-V2 models: logits (and, for OLMoE,
expert-weight gradients) equal the unpatched model."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import OlmoeConfig, OlmoeForCausalLM

from occult.harness.ranks import run_ranks
from occult.ep.hf import IMPLEMENTATION_NAME, moe_experts_modules, placements_from_json, use_ep
from occult.ep.plan import experts_of_device

VOCAB, WORLD = 64, 2
PLACEMENT_FILE = {"layers": [0, 1], "device_of_expert": [[0, 1, 0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 1, 1, 0]]}


@pytest.fixture(scope="module")
def reference():
    """The model, per-rank inputs, their logits and the full-batch expert-weight gradients."""
    torch.manual_seed(0)
    config = OlmoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        initializer_range=0.2,  # large enough that the experts move the logits by O(1)
    )
    model = OlmoeForCausalLM(config).float()
    input_ids = torch.randint(0, VOCAB, (WORLD, 2, 9))
    logits = []
    for rank in range(WORLD):
        out = model(input_ids=input_ids[rank])
        out.logits.float().square().mean().backward()       # grads accumulate over the ranks' batches
        logits.append(out.logits.detach())
    grads = {
        layer: (module.gate_up_proj.grad.clone(), module.down_proj.grad.clone())
        for layer, module in moe_experts_modules(model).items()
    }
    model.zero_grad()
    without_experts = copy.deepcopy(model)
    for module in moe_experts_modules(without_experts).values():
        module.down_proj.data.zero_()
    with torch.no_grad():
        assert (without_experts(input_ids=input_ids[0]).logits - logits[0]).abs().max() > 0.1
    return model, input_ids, logits, grads


def run_patched(rank: int, world: int, reference, mode: str) -> dict[str, float]:
    model, input_ids, logits, grads = reference
    patched = use_ep(copy.deepcopy(model), placements_from_json(PLACEMENT_FILE), mode=mode)
    out = patched(input_ids=input_ids[rank])
    out.logits.float().square().mean().backward()
    report = {"logits": float((out.logits.detach() - logits[rank]).abs().max())}
    for layer, module in moe_experts_modules(patched).items():
        placement = torch.tensor(PLACEMENT_FILE["device_of_expert"][layer])
        if world == 1:
            placement = torch.zeros(8, dtype=torch.long)
        local = experts_of_device(placement, rank)
        want_gate_up, want_down = grads[layer]
        got_gate_up = module.gate_up_proj.grad.clone()
        got_down = module.down_proj.grad.clone()
        if world > 1:
            report[f"grad_gate_up_{layer}"] = float((got_gate_up - want_gate_up[local]).abs().max())
            report[f"grad_down_{layer}"] = float((got_down - want_down[local]).abs().max())
        assert module.gate_up_proj.shape[0] == len(local)
    report["implementation"] = patched.config._experts_implementation
    return report


@pytest.mark.parametrize("mode", ["dedup", "per_expert"])
def test_two_ranks_match_unpatched(reference, mode):
    for report in run_ranks(run_patched, WORLD, reference, mode, timeout_s=60):
        assert report.pop("implementation") == IMPLEMENTATION_NAME
        for field, err in report.items():
            assert err < 1e-5, f"{mode}: {field} off by {err:.2e}"


def test_single_device_matches_unpatched(reference):
    model, input_ids, logits, _ = reference
    patched = use_ep(copy.deepcopy(model), {0: [0] * 8, 1: [0] * 8})
    with torch.no_grad():
        out = patched(input_ids=input_ids[0]).logits
    torch.testing.assert_close(out, logits[0], atol=1e-5, rtol=0)


def test_bad_placements_are_named(reference):
    model = copy.deepcopy(reference[0])
    with pytest.raises(ValueError, match=r"no placement for MoE layers \[1\]"):
        use_ep(model, {0: [0] * 8})
    with pytest.raises(ValueError, match=r"placements\[0\]"):
        use_ep(copy.deepcopy(reference[0]), {0: [0] * 7, 1: [0] * 8})
    with pytest.raises(ValueError, match="device_of_expert"):
        placements_from_json({"layers": [0]})


def _other_family_logits(rank: int, world: int, arch: str, mode: str) -> float:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.models.test_moe import tiny_hf_model

    model = tiny_hf_model(arch, VOCAB).float()
    modules = moe_experts_modules(model)
    with torch.no_grad():
        for module in modules.values():            # experts strong enough to move the logits
            module.gate_up_proj.normal_(0, 0.3)
            module.down_proj.normal_(0, 0.3)
    input_ids = torch.randint(0, VOCAB, (world, 2, 9), generator=torch.Generator().manual_seed(3))[rank]
    with torch.no_grad():
        want = model(input_ids=input_ids).logits
    experts = next(iter(modules.values())).gate_up_proj.shape[0]
    placements = {layer: torch.arange(experts) % world for layer in modules}
    patched = use_ep(copy.deepcopy(model), placements, mode=mode)
    with torch.no_grad():
        got = patched(input_ids=input_ids).logits
        silenced = copy.deepcopy(model)
        for module in moe_experts_modules(silenced).values():
            module.down_proj.zero_()
        expert_effect = float((silenced(input_ids=input_ids).logits - want).abs().max())
    local_counts = {m.gate_up_proj.shape[0] for m in moe_experts_modules(patched).values()}
    return {"err": float((got - want).abs().max()), "expert_effect": expert_effect,
            "local_experts": sorted(local_counts), "experts": experts,
            "implementation": patched.config._experts_implementation}


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v2", "mixtral"])
@pytest.mark.parametrize("mode", ["dedup", "per_expert"])
def test_qwen2_moe_deepseek_v2_and_mixtral_match_unpatched_on_two_ranks(arch, mode):
    """Shared experts and dense first layers stay outside EP; the routed experts go through it."""
    for report in run_ranks(_other_family_logits, WORLD, arch, mode, timeout_s=60):
        assert report["implementation"] == IMPLEMENTATION_NAME
        assert report["local_experts"] == [report["experts"] // WORLD]      # really sharded
        assert report["expert_effect"] > 0.05                               # the experts matter
        assert report["err"] < 1e-5, f"{arch} {mode}: logits off by {report['err']:.2e}"
