"""occult: communication-efficient expert-parallel Mixture-of-Experts (a reproduction of Occult, ICML 2025)."""

__version__ = "0.1.0"
