"""Whether a model's routers learned structure: pair mutual information of co-selected experts against
a load-matched null routing, load spread, the best random placement's E[C_T], and group inheritance
from upcycling (`occult.routing.inheritance`). The pre-training stage writes these before and after
training (`router_structure.json`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from occult.routing.profiling import TokenWindows, coactivation_counts, route_windows

PLACEMENT_TRIALS = 64


def pair_mutual_information(coactivation_EE: np.ndarray) -> float:
    """I(X; Y) in bits for (X, Y) a random ordered pair of distinct experts of a random token."""
    pairs = coactivation_EE.astype(np.float64).copy()
    np.fill_diagonal(pairs, 0.0)
    if pairs.sum() == 0:
        return 0.0
    joint = pairs / pairs.sum()
    marginal = joint.sum(axis=1)
    independent = marginal[:, None] * marginal[None, :]
    nz = joint > 0
    return float((joint[nz] * np.log2(joint[nz] / independent[nz])).sum())


def null_routing(load_E: np.ndarray, tokens: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """[tokens, k] ids: k distinct experts per token, Gumbel-top-k with weights = observed loads."""
    log_w = np.log(np.maximum(load_E.astype(np.float64), 0.5))
    scores = log_w[None, :] + rng.gumbel(size=(tokens, len(load_E)))
    return np.argsort(-scores, axis=1)[:, :top_k]


def best_random_placement_ct(ids_NK: np.ndarray, num_experts: int, devices: int, rng: np.random.Generator) -> float:
    """min over random balanced placements of E[C_T] (mean distinct devices per token)."""
    best = float("inf")
    for _ in range(PLACEMENT_TRIALS):
        device_of = np.empty(num_experts, dtype=np.int64)
        device_of[rng.permutation(num_experts)] = np.arange(num_experts) // (num_experts // devices)
        on_device = np.zeros((len(ids_NK), devices), dtype=bool)
        np.put_along_axis(on_device, device_of[ids_NK], True, axis=1)
        best = min(best, float(on_device.sum(axis=1).mean()))
    return best


@dataclass(frozen=True)
class LayerStructure:
    layer: int
    pair_mi_bits: float
    null_pair_mi_bits: float
    excess_pair_mi_bits: float
    load_cv: float
    ct_best_random_placement: float
    null_ct_best_random_placement: float


def routing_structure(ids_LNK: np.ndarray, layers: list[int], num_experts: int, devices: int,
                      seed: int) -> list[LayerStructure]:
    rng = np.random.default_rng(seed)
    out = []
    for layer, ids_NK in zip(layers, ids_LNK.astype(np.int64)):
        tokens, top_k = ids_NK.shape
        coact = coactivation_counts(torch.from_numpy(ids_NK), num_experts)
        load = np.diag(coact)
        null_ids = null_routing(load, tokens, top_k, rng)
        null_coact = coactivation_counts(torch.from_numpy(null_ids), num_experts)
        mi, null_mi = pair_mutual_information(coact), pair_mutual_information(null_coact)
        out.append(LayerStructure(
            layer=int(layer),
            pair_mi_bits=mi,
            null_pair_mi_bits=null_mi,
            excess_pair_mi_bits=mi - null_mi,
            load_cv=float(load.std() / max(load.mean(), 1e-12)),
            ct_best_random_placement=best_random_placement_ct(ids_NK, num_experts, devices, rng),
            null_ct_best_random_placement=best_random_placement_ct(null_ids, num_experts, devices, rng),
        ))
    return out


def inheritance_summary(model: nn.Module, windows: TokenWindows) -> dict[str, Any] | None:
    """Layer-mean group inheritance (`occult.routing.inheritance`) of `model`'s routing on `windows`
    against its virtual-group map; None where E is not a multiple of k (no such map)."""
    from occult.routing.inheritance import group_inheritance, group_map_of_model

    try:
        group_of_expert, basis = group_map_of_model(model.config.to_dict())
    except ValueError:
        return None
    routed = route_windows(model, windows, logit_stats=False, desc="inheritance")
    mean = group_inheritance(routed.ids_LNK, group_of_expert, routed.layers.tolist(), basis).iloc[-1]
    keys = ("basis", "groups_spanned", "groups_spanned_random", "main_group_share", "main_group_share_random",
            "main_group_share_load_null", "inheritance_index")
    return {k: mean[k] if k == "basis" else float(mean[k]) for k in keys}
