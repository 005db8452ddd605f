"""Typed configuration: one small dataclass per stage, validated before any job runs.

`load_config` reads YAML (or takes a dict, as Snakemake's `config`), checks it against
`config/schema.yaml` (closed sections: unknown keys are errors) and then the facts a schema
cannot express (experts divisible by devices, N_d * E / D >= k, the checkpoint exists).
Every failure is one `ConfigError` whose message names the offending field.

The schema, the default configuration and the presets are package data: `occult/resources` is a
link to the repository's `config/` folder, whose files a built wheel holds as copies, so an
installed `occult` finds them without the checkout (`resource`, `preset_config`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.resources
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

RESOURCES = "resources"      # occult/resources -> ../config: schema.yaml, config.yaml, presets/
VARIANT_RE = re.compile(r"^(raw|sft|prune(?P<nd>[0-9]+)-(?P<kind>router|sim))$")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclass(frozen=True)
class DataConfig:
    sources: tuple[str, ...]
    max_chars_per_source: int
    heldout_fraction: float
    vocab_size: int
    instruction_pairs: int
    eval_tasks: tuple[str, ...]
    eval_examples: int | None
    tokenizer_from: str | None = None     # a GGUF file or distribution: its tokenizer instead of training one


@dataclass(frozen=True)
class ModelConfig:
    source: str
    checkpoint: str | None
    hidden_size: int
    num_layers: int
    num_heads: int
    num_experts: int
    top_k: int
    expert_ffn: int
    max_seq_len: int
    experts_kernel: str = "grouped"     # "triton": the EP runtime's fused kernels (GPU), occult.models.moe
    router_noise: float = 0.0           # upcycle: noise on the tied group router rows (occult.models.upcycle)
    upcycle_init: str = "virtual_groups"   # upcycle: virtual_groups (exact) or drop (no groups), occult.models.upcycle
    drop_ratio: float = 0.5             # upcycle_init drop: share of each expert's units redrawn


@dataclass(frozen=True)
class PretrainConfig:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    router_aux_loss: float
    seed: int | None = None             # the base model's seed (initial draws, data order); None: the top-level seed
    target_heldout_ppl: float | None = None   # stop once the held-out perplexity reaches it (steps: the budget)
    eval_every: int | None = None       # steps between held-out evaluations; None: steps // 5

    def base_seed(self, seed: int) -> int:
        """The seed of the base model: `seed` unless `pretrain.seed` sets its own."""
        return seed if self.seed is None else self.seed


@dataclass(frozen=True)
class ProfileConfig:
    calibration_tokens: int
    heldout_tokens: int
    seq_len: int


@dataclass(frozen=True)
class PlacementConfig:
    devices: tuple[int, ...]
    methods: tuple[str, ...]
    swap_rounds: int
    study_synthetic: tuple[str, ...]


@dataclass(frozen=True)
class FinetuneConfig:
    devices: int
    placement_method: str
    variants: tuple[str, ...]
    gate_weights: str
    train_modules: str
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    quality_grid: bool = False          # also every arm of occult.routing.variants.quality_arms (presets mini, upcycle)
    quality_arms: str = "full"          # full: every arm of quality_arms; core: D = finetune.devices only
    base_seeds: tuple[int, ...] = ()    # the grid again on one base model per pretrain.seed (rule quality_base_grid)


@dataclass(frozen=True)
class EvaluateConfig:
    batch_size: int


@dataclass(frozen=True)
class BenchConfig:
    devices: int
    tokens_per_rank: tuple[int, ...]
    repeats: int
    warmup: int
    cases: tuple[str, ...]


@dataclass(frozen=True)
class SimulateConfig:
    """The scale simulator's model settings; its measured runs are named by the results tree
    (`results/<machine>/<run>/simulator.yaml`, occult.sim.inputs)."""

    shapes: tuple[str, ...]
    methods: tuple[str, ...]
    devices: tuple[int, ...]
    tokens_per_gpu: tuple[int, ...]
    prediction_devices: tuple[int, ...]   # D of predictions_D4_D8.csv (the sweep's own sizes)
    gpus_per_node: int
    inter_node_gbps: float
    inter_node_latency_us: float
    pool_tokens: int
    gemm_min_rows_per_expert: int
    tolerance: float
    hbm_gbps: float | None = None       # HBM bandwidth: floor of the kernels' weight reads (None: no floor)
    dense_tflops: float | None = None   # shared experts' matmul rate (None: the results tree's dense_peak file)
    kernel_stream_gbps: float | None = None   # small expert calls' weight streaming (None: fitted, else hbm_gbps)
    host_speed: str = "auto"            # auto | none | launch | python: host terms scaled by a probe (occult.sim.measured.host_scale_of_set)
    prediction_check: dict | None = None   # {predictions: FILE}: the pre-registered predictions (occult.sim.check)


@dataclass(frozen=True)
class Config:
    run: str
    seed: int
    data: DataConfig
    model: ModelConfig
    pretrain: PretrainConfig
    profile: ProfileConfig
    placement: PlacementConfig
    finetune: FinetuneConfig
    evaluate: EvaluateConfig
    bench: BenchConfig
    simulate: SimulateConfig | None = None   # optional section: the scale simulator (occult.sim.run)
    raw: dict = dataclasses.field(repr=False, compare=False, default_factory=dict)

    @property
    def num_experts(self) -> int:
        return checkpoint_moe_shape(self.model)[0]

    @property
    def top_k(self) -> int:
        return checkpoint_moe_shape(self.model)[1]

    def hash(self) -> str:
        """Short hash of the resolved configuration (recorded beside every result)."""
        return config_hash(self.raw)


@dataclass(frozen=True)
class Variant:
    """A fine-tuning variant: `raw`, `sft`, or `prune<N_d>-<router|sim>`."""

    name: str
    max_devices: int | None = None   # N_d; None = no pruning
    method: str | None = None        # "router" | "sim"

    @property
    def trains(self) -> bool:
        return self.name != "raw"


def parse_variant(name: str) -> Variant:
    m = VARIANT_RE.match(name)
    if not m:
        raise ConfigError(f"finetune.variants: {name!r} is not raw, sft or prune<N>-<router|sim>")
    if m.group("nd") is None:
        return Variant(name)
    return Variant(name, int(m.group("nd")), m.group("kind"))


def parse_bench_case(name: str) -> tuple[str, int | None]:
    """`trivial`/`placed` → (name, None); `prune<N>` → ("prune", N)."""
    if name.startswith("prune"):
        return "prune", int(name[len("prune"):])
    return name, None


def config_hash(raw: dict) -> str:
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:12]


def checkpoint_moe_shape(model: ModelConfig) -> tuple[int, int]:
    """(num_experts, top_k) of the model: from the config for `scratch`/`upcycle`, from config.json otherwise."""
    if model.source in ("scratch", "upcycle"):
        return model.num_experts, model.top_k
    cfg_file = Path(model.checkpoint or "") / "config.json"
    try:
        hf = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"model.checkpoint: {cfg_file} does not exist") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"model.checkpoint: {cfg_file} is not valid JSON ({err})") from None
    experts = hf.get("num_experts", hf.get("n_routed_experts", hf.get("num_local_experts")))
    top_k = hf.get("num_experts_per_tok")
    if not isinstance(experts, int) or not isinstance(top_k, int):
        raise ConfigError(
            f"model.checkpoint: {cfg_file} has no num_experts/n_routed_experts and num_experts_per_tok"
        )
    return experts, top_k


def resource(*parts: str) -> Traversable:
    """A file of the package's copy of `config/` (`resource("schema.yaml")`), checkout or wheel."""
    return importlib.resources.files("occult").joinpath(RESOURCES, *parts)


