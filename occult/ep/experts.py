"""A single-device model's experts on the EP runtime's fused Triton kernels: `model.experts_kernel:
triton`.

`fused_experts_forward` computes what `occult.models.moe.grouped_experts_forward` does through
`ep_moe` on one device: the gather inside the gate/up GEMM, the gate-weighted fp32 reduction inside
the down GEMM, no sort, unsort or fp32 copies of the (token, expert) rows. Importing this module
registers it as the "triton" experts kernel of `occult.models.moe` (`use_experts_kernel`, and
`load_checkpoint(experts_kernel=...)`); the stages that apply `model.experts_kernel` import it.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from occult.ep.layer import ep_moe
from occult.models.moe import register_experts_kernel

FUSED_IMPLEMENTATION = "occult_fused"
_ONE_DEVICE: dict[int, Tensor] = {}      # E -> the all-zeros placement of E experts (one per size)


def fused_experts_forward(experts: nn.Module, hidden_states_TD: Tensor, top_k_index_TK: Tensor,
                          top_k_weights_TK: Tensor) -> Tensor:
    """The same maths through `occult.ep.ep_moe` on one device with the Triton kernels (dedup mode:
    one row per token, its k experts reduced in fp32 inside the down-projection kernel).

    GEMMs run in the autocast dtype when autocast is on (bf16 on GPU; the fp32 master weights are
    cast, and their gradients flow back through the cast), else in the weights' dtype; the output
    is cast back to the input's dtype. On a CPU only under TRITON_INTERPRET=1 (the tests).
    """
    device_type = hidden_states_TD.device.type
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("model.experts_kernel: 'triton' needs a CUDA device (or TRITON_INTERPRET=1 on a CPU); "
                           "use 'grouped' here")
    dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
             else experts.gate_up_proj.dtype)
    num_experts = experts.gate_up_proj.shape[0]
    placement_E = _ONE_DEVICE.get(num_experts)
    if placement_E is None:
        placement_E = _ONE_DEVICE[num_experts] = torch.zeros(num_experts, dtype=torch.long)
    with torch.autocast(device_type, enabled=False):
        y_TD = ep_moe(hidden_states_TD.to(dtype), top_k_index_TK, top_k_weights_TK.float(), placement_E,
                      experts.gate_up_proj.to(dtype), experts.down_proj.to(dtype), group=None, mode="dedup",
                      backend="triton")
    return y_TD.to(hidden_states_TD.dtype)


register_experts_kernel("triton", FUSED_IMPLEMENTATION, fused_experts_forward)
