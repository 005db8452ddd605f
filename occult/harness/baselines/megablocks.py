"""MegaBlocks (PyPI `megablocks` 0.10.0): its dropless expert layer with our routing and weights.

`megablocks.layers.dmoe.dMoE` is a router (`LearnedRouter`: softmax, top-k) followed by
`ParallelDroplessMLP`, whose `forward(x, scores, expert_weights, top_experts)` is everything after
the router: local permutation, the token-count all-to-all, the row all-to-all over the expert
parallel group, the expert GLU (`mlp_type="glu"`), the inverse all-to-all and the weighted
un-permutation. We build that module alone and call it with our `ids_TK` / `weights_TK`, so
MegaBlocks sees exactly the routing every other method sees, and its router (one small GEMM and a
top-k) is not timed, as for the others.

Settings (`occult.method_names.BASELINE_SETTINGS`): `mlp_impl=grouped` (default) runs the GLU as
grouped GEMMs of the `grouped_gemm` package, which has two builds: `grouped_gemm=cublas` (default
build: one cuBLAS GEMM per expert) and `grouped_gemm=cutlass` (built with `GROUPED_GEMM_CUTLASS=1`:
CUTLASS grouped-GEMM kernels). A process can import one build only; `use_grouped_gemm_build` puts
the chosen one first on `sys.path` before MegaBlocks is imported, and `setup` checks which kernels
the imported extension actually runs (`grouped_gemm_mode`). `mlp_impl=sparse` runs stk's
block-sparse Triton kernels instead; MegaBlocks refuses it under Triton >= 3.2, which `supports`
reports.

Configuration: `moe_expert_model_parallelism=True` over our group when D > 1 (experts sharded
contiguously, E/D per rank: E must divide by D), no bias, SiLU GLU, no load-balancing loss
(`moe_loss_weight=0`), weights in the run's dtype. MegaBlocks scales expert-weight gradients by
1/D under expert parallelism (its data-parallel convention): their values differ from ours by
that factor, their cost does not. Needs CUDA (grouped_gemm, its custom sort/histogram ops).
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from occult.harness.baselines import ExpertWeights, Method, contiguous_experts, import_error_text, world_and_rank
from occult.shapes import MoEShape


GROUPED_GEMM_MODES = ("cublas", "cutlass")
MLP_IMPLS = ("grouped", "sparse")
PROBE_SIZE = 128     # rows and columns of the probe GEMM in grouped_gemm_mode


def use_grouped_gemm_build(builds_dir: str | Path, mode: str) -> Path:
    """Put the grouped_gemm build of `mode` (`builds_dir/gg-<mode>`, as tools/build_baselines.sh
    installs it) first on `sys.path`; call before anything imports grouped_gemm or MegaBlocks.
    Returns that folder; raises if it holds no grouped_gemm or another build is imported already."""
    if mode not in GROUPED_GEMM_MODES:
        raise ValueError(f"grouped_gemm: mode {mode!r} is not one of {GROUPED_GEMM_MODES}")
    folder = (Path(builds_dir) / f"gg-{mode}").resolve()
    if not (folder / "grouped_gemm" / "__init__.py").is_file():
        raise FileNotFoundError(f"grouped_gemm: {folder} holds no grouped_gemm package "
                                "(tools/build_baselines.sh installs the two builds there)")
    loaded = sys.modules.get("grouped_gemm")
    if loaded is not None and Path(loaded.__file__).resolve().parent.parent != folder:
        raise RuntimeError(f"grouped_gemm: {loaded.__file__} is imported already; {mode} from {folder} "
                           "needs a process of its own")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return folder


def backend_mode(backend, device: torch.device) -> str:
    """`cutlass` if `backend.gmm` (grouped_gemm's extension wrapper) takes batch sizes that live on
    the GPU, `cublas` if it refuses them: its cuBLAS path launches one GEMM per expert and so needs
    the sizes on the host, its CUTLASS path reads them on the device."""
    a = torch.zeros(2, PROBE_SIZE, dtype=torch.bfloat16, device=device)
    b = torch.zeros(1, PROBE_SIZE, PROBE_SIZE, dtype=torch.bfloat16, device=device)
    sizes = torch.tensor([2], dtype=torch.long, device=device)
    try:
        backend.gmm(a, b, sizes)
    except RuntimeError as err:
        if "is_cpu" in str(err):
            return "cublas"
        raise
    return "cutlass"


def grouped_gemm_mode(device: torch.device) -> tuple[str, str]:
    """(mode, file) of the grouped_gemm extension this process imported: which kernels it runs
    (`backend_mode`) and where its compiled module lies."""
    import grouped_gemm

    extension = sys.modules.get("grouped_gemm_backend")
    return backend_mode(grouped_gemm.backend, device), str(getattr(extension, "__file__", "?"))


def _leave_uninitialised(tensor: torch.Tensor) -> None:
    """MegaBlocks' init hook; our weights are copied in right after construction."""


def per_expert_traffic_bytes(ids_TK: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None,
                             row_bytes: int) -> int:
    """Bytes a rank sends in contiguous EP with one row per (token, expert): out and back."""
    world, rank = world_and_rank(group)
    per_rank = num_experts // world
    send_D = torch.bincount(ids_TK.reshape(-1) // per_rank, minlength=world)
    recv_D = send_D.clone()
    if world > 1:
        dist.all_to_all_single(recv_D, send_D.contiguous(), group=group)
    send, recv = torch.stack([send_D, recv_D]).tolist()
    return (sum(send) - send[rank] + sum(recv) - recv[rank]) * row_bytes


class MegaBlocksMoE(Method):
    """MegaBlocks' `ParallelDroplessMLP`, fed our routing; see the module doc."""

    name = "megablocks"

    def __init__(self, grouped_gemm: str = "cublas", mlp_impl: str = "grouped") -> None:
        if grouped_gemm not in GROUPED_GEMM_MODES:
            raise ValueError(f"megablocks: grouped_gemm {grouped_gemm!r} is not one of {GROUPED_GEMM_MODES}")
        if mlp_impl not in MLP_IMPLS:
            raise ValueError(f"megablocks: mlp_impl {mlp_impl!r} is not one of {MLP_IMPLS}")
        self.grouped_gemm, self.mlp_impl = grouped_gemm, mlp_impl

    @property
    def config(self) -> str:
        return f"grouped_gemm={self.grouped_gemm}" if self.mlp_impl == "grouped" else f"mlp_impl={self.mlp_impl}"

    def available(self) -> tuple[bool, str]:
        modules = ("stk", "grouped_gemm", "megablocks", "megablocks.layers.dmoe")
        try:
            for module in modules if self.mlp_impl == "grouped" else modules[:1] + modules[2:]:
                importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - any import failure is the reason
            return False, import_error_text(err)
        if not torch.cuda.is_available():
            return False, "megablocks needs CUDA (grouped_gemm kernels and its sort/histogram ops)"
        return True, f"megablocks {metadata.version('megablocks')}"

    def supports(self, shape: MoEShape, world: int, train: bool = False) -> str | None:
        why = super().supports(shape, world)
        if why or self.mlp_impl != "sparse":
            return why
        from megablocks.layers.arguments import Arguments

        try:
            Arguments(mlp_impl="sparse", hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
                      moe_num_experts=shape.num_experts, moe_top_k=shape.top_k)
        except (ValueError, ImportError, AssertionError) as err:
            import triton

            return f"MegaBlocks refuses mlp_impl=sparse with triton {triton.__version__}: {err}"
        return None

    def setup(self, shape: MoEShape, group: dist.ProcessGroup | None, dtype: torch.dtype,
              device: torch.device, weights: ExpertWeights) -> None:
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import ParallelDroplessMLP

        if self.mlp_impl == "grouped":
            mode, where = grouped_gemm_mode(device)
            if mode != self.grouped_gemm:
                raise RuntimeError(f"megablocks: the imported grouped_gemm ({where}) is the {mode} build, "
                                   f"{self.grouped_gemm} was asked for")
        self.group = group
        self.num_experts = shape.num_experts
        world, rank = world_and_rank(group)
        args = Arguments(
            hidden_size=shape.hidden,
            ffn_hidden_size=shape.ffn,
            num_layers=1,
            bias=False,
            return_bias=False,
            activation_fn=F.silu,
            moe_num_experts=shape.num_experts,
            moe_top_k=shape.top_k,
            moe_loss_weight=0.0,
            moe_expert_model_parallelism=world > 1,
            expert_parallel_group=group if world > 1 else None,
            mlp_type="glu",
            mlp_impl=self.mlp_impl,
            memory_optimized_mlp=False,
            fp16=dtype == torch.float16,
            bf16=dtype == torch.bfloat16,
            device=device,
            init_method=_leave_uninitialised,
            output_layer_init_method=_leave_uninitialised,
        )
        self.layer = ParallelDroplessMLP(args)
        experts = contiguous_experts(shape.num_experts, world, rank)
        w_gate_up, w_down = weights.local(experts, dtype, device)
        ffn, hidden = shape.ffn, shape.hidden
        glu = self.layer.mlp
        with torch.no_grad():
            # GroupedGLU and SparseGLU: w1 (gate) and v1 (up) are [E_r*F, D]; w2 is the down
            # projection stored transposed, [E_r*F, D] (it computes h @ w2[e]).
            glu.w1.copy_(w_gate_up[:, :ffn, :].reshape(-1, hidden))
            glu.v1.copy_(w_gate_up[:, ffn:, :].reshape(-1, hidden))
            glu.w2.copy_(w_down.transpose(1, 2).reshape(-1, hidden))
        self.row_bytes = hidden * torch.finfo(dtype).bits // 8

    def expert_parameters(self) -> list[torch.Tensor]:
        return [self.layer.mlp.w1, self.layer.mlp.v1, self.layer.mlp.w2]

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        # scores feed only the load-balancing loss, which is off.
        return self.layer(x_TD, None, weights_TK.to(x_TD.dtype), ids_TK)

    def bytes_sent(self, ids_TK: torch.Tensor) -> int | None:
        return per_expert_traffic_bytes(ids_TK, self.num_experts, self.group, self.row_bytes)