def preset_names() -> list[str]:
    """The presets shipped with the package (`config/presets/<name>.yaml`)."""
    return sorted(f.name[:-len(".yaml")] for f in resource("presets").iterdir() if f.name.endswith(".yaml"))


def preset_config(name: str) -> dict:
    """The default configuration (`config/config.yaml`) with the named preset on top, as a dict."""
    if name not in preset_names():
        raise ConfigError(f"preset {name!r} is not shipped (presets: {', '.join(preset_names())})")
    default = yaml.safe_load(resource("config.yaml").read_text(encoding="utf-8"))
    return merge(default, yaml.safe_load(resource("presets", f"{name}.yaml").read_text(encoding="utf-8")) or {})


def _schema() -> dict:
    return yaml.safe_load(resource("schema.yaml").read_text(encoding="utf-8"))


def _validate_schema(raw: dict) -> None:
    import jsonschema

    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(raw), key=lambda e: list(e.absolute_path))
    if not errors:
        return
    err = errors[0]
    field = ".".join(str(p) for p in err.absolute_path) or "<top level>"
    if err.validator == "additionalProperties":
        extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
        prefix = f"{field}." if err.absolute_path else ""
        raise ConfigError(f"{prefix}{extra[0]}: unknown key (allowed: {', '.join(err.schema['properties'])})")
    raise ConfigError(f"{field}: {err.message}")


