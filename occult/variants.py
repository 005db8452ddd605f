"""Fine-tuning variants as routing rules: `raw`/`sft` keep the model's top-k; `prune<N>-router`
and `prune<N>-sim` restrict each token to N devices of the fine-tuning placement.

The same rule is active while a variant is fine-tuned and while it is evaluated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from occult.config import Config, Variant, parse_variant

RoutingFn = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def placement_file(cfg: Config, placements_dir: Path) -> Path:
    return placements_dir / f"D{cfg.finetune.devices}_{cfg.finetune.placement_method}.json"


def routing_for_variant(cfg: Config, variant: Variant | str, placements_dir: Path, profile_dir: Path,
                        norm_topk_prob: bool = False) -> RoutingFn | None:
    """The routing override of a variant (None = the model's own top-k)."""
    from occult.placement import load_placement_layers
    from occult.pruning import prune_router_score, prune_similarity

    v = parse_variant(variant) if isinstance(variant, str) else variant
    if v.max_devices is None:
        return None
    layers, device_of_expert_LE = load_placement_layers(placement_file(cfg, placements_dir))
    placement = {layer: torch.as_tensor(row, dtype=torch.long) for layer, row in zip(layers, device_of_expert_LE)}
    k, gate, devices = cfg.top_k, cfg.finetune.gate_weights, cfg.finetune.devices
    if v.method == "router":
        def route(layer: int, logits_TE: torch.Tensor):
            return prune_router_score(logits_TE, k, placement[layer].to(logits_TE.device), v.max_devices,
                                      gate=gate, norm_topk_prob=norm_topk_prob, num_devices=devices)
        return route

    from occult.profiling import load_profile

    prof = load_profile(profile_dir / "profile.npz")
    similarity = {int(layer): torch.as_tensor(sim_EE, dtype=torch.float32)
                  for layer, sim_EE in zip(prof.layers, prof.similarity())}

    def route_sim(layer: int, logits_TE: torch.Tensor):
        return prune_similarity(logits_TE, k, placement[layer].to(logits_TE.device), v.max_devices,
                                similarity[layer].to(logits_TE.device), gate=gate,
                                norm_topk_prob=norm_topk_prob, num_devices=devices)
    return route_sim
