"""The sweep's settings: kinds, default sizes and methods, routings, timings, the CSV columns, and
`SweepSettings` with its one validation error type (`SweepError`, naming the field)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from occult.harness.baselines import METHOD_CLASSES
from occult.shapes import get_shape
from occult.method_names import MethodNameError, parse_method

KINDS = ("prefill", "decode", "train")
DEFAULT_SIZES = {
    "prefill": tuple(2**p for p in range(10, 17)),
    "decode": (1, 8, 64, 512),
    "train": (1, 2, 4, 8, 16),
}
DEFAULT_METHODS = ("occult", "occult-nd2", "occult-nd1", "megablocks", "tutel", "naive", "hf", "fsdp", "deepspeed")
# The fair comparison (`python -m occult.harness.sweep.parts`): every Occult variant, and every exact
# setting of each baseline (docs/baselines.md), the processes split as `parts.process_key` says.
FAIR_METHODS = (
    "occult", "occult-balanced", "occult-latency", "occult-graph", "occult-graph-balanced", "occult-graph-latency",
    "occult-nd2", "occult-nd1", "naive", "hf", "fsdp",
    "megablocks", "megablocks:grouped_gemm=cutlass", "megablocks:mlp_impl=sparse",
    "tutel", "tutel:adaptive_r=0", "tutel:megablocks_size=1",
    "deepspeed", "deepspeed:use_tutel=1",
)
ROUTINGS = ("synthetic", "uniform", "trace")
# step: the GPU drained before each timed step (one layer call from an idle GPU, host time before
# its first kernel included); stream: blocks of steps issued back to back, as consecutive layers of a
# model issue them, so host time hides behind queued GPU work unless a method syncs with the host
TIMINGS = ("step", "stream")
STREAM_BLOCKS = 5
REL_TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
VERSION_PACKAGES = ("torch", "triton", "transformers", "megablocks", "grouped_gemm", "stanford-stk", "tutel", "deepspeed")
COLUMNS = (
    "machine", "commit", "command", "kind", "shape", "method", "D", "tokens_per_gpu", "batch", "seq_len",
    "dtype", "median_ms", "p10_ms", "p90_ms", "peak_mem_gib", "bytes_sent", "mean_devices_per_token",
    "max_rel_err", "status", "routing", "baseline_config", "order_seed", "order_position", "point_position", "pairs_received_max", "dispatch_ms", "experts_ms", "combine_ms", "host_ms",
    "host_probe_us", "host_launch_us", "repeats", "warmup", "timer", "timing", "num_experts", "top_k", "hidden", "ffn",
    "shared_ffn", *(f"version_{name.replace('-', '_')}" for name in VERSION_PACKAGES),
)


class SweepError(ValueError):
    """A sweep argument is invalid; the message names it."""


def order_base_seed(seed: int, order_seed: int | None) -> int:
    """The seed the methods' order is drawn from: `order_seed`, else the data's `seed`."""
    return seed if order_seed is None else order_seed


@dataclass(frozen=True)
class SweepSettings:
    """Everything a rank needs (inherited by forked CPU ranks, passed to `run_sweep` on GPUs)."""

    kind: str
    shapes: tuple[str, ...]
    methods: tuple[str, ...]
    world: int
    sizes: tuple[int, ...]
    out_csv: str
    repeats: int = 20
    warmup: int = 5
    device: str = "cuda"
    dtype: str = "bfloat16"
    seed: int = 0                    # the data: router, weights, inputs, placements
    order_seed: int | None = None    # the methods' order at each point; None: drawn from `seed`
    seq_len: int = 512
    input_sets: int = 3
    check_tokens: int = 64
    occult_backend: str = "auto"
    include_shared: bool = True
    command: str = ""
    routings: tuple[str, ...] = ("synthetic",)
    trace: str = ""
    host_profile: str = ""
    timing: str = "step"
    grouped_gemm_dir: str = ""       # holds gg-cublas/ and gg-cutlass/ (tools/build_baselines.sh); "": as installed
    skip_points: str = ""            # CSV of points (routing, shape, tokens_per_gpu, method) not to run

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise SweepError(f"kind: {self.kind!r} is not one of {KINDS}")
        for name in self.shapes:
            try:
                get_shape(name)
            except ValueError as err:
                raise SweepError(f"shapes: {err}") from None
        self._validate_methods()
        if self.world < 1:
            raise SweepError(f"D: must be at least 1, got {self.world}")
        if not self.sizes or min(self.sizes) < 1:
            raise SweepError(f"sizes: need positive sizes, got {self.sizes}")
        for field in ("repeats", "input_sets", "check_tokens", "seq_len"):
            if getattr(self, field) < 1:
                raise SweepError(f"{field}: must be at least 1, got {getattr(self, field)}")
        unknown = [r for r in self.routings if r not in ROUTINGS]
        if not self.routings or unknown or len(set(self.routings)) < len(self.routings):
            raise SweepError(f"routings: need distinct ones of {ROUTINGS}, got {self.routings}")
        if self.timing not in TIMINGS:
            raise SweepError(f"timing: {self.timing!r} is not one of {TIMINGS}")
        if "trace" in self.routings and not Path(self.trace).is_file():
            raise SweepError(f"trace: routing trace needs a routing_*.npz file, got {self.trace!r}")
        if self.skip_points and not Path(self.skip_points).is_file():
            raise SweepError(f"skip_points: {self.skip_points!r} is not a file")
        mode = self.grouped_gemm_mode()
        if self.grouped_gemm_dir and mode and not (Path(self.grouped_gemm_dir) / f"gg-{mode}" / "grouped_gemm").is_dir():
            raise SweepError(f"grouped_gemm_dir: {self.grouped_gemm_dir} has no gg-{mode}/grouped_gemm "
                             "(tools/build_baselines.sh installs both builds there)")
        if self.order_seed is not None and self.order_seed < 0:
            raise SweepError(f"order_seed: must be >= 0, got {self.order_seed}")
        if self.warmup < 0:
            raise SweepError(f"warmup: must be >= 0, got {self.warmup}")
        if self.dtype not in DTYPES:
            raise SweepError(f"dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.device not in ("cuda", "cpu"):
            raise SweepError(f"device: {self.device!r} is not cuda or cpu")
        if self.occult_backend not in ("auto", "torch", "triton"):
            raise SweepError(f"occult_backend: {self.occult_backend!r} is not auto, torch or triton")

    def _validate_methods(self) -> None:
        if not self.methods:
            raise SweepError("methods: none given")
        seen: dict[tuple, str] = {}
        for name in self.methods:
            try:
                spec = parse_method(name)
            except MethodNameError as err:
                raise SweepError(f"methods: {err}") from None
            if not spec.is_occult and spec.system not in METHOD_CLASSES:
                raise SweepError(f"methods: {name!r} has no adapter; expected one of {sorted(METHOD_CLASSES)}")
            meaning = (spec.system, spec.max_devices, spec.options, spec.settings)
            if meaning in seen:
                raise SweepError(f"methods: {seen[meaning]!r} and {name!r} are the same method")
            seen[meaning] = name
        modes = {parse_method(name).setting("grouped_gemm") for name in self.methods if _grouped_megablocks(name)}
        if len(modes) > 1:
            raise SweepError("methods: MegaBlocks with grouped_gemm=cublas and with grouped_gemm=cutlass need a "
                             "process each (one grouped_gemm build per process; "
                             "python -m occult.harness.sweep.parts runs them apart)")

    def grouped_gemm_mode(self) -> str:
        """The grouped_gemm build this process's MegaBlocks methods use ("" if none uses one)."""
        modes = {parse_method(name).setting("grouped_gemm") for name in self.methods if _grouped_megablocks(name)}
        return modes.pop() if len(modes) == 1 else ""

    @property
    def order_base_seed(self) -> int:
        """The seed the methods' order at every point is drawn from (`order_base_seed`)."""
        return order_base_seed(self.seed, self.order_seed)

    def tokens_per_gpu(self, size: int) -> int:
        return size * self.seq_len if self.kind == "train" else size

    def batch(self, size: int) -> int | None:
        return None if self.kind == "prefill" else size


def _grouped_megablocks(name: str) -> bool:
    spec = parse_method(name)
    return spec.system == "megablocks" and spec.setting("mlp_impl") == "grouped"