def _check_semantics(cfg: Config) -> None:
    m = cfg.model
    if m.source == "checkpoint":
        if not m.checkpoint:
            raise ConfigError("model.checkpoint: required when model.source is 'checkpoint'")
        if not Path(m.checkpoint).is_dir():
            raise ConfigError(f"model.checkpoint: {m.checkpoint} is not a directory")
    elif m.source == "upcycle":
        _check_upcycle(m)
    elif m.hidden_size % m.num_heads:
        raise ConfigError(f"model.num_heads: {m.num_heads} does not divide model.hidden_size {m.hidden_size}")
    _check_init(cfg)
    experts, top_k = checkpoint_moe_shape(m)
    if top_k > experts:
        raise ConfigError(f"model.top_k: {top_k} exceeds model.num_experts {experts}")
    for field, devices in [
        *[("placement.devices", d) for d in cfg.placement.devices],
        ("finetune.devices", cfg.finetune.devices),
        ("bench.devices", cfg.bench.devices),
    ]:
        if experts % devices:
            raise ConfigError(f"{field}: {experts} experts are not divisible by {devices} devices")
    if cfg.finetune.placement_method not in cfg.placement.methods:
        raise ConfigError(
            f"finetune.placement_method: {cfg.finetune.placement_method!r} is not in placement.methods"
        )
    if cfg.finetune.devices not in cfg.placement.devices:
        raise ConfigError(f"finetune.devices: {cfg.finetune.devices} is not in placement.devices")
    if cfg.bench.devices not in cfg.placement.devices:
        raise ConfigError(f"bench.devices: {cfg.bench.devices} is not in placement.devices")
    for name in cfg.finetune.variants:
        v = parse_variant(name)
        if v.max_devices is not None:
            _check_prune(f"finetune.variants: {name}", v.max_devices, experts, top_k, cfg.finetune.devices)
    for name in cfg.bench.cases:
        kind, nd = parse_bench_case(name)
        if nd is not None:
            _check_prune(f"bench.cases: {name}", nd, experts, top_k, cfg.bench.devices)


def _check_init(cfg: Config) -> None:
    """Upcycling keys only where they act, and the quality grid's base models only with the grid."""
    m = cfg.model
    if m.upcycle_init != "virtual_groups" and m.source != "upcycle":
        raise ConfigError(f"model.upcycle_init: {m.upcycle_init} needs model.source: upcycle, not {m.source}")
    if m.router_noise and m.upcycle_init != "virtual_groups":
        raise ConfigError("model.router_noise: only for model.upcycle_init: virtual_groups (drop draws independent router rows)")
    ft = cfg.finetune
    if ft.base_seeds and not ft.quality_grid:
        raise ConfigError("finetune.base_seeds: the quality grid's base models need finetune.quality_grid: true")
    if ft.base_seeds and m.source not in ("scratch", "upcycle"):
        raise ConfigError(f"finetune.base_seeds: base models are pre-trained here; model.source is {m.source}")
    target = cfg.pretrain.target_heldout_ppl
    if target is not None and cfg.pretrain.steps == 0:
        raise ConfigError("pretrain.target_heldout_ppl: pretrain.steps is 0, so no step could reach it")


