"""Triton kernels of the EP runtime, each beside its plain-torch reference (imported as occult.kernels)."""

from .combine import combine
from .grouped_down_reduce import grouped_down_reduce
from .grouped_swiglu import grouped_swiglu
from .reference import combine_ref, grouped_down_reduce_ref, grouped_swiglu_ref

__all__ = [
    "combine",
    "combine_ref",
    "grouped_down_reduce",
    "grouped_down_reduce_ref",
    "grouped_swiglu",
    "grouped_swiglu_ref",
]
