"""Triton kernels of the EP runtime, each beside its plain-torch reference (imported as occult.kernels)."""

if __name__ != "occult.kernels":
    # This directory is also importable as a top-level `kernels` whenever the repository root is on
    # sys.path (`python -m` or pytest from the root). That name belongs to the Hugging Face package
    # `kernels` (transformers >= 5.25 requires it and imports it), so the name is handed to it when it
    # is installed. Otherwise it becomes an alias of occult.kernels: a second copy of this directory
    # would register the custom ops again and take them over, so that autograd-recording calls ran the
    # copy's launchers (its own forced configs and launch records).
    import importlib as _importlib
    import sys as _sys

    _sys.modules[__name__] = _importlib.import_module("occult._top_level_kernels").resolve(__name__, __file__)
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
