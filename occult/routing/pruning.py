"""Collaboration pruning: routing that sends each token to at most N_d devices.

Both rules run inside a model's forward pass, are vectorised over tokens and return
`(weights_TK, ids_TK)` like a top-k router; weights stay differentiable w.r.t. the logits.

- Router-score (`prune_router_score`): walk all experts by descending router score, collect the
  first N_d distinct devices met, then take the top-k experts among the experts on them.
- Similarity (`prune_similarity`): take the plain top-k; its device set is the first N_d distinct
  devices in top-k order. Selected experts on those devices stay; each one outside is replaced, in
  top-k order, by the expert inside the set most similar to it (`similarity_EE`, e.g. router-logit
  cosine) that is not selected yet. The replacement keeps the replaced expert's slot.

Gate weights are probabilities from a softmax over all E logits, read at the final ids.
`gate="keep"` gives each kept expert the weight the unpruned router would give it: the probability
itself (OLMoE), or for a router that normalises its top-k (`norm_topk_prob=True`, Mixtral) the
probability over the unpruned top-k's mass. Either way the weights sum to less than the unpruned
ones when pruning drops probability mass. `gate="renormalise"` divides them by their own sum
(the rule a normalising router applies to whatever set it is given). For similarity replacements, `weight_from="own"`
(default) gives a replacement its own router probability, so the gate reflects how much the router
actually wants the expert that runs; `weight_from="replaced"` lets it inherit the probability of
the expert it replaces, which keeps the total gate mass of the unpruned top-k.

Pruned routing needs N_d · E/D ≥ k (enough experts on N_d devices). Pass `num_devices` to check
it without a device→host sync; without it D is read from the placement (one sync).
"""

from __future__ import annotations

import torch

GATES = ("keep", "renormalise")
WEIGHT_SOURCES = ("own", "replaced")


