"""Method names of the latency sweeps and the scale simulator, and the one parser of them.

A name is a baseline (`megablocks`, `tutel`, `naive`, `hf`, `fsdp`, `deepspeed`), optionally with
settings of its library, `<baseline>:<key>=<value>[,<key>=<value>...]` (the keys and values of
`BASELINE_SETTINGS`; for example `megablocks:grouped_gemm=cutlass`, `tutel:adaptive_r=0`), or
Occult's EP layer with options: `occult[-nd<N>][-<option>...]`, for example
`occult-nd2-graph-balanced`. `-nd<N>` prunes each token's routing to N devices (router-score rule);
the options are those of `OCCULT_OPTIONS`, each at most once. `parse_method` turns a name into a
`MethodSpec`; every reader of method names (the sweep, the simulator, the reports) goes through it.
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
    "latency": "the placement of lowest predicted layer time (occult.routing.latency: the shipped cost model at "
               "2^14 tokens per GPU), from the fastest of greedy_occult, swap, load-aware and EPLB-style on the "
               "calibration batch",
    "compute": "expert compute alone: each GPU's received pairs, dispatched once outside the timing "
               "(with -graph: replayed from a CUDA graph, so no host time; the simulator's kernel curve)",
}
# A baseline's library settings a name may choose: key -> allowed values, the default first. Only
# settings that keep the layer exact (no dropped token) are offered.
BASELINE_SETTINGS = {
    "megablocks": {
        "grouped_gemm": ("cublas", "cutlass"),   # grouped_gemm 0.3.0 built without / with GROUPED_GEMM_CUTLASS=1
        "mlp_impl": ("grouped", "sparse"),       # grouped GEMMs, or stk's block-sparse Triton kernels
    },
    "tutel": {
        "adaptive_r": ("1", "0"),                # 0: experts computed in place, no all-to-all (D = 1 only)
        "megablocks_size": ("0", "1", "2"),      # Tutel's block-sparse expert GEMMs (inference, D = 1)
    },
    "deepspeed": {
        "use_tutel": ("0", "1"),                 # Tutel's dispatch encoder inside DeepSpeed's layer
    },
}
# Which host and GPU terms of the simulator's cost model apply to a method.
FAMILIES = ("occult", "occult-pe", "occult-static", "occult-graph", "occult-compute", "naive")
GRAMMAR = (f"occult[-nd<N>][-{'|-'.join(OCCULT_OPTIONS)}] or one of {', '.join(BASELINES)}, "
           "optionally <baseline>:<key>=<value>[,...]")


class MethodNameError(ValueError):
    """A method name outside the grammar; the message names it and says why."""


@dataclass(frozen=True)
class MethodSpec:
    """What a method name means."""

    name: str
    system: str                          # "occult" or a baseline's name
    max_devices: int | None = None       # N_d of router-score pruning (None: exact routing)
    options: frozenset[str] = frozenset()
    settings: tuple[tuple[str, str], ...] = ()   # a baseline's library settings, every key, defaults filled

    def setting(self, key: str) -> str:
        """The value of a baseline setting (KeyError for a key the baseline does not have)."""
        return dict(self.settings)[key]

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
    def latency(self) -> bool:
        return "latency" in self.options

    @property
    def placement(self) -> str:
        """The placement the layer runs on: contiguous, greedy (greedy_occult), balanced or latency."""
        if self.contiguous:
            return "contiguous"
        return "balanced" if self.balanced else "latency" if self.latency else "greedy"

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
    system, colon, text = name.partition(":")
    if system in BASELINES:
        return MethodSpec(name, system, settings=_baseline_settings(name, system, text if colon else None))
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
    for placement in ("balanced", "latency"):
        if placement in chosen and ("trivial" in chosen or max_devices is not None):
            raise MethodNameError(f"method {name!r}: -{placement} is a placement of exact routing "
                                  "(not -trivial, not -nd<N>)")
    if {"balanced", "latency"} <= chosen:
        raise MethodNameError(f"method {name!r}: -balanced and -latency are two placements; choose one")
    if "trivial" in chosen and max_devices is not None:
        raise MethodNameError(f"method {name!r}: -nd<N> prunes to devices of the collaboration-aware placement, "
                              "not -trivial's contiguous one")
    return MethodSpec(name, "occult", max_devices, chosen)


def _baseline_settings(name: str, system: str, text: str | None) -> tuple[tuple[str, str], ...]:
    """Every setting of `system` (defaults filled) with those chosen in `text` (`key=value,...`)."""
    table = BASELINE_SETTINGS.get(system, {})
    if text is None:
        return tuple((key, values[0]) for key, values in table.items())
    if not table:
        raise MethodNameError(f"method {name!r}: {system} has no settings to choose")
    chosen: dict[str, str] = {}
    for item in text.split(","):
        key, equals, value = item.partition("=")
        if not equals or key not in table:
            raise MethodNameError(f"method {name!r}: expected <key>=<value> with a key of {system}: "
                                  f"{', '.join(table)}; got {item!r}")
        if key in chosen:
            raise MethodNameError(f"method {name!r}: setting {key} given twice")
        if value not in table[key]:
            raise MethodNameError(f"method {name!r}: {key}={value!r} is not one of {', '.join(table[key])}")
        chosen[key] = value
    if system == "megablocks" and chosen.get("mlp_impl") == "sparse" and "grouped_gemm" in chosen:
        raise MethodNameError(f"method {name!r}: mlp_impl=sparse runs stk's kernels, no grouped_gemm to choose")
    return tuple((key, chosen.get(key, values[0])) for key, values in table.items())


def is_occult(name: str) -> bool:
    """Whether `name` is a well-formed Occult method name."""
    try:
        return parse_method(name).is_occult
    except MethodNameError:
        return False
