"""Plain-torch references of the EP runtime's expert-side and combine ops (the slow path).

Layout shared by the references, the Triton kernels and `occult.ep`:

* `x_RD`       rows received by an expert rank: one per (token, device) in `dedup` mode, one
               per (token, expert) in `per_expert` mode. R rows of width D (hidden size).
* pairs        the (row, local expert) pairs the rows carry, sorted by expert (BRIM_1):
  `pair_row_M` int64 [M]: the received row of pair m (pairs past `expert_offsets[-1]` are
               padding of a static-shape dispatch: ignored, their `h` rows are unspecified);
  `pair_gate_M` [M]: its gate weight;
  `expert_offsets` int64 [E+1]: pairs of local expert e are `offsets[e]:offsets[e+1]` (0 = first).
* `w_gate_up_E2FD` [E, 2F, D]: rows 0..F-1 the gate projection, F..2F-1 the up projection
  (transformers' fused `gate_up_proj` layout); `w_down_EDF` [E, D, F].
* BRIM_0 on the source rank: `brim0_TJ` int64 [T, J] the row of token t's j-th returned partial
  in the buffer `z_SD` (or -1); J = devices (dedup) or k (per_expert).

Math:
  h[m]   = silu(x[row[m]] @ Wg[e]^T) * (x[row[m]] @ Wu[e]^T)             (grouped_swiglu)
  y[r]   = sum_{m : row[m] = r} gate[m] * (h[m] @ Wd[e]^T)   fp32 accumulate (grouped_down_reduce)
  out[t] = sum_{j : brim0[t,j] >= 0} z[brim0[t,j]]           fp32 accumulate (combine)
All three are differentiable through torch autograd here; the fast versions implement the same
forward and backward by hand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_of_pairs(expert_offsets: torch.Tensor) -> torch.Tensor:
    """Local expert id of every pair, from the offsets [E+1]."""
    counts = expert_offsets[1:] - expert_offsets[:-1]
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)


def _pad_rows(rows: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """`rows` [m, n] followed by zero rows up to `num_pairs` (the padding pairs contribute 0)."""
    missing = num_pairs - rows.shape[0]
    return torch.cat([rows, rows.new_zeros(missing, rows.shape[1])]) if missing > 0 else rows


def grouped_swiglu_ref(
    x_RD: torch.Tensor,
    pair_row_M: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_gate_up_E2FD: torch.Tensor,
) -> torch.Tensor:
    """h [M, F] = silu(x[row] Wg[e]^T) * (x[row] Wu[e]^T), computed per expert in fp32."""
    num_experts, two_f, _ = w_gate_up_E2FD.shape
    ffn = two_f // 2
    offsets = expert_offsets.tolist()
    x_MD = x_RD[pair_row_M]
    parts = []
    for e in range(num_experts):
        xs = x_MD[offsets[e] : offsets[e + 1]].float()
        gate_up = xs @ w_gate_up_E2FD[e].float().t()
        parts.append(F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:])
    h = torch.cat(parts) if parts else x_RD.new_zeros(0, ffn, dtype=torch.float32)
    return _pad_rows(h, pair_row_M.shape[0]).to(x_RD.dtype)


def grouped_down_reduce_ref(
    h_MF: torch.Tensor,
    pair_row_M: torch.Tensor,
    pair_gate_M: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_down_EDF: torch.Tensor,
    num_rows: int,
) -> torch.Tensor:
    """y [R, D]: each pair's down projection, scaled by its gate, summed into its row in fp32."""
    num_experts, hidden, _ = w_down_EDF.shape
    offsets = expert_offsets.tolist()
    parts = []
    for e in range(num_experts):
        parts.append(h_MF[offsets[e] : offsets[e + 1]].float() @ w_down_EDF[e].float().t())
    y_MD = torch.cat(parts) if parts else h_MF.new_zeros(0, hidden, dtype=torch.float32)
    y_MD = _pad_rows(y_MD, pair_row_M.shape[0]) * pair_gate_M.float()[:, None]
    out = torch.zeros(num_rows, hidden, dtype=torch.float32, device=h_MF.device)
    out = out.index_add(0, pair_row_M, y_MD)
    return out.to(h_MF.dtype)


def combine_ref(z_SD: torch.Tensor, brim0_TJ: torch.Tensor) -> torch.Tensor:
    """out [T, D] = sum of the rows of z named by each token's BRIM_0 entries (−1 = none), fp32."""
    valid = brim0_TJ >= 0
    rows = z_SD[brim0_TJ.clamp(min=0)].float() * valid[..., None]
    return rows.sum(dim=1).to(z_SD.dtype)


def moe_dense_ref(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w_gate_up_E2FD: torch.Tensor,
    w_down_EDF: torch.Tensor,
) -> torch.Tensor:
    """Single-device MoE output: sum_j weights[t,j] * expert_{ids[t,j]}(x[t]), in fp32."""
    ffn = w_gate_up_E2FD.shape[1] // 2
    x = x_TD.float()
    out = torch.zeros_like(x)
    for j in range(ids_TK.shape[1]):
        wgu = w_gate_up_E2FD.float()[ids_TK[:, j]]            # [T, 2F, D]
        gate_up = torch.einsum("td,tfd->tf", x, wgu)
        h = F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
        y = torch.einsum("tf,tdf->td", h, w_down_EDF.float()[ids_TK[:, j]])
        out = out + weights_TK[:, j : j + 1].float() * y
    return out.to(x_TD.dtype)
