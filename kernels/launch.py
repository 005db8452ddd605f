"""Triton launches with less host work: a specialisation's compiled kernel, launched directly.

`kernel[grid](*args, **kwargs)` (Triton's `JITFunction.run`) binds the arguments, derives the
specialisation key, looks the compiled kernel up, builds launch metadata for profiler hooks,
checks the kernel's globals and launches: 32 µs of host time a launch on an H200 host, of
which the launch itself is 10 and the binder 8 (docs/notes/performance.md). `launch` keeps Triton's
own binder and cache key, so the specialisation (16-byte pointer alignment, integer divisibility,
dtypes, constexprs) is decided by Triton as before. It remembers which compiled kernel Triton's
normal path returned for that key, and launches that kernel directly from then on. The normal path
runs for a key's first launch, under the interpreter, while a launch hook or pre-run hook is set,
when `FAST_LAUNCH` is off, and for good after a failure of the fast path's own lookups (Triton
internals that moved), with one warning. Kernels are keyed by `id`: they live as long as their
module.

`launch_tuned` does the same for a `triton.autotune` wrapper: once the autotuner has picked a config
for a tuning key (its own first launch, benchmarks included), the kernel is launched with that
config through `launch`, past the autotuner's and Triton's per-launch Python. The key is read from
the autotuner's own cache with the autotuner's formula (the `key` arguments' values, then every
tensor argument's dtype), so the config is the one Triton would have launched; a miss, a config with
a pre-hook, or `FAST_TUNED_LAUNCH` off takes the autotuner's normal path.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

try:        # the Triton internals the fast path reads; without them every launch takes the normal path
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
    from triton.runtime.autotuner import Autotuner as _Autotuner
    from triton.runtime.jit import compute_cache_key as _compute_cache_key
except ImportError:                                                 # pragma: no cover - other Triton
    _knobs = _driver = _compute_cache_key = _Autotuner = None

@functools.cache
def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (TRITON_INTERPRET=1). Read once: `triton.jit`
    itself fixes the mode when a kernel is defined, and an environment lookup is a host cost that
    several launchers pay per call."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# A/B switches (benchmarks patch them; not thread-safe).
FAST_LAUNCH = [_compute_cache_key is not None]
FAST_TUNED_LAUNCH = [True]
_COMPILED: dict[tuple, Any] = {}


def _hook_set(hook) -> bool:
    """A launch hook that would have to run: Triton ≥ 3.5 keeps an (often empty) `HookChain`."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _lookup(kernel, args: tuple, kwargs: dict) -> tuple[tuple | None, Any, tuple]:
    """(our cache key, the compiled kernel remembered for it or None, the bound arguments); no key
    while a launch or pre-run hook is set (the normal path runs them)."""
    runtime = _knobs.runtime
    if (_hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook)
            or getattr(kernel, "pre_run_hooks", None)):
        return None, None, ()
    device = _driver.active.get_current_device()
    _, kernel_key_cache, _, _, binder = kernel.device_caches[device]
    bound, specialization, options = binder(*args, **kwargs)
    key = (id(kernel), device, _compute_cache_key(kernel_key_cache, specialization, options), runtime.debug)
    return key, _COMPILED.get(key), tuple(bound.values())


def launch(kernel, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
    """`kernel[grid](*args, **kwargs)` for a `triton.jit` kernel and a grid of 1–3 ints."""
    key = None
    if FAST_LAUNCH[0] and not interpreting():
        try:
            key, compiled, bound = _lookup(kernel, args, kwargs)
        except Exception as err:  # noqa: BLE001 - Triton internals moved: the normal path from now on
            FAST_LAUNCH[0] = False
            warnings.warn(f"occult.kernels.launch: direct launches disabled ({type(err).__name__}: {err})",
                          RuntimeWarning, stacklevel=2)
        else:
            if compiled is not None:
                stream = _driver.active.get_current_stream(key[1])
                grid_y = grid[1] if len(grid) > 1 else 1
                grid_z = grid[2] if len(grid) > 2 else 1
                compiled.run(grid[0], grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
                             None, None, None, *bound)
                return
    compiled = kernel[grid](*args, **kwargs)
    if key is not None and compiled is not None:
        _COMPILED[key] = compiled


def _tuned_config(tuned, args: tuple, kwargs: dict[str, Any]):
    """The config `tuned` (a `triton.autotune` wrapper of a `triton.jit` kernel) has already picked
    for these arguments, or None (not tuned yet, a config pre-hook to run, or another wrapper)."""
    if _Autotuner is None or not isinstance(tuned, _Autotuner):
        return None
    if len(tuned.configs) == 1:
        config = tuned.configs[0]
    else:
        named = dict(zip(tuned.arg_names, args))
        named.update((name, value) for name, value in kwargs.items() if name in tuned.arg_names)
        key = [named[name] for name in tuned.keys if name in named]
        key.extend(str(value.dtype) for value in named.values() if hasattr(value, "dtype"))
        config = tuned.cache.get(tuple(key))
    if config is None or config.pre_hook is not None or not hasattr(tuned.fn, "device_caches"):
        return None
    return config


def launch_tuned(tuned, grid, args: tuple, kwargs: dict[str, Any] | None = None) -> None:
    """`tuned[grid](*args, **kwargs)` for a `triton.autotune` wrapper `tuned`; `grid` maps the
    config's meta-parameters to a grid of 1–3 ints."""
    kwargs = kwargs or {}
    if FAST_TUNED_LAUNCH[0] and FAST_LAUNCH[0] and not interpreting():
        config = _tuned_config(tuned, args, kwargs)
        if config is not None:
            meta = config.all_kwargs()
            tuned.best_config = config
            launch(tuned.fn, grid(meta), args, {**kwargs, **meta})
            return
    tuned[grid](*args, **kwargs)
