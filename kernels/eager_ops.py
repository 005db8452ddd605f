"""Eager calls of the kernels' differentiable ops without the torch.library dispatcher.

Each op is a `torch.library.custom_op` with a fake implementation and registered autograd, so that
`torch.compile` traces it. Called eagerly, that wrapper costs the host tens of µs per call
(dispatcher, autograd kernel, alias checks), which an eager MoE layer pays before its first large
GEMM starts (`python -m occult.ep.launches --host-us`). `differentiable` returns a callable that
runs the custom op while torch.compile traces and otherwise a `torch.autograd.Function` built from
the same implementation, `setup_context` and backward: one source for the math, two entry points.
`direct` does the same for the backward ops (no autograd). `through_custom_ops()` forces the
custom ops everywhere (tests compare both paths; host-time A/B).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

_CUSTOM_OPS_ALWAYS = [False]


@contextlib.contextmanager
def through_custom_ops() -> Iterator[None]:
    """Inside the block every kernel op goes through its `torch.library` custom op, as under torch.compile."""
    previous, _CUSTOM_OPS_ALWAYS[0] = _CUSTOM_OPS_ALWAYS[0], True
    try:
        yield
    finally:
        _CUSTOM_OPS_ALWAYS[0] = previous


def _use_op() -> bool:
    return _CUSTOM_OPS_ALWAYS[0] or torch.compiler.is_compiling()


def direct(op: Callable, impl: Callable) -> Callable:
    """`op` while compiling (or inside `through_custom_ops`), else `impl` itself (same arguments)."""
    def call(*args):
        return op(*args) if _use_op() else impl(*args)
    call.__name__ = getattr(impl, "__name__", "call")
    return call


def differentiable(op: Callable, impl: Callable, setup_context: Callable, backward: Callable) -> Callable:
    """`op` while compiling (or inside `through_custom_ops`), else an autograd Function running
    `impl` with `setup_context(ctx, inputs, output)` and `backward(ctx, *grads)`, the functions the
    op registered with `register_autograd`."""

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(*inputs):
            return impl(*inputs)

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_context(ctx, inputs, output)

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    Eager.__name__ = f"Eager_{getattr(impl, '__name__', 'op')}"

    def call(*args):
        return op(*args) if _use_op() else Eager.apply(*args)
    return call
