# Config validation (before any job runs) and the paths every rule shares.
import json
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError

from occult.config import ConfigError, load_config
from occult.report.results_index import ResultsIndexError, runs_in_tree
from occult.sim.columns import SimulateError
from occult.sim.inputs import discover

try:
    CFG = load_config(config)
except ConfigError as err:
    raise WorkflowError(f"config error: {err}") from None

RUN = CFG.run
WORK = f"work/{RUN}"
RESULTS = f"results/{RUN}"
FIGURES = f"figures/{RUN}"
RESOLVED_CONFIG = f"{WORK}/config.yaml"
PLACEMENT_FILES = [
    f"{RESULTS}/placement/D{d}_{m}.json" for d in CFG.placement.devices for m in CFG.placement.methods
]
VARIANTS = list(CFG.finetune.variants)


def _write_resolved_config() -> None:
    """Write the validated config for the CLI; rewrite only on change so mtimes stay stable."""
    import yaml

    path = Path(RESOLVED_CONFIG)
    text = yaml.safe_dump(CFG.raw, sort_keys=False)
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


_write_resolved_config()


def settings(*sections: str) -> str:
    """Config sections as a params value; editing one of them reruns the jobs that declare it."""
    return json.dumps({s: CFG.raw[s] for s in sections}, sort_keys=True)


def output_dir(wildcards, output) -> str:
    """Folder of the first output (for stages that write several files there)."""
    return str(Path(output[0]).parent)


def data_dir(wildcards, input) -> str:
    return str(Path(input.manifest).parent)


def profile_dir(wildcards, input) -> str:
    return str(Path(input.profile).parent)


def profile_dir_of_traces(wildcards, input) -> str:
    return str(Path(input.heldout).parent)


def placement_dir(wildcards, input) -> str:
    return str(Path(input.placements[0]).parent)


def results_dir(wildcards, output) -> str:
    return str(Path(output.ablation).parent.parent)


def figures_dir(wildcards, output) -> str:
    return str(Path(output.fig_ablation).parent)


def variant_model(wildcards):
    """The checkpoint a variant is evaluated from: the base model for `raw`."""
    if wildcards.variant == "raw":
        return f"{WORK}/model/base"
    return f"{WORK}/finetune/{wildcards.variant}"


# The committed GPU runs whose figures `rule all` redraws: those results/<machine>/index.csv keeps in the tree.
try:
    RUNS_IN_TREE = runs_in_tree(results_dir="results")
except ResultsIndexError as err:
    raise WorkflowError(f"results index error: {err}") from None


def indexed_runs(kind: str, holding: str) -> list[tuple[str, str]]:
    """(machine, version) of every in-tree run of `kind` named results/<machine>/<kind>_<version>/
    that holds a file matching `holding`."""
    runs = set()
    for machine, run, run_kind in zip(RUNS_IN_TREE["machine"], RUNS_IN_TREE["run"], RUNS_IN_TREE["kind"]):
        if run_kind == kind and run.startswith(f"{kind}_") and any((Path("results") / machine / run).glob(holding)):
            runs.add((machine, run.removeprefix(f"{kind}_")))
    return sorted(runs)


def committed_sweep_runs() -> list[tuple[str, str]]:
    """(machine, version) of every indexed GPU sweep run with sweep CSVs: results/<machine>/sweeps_<version>/."""
    return indexed_runs("sweeps", "sweep_*_D*.csv")


def committed_order_checks() -> list[tuple[str, str]]:
    """(machine, version) of every indexed GPU sweep run with order checks: sweeps_<version>/order_check_*_D*.csv."""
    return indexed_runs("sweeps", "order_check_*_D*.csv")


def committed_ep_runs() -> list[tuple[str, str]]:
    """(machine, version) of every indexed EP benchmark run: results/<machine>/ep_<version>/."""
    return indexed_runs("ep", "ep_*_D*.csv")


