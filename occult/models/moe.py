"""Single-device MoE models: a tiny OLMoE from config, local checkpoints, routing hooks.

Supported layouts are those of transformers 5.x, where every MoE block (`layer.mlp`) holds a
router `gate` (weight [E, d]; forward returns `(router_logits_TE, weights_TK, ids_TK)`) and fused
experts `experts` (`gate_up_proj` [E, 2F, d] = [gate; up] stacked along dim 1, `down_proj`
[E, d, F]). OLMoE is exactly that; Qwen2-MoE adds a shared expert scaled by a sigmoid gate;
DeepSeek-V2 adds shared experts, dense first layers and a grouped top-k router with a scaling
factor. `moe_layers(model)` wraps each MoE block in a `MoELayer` adapter that exposes these
tensors under one set of names (they are the model's own parameters, not copies).

Routing hooks work by PyTorch module hooks, never by editing transformers:
- `set_routing(model, fn)` puts a forward hook on every router that keeps the router's logits and
  replaces its `(weights, ids)` by `fn(layer_index, router_logits_TE)`. Because the weights are
  computed from the router's own logits, gradients still reach the router. `fn=None` removes it.
  The Switch-style auxiliary load-balancing loss of transformers recomputes a plain top-k from
  the logits, so it does not see an override.
- `capture_routing(model)` records, per MoE layer, the ids that the experts module actually
  received (a forward pre-hook on `experts`, so after any override) and optionally the router
  logits, on CPU, keeping only positions where the caller's attention mask is 1.

Expert compute: models built or loaded here run their fused experts through
`grouped_experts_forward` (registered with transformers as `EXPERTS_IMPLEMENTATION`): one sort by
expert and two grouped GEMMs per layer (no Python loop over experts), in the autocast dtype when
autocast is on (bf16 on GPU), combined per token in fp32. Without a grouped GEMM in torch it runs
transformers' own per-expert loop. `use_experts_kernel(model, kernel)` (config
`model.experts_kernel`) picks the implementation from `EXPERTS_KERNELS`, where "grouped" is this
one; other implementations register themselves there on import (`register_experts_kernel`):
`occult.ep.experts` adds "triton", the EP runtime's fused Triton kernels on one device. Model code
here never imports the runtime.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from occult.config import ModelConfig

RoutingFn = Callable[[int, Tensor], tuple[Tensor, Tensor]]
ROUTING_HOOK_ATTR = "_occult_routing"   # (fn, hook handle) stored on the router module
MOE_BLOCK_NAMES = ("mlp", "block_sparse_moe")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
EXPERTS_IMPLEMENTATION = "occult_grouped"


class CheckpointError(ValueError):
    """A local checkpoint is missing, truncated or not a supported MoE; the message names the path."""


# --------------------------------------------------------------------------- building and loading


def build_tiny_olmoe(
    model_cfg: ModelConfig,
    vocab_size: int,
    *,
    pad_token_id: int | None,
    bos_token_id: int,
    eos_token_id: int,
    seed: int,
    router_aux_loss: float = 0.01,
):
    """A randomly initialised `OlmoeForCausalLM` with the sizes of `model_cfg`.

    Like OLMoE: SwiGLU experts, `norm_topk_prob=False`, untied embeddings. Initialisation draws
    from a private RNG seeded with `seed`, so the global RNG state is left untouched.
    """
    from transformers import OlmoeConfig, OlmoeForCausalLM

    if model_cfg.hidden_size % model_cfg.num_heads:
        raise ValueError(
            f"model.num_heads: {model_cfg.num_heads} does not divide model.hidden_size {model_cfg.hidden_size}"
        )
    if model_cfg.top_k > model_cfg.num_experts:
        raise ValueError(f"model.top_k: {model_cfg.top_k} exceeds model.num_experts {model_cfg.num_experts}")
    hf_cfg = OlmoeConfig(
        vocab_size=vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.expert_ffn,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_heads,
        num_experts=model_cfg.num_experts,
        num_experts_per_tok=model_cfg.top_k,
        max_position_embeddings=model_cfg.max_seq_len,
        norm_topk_prob=False,
        router_aux_loss_coef=router_aux_loss,
        output_router_logits=False,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    register_experts_implementation()
    hf_cfg._experts_implementation = EXPERTS_IMPLEMENTATION
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = OlmoeForCausalLM(hf_cfg)
    return model


# --------------------------------------------------------------------------- expert compute


def _grouped_mm_op():
    """torch's grouped GEMM (`F.grouped_mm` from torch 2.10, `torch._grouped_mm` before), or None."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_experts_forward(experts: nn.Module, hidden_states_TD: Tensor, top_k_index_TK: Tensor,
                            top_k_weights_TK: Tensor) -> Tensor:
    """Fused-experts forward by sort-by-expert and two grouped GEMMs (same maths as the eager loop).

    Rows are the (token, slot) pairs S = T*K sorted by expert; `offs_E` ends each expert's rows.
    GEMMs run in the autocast dtype when autocast is enabled, else in the weights' dtype; the
    gate-weighted rows are summed per token in fp32 (a reshape and sum, deterministic on GPU).
    """
    grouped_mm = _grouped_mm_op()
    if grouped_mm is None:
        return _looped_experts_forward(experts, hidden_states_TD, top_k_index_TK, top_k_weights_TK)
    num_tokens, top_k = top_k_index_TK.shape
    num_experts = experts.gate_up_proj.shape[0]
    device_type = hidden_states_TD.device.type
    dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
             else experts.gate_up_proj.dtype)
    ids_S = top_k_index_TK.reshape(-1)
    order_S = torch.argsort(ids_S, stable=True)
    rows_per_expert_E = torch.zeros(num_experts, dtype=torch.int32, device=ids_S.device)
    rows_per_expert_E.index_add_(0, ids_S, torch.ones_like(ids_S, dtype=torch.int32))   # no host sync
    offs_E = torch.cumsum(rows_per_expert_E, 0, dtype=torch.int32)
    # Gather (token, slot) pairs from a k-fold expanded view: its backward scatters without
    # duplicates and sums the k copies (deterministic), where `x[order_S // k]` would accumulate
    # with index_put_, whose parallel CPU (and CUDA) kernel adds in a scheduling-dependent order.
    x_SD = hidden_states_TD.unsqueeze(1).expand(num_tokens, top_k, -1)[order_S // top_k, order_S % top_k].to(dtype)
    gate_up_S2F = grouped_mm(x_SD, experts.gate_up_proj.to(dtype).transpose(-2, -1), offs=offs_E)
    gate_SF, up_SF = gate_up_S2F.chunk(2, dim=-1)
    y_SD = grouped_mm(experts.act_fn(gate_SF) * up_SF, experts.down_proj.to(dtype).transpose(-2, -1), offs=offs_E)
    weighted_SD = y_SD.float() * top_k_weights_TK.reshape(-1)[order_S].float().unsqueeze(-1)
    unsorted_SD = torch.empty_like(weighted_SD)
    unsorted_SD[order_S] = weighted_SD
    return unsorted_SD.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states_TD.dtype)


