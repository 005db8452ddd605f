"""Expert-parallel runtime: BRIM dispatch/combine with dedup and per-expert modes.

`plan` builds the dispatch (BRIM_0, send order, split sizes) and the expert-side grouping
(BRIM_1); `layer.ep_moe` is the differentiable EP MoE layer over a process group; `dist.run_ranks`
runs a function on CPU gloo ranks; `hf.use_ep` puts a transformers MoE model's experts on EP;
`experts` runs a single-device model's experts on the fused kernels (`model.experts_kernel: triton`).
"""

from occult.harness.ranks import RankFailure, run_ranks
from occult.ep.layer import BACKENDS, EPStats, ExpertBackend, ep_moe, get_backend
from occult.ep.plan import (
    MODES,
    DispatchPlan,
    build_pairs,
    build_plan,
    contiguous_placement,
    experts_of_device,
    local_expert_ids,
)

__all__ = [
    "BACKENDS", "MODES", "DispatchPlan", "EPStats", "ExpertBackend", "RankFailure",
    "build_pairs", "build_plan", "contiguous_placement", "ep_moe", "experts_of_device",
    "get_backend", "local_expert_ids", "run_ranks",
]
