"""Triton kernels of the EP runtime, each beside its plain-torch reference (imported as occult.kernels)."""

if __name__ != "occult.kernels":
    # This directory is also importable as a top-level `kernels` whenever the repository root is on
    # sys.path (`python -m` or pytest from the root), and transformers imports a top-level `kernels` to
    # probe for the Hugging Face package of that name. A second copy would register the custom ops
    # again and take them over, so that autograd-recording calls ran the copy's launchers (its own
    # forced configs and launch records). The name is made an alias of the one package instead.
    import importlib as _importlib
    import sys as _sys

    _sys.modules[__name__] = _importlib.import_module("occult.kernels")
else:
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