def unpruned_topk(logits_TE: torch.Tensor, k: int, norm_topk_prob: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain top-k routing: ids by descending logit, weights = softmax probabilities at those ids."""
    _check_logits(logits_TE, k)
    ids_TK = torch.topk(logits_TE, k, dim=-1).indices
    return _gate_weights(logits_TE, ids_TK, renormalise=norm_topk_prob), ids_TK


def prune_router_score(logits_TE: torch.Tensor, k: int, device_of_expert_E: torch.Tensor, max_devices: int,
                       gate: str = "keep", norm_topk_prob: bool = False,
                       num_devices: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k among the experts on the first `max_devices` distinct devices of the score ranking."""
    _check_args(logits_TE, k, device_of_expert_E, max_devices, gate, num_devices)
    num_tokens, num_experts = logits_TE.shape
    device_of_expert_E = device_of_expert_E.to(device=logits_TE.device, dtype=torch.long)
    with torch.no_grad():
        order_TE = torch.argsort(logits_TE, dim=-1, descending=True, stable=True)
        rank_device_TE = device_of_expert_E[order_TE]                    # device of the i-th ranked expert
        # first rank at which each device appears (devices are < E, so E slots suffice)
        first_rank_TX = torch.full((num_tokens, num_experts), num_experts, dtype=torch.long, device=logits_TE.device)
        ranks_TE = torch.arange(num_experts, device=logits_TE.device).expand(num_tokens, -1)
        first_rank_TX.scatter_reduce_(1, rank_device_TE, ranks_TE, reduce="amin")
        is_new_TE = first_rank_TX.gather(1, rank_device_TE) == ranks_TE
        devices_seen_TE = torch.cumsum(is_new_TE, dim=1)                   # distinct devices up to rank i
        # an expert is allowed when its device was among the first max_devices distinct ones
        expert_first_rank_TE = first_rank_TX[:, device_of_expert_E]
        allowed_TE = devices_seen_TE.gather(1, expert_first_rank_TE) <= max_devices
        masked_TE = logits_TE.detach().masked_fill(~allowed_TE, float("-inf"))
        ids_TK = torch.topk(masked_TE, k, dim=-1).indices
    return _pruned_gates(logits_TE, ids_TK, k, gate, norm_topk_prob), ids_TK


def prune_similarity(logits_TE: torch.Tensor, k: int, device_of_expert_E: torch.Tensor, max_devices: int,
                     similarity_EE: torch.Tensor, gate: str = "keep", norm_topk_prob: bool = False,
                     weight_from: str = "own",
                     num_devices: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k with every expert outside the token's first `max_devices` devices replaced by its most
    similar unselected expert inside them (see the module docstring)."""
    _check_args(logits_TE, k, device_of_expert_E, max_devices, gate, num_devices)
    num_tokens, num_experts = logits_TE.shape
    if similarity_EE.shape != (num_experts, num_experts):
        raise ValueError(f"similarity_EE must have shape [{num_experts}, {num_experts}], got {tuple(similarity_EE.shape)}")
    if weight_from not in WEIGHT_SOURCES:
        raise ValueError(f"weight_from must be one of {WEIGHT_SOURCES}, got {weight_from!r}")
    device_of_expert_E = device_of_expert_E.to(device=logits_TE.device, dtype=torch.long)
    similarity_EE = similarity_EE.to(device=logits_TE.device)
    with torch.no_grad():
        topk_ids_TK = torch.topk(logits_TE, k, dim=-1).indices
        topk_device_TK = device_of_expert_E[topk_ids_TK]
        same_KK = topk_device_TK[:, :, None] == topk_device_TK[:, None, :]              # [T, K, K]
        first_slot_TK = same_KK.int().argmax(dim=2)                # first slot holding the same device
        slots = torch.arange(k, device=logits_TE.device)
        is_new_TK = first_slot_TK == slots
        device_order_TK = torch.cumsum(is_new_TK, dim=1).gather(1, first_slot_TK)     # 1-based device rank
        inside_TK = device_order_TK <= max_devices
        kept_device_TKE = (device_of_expert_E[None, None, :] == topk_device_TK[:, :, None]) & inside_TK[:, :, None]
        allowed_TE = kept_device_TKE.any(dim=1)
        taken_TE = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=logits_TE.device)
        taken_TE.scatter_(1, topk_ids_TK, True)
        ids_TK = topk_ids_TK.clone()
        for slot in range(k):
            outside_T = ~inside_TK[:, slot]
            # finite scores for candidates (a NaN similarity, e.g. of a never-used expert, ranks last),
            # -inf for the rest; argmax takes the lowest index among ties
            sim_TE = similarity_EE[topk_ids_TK[:, slot]].float().nan_to_num(nan=-3e38, posinf=3e38, neginf=-3e38)
            candidates_TE = allowed_TE & ~taken_TE
            best_T = sim_TE.masked_fill(~candidates_TE, float("-inf")).argmax(dim=1)
            ids_TK[:, slot] = torch.where(outside_T, best_T, topk_ids_TK[:, slot])
            taken_TE[torch.arange(num_tokens, device=logits_TE.device), best_T] |= outside_T
    weight_ids_TK = ids_TK if weight_from == "own" else topk_ids_TK
    return _pruned_gates(logits_TE, weight_ids_TK, k, gate, norm_topk_prob), ids_TK


def check_prunable(num_experts: int, k: int, num_devices: int, max_devices: int) -> None:
    """Raise unless a balanced placement leaves k experts on `max_devices` devices."""
    if num_devices < 1 or num_experts % num_devices:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {num_devices} devices")
    if max_devices < 1:
        raise ValueError(f"max_devices must be at least 1, got {max_devices}")
    if min(max_devices, num_devices) * (num_experts // num_devices) < k:
        raise ValueError(f"max_devices*E/D = {max_devices}*{num_experts}/{num_devices} < k = {k}: "
                         "a pruned token could not keep k experts")


def _pruned_gates(logits_TE: torch.Tensor, ids_TK: torch.Tensor, k: int, gate: str,
                  norm_topk_prob: bool) -> torch.Tensor:
    """Gate weights at the pruned ids under `gate` (module docstring)."""
    if gate == "renormalise" or not norm_topk_prob:
        return _gate_weights(logits_TE, ids_TK, renormalise=gate == "renormalise")
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    unpruned_mass_T1 = torch.topk(probs_TE, k, dim=-1).values.sum(dim=-1, keepdim=True)
    return (probs_TE.gather(1, ids_TK) / unpruned_mass_T1).to(logits_TE.dtype)


def _gate_weights(logits_TE: torch.Tensor, ids_TK: torch.Tensor, renormalise: bool) -> torch.Tensor:
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    weights_TK = probs_TE.gather(1, ids_TK)
    if renormalise:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype)


def _check_logits(logits_TE: torch.Tensor, k: int) -> None:
    if logits_TE.ndim != 2:
        raise ValueError(f"logits_TE must be [tokens, experts], got shape {tuple(logits_TE.shape)}")
    if not 1 <= k <= logits_TE.shape[1]:
        raise ValueError(f"k={k} must lie in [1, {logits_TE.shape[1]}]")


def _check_args(logits_TE: torch.Tensor, k: int, device_of_expert_E: torch.Tensor, max_devices: int,
                gate: str, num_devices: int | None) -> None:
    _check_logits(logits_TE, k)
    num_experts = logits_TE.shape[1]
    if device_of_expert_E.shape != (num_experts,):
        raise ValueError(f"device_of_expert_E must have shape [{num_experts}], got {tuple(device_of_expert_E.shape)}")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if num_devices is None:
        num_devices = int(device_of_expert_E.max()) + 1
    check_prunable(num_experts, k, num_devices, max_devices)
