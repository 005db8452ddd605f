"""Collaboration pruning: invariants, exactness where nothing is pruned, gradients, and equality
with slow per-token Python references."""

from __future__ import annotations

import math

import pytest
import torch

from occult.routing.pruning import check_prunable, prune_router_score, prune_similarity, unpruned_topk

# (E, k, D, N_d): N_d * E/D >= k everywhere
SHAPES = [
    (16, 4, 2, 1), (16, 4, 4, 1), (16, 4, 4, 2), (16, 4, 8, 2), (16, 4, 8, 3), (16, 4, 4, 4),
    (64, 8, 2, 1), (64, 8, 4, 1), (64, 8, 4, 2), (64, 8, 8, 1), (64, 8, 8, 2), (64, 8, 8, 8),
]
TOKENS = 200


def make_case(num_experts: int, num_devices: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(TOKENS, num_experts, generator=gen) * 2
    device_of_expert_E = (torch.arange(num_experts) // (num_experts // num_devices))[torch.randperm(num_experts, generator=gen)]
    features_EF = torch.randn(num_experts, 16, generator=gen)
    features_EF = features_EF / features_EF.norm(dim=1, keepdim=True)
    similarity_EE = features_EF @ features_EF.T
    return logits_TE, device_of_expert_E, similarity_EE


def reference_router_score(logits_E: list[float], k: int, device_of: list[int], max_devices: int) -> list[int]:
    ranked = sorted(range(len(logits_E)), key=lambda e: -logits_E[e])
    devices: list[int] = []
    for e in ranked:
        if device_of[e] not in devices and len(devices) < max_devices:
            devices.append(device_of[e])
    return [e for e in ranked if device_of[e] in devices][:k]


def reference_similarity(logits_E: list[float], k: int, device_of: list[int], max_devices: int,
                         sim: list[list[float]]) -> tuple[list[int], list[int]]:
    topk = sorted(range(len(logits_E)), key=lambda e: -logits_E[e])[:k]
    devices: list[int] = []
    for e in topk:
        if device_of[e] not in devices and len(devices) < max_devices:
            devices.append(device_of[e])
    chosen, taken = list(topk), set(topk)
    for slot, e in enumerate(topk):
        if device_of[e] in devices:
            continue
        candidates = [c for c in range(len(logits_E)) if device_of[c] in devices and c not in taken]
        best = max(candidates, key=lambda c: (sim[e][c], -c))
        chosen[slot] = best
        taken.add(best)
    return chosen, topk


def reference_weights(logits_E: list[float], ids: list[int], renormalise: bool) -> list[float]:
    z = max(logits_E)
    exp = [math.exp(v - z) for v in logits_E]
    probs = [exp[e] / sum(exp) for e in ids]
    return [p / sum(probs) for p in probs] if renormalise else probs


def devices_spanned(ids_TK: torch.Tensor, device_of_expert_E: torch.Tensor) -> torch.Tensor:
    devices_TK = device_of_expert_E[ids_TK].sort(dim=1).values
    return 1 + (devices_TK.diff(dim=1) != 0).sum(dim=1)


def both_rules(logits_TE, k, device_of_expert_E, max_devices, similarity_EE, gate="keep"):
    yield "router", prune_router_score(logits_TE, k, device_of_expert_E, max_devices, gate=gate)
    yield "sim", prune_similarity(logits_TE, k, device_of_expert_E, max_devices, similarity_EE, gate=gate)


@pytest.mark.parametrize("num_experts,k,num_devices,max_devices", SHAPES)
def test_invariants_and_exact_when_unpruned(num_experts, k, num_devices, max_devices):
    logits_TE, device_of_expert_E, similarity_EE = make_case(num_experts, num_devices, seed=num_experts + 7 * max_devices)
    plain_w_TK, plain_ids_TK = unpruned_topk(logits_TE, k)
    fits_T = devices_spanned(plain_ids_TK, device_of_expert_E) <= max_devices
    for name, (weights_TK, ids_TK) in both_rules(logits_TE, k, device_of_expert_E, max_devices, similarity_EE):
        assert ids_TK.shape == weights_TK.shape == (TOKENS, k), name
        assert (devices_spanned(ids_TK, device_of_expert_E) <= max_devices).all(), name
        assert (ids_TK.sort(dim=1).values.diff(dim=1) != 0).all(), f"{name}: an expert repeats in a row"
        assert ((ids_TK >= 0) & (ids_TK < num_experts)).all(), name
        # tokens whose top-k already fits in N_d devices are routed exactly as without pruning
        assert torch.equal(ids_TK[fits_T], plain_ids_TK[fits_T]), name
        assert torch.equal(weights_TK[fits_T], plain_w_TK[fits_T]), name
        if max_devices >= num_devices:
            assert fits_T.all()
            assert torch.equal(ids_TK, plain_ids_TK) and torch.equal(weights_TK, plain_w_TK), name
    if max_devices < num_devices:
        assert not fits_T.all(), "the case should prune some tokens"


@pytest.mark.parametrize("num_experts,k,num_devices,max_devices", SHAPES)
@pytest.mark.parametrize("gate", ["keep", "renormalise"])
def test_router_score_matches_reference(num_experts, k, num_devices, max_devices, gate):
    logits_TE, device_of_expert_E, _ = make_case(num_experts, num_devices, seed=3 * num_experts + max_devices)
    weights_TK, ids_TK = prune_router_score(logits_TE, k, device_of_expert_E, max_devices, gate=gate)
    device_of = device_of_expert_E.tolist()
    for t in range(TOKENS):
        row = logits_TE[t].double().tolist()
        want = reference_router_score(row, k, device_of, max_devices)
        assert ids_TK[t].tolist() == want, f"token {t}"
        torch.testing.assert_close(weights_TK[t].double(),
                                   torch.tensor(reference_weights(row, want, gate == "renormalise"), dtype=torch.float64),
                                   atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_experts,k,num_devices,max_devices", SHAPES)
@pytest.mark.parametrize("gate,weight_from", [("keep", "own"), ("renormalise", "own"), ("keep", "replaced")])
def test_similarity_matches_reference(num_experts, k, num_devices, max_devices, gate, weight_from):
    logits_TE, device_of_expert_E, similarity_EE = make_case(num_experts, num_devices, seed=5 * num_experts + max_devices)
    weights_TK, ids_TK = prune_similarity(logits_TE, k, device_of_expert_E, max_devices, similarity_EE,
                                          gate=gate, weight_from=weight_from)
    device_of, sim = device_of_expert_E.tolist(), similarity_EE.double().tolist()
    for t in range(TOKENS):
        row = logits_TE[t].double().tolist()
        want, topk = reference_similarity(row, k, device_of, max_devices, sim)
        assert ids_TK[t].tolist() == want, f"token {t}"
        weight_ids = want if weight_from == "own" else topk
        torch.testing.assert_close(weights_TK[t].double(),
                                   torch.tensor(reference_weights(row, weight_ids, gate == "renormalise"), dtype=torch.float64),
                                   atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("gate", ["keep", "renormalise"])
def test_gradients_reach_the_logits(gate):
    logits_TE, device_of_expert_E, similarity_EE = make_case(64, 8, seed=11)
    for name, fn in [
        ("router", lambda x: prune_router_score(x, 8, device_of_expert_E, 2, gate=gate)),
        ("sim", lambda x: prune_similarity(x, 8, device_of_expert_E, 2, similarity_EE, gate=gate)),
        ("plain", lambda x: unpruned_topk(x, 8, norm_topk_prob=gate == "renormalise")),
    ]:
        x = logits_TE.clone().requires_grad_(True)
        weights_TK, _ = fn(x)
        probe_TK = torch.randn(weights_TK.shape, generator=torch.Generator().manual_seed(0))
        (grad,) = torch.autograd.grad((weights_TK * probe_TK).sum(), x)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
        # gradient equals that of softmax-gather at the returned ids (ids are constants)
        y = logits_TE.clone().requires_grad_(True)
        _, ids_TK = fn(logits_TE)
        ref_TK = torch.softmax(y, dim=-1).gather(1, ids_TK) if name != "sim" else None
        if ref_TK is not None:
            if gate == "renormalise":
                ref_TK = ref_TK / ref_TK.sum(dim=1, keepdim=True)
            (ref_grad,) = torch.autograd.grad((ref_TK * probe_TK).sum(), y)
            torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("rule", ["router", "sim"])
def test_a_normalising_router_keeps_its_unpruned_weights_or_renormalises(rule):
    """norm_topk_prob (Mixtral): `keep` divides each kept probability by the unpruned top-k's mass,
    `renormalise` by the kept experts' own; pruning to every device gives the router's own weights."""
    k, num_devices = 8, 8
    logits_TE, device_of_expert_E, similarity_EE = make_case(64, num_devices, seed=13)
    probs_TE = torch.softmax(logits_TE.double(), dim=-1)
    unpruned_mass_T = probs_TE.topk(k, dim=-1).values.sum(dim=-1)

    def prune(gate, max_devices):
        if rule == "router":
            return prune_router_score(logits_TE, k, device_of_expert_E, max_devices, gate=gate, norm_topk_prob=True)
        return prune_similarity(logits_TE, k, device_of_expert_E, max_devices, similarity_EE, gate=gate,
                                norm_topk_prob=True)

    for gate in ("keep", "renormalise"):
        weights_TK, ids_TK = prune(gate, 2)
        kept_TK = probs_TE.gather(1, ids_TK)
        want_TK = kept_TK / (unpruned_mass_T[:, None] if gate == "keep" else kept_TK.sum(dim=1, keepdim=True))
        torch.testing.assert_close(weights_TK.double(), want_TK, atol=1e-6, rtol=1e-5)
    kept_sum_T = prune("keep", 2)[0].double().sum(dim=1)
    assert (kept_sum_T <= 1 + 1e-6).all() and (kept_sum_T < 1 - 1e-3).any()     # pruning dropped mass
    own_w_TK, own_ids_TK = unpruned_topk(logits_TE, k, norm_topk_prob=True)
    for gate in ("keep", "renormalise"):
        weights_TK, ids_TK = prune(gate, num_devices)
        assert torch.equal(ids_TK, own_ids_TK)
        torch.testing.assert_close(weights_TK, own_w_TK)


def test_nan_similarity_still_picks_a_valid_expert():
    logits_TE, device_of_expert_E, similarity_EE = make_case(16, 4, seed=2)
    similarity_EE[:, :8] = float("nan")
    _, ids_TK = prune_similarity(logits_TE, 4, device_of_expert_E, 1, similarity_EE)
    assert (devices_spanned(ids_TK, device_of_expert_E) <= 1).all()
    assert (ids_TK.sort(dim=1).values.diff(dim=1) != 0).all()


def test_bad_arguments_are_named():
    logits_TE, device_of_expert_E, similarity_EE = make_case(16, 8, seed=0)
    with pytest.raises(ValueError, match="max_devices\\*E/D"):
        prune_router_score(logits_TE, 4, device_of_expert_E, 1)          # 1 * 16/8 = 2 < 4
    with pytest.raises(ValueError, match="gate"):
        prune_router_score(logits_TE, 2, device_of_expert_E, 1, gate="sum")
    with pytest.raises(ValueError, match="device_of_expert_E"):
        prune_router_score(logits_TE, 2, device_of_expert_E[:8], 1)
    with pytest.raises(ValueError, match="similarity_EE"):
        prune_similarity(logits_TE, 2, device_of_expert_E, 1, similarity_EE[:4])
    with pytest.raises(ValueError, match="weight_from"):
        prune_similarity(logits_TE, 2, device_of_expert_E, 1, similarity_EE, weight_from="mean")
    with pytest.raises(ValueError, match="cannot be split"):
        check_prunable(16, 2, 3, 1)
    check_prunable(64, 8, 8, 1)