def committed_kernel_runs() -> list[tuple[str, str]]:
    """(machine, version) of every indexed kernel benchmark run with the cuBLAS peaks measured in
    the same run: results/<machine>/kernels_<version>/kernels.csv with a pct_of_burst_peak column."""
    runs = []
    for machine, version in indexed_runs("kernels", "kernels.csv"):
        with open(Path("results") / machine / f"kernels_{version}" / "kernels.csv") as handle:
            if "pct_of_burst_peak" in handle.readline().rstrip("\n").split(","):
                runs.append((machine, version))
    return runs


def kernel_bench_csvs(wildcards) -> list[str]:
    return sorted(str(p) for p in (Path("results") / wildcards.machine / f"kernels_{wildcards.version}").glob("kernels*.csv"))


def ep_bench_csvs(wildcards) -> list[str]:
    run_dir = Path("results") / wildcards.machine / f"ep_{wildcards.version}"
    comm = run_dir.parent.glob("comm_*/alltoall.csv")      # the machine's own all-to-all curve, if any
    return sorted(str(p) for p in [*run_dir.glob("ep_*_D*.csv"), run_dir / "peak.csv", *comm])


def order_check_csvs(wildcards) -> list[str]:
    run_dir = Path("results") / wildcards.machine / f"sweeps_{wildcards.version}"
    return sorted(str(p) for p in run_dir.glob("order_check_*_D*.csv"))


def gpu_sweep_csvs(wildcards) -> list[str]:
    run_dir = Path("results") / wildcards.machine / f"sweeps_{wildcards.version}"
    return sorted(str(p) for p in run_dir.glob("sweep_*_D*.csv"))


def committed_quality_runs(holding: str = "evaluate/*.json") -> list[tuple[str, str]]:
    """(machine, version) of every indexed quality-study run results/<machine>/quality_<version>/
    with a file matching `holding` (default: its evaluations; `placement_study/study.csv`: a placement
    study of its routing sample, docs/placement.md)."""
    return indexed_runs("quality", holding)


def quality_eval_jsons(wildcards) -> list[str]:
    run_dir = Path("results") / wildcards.machine / f"quality_{wildcards.version}"
    return sorted(str(p) for p in (run_dir / "evaluate").glob("*.json"))


def replicate_inputs(wildcards) -> dict[str, list[str] | str]:
    """A run's replicate_of.yaml and the evaluations of both runs it pairs (docs/quality.md)."""
    spec = Path("results") / wildcards.machine / f"quality_{wildcards.version}" / "replicate_of.yaml"
    first = Path((yaml.safe_load(spec.read_text()) or {}).get("first", spec.parent))
    return {"spec": str(spec), "scores": sorted(str(p) for d in (spec.parent, first) for p in (d / "evaluate").glob("*.json"))}


def quality_run_dir(wildcards, input) -> str:
    return str(Path(input.scores[0]).parent.parent)


def quality_figures_dir(wildcards, output) -> str:
    return str(Path(output.figure).parent)


def gpus_of_sweep(wildcards) -> int:
    return int(wildcards.devices)


def sweep_run_dir(wildcards, input) -> str:
    return str(Path(input.sweeps[0]).parent)


def committed_path(path: str) -> str:
    """`path` as given, else relative to the repository (committed results)."""
    return path if Path(path).exists() else str(Path(workflow.basedir) / path)


# The runs the simulator reads: their simulator.yaml files and the files those name (results/README.md).
try:
    SIMULATOR_INPUTS = discover() if CFG.simulate is not None else None
except SimulateError as err:
    raise WorkflowError(f"simulator inputs: {err}") from None


def simulate_inputs(wildcards) -> list[str]:
    """Every file the simulator reads, the simulator.yaml files included; relative paths are committed results."""
    return [committed_path(p) for p in SIMULATOR_INPUTS.files()] if SIMULATOR_INPUTS is not None else []


# The pre-registered check runs once a simulator.yaml names measured sweeps under prediction_check.
PREDICTION_CHECK_PREDICTIONS = (CFG.simulate.prediction_check or {}).get("predictions", "") if CFG.simulate else ""
PREDICTION_CHECK_MEASURED = list(SIMULATOR_INPUTS.prediction_check) if SIMULATOR_INPUTS is not None else []


def simulate_figures_dir(wildcards, output) -> str:
    return str(Path(output.fig_speedup).parent)