def _looped_experts_forward(experts: nn.Module, hidden_states_TD: Tensor, top_k_index_TK: Tensor,
                            top_k_weights_TK: Tensor) -> Tensor:
    """The same maths one expert at a time (for a torch without grouped GEMM)."""
    out_TD = torch.zeros(hidden_states_TD.shape, dtype=torch.float32, device=hidden_states_TD.device)
    for expert in top_k_index_TK.unique().tolist():
        token_R, slot_R = torch.where(top_k_index_TK == expert)
        gate_RF, up_RF = torch.nn.functional.linear(hidden_states_TD[token_R], experts.gate_up_proj[expert]).chunk(2, -1)
        y_RD = torch.nn.functional.linear(experts.act_fn(gate_RF) * up_RF, experts.down_proj[expert])
        out_TD.index_add_(0, token_R, y_RD.float() * top_k_weights_TK[token_R, slot_R, None].float())
    return out_TD.to(hidden_states_TD.dtype)


# (experts module, hidden_states_TD, top_k_index_TK, top_k_weights_TK) -> y_TD
ExpertsForward = Callable[[nn.Module, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class ExpertsKernel:
    """One choice of `model.experts_kernel`: the name transformers knows the forward by, and the forward."""

    implementation: str
    forward: ExpertsForward


# model.experts_kernel -> its implementation; "triton" is added by importing occult.ep.experts
EXPERTS_KERNELS: dict[str, ExpertsKernel] = {
    "grouped": ExpertsKernel(EXPERTS_IMPLEMENTATION, grouped_experts_forward),
}


def register_experts_kernel(kernel: str, implementation: str, forward: ExpertsForward) -> None:
    """Make `kernel` a choice of `use_experts_kernel` (and of `model.experts_kernel`), run by
    `forward` under the transformers experts implementation named `implementation`."""
    EXPERTS_KERNELS[kernel] = ExpertsKernel(implementation, forward)


def register_experts_implementation() -> None:
    """Make every registered kernel's implementation known to transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    for kernel in EXPERTS_KERNELS.values():
        if kernel.implementation not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS.register(kernel.implementation, kernel.forward)


def use_experts_kernel(model: nn.Module, kernel: str = "grouped") -> None:
    """Run an OLMoE or Mixtral model's experts (same layout, SiLU-gated) through the forward that
    `EXPERTS_KERNELS` registers for `kernel`; other model families keep theirs."""
    if kernel not in EXPERTS_KERNELS:
        raise ValueError(f"model.experts_kernel: {kernel!r} is not one of {tuple(EXPERTS_KERNELS)} "
                         "(\"triton\" is registered by importing occult.ep.experts)")
    if getattr(model.config, "model_type", None) not in ("olmoe", "mixtral"):
        return
    register_experts_implementation()
    model.set_experts_implementation(EXPERTS_KERNELS[kernel].implementation)


def use_grouped_experts(model: nn.Module) -> None:
    """`use_experts_kernel(model, "grouped")`."""
    use_experts_kernel(model, "grouped")


def load_checkpoint(path: str | Path, *, dtype: str | torch.dtype = "auto", device: str | None = None,
                    experts_kernel: str = "grouped"):
    """Load a local HF MoE checkpoint and its tokenizer: `(model in eval mode, tokenizer)`.

    Only local files are read. Raises `CheckpointError` naming `path` when the directory, its
    config, weights or tokenizer are missing or unreadable, when weights are missing from the
    files, or when the model has no MoE layer of the supported layout.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: not a directory")
    config_file = path / "config.json"
    try:
        json.loads(config_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: config.json is not valid JSON ({err})") from None
    weight_files = [*path.glob("*.safetensors"), *path.glob("*.bin"), *path.glob("*.safetensors.index.json")]
    if not weight_files:
        raise CheckpointError(f"checkpoint {path}: no weight files (*.safetensors or *.bin)")
    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as err:  # transformers raises many kinds (ValueError, KeyError, OSError)
        raise CheckpointError(f"checkpoint {path}: config.json cannot be read by transformers ({err})") from err
    if not _config_is_moe(hf_cfg):
        raise CheckpointError(
            f"checkpoint {path}: model_type {hf_cfg.model_type!r} is not a Mixture-of-Experts "
            "(no num_experts / n_routed_experts / num_local_experts and num_experts_per_tok)"
        )
    from transformers.utils import logging as hf_logging

    register_experts_implementation()     # a config saved by another transformers version may name it
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # its load report would precede our one-line error; we check `info`
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, output_loading_info=True
        )
    except Exception as err:
        raise CheckpointError(f"checkpoint {path}: weights cannot be loaded ({type(err).__name__}: {err})") from err
    finally:
        hf_logging.set_verbosity(verbosity)
    mismatched = info.get("mismatched_keys", [])
    if mismatched:
        first = sorted(mismatched)[0]
        raise CheckpointError(
            f"checkpoint {path}: {len(mismatched)} weights do not match the shapes config.json declares "
            f"(first: {first[0] if isinstance(first, tuple) else first})"
        )
    missing = [k for k in info.get("missing_keys", []) if k not in _tied_keys(model)]
    if missing:
        raise CheckpointError(
            f"checkpoint {path}: {len(missing)} weights are missing from the files (first: {sorted(missing)[0]})"
        )
    if not moe_layers(model):
        raise CheckpointError(f"checkpoint {path}: no MoE layer with a router `gate` and fused `experts` found")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        # transformers 5 would silently build an empty tokenizer instead of failing
        raise CheckpointError(f"checkpoint {path}: tokenizer cannot be loaded (none of {', '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:
        raise CheckpointError(f"checkpoint {path}: tokenizer cannot be loaded ({type(err).__name__}: {err})") from err
    use_experts_kernel(model, experts_kernel)       # OLMoE's experts: see the module docstring
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def _config_is_moe(hf_cfg) -> bool:
    experts = (getattr(hf_cfg, "num_experts", None) or getattr(hf_cfg, "n_routed_experts", None)
               or getattr(hf_cfg, "num_local_experts", None))
    return isinstance(experts, int) and experts > 1 and isinstance(getattr(hf_cfg, "num_experts_per_tok", None), int)


def _tied_keys(model) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    return set(tied) if isinstance(tied, (dict, list, tuple, set)) else set()


# --------------------------------------------------------------------------- the MoE layer adapter


@dataclass(frozen=True)
class RoutingRule:
    """A router's own top-k rule, read from the router module's attributes."""

    top_k: int
    norm_topk_prob: bool = False
    scaling: float = 1.0            # DeepSeek's routed_scaling_factor
    sorted: bool = True             # DeepSeek asks torch.topk for unsorted results
    num_group: int | None = None    # DeepSeek "group_limited_greedy": groups of experts ...
    topk_group: int | None = None   # ... of which the best `topk_group` stay eligible


@dataclass(frozen=True)
class MoELayer:
    """One MoE block of a model, under names common to OLMoE, Mixtral, Qwen2-MoE and DeepSeek-V2.

    `w_gate_up` [E, 2F, d] (gate rows first, then up rows) and `w_down` [E, d, F] are the
    experts module's own parameters (no copy); the expert computes
    `down @ (act(gate @ x) * (up @ x))`.
    """

    layer_index: int
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    rule: RoutingRule
    shared_expert: nn.Module | None = None        # dense MLP applied to every token
    shared_expert_gate: nn.Module | None = None   # Qwen2-MoE: output scaled by sigmoid(gate(x))

    @property
    def num_experts(self) -> int:
        return int(self.router.weight.shape[0])

    @property
    def top_k(self) -> int:
        return self.rule.top_k

    @property
    def router_weight(self) -> nn.Parameter:
        return self.router.weight

    @property
    def w_gate_up(self) -> nn.Parameter:
        return self.experts.gate_up_proj

    @property
    def w_down(self) -> nn.Parameter:
        return self.experts.down_proj

    @property
    def expert_ffn(self) -> int:
        return int(self.experts.down_proj.shape[-1])

    def topk(self, router_logits_TE: Tensor) -> tuple[Tensor, Tensor]:
        """This layer's own top-k rule applied to `router_logits_TE`."""
        return default_topk(
            router_logits_TE,
            self.rule.top_k,
            self.rule.norm_topk_prob,
            scaling=self.rule.scaling,
            sorted=self.rule.sorted,
            num_group=self.rule.num_group,
            topk_group=self.rule.topk_group,
        )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", None) or getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: no decoder `layers` found (expected model.model.layers)")
    return layers


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """One `MoELayer` per MoE block, in layer order; dense layers are skipped."""
    out = []
    for index, layer in enumerate(decoder_layers(model)):
        block = next((getattr(layer, n) for n in MOE_BLOCK_NAMES if hasattr(layer, n)), None)
        router = getattr(block, "gate", None)
        experts = getattr(block, "experts", None)
        if router is None or experts is None or not hasattr(experts, "gate_up_proj"):
            continue
        weight = getattr(router, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            continue
        if getattr(experts, "is_transposed", False):
            raise TypeError(f"layer {index}: transposed expert weights are not supported")
        out.append(
            MoELayer(
                layer_index=index,
                block=block,
                router=router,
                experts=experts,
                rule=routing_rule(router),
                shared_expert=_first_attr(block, ("shared_expert", "shared_experts")),
                shared_expert_gate=getattr(block, "shared_expert_gate", None),
            )
        )
    return out


def _first_attr(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    return next((getattr(module, n) for n in names if getattr(module, n, None) is not None), None)


def routing_rule(router: nn.Module) -> RoutingRule:
    method = getattr(router, "topk_method", "greedy") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"router topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    grouped = method == "group_limited_greedy"
    is_deepseek = hasattr(router, "routed_scaling_factor")
    # Mixtral's router has no flag: it always renormalises its top-k weights
    renormalise = getattr(router, "norm_topk_prob", type(router).__name__.startswith("Mixtral"))
    return RoutingRule(
        top_k=int(router.top_k),
        norm_topk_prob=bool(renormalise) and not is_deepseek,
        scaling=float(getattr(router, "routed_scaling_factor", 1.0)),
        sorted=not is_deepseek,
        num_group=int(router.num_group) if grouped else None,
        topk_group=int(router.topk_group) if grouped else None,
    )


def default_topk(
    router_logits_TE: Tensor,
    top_k: int,
    norm_topk_prob: bool = False,
    *,
    scaling: float = 1.0,
    sorted: bool = True,
    num_group: int | None = None,
    topk_group: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The routers' own rule: softmax in fp32, top-k, optional renormalisation and scaling.

    Returns `(weights_TK in the logits' dtype, ids_TK int64)`, bit-identical to OLMoE/Qwen2-MoE
    (`norm_topk_prob`) and DeepSeek-V2 (`scaling`, `sorted=False`, groups) given the same flags.
    """
    probs_TE = router_logits_TE.softmax(dim=-1, dtype=torch.float32)
    if num_group is not None:
        T, E = probs_TE.shape
        group_best_TG = probs_TE.view(T, num_group, E // num_group).max(dim=-1).values
        kept_TG = torch.topk(group_best_TG, k=topk_group, dim=-1, sorted=False)[1]
        mask_TG = torch.zeros_like(group_best_TG).scatter_(1, kept_TG, 1)
        mask_TE = mask_TG.unsqueeze(-1).expand(T, num_group, E // num_group).reshape(T, E)
        probs_TE = probs_TE.masked_fill(~mask_TE.bool(), 0.0)
    weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1, sorted=sorted)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights_TK = weights_TK * scaling
    return weights_TK.to(router_logits_TE.dtype), ids_TK


# --------------------------------------------------------------------------- routing override


def set_routing(model: nn.Module, fn: RoutingFn | None) -> None:
    """Replace the top-k selection of every MoE layer by `fn(layer_index, router_logits_TE)`.

    `fn` returns `(weights_TK, ids_TK)`; the router's logits are kept as its first output.
    `fn=None` restores the model's own behaviour. Setting a new `fn` replaces the previous one.
    """
    for layer in moe_layers(model):
        previous = getattr(layer.router, ROUTING_HOOK_ATTR, None)
        if previous is not None:
            previous[1].remove()
            delattr(layer.router, ROUTING_HOOK_ATTR)
        if fn is None:
            continue
        handle = layer.router.register_forward_hook(_routing_hook(layer.layer_index, fn))
        setattr(layer.router, ROUTING_HOOK_ATTR, (fn, handle))


def get_routing(model: nn.Module) -> RoutingFn | None:
    """The override currently set by `set_routing` (None when the model routes by itself)."""
    for layer in moe_layers(model):
        current = getattr(layer.router, ROUTING_HOOK_ATTR, None)
        return None if current is None else current[0]
    return None


@contextlib.contextmanager
def routing_override(model: nn.Module, fn: RoutingFn | None) -> Iterator[None]:
    """`set_routing(model, fn)` for the duration of a block, then restore the previous override."""
    previous = get_routing(model)
    set_routing(model, fn)
    try:
        yield
    finally:
        set_routing(model, previous)


def _routing_hook(layer_index: int, fn: RoutingFn):
    def hook(module: nn.Module, args, output):
        router_logits_TE = output[0]
        weights_TK, ids_TK = fn(layer_index, router_logits_TE)
        if ids_TK.shape[0] != router_logits_TE.shape[0] or weights_TK.shape != ids_TK.shape:
            raise ValueError(
                f"routing fn at layer {layer_index}: got weights {tuple(weights_TK.shape)} and ids "
                f"{tuple(ids_TK.shape)} for {router_logits_TE.shape[0]} tokens"
            )
        return router_logits_TE, weights_TK, ids_TK

    return hook


# --------------------------------------------------------------------------- routing capture


class RoutingCapture:
    """Per-MoE-layer routing recorded by `capture_routing`.

    Set `attention_mask` (any shape with one entry per token of the next forward, 1 = keep)
    before each forward to exclude padding; None keeps every position.
    """

    def __init__(self, layers: list[int], keep_logits: bool):
        self.layers = layers
        self.keep_logits = keep_logits
        self.attention_mask: Tensor | None = None
        self._ids: dict[int, list[Tensor]] = {i: [] for i in layers}
        self._logits: dict[int, list[Tensor]] = {i: [] for i in layers}

    def _keep(self, rows_T: Tensor, layer_index: int) -> Tensor:
        rows_T = rows_T.detach()
        if self.attention_mask is None:
            return rows_T.cpu()
        keep_T = self.attention_mask.reshape(-1).to(rows_T.device).bool()
        if keep_T.numel() != rows_T.shape[0]:
            raise ValueError(
                f"capture_routing: attention_mask has {keep_T.numel()} entries but layer {layer_index} "
                f"routed {rows_T.shape[0]} tokens"
            )
        return rows_T[keep_T].cpu()

    def _record_ids(self, layer_index: int, ids_TK: Tensor) -> None:
        self._ids[layer_index].append(self._keep(ids_TK, layer_index))

    def _record_logits(self, layer_index: int, router_logits_TE: Tensor) -> None:
        self._logits[layer_index].append(self._keep(router_logits_TE, layer_index).float())

    def ids(self) -> list[Tensor]:
        """Selected experts per MoE layer, each [N, k] int64 (N = kept tokens so far)."""
        return [_cat(self._ids[i], torch.int64) for i in self.layers]

    def logits(self) -> list[Tensor]:
        """Router logits per MoE layer, each [N, E] float32 (only with `keep_logits=True`)."""
        if not self.keep_logits:
            raise RuntimeError("capture_routing(model, keep_logits=False) did not record logits")
        return [_cat(self._logits[i], torch.float32) for i in self.layers]

    def clear(self) -> None:
        for i in self.layers:
            self._ids[i].clear()
            self._logits[i].clear()


def _cat(chunks: list[Tensor], dtype: torch.dtype) -> Tensor:
    if not chunks:
        return torch.empty(0, 0, dtype=dtype)
    return torch.cat(chunks).to(dtype)


@contextlib.contextmanager
def capture_routing(model: nn.Module, keep_logits: bool = False) -> Iterator[RoutingCapture]:
    """Record the ids each MoE layer's experts actually receive (and optionally the logits).

    Forwards run twice under activation checkpointing would be recorded twice: capture in eval
    or without checkpointing.
    """
    layers = moe_layers(model)
    capture = RoutingCapture([layer.layer_index for layer in layers], keep_logits)
    handles = []
    for layer in layers:
        handles.append(layer.experts.register_forward_pre_hook(_ids_hook(capture, layer.layer_index), with_kwargs=True))
        if keep_logits:
            handles.append(layer.router.register_forward_hook(_logits_hook(capture, layer.layer_index)))
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()


def _ids_hook(capture: RoutingCapture, layer_index: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        ids_TK = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
        capture._record_ids(layer_index, ids_TK)

    return hook


def _logits_hook(capture: RoutingCapture, layer_index: int):
    def hook(module: nn.Module, args, output):
        capture._record_logits(layer_index, output[0])

    return hook


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Total parameters and those of routed experts (for reports)."""
    experts = sum(l.w_gate_up.numel() + l.w_down.numel() for l in moe_layers(model))
    return {"total": sum(p.numel() for p in model.parameters()), "routed_experts": experts}

