"""Fine-tuning variants as routing rules: `raw`/`sft` keep the model's top-k; `prune<N>-router`
and `prune<N>-sim` restrict each token to N devices of the fine-tuning placement.

The same rule is active while a variant is fine-tuned and while it is evaluated.
`quality_arms(cfg)` lists the quality study's arms (variant x devices x gate handling x trained
modules); `arm_config` gives each its own resolved config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from occult.config import Config, Variant, parse_variant

RoutingFn = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def placement_file(cfg: Config, placements_dir: Path) -> Path:
    return placements_dir / f"D{cfg.finetune.devices}_{cfg.finetune.placement_method}.json"


def routing_for_variant(cfg: Config, variant: Variant | str, placements_dir: Path, profile_dir: Path,
                        model: torch.nn.Module) -> RoutingFn | None:
    """The routing override of a variant for `model` (None = the model's own top-k).

    Pruned weights follow `finetune.gate_weights` against each layer's own rule (`occult.routing.pruning`:
    `keep` = what the unpruned router gives each kept expert, normalised over the unpruned top-k's
    mass where the router normalises its top-k: Mixtral, Qwen2-MoE with `norm_topk_prob`), then
    DeepSeek's routed scaling factor.
    """
    from occult.models.moe import moe_layers
    from occult.routing.placement import load_placement_layers
    from occult.routing.pruning import prune_router_score, prune_similarity

    v = parse_variant(variant) if isinstance(variant, str) else variant
    if v.max_devices is None:
        return None
    rules = {layer.layer_index: layer.rule for layer in moe_layers(model)}
    layers, device_of_expert_LE = load_placement_layers(placement_file(cfg, placements_dir))
    placement = {layer: torch.as_tensor(row, dtype=torch.long) for layer, row in zip(layers, device_of_expert_LE)}
    k, gate, devices = cfg.top_k, cfg.finetune.gate_weights, cfg.finetune.devices

    def scaled(layer: int, weights_TK: torch.Tensor, ids_TK: torch.Tensor):
        scaling = rules[layer].scaling
        return (weights_TK * scaling if scaling != 1.0 else weights_TK), ids_TK

    if v.method == "router":
        def route(layer: int, logits_TE: torch.Tensor):
            return scaled(layer, *prune_router_score(
                logits_TE, k, placement[layer].to(logits_TE.device), v.max_devices, gate=gate,
                norm_topk_prob=rules[layer].norm_topk_prob, num_devices=devices))
        return route

    from occult.routing.profiling import load_profile

    prof = load_profile(profile_dir / "profile.npz")
    similarity = {int(layer): torch.as_tensor(sim_EE, dtype=torch.float32)
                  for layer, sim_EE in zip(prof.layers, prof.similarity())}

    def route_sim(layer: int, logits_TE: torch.Tensor):
        return scaled(layer, *prune_similarity(
            logits_TE, k, placement[layer].to(logits_TE.device), v.max_devices,
            similarity[layer].to(logits_TE.device), gate=gate, norm_topk_prob=rules[layer].norm_topk_prob,
            num_devices=devices))
    return route_sim


# --------------------------------------------------------------------------- the quality study's arms


@dataclass(frozen=True)
class Arm:
    """One fine-tuned (or raw) model of the quality study: a variant under a fine-tuning setting.

    The setting is applied as overrides of the `finetune` section, so each arm has its own
    resolved config (and config hash) and the unchanged `finetune`/`evaluate` stages run it.
    """

    variant: str
    devices: int
    gate_weights: str = "keep"
    train_modules: str = "moe"

    @property
    def name(self) -> str:
        """`raw`, `sft-moe`, `prune2-sim-D8-keep-moe`, ... (a file-name-safe label)."""
        v = parse_variant(self.variant)
        if not v.trains:
            return "raw"
        if v.max_devices is None:
            return f"sft-{self.train_modules}"
        return f"{self.variant}-D{self.devices}-{self.gate_weights}-{self.train_modules}"

    def overrides(self) -> dict:
        return {"finetune": {"variants": [self.variant], "devices": self.devices,
                             "gate_weights": self.gate_weights, "train_modules": self.train_modules}}


CORE_MAX_DEVICES = (1, 2)


def quality_arms(cfg: Config, devices: tuple[int, ...] = (4, 8), max_devices: tuple[int, ...] = (1, 2, 4),
                 renormalised: tuple[str, ...] = ("prune2-sim", "prune1-sim"),
                 fully_trained: tuple[str, ...] = ("sft", "prune2-sim")) -> list[Arm]:
    """The arms of the quality study, in run order.

    raw; standard SFT; `prune<N_d>-{router,sim}` for every D in `devices` (those of
    `cfg.placement.devices`) and every N_d < D with N_d*E/D >= k, gates kept, MoE modules trained;
    the gate ablation (`renormalised` variants with renormalised gates, against the kept gates
    of the same variant: `occult.routing.pruning` defines both for every router) and full fine-tuning
    (`fully_trained`) at the largest D. Every arm shares data, steps and seed.
    With `finetune.quality_arms: core` the grid keeps D = `finetune.devices` and N_d in
    CORE_MAX_DEVICES, with the gate ablation and without full fine-tuning (8 arms at D = 8).
    """
    if cfg.finetune.quality_arms == "core":
        devices, max_devices, fully_trained = (cfg.finetune.devices,), CORE_MAX_DEVICES, ()
    experts, k = cfg.num_experts, cfg.top_k
    usable = [d for d in devices if d in cfg.placement.devices and experts % d == 0]
    if not usable:
        raise ValueError(f"placement.devices: none of {devices} is a placement device count of this config")
    base = cfg.finetune.devices if cfg.finetune.devices in usable else usable[0]
    arms = [Arm("raw", base), Arm("sft", base)]
    for d in usable:
        for nd in max_devices:
            if nd < d and nd * experts // d >= k:
                arms += [Arm(f"prune{nd}-router", d), Arm(f"prune{nd}-sim", d)]
    largest = max(usable)
    valid = {a.variant for a in arms if a.devices == largest} | {"sft"}
    arms += [Arm(v, largest if v != "sft" else base, gate_weights="renormalise")
             for v in renormalised if v in valid and v != "sft"]
    arms += [Arm(v, largest if v != "sft" else base, train_modules="all") for v in fully_trained if v in valid]
    return arms


def arm_config(cfg: Config, arm: Arm) -> Config:
    """`cfg` with the arm's fine-tuning setting (validated like any config)."""
    from occult.config import load_config, merge

    return load_config(merge(cfg.raw, arm.overrides()))


