"""Triton kernels of the EP runtime, each beside its plain-torch reference (imported as occult.kernels)."""
