"""Method names of the latency sweeps and the scale simulator, and the one parser of them.

A name is a baseline (`megablocks`, `tutel`, `naive`, `hf`, `fsdp`, `deepspeed`) or Occult's EP
layer with options: `occult[-nd<N>][-<option>...]`, for example `occult-nd2-graph-balanced`.
`-nd<N>` prunes each token's routing to N devices (router-score rule); the options are those of
`OCCULT_OPTIONS`, each at most once. `parse_method` turns a name into a `MethodSpec`; every
reader of method names (the sweep, the simulator, the reports) goes through it.
"""

from __future__ import annotations

from dataclasses import dataclass

BASELINES = ("megablocks", "tutel", "naive", "hf", "fsdp", "deepspeed")
BALANCE_EPS = 0.1          # -balanced: busiest device's calibration load <= (1 + eps) x mean
OCCULT_OPTIONS = {
    "pe": "per_expert dispatch (one row per (token, expert)) through the same kernels",
    "static": "static-shape dedup plan (no host sync; C = T rows per destination)",
    "graph": "the static plan replayed from a CUDA graph (forward: GraphedForward; train: make_graphed_callables)",
    "trivial": "contiguous placement instead of greedy_occult",
    "balanced": f"greedy_occult repaired and swap-searched so that no device holds more than {1 + BALANCE_EPS:g}x "
                "the mean token-expert pairs of the calibration batch (placement_methods.load_aware_swap)",
    "compute": "expert compute alone: each GPU's received pairs, dispatched once outside the timing "
               "(with -graph: replayed from a CUDA graph, so no host time; the simulator's kernel curve)",
}
# Which host and GPU terms of the simulator's cost model apply to a method.
FAMILIES = ("occult", "occult-pe", "occult-static", "occult-graph", "occult-compute", "naive")
GRAMMAR = f"occult[-nd<N>][-{'|-'.join(OCCULT_OPTIONS)}] or one of {', '.join(BASELINES)}"


class MethodNameError(ValueError):
    """A method name outside the grammar; the message names it and says why."""


@dataclass(frozen=True)
class MethodSpec:
    """What a method name means."""

    name: str
    system: str                          # "occult" or a baseline's name
    max_devices: int | None = None       # N_d of router-score pruning (None: exact routing)
    options: frozenset[str] = frozenset()

    @property
    def is_occult(self) -> bool:
        return self.system == "occult"

    @property
    def static(self) -> bool:
        """A static-shape plan: T rows to every device, no host sync."""
        return bool(self.options & {"static", "graph"})

    @property
    def contiguous(self) -> bool:
        """Contiguous placement (the naive EP, `-trivial`) instead of the collaboration-aware one."""
        return self.system == "naive" or "trivial" in self.options

    @property
    def balanced(self) -> bool:
        return "balanced" in self.options

    @property
    def mode(self) -> str:
        """Dispatch wire format: `dedup` (one row per token and device), `per_expert` or `naive`."""
        if not self.is_occult:
            return "naive"
        return "per_expert" if "pe" in self.options else "dedup"

    @property
    def family(self) -> str:
        """One of FAMILIES for Occult and the naive EP; the system's name for other baselines."""
        if not self.is_occult:
            return self.system
        for option in ("compute", "graph", "static", "pe"):
            if option in self.options:
                return f"occult-{option}"
        return "occult"


def parse_method(name: str) -> MethodSpec:
    """The spec of `name`; MethodNameError if it is outside the grammar (GRAMMAR)."""
    if name in BASELINES:
        return MethodSpec(name, name)
    parts = name.split("-")
    if parts[0] != "occult":
        raise MethodNameError(f"method {name!r}: expected {GRAMMAR}")
    max_devices, options = None, []
    for i, part in enumerate(parts[1:]):
        if part.startswith("nd") and part[2:].isdigit():
            if i != 0 or int(part[2:]) < 1:
                raise MethodNameError(f"method {name!r}: -nd<N> (N >= 1) must come first, right after 'occult'")
            max_devices = int(part[2:])
        elif part in OCCULT_OPTIONS:
            if part in options:
                raise MethodNameError(f"method {name!r}: option -{part} given twice")
            options.append(part)
        else:
            raise MethodNameError(f"method {name!r}: unknown option {part!r}; expected {GRAMMAR}")
    chosen = frozenset(options)
    if "pe" in chosen and chosen & {"static", "graph"}:
        raise MethodNameError(f"method {name!r}: per-expert rows have no static plan (-pe with -static/-graph)")
    if "balanced" in chosen and ("trivial" in chosen or max_devices is not None):
        raise MethodNameError(f"method {name!r}: -balanced is a placement of exact routing (not -trivial, not -nd<N>)")
    if "trivial" in chosen and max_devices is not None:
        raise MethodNameError(f"method {name!r}: -nd<N> prunes to devices of the collaboration-aware placement, "
                              "not -trivial's contiguous one")
    return MethodSpec(name, "occult", max_devices, chosen)


def is_occult(name: str) -> bool:
    """Whether `name` is a well-formed Occult method name."""
    try:
        return parse_method(name).is_occult
    except MethodNameError:
        return False