def arms_before_deadline(arms, deadline: float | None, missing: list[str]):
    """Yield the arms of `arms` (an iterable or progress bar) while `time.monotonic()` is before
    `deadline`; the names of the rest go to `missing` (a resumable phase picks them up next call)."""
    import time

    for arm in arms:
        if deadline is not None and time.monotonic() >= deadline:
            missing.append(arm.name)
            continue
        if hasattr(arms, "log"):
            arms.log(arm=arm.name)
        yield arm


def write_arms_done(path: Path, arms: list, where: Path, stage: str) -> None:
    """The record a finished grid stage leaves for the workflow (its declared output): the arms and
    the folder holding them. The arms themselves are saved one by one outside the declared outputs,
    so that a job cut off and started again keeps the finished ones."""
    from occult.provenance import provenance, write_json

    write_json(path, {"stage": stage, "arms": [arm.name for arm in arms], "folder": str(where),
                      "provenance": provenance(None, None, stage=stage)})


PROCESSES_PER_GPU_ENV = "OCCULT_PROCESSES_PER_GPU"


def cap_gpu_memory_share(environ: dict | None = None) -> float | None:
    """Where `OCCULT_PROCESSES_PER_GPU` = n > 1 (set it when n `--shard` processes share one GPU), cap
    this process's CUDA caching allocator at 0.95/n of the GPU, so that it frees its cache and retries
    before starving the processes beside it (uncapped, one evaluation process held 85 GiB of an
    H200 and its neighbour failed to allocate 3.6 GiB). Evaluation calls it; fine-tuning does not,
    since a third of an H200 failed its full-module arms. Returns the fraction set, or None."""
    import os

    raw = (os.environ if environ is None else environ).get(PROCESSES_PER_GPU_ENV, "")
    if not raw:
        return None
    try:
        processes = int(raw)
        if processes < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"{PROCESSES_PER_GPU_ENV}={raw!r}: expected a whole number >= 1") from None
    if processes == 1 or not torch.cuda.is_available():
        return None
    fraction = 0.95 / processes
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def parse_shard(text: str) -> tuple[int, int]:
    """`K/N` (0 <= K < N) of a `--shard` flag."""
    import argparse

    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"need 0 <= K < N, got {text!r}")
    return index, count


def shard_of(arms: list, shard: tuple[int, int]) -> list:
    """The arms at positions k, k + n, k + 2n, ... of `arms` for `shard` = (k, n)."""
    index, count = shard
    return arms[index::count]
