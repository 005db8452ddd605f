"""Replay a static-shape EP forward from a CUDA graph: one launch for the whole layer.

The exact dedup dispatch reads its split sizes on the host (one sync per call), so its ≈75
kernels and 3 collectives are launched one by one while the GPU waits. With
`ep_moe(..., static_capacity=C)` the call has fixed shapes and no sync, so it can be captured
once and replayed. `GraphedForward(fn, *example_inputs)` warms `fn` up on a side stream (Triton
autotuning and NCCL communicator set-up must happen before capture), captures one call, and each
later call copies the new inputs into the captured buffers and replays. Every rank of the group
must capture and replay together (the graph holds the collectives).

    layer = GraphedForward(lambda x, ids, w: ep_moe(x, ids, w, placement, wgu, wd, group=g,
                                                       static_capacity=x.shape[0]), x, ids, w)
    y = layer(x2, ids2, w2)          # same shapes; y is overwritten by the next replay

Forward only (no autograd through the replay); training steps can use
`torch.cuda.make_graphed_callables` on a module that calls the static path.
"""

from __future__ import annotations

from typing import Callable

import torch


class GraphedForward:
    """A captured forward of fixed input shapes (module docstring)."""

    def __init__(self, fn: Callable[..., torch.Tensor], *example: torch.Tensor, warmup: int = 2) -> None:
        if not example or not all(t.is_cuda for t in example):
            raise ValueError("GraphedForward: needs CUDA example inputs (CUDA graphs capture GPU work only)")
        self.inputs = tuple(t.detach().clone() for t in example)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.output = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != len(self.inputs):
            raise ValueError(f"GraphedForward: captured with {len(self.inputs)} inputs, got {len(inputs)}")
        for index, (held, new) in enumerate(zip(self.inputs, inputs)):
            if new.shape != held.shape or new.dtype != held.dtype:
                raise ValueError(
                    f"GraphedForward: input {index} is {new.dtype} {tuple(new.shape)}, the graph was captured "
                    f"for {held.dtype} {tuple(held.shape)}"
                )
            held.copy_(new)
        self.graph.replay()
        return self.output
