"""Who owns the top-level import name `kernels` (see kernels/__init__.py).

The repository's `kernels/` directory is the package `occult.kernels`. With the repository root on
sys.path it is also found as a top-level `kernels`, a name the Hugging Face package of that name
(which transformers imports) owns on PyPI. `resolve` finds the module that name should be.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def installed_elsewhere(name: str, own_init: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of a package `name` on sys.path that is not the directory holding `own_init`, if any."""
    own_dir = os.path.dirname(own_init)
    own_root = os.path.dirname(own_dir)
    others = [entry for entry in sys.path if not _same_dir(entry or os.getcwd(), own_root)]
    spec = importlib.machinery.PathFinder.find_spec(name, others)
    if spec is None or spec.origin is None or spec.loader is None:
        return None
    if _same_dir(os.path.dirname(spec.origin), own_dir):  # this directory again, by another path entry
        return None
    return spec


def resolve(name: str, own_init: str) -> ModuleType:
    """The module the top-level import `name` of `own_init`'s directory should give.

    Another installed package of that name (Hugging Face `kernels`) is loaded and returned; otherwise
    the one `occult.kernels`, so that the ops are registered once.
    """
    spec = installed_elsewhere(name, own_init)
    if spec is None:
        return importlib.import_module("occult.kernels")
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(name)
    sys.modules[name] = module  # its own `from kernels.x import y` must find it while it runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
        raise
    return module