def _check_upcycle(m: ModelConfig) -> None:
    """The dense GGUF exists and the model sizes written in the config are the ones it gives."""
    from occult.models.gguf import GGUFError, GGUFReader, find_gguf
    from occult.models.gguf import dense_shape

    if not m.checkpoint:
        raise ConfigError("model.checkpoint: required when model.source is 'upcycle' (a .gguf file or distribution)")
    try:
        shape = dense_shape(GGUFReader(find_gguf(m.checkpoint)))
    except GGUFError as err:
        raise ConfigError(str(err)) from None
    for field, value, want in [("hidden_size", m.hidden_size, shape.hidden_size),
                               ("num_layers", m.num_layers, shape.num_layers),
                               ("num_heads", m.num_heads, shape.num_heads),
                               ("expert_ffn", m.expert_ffn * m.top_k, shape.ffn)]:
        if value != want:
            detail = f"expert_ffn * top_k = {value}" if field == "expert_ffn" else str(value)
            raise ConfigError(f"model.{field}: {detail}, but {m.checkpoint} gives {want} "
                              "(upcycling: expert_ffn = dense FFN width / top_k)")
    if m.num_experts % m.top_k:
        raise ConfigError(f"model.num_experts: {m.num_experts} is not a multiple of model.top_k {m.top_k}")


def _check_prune(field: str, nd: int, experts: int, top_k: int, devices: int) -> None:
    if nd < 1:
        raise ConfigError(f"{field}: N_d must be at least 1")
    if nd * experts // devices < top_k:
        raise ConfigError(
            f"{field}: N_d*E/D = {nd}*{experts}/{devices} = {nd * experts // devices} < top_k {top_k}; "
            "pruned tokens could not keep k experts"
        )


def _section(cls, raw: dict):
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING):
            continue
        value = raw[f.name]
        kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def load_config(source: str | Path | dict, overrides: dict | None = None) -> Config:
    """Load, validate and type a configuration from a YAML path, a dict, or the name of a shipped
    preset (`tiny`, `mini`, ...: `preset_config`) where no file of that name exists."""
    if isinstance(source, dict):
        raw = copy.deepcopy(source)
    elif not Path(source).is_file() and str(source) in preset_names():
        raw = preset_config(str(source))
    else:
        path = Path(source)
        try:
            raw = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist "
                              f"(or name a shipped preset: {', '.join(preset_names())})") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if overrides:
        raw = merge(raw, overrides)
    if not isinstance(raw, dict):
        raise ConfigError("<top level>: the configuration must be a mapping")
    _validate_schema(raw)
    cfg = Config(
        run=raw["run"],
        seed=raw["seed"],
        data=_section(DataConfig, raw["data"]),
        model=_section(ModelConfig, raw["model"]),
        pretrain=_section(PretrainConfig, raw["pretrain"]),
        profile=_section(ProfileConfig, raw["profile"]),
        placement=_section(PlacementConfig, raw["placement"]),
        finetune=_section(FinetuneConfig, raw["finetune"]),
        evaluate=_section(EvaluateConfig, raw["evaluate"]),
        bench=_section(BenchConfig, raw["bench"]),
        simulate=_section(SimulateConfig, raw["simulate"]) if "simulate" in raw else None,
        raw=raw,
    )
    _check_semantics(cfg)
    return cfg


def merge(base: dict, override: dict) -> dict:
    """Recursive dict merge (presets on top of the default)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