SIMULATE_OUTPUTS = [
    f"{RESULTS}/simulate/validation.csv",
    f"{RESULTS}/simulate/validation_history.csv",
    f"{RESULTS}/simulate/predictions.csv",
    f"{RESULTS}/simulate/predictions_D4_D8.csv",
    f"{RESULTS}/simulate/cost_model.json",
    f"{FIGURES}/simulate_speedup.png",
    f"{FIGURES}/simulate_validation.png",
    *([f"{RESULTS}/simulate/prediction_check.csv", f"{FIGURES}/prediction_check.png"] if PREDICTION_CHECK_MEASURED else []),
] if CFG.simulate is not None else []


def final_outputs() -> list[str]:
    """Every result a reader looks at, so deleting any one of them reruns its job and what follows."""
    model = [f"{RESULTS}/model/pretrain_log.csv", f"{RESULTS}/model/router_structure.json"]
    return [
        *(model if CFG.model.source in ("scratch", "upcycle") else []),
        f"{RESULTS}/profile/profile.json",
        *PLACEMENT_FILES,
        f"{RESULTS}/placement/expected_ct.csv",
        f"{RESULTS}/placement/study.csv",
        *[f"{RESULTS}/placement/latency_{t}.csv" for t in ("tradeoff", "replicas", "summary")],
        f"{FIGURES}/placement_latency.png",
        f"{RESULTS}/placement/inheritance.csv",
        *[f"{RESULTS}/finetune/{v}_log.csv" for v in VARIANTS if v != "raw"],
        *[f"{RESULTS}/evaluate/{v}.json" for v in VARIANTS],
        *([f"{RESULTS}/quality/tables/accuracy.csv", f"{FIGURES}/quality/accuracy.png"] if CFG.finetune.quality_grid else []),
        f"{RESULTS}/bench/ep_cpu.csv",
        *[f"results/{m}/sweeps_{v}/speedups.csv" for m, v in committed_sweep_runs()],
        *[f"results/{m}/sweeps_{v}/order_effect.csv" for m, v in committed_order_checks()],
        *[f"results/{m}/ep_{v}/targets.csv" for m, v in committed_ep_runs()],
        *[f"results/{m}/kernels_{v}/summary.csv" for m, v in committed_kernel_runs()],
        *[f"results/{m}/quality_{v}/tables/accuracy.csv" for m, v in committed_quality_runs()],
        *[f"figures/{m}/quality_{v}/accuracy.png" for m, v in committed_quality_runs()],
        *[f"figures/{m}/quality_{v}/placement_study.png" for m, v in committed_quality_runs("placement_study/study.csv")],
        *[f"results/{m}/quality_{v}/tables/replicates.csv" for m, v in committed_quality_runs("replicate_of.yaml")],
        *[f"figures/{m}/quality_{v}/replicates.png" for m, v in committed_quality_runs("replicate_of.yaml")],
        *[f"results/{m}/quality_{v}/tables/inheritance.csv" for m, v in committed_quality_runs("model/config.json")
          if any((Path("results") / m / f"quality_{v}" / "profile").glob("routing_*_sample.npz"))],
        *[f"results/{m}/quality_{v}/tables/verdicts_pooled.csv" for m, v in committed_quality_runs("pooled.yaml")],
        *[f"figures/{m}/quality_{v}/verdicts_pooled.png" for m, v in committed_quality_runs("pooled.yaml")],
        f"{RESULTS}/config.yaml",
        f"{RESULTS}/tables/ct_ablation.csv",
        f"{RESULTS}/tables/accuracy.csv",
        f"{RESULTS}/tables/placement_summary.csv",
        f"{FIGURES}/ct_ablation.png",
        f"{FIGURES}/latency_vs_ct.png",
        f"{FIGURES}/accuracy.png",
        f"{FIGURES}/coactivation_heatmaps.png",
        f"{FIGURES}/expected_ct_vs_devices.png",
        f"{FIGURES}/placement_study.png",
        *SIMULATE_OUTPUTS,
        *CLAIMS_OUTPUTS,
    ]
