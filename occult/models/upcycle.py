"""Upcycle a dense llama-architecture GGUF model into a fine-grained MoE (`model.source: upcycle`).

The dense SwiGLU FFN of width F is cut into `k` shards of width F/k along its hidden dimension,
and the MoE layer gets E experts in E/k *virtual groups* of k experts, each group holding all k
shards once (the "virtual group" initialisation of fine-grained upcycling). Every expert of a
group starts with the same router row, so the router's top-k picks one whole group; with the
top-k weights renormalised (Mixtral's rule, 1/k each) and each expert's down projection scaled
by k, the MoE layer computes exactly the dense FFN for every token, whichever group wins. All
other weights (embeddings, attention, norms) are copied. The upcycled model therefore starts
with the dense model's ability; continued pre-training breaks the ties and lets the copies
specialise. Groups are strided (expert `j` is shard `j // G` of group `j % G`, G = E/k), so the
contiguous placement spreads every group over all devices; a placement that gathers them recovers
the groups, and routing that still follows them after training is measured by
`occult.routing.inheritance`.

`init="drop"` builds experts without any group structure (drop-upcycling, Nakamura et al., ICLR
2025, adapted to fine-grained experts; docs/notes/learned-groups.md): each expert takes its own
uniformly random F/k of the dense FFN's F hidden units (independently of every other expert, so no
set of experts reproduces the FFN better than another), then a share `drop_ratio` of that expert's
units is re-initialised: their rows of the gate and up projections and their column of the down
projection are drawn from a normal distribution with the mean and standard deviation of the values
they replace (per matrix). Down projections are scaled by k as above, so with renormalised top-k
weights the layer is an unbiased (not exact) estimate of the dense FFN when `drop_ratio` is 0.
Router rows are independent draws of N(0, router_std^2): nothing ties experts together.

`dense_from_gguf` builds the dense `LlamaForCausalLM` the MoE is compared against.
GGUF files from llama.cpp's converter store the Q and K projections with each head's rows
interleaved for its RoPE layout (pairs (i, i + d/2) adjacent); `_unpermute_rows` undoes that.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from occult.models.gguf import ARCH, DenseShape, GGUFError, GGUFReader, dense_shape  # noqa: F401


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of a Q or K projection ([heads*hd, d])."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _common_config_kwargs(shape: DenseShape, max_seq_len: int, token_ids: dict[str, int | None]) -> dict:
    return dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max_seq_len,
        rms_norm_eps=shape.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=shape.tied,
        hidden_act="silu",
        **token_ids,
    )


def _load_shared(model: nn.Module, reader: GGUFReader, shape: DenseShape) -> None:
    """Embeddings, attention, norms and (untied) output head, copied into `model` in place."""
    sd = {"model.embed_tokens.weight": reader.tensor("token_embd.weight"),
          "model.norm.weight": reader.tensor("output_norm.weight")}
    if not shape.tied:
        sd["lm_head.weight"] = reader.tensor("output.weight")
    for i in range(shape.num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        sd[p + "input_layernorm.weight"] = reader.tensor(b + "attn_norm.weight")
        sd[p + "post_attention_layernorm.weight"] = reader.tensor(b + "ffn_norm.weight")
        sd[p + "self_attn.q_proj.weight"] = _unpermute_rows(reader.tensor(b + "attn_q.weight"), shape.num_heads)
        sd[p + "self_attn.k_proj.weight"] = _unpermute_rows(reader.tensor(b + "attn_k.weight"), shape.num_kv_heads)
        sd[p + "self_attn.v_proj.weight"] = reader.tensor(b + "attn_v.weight")
        sd[p + "self_attn.o_proj.weight"] = reader.tensor(b + "attn_output.weight")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in sd.items():
            if name not in params:
                raise KeyError(f"{type(model).__name__} has no parameter {name}")
            if tuple(params[name].shape) != value.shape:
                raise GGUFError(f"{reader.path}: {name} has shape {value.shape}, the model expects "
                                f"{tuple(params[name].shape)}")
            params[name].copy_(_t(value))


def _ffn(reader: GGUFReader, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b = f"blk.{layer}."
    return reader.tensor(b + "ffn_gate.weight"), reader.tensor(b + "ffn_up.weight"), reader.tensor(b + "ffn_down.weight")


def dense_from_gguf(path: str | Path, *, max_seq_len: int, token_ids: dict[str, int | None]):
    """The dense `LlamaForCausalLM` stored in a llama GGUF file (weights dequantised to fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    reader = GGUFReader(path)
    shape = dense_shape(reader)
    cfg = LlamaConfig(intermediate_size=shape.ffn, attention_bias=False, mlp_bias=False,
                      **_common_config_kwargs(shape, max_seq_len, token_ids))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")
    _load_shared(model, reader, shape)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            gate, up, down = _ffn(reader, i)
            layer.mlp.gate_proj.weight.copy_(_t(gate))
            layer.mlp.up_proj.weight.copy_(_t(up))
            layer.mlp.down_proj.weight.copy_(_t(down))
    model.model.rotary_emb.__init__(cfg)        # buffers were left empty on the meta device
    if shape.tied:
        model.tie_weights()
    return model.eval()


UPCYCLE_INITS = ("virtual_groups", "drop")


def upcycle_gguf(path: str | Path, *, num_experts: int, top_k: int, max_seq_len: int,
                 token_ids: dict[str, int | None], seed: int, router_std: float = 0.02,
                 router_noise: float = 0.0, router_aux_loss: float = 0.01, init: str = "virtual_groups",
                 drop_ratio: float = 0.5):
    """A `MixtralForCausalLM` with `num_experts` experts (top-`top_k`) upcycled from a dense GGUF.

    `init`: `virtual_groups` (exact, the module docstring) or `drop` (random unit subsets with a
    share `drop_ratio` of each expert re-initialised, independent router rows). `router_std` is the
    spread of the router rows; with virtual groups `router_noise` adds independent noise of that
    std (relative to `router_std`) to every row, which breaks the exact equality with the dense
    model (0 keeps it). Random draws use a private generator seeded with `seed`.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    reader = GGUFReader(path)
    shape = dense_shape(reader)
    if num_experts % top_k:
        raise ValueError(f"model.num_experts: {num_experts} is not a multiple of model.top_k {top_k} "
                         "(upcycling puts k shards in each of E/k groups)")
    if shape.ffn % top_k:
        raise ValueError(f"model.top_k: {top_k} does not divide the dense FFN width {shape.ffn} of {reader.path}")
    if init not in UPCYCLE_INITS:
        raise ValueError(f"model.upcycle_init: {init!r} is not one of {', '.join(UPCYCLE_INITS)}")
    if not 0.0 <= drop_ratio <= 1.0:
        raise ValueError(f"model.drop_ratio: {drop_ratio} is not between 0 and 1")
    groups, shard = num_experts // top_k, shape.ffn // top_k
    cfg = MixtralConfig(intermediate_size=shard, num_local_experts=num_experts, num_experts_per_tok=top_k,
                        router_aux_loss_coef=router_aux_loss, output_router_logits=False,
                        router_jitter_noise=0.0, sliding_window=None,
                        **_common_config_kwargs(shape, max_seq_len, token_ids))
    from occult.models.moe import EXPERTS_IMPLEMENTATION, register_experts_implementation
    register_experts_implementation()
    cfg._experts_implementation = EXPERTS_IMPLEMENTATION
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    model.to_empty(device="cpu")
    _load_shared(model, reader, shape)
    gen = torch.Generator().manual_seed(seed)
    expert_group = torch.arange(num_experts) % groups        # expert j: group j % G ...
    expert_shard = torch.arange(num_experts) // groups       # ... shard j // G
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            gate, up, down = (_t(a) for a in _ffn(reader, i))
            experts, router = layer.mlp.experts, layer.mlp.gate
            if init == "drop":
                _drop_experts(experts, gate, up, down, top_k, drop_ratio, gen)
                router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * router_std)
                continue
            for j in range(num_experts):
                rows = slice(int(expert_shard[j]) * shard, (int(expert_shard[j]) + 1) * shard)
                experts.gate_up_proj[j].copy_(torch.cat([gate[rows], up[rows]], dim=0))
                experts.down_proj[j].copy_(down[:, rows] * top_k)
            group_rows = torch.randn(groups, shape.hidden_size, generator=gen) * router_std
            weight = group_rows[expert_group]
            if router_noise:
                weight = weight + torch.randn(weight.shape, generator=gen) * router_std * router_noise
            router.weight.copy_(weight)
    model.model.rotary_emb.__init__(cfg)
    if shape.tied:
        model.tie_weights()
    record = {"source": str(path), "init": init, "shard_ffn": shard, "router_std": router_std, "seed": seed}
    record.update({"drop_ratio": drop_ratio} if init == "drop" else {"groups": groups, "router_noise": router_noise})
    model.config.occult_upcycle = record
    return model


def _statistical_redraw(values: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fresh normal values with the mean and standard deviation of `values` (same shape)."""
    std = values.std() if values.numel() > 1 else values.new_zeros(())
    return torch.randn(values.shape, generator=gen) * std + values.mean()


def _drop_experts(experts: nn.Module, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, top_k: int,
                  drop_ratio: float, gen: torch.Generator) -> None:
    """Fill every expert of one layer from the dense FFN (gate, up: [F, d]; down: [d, F]): its own
    random F/k units, a share `drop_ratio` of them redrawn statistically (`_statistical_redraw` per
    matrix over the redrawn units' values), down projection scaled by k."""
    width = gate.shape[0]
    shard = width // top_k
    redrawn = int(round(drop_ratio * shard))
    for j in range(experts.gate_up_proj.shape[0]):
        units = torch.randperm(width, generator=gen)[:shard]
        g, u, d = gate[units].clone(), up[units].clone(), down[:, units].clone()
        if redrawn:
            fresh = torch.randperm(shard, generator=gen)[:redrawn]
            g[fresh] = _statistical_redraw(g[fresh], gen)
            u[fresh] = _statistical_redraw(u[fresh], gen)
            d[:, fresh] = _statistical_redraw(d[:, fresh], gen)
        experts.gate_up_proj[j].copy_(torch.cat([g, u], dim=0))
        experts.down_proj[j].copy_(d * top_k)
