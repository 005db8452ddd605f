# The quality grid over base models (docs/quality.md). With finetune.base_seeds (presets upcycle and
# upcycle-drop), every seed s gets its own base model: the configured run with pretrain.seed = s (its
# initial draws and data order), pre-trained, profiled and placed like the run's own model, then the
# quality grid's arms fine-tuned and scored on it, all under results/<run>/bases/s<s>/. One target
# runs a whole family (a preset) over its base models and pools the claims:
#   snakemake --workflow-profile workflow/profiles/gpu --configfile config/presets/upcycle-drop.yaml \
#       -- results/upcycle-drop/bases/verdicts_pooled.csv
# The grid's fine-tuning and evaluation (rules finetune_quality_arms, evaluate_quality_arms in
# finetune.smk and evaluate.smk) serve the run's own model ({grid} = quality) and every base model
# ({grid} = bases/s<s>). They keep each finished arm outside their declared output and record the
# whole set only at the end, so a job cut off by a time limit continues from its last finished arm
# when the same target runs again; pre-training resumes from its saved state (occult.stages.pretrain).
from occult.config import merge

BASE_SEEDS = list(CFG.finetune.base_seeds)
BASE_WORK = f"{WORK}/bases"
BASE_RESULTS = f"{RESULTS}/bases"
GRID_PATTERN = "quality|bases/s[0-9]+"


def base_raw(seed: int) -> dict:
    """The configuration of base model `seed`: the run's, with its own pretrain.seed (the list of base
    models left out, so that adding one reruns none of the others)."""
    return merge(CFG.raw, {"pretrain": {"seed": seed}, "finetune": {"base_seeds": []}})


def _write_base_configs() -> None:
    """Validate and write each base model's configuration; rewrite only on change (stable mtimes)."""
    for seed in BASE_SEEDS:
        raw = base_raw(seed)
        try:
            load_config(raw)
        except ConfigError as err:
            raise WorkflowError(f"config error (base model s{seed}): {err}") from None
        path = Path(f"{BASE_WORK}/s{seed}/config.yaml")
        text = yaml.safe_dump(raw, sort_keys=False)
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


_write_base_configs()


def grid_seed(grid: str) -> int | None:
    """None for the run's own model (`quality`), else the seed of `bases/s<seed>`."""
    return None if grid == "quality" else int(grid.removeprefix("bases/s"))


def grid_config(wildcards) -> str:
    seed = grid_seed(wildcards.grid)
    return RESOLVED_CONFIG if seed is None else f"{BASE_WORK}/s{seed}/config.yaml"


def grid_settings(*sections: str):
    """`settings(...)` of the model a grid job works on, as a params function."""
    def of(wildcards) -> str:
        seed = grid_seed(wildcards.grid)
        raw = CFG.raw if seed is None else base_raw(seed)
        return json.dumps({s: raw[s] for s in sections}, sort_keys=True)

    return of


def base_placement_files(seed) -> list[str]:
    return [f"{BASE_RESULTS}/s{seed}/placement/D{d}_{m}.json" for d in CFG.placement.devices
            for m in CFG.placement.methods]


def grid_inputs(wildcards) -> dict[str, str | list[str]]:
    """The model, data, profile and placements a grid job reads: the run's own, or base model s's."""
    seed = grid_seed(wildcards.grid)
    if seed is None:
        return {"model": f"{WORK}/model/base", "manifest": f"{WORK}/data/manifest.json",
                "profile": f"{WORK}/profile/profile.npz", "placements": PLACEMENT_FILES}
    return {"model": f"{BASE_WORK}/s{seed}/model/base", "manifest": f"{WORK}/data/manifest.json",
            "profile": f"{BASE_WORK}/s{seed}/profile/profile.npz", "placements": base_placement_files(seed),
            "config": f"{BASE_WORK}/s{seed}/config.yaml"}


def base_settings(*sections: str):
    def of(wildcards) -> str:
        raw = base_raw(int(wildcards.seed))
        return json.dumps({s: raw[s] for s in sections}, sort_keys=True)

    return of


def model_family() -> str:
    """The family the base models belong to: their upcycling initialisation, or `scratch`."""
    return CFG.model.upcycle_init if CFG.model.source == "upcycle" else CFG.model.source


BASE_SEED_PATTERN = "|".join(str(s) for s in BASE_SEEDS) or "(?!)"


rule pretrain_base_model:
    input:
        manifest=rules.build_data.output.manifest,
        config=f"{BASE_WORK}/s{{seed}}/config.yaml",
    output:
        model=directory(f"{BASE_WORK}/s{{seed}}/model/base"),
        loss=f"{BASE_RESULTS}/s{{seed}}/model/pretrain_log.csv",
        structure=f"{BASE_RESULTS}/s{{seed}}/model/router_structure.json",
        config=f"{BASE_RESULTS}/s{{seed}}/model/config.json",
        record=f"{BASE_RESULTS}/s{{seed}}/model/occult_pretrain.json",
    params:
        settings=base_settings("model", "pretrain", "seed"),
        data=data_dir,
    log:
        text=f"logs/pretrain_base_model/{RUN}_s{{seed}}.log",
        json=f"logs/pretrain_base_model/{RUN}_s{{seed}}.jsonl",
    benchmark:
        f"benchmarks/pretrain_base_model/{RUN}_s{{seed}}.tsv"
    wildcard_constraints:
        seed=BASE_SEED_PATTERN,
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        mem_mb=32000,
        runtime=120,
        gpus=0,             # the gpu and slurm profiles give it one
    shell:
        "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
        " occult pretrain --config {input.config} --threads {threads} --data {params.data}"
        " --out {output.model} --log {output.loss} --structure {output.structure}"
        " --log-json {log.json} 2>&1 | tee {log.text}"
        " && cp {output.model}/config.json {output.config}"
        " && cp {output.model}/occult_pretrain.json {output.record}"


rule profile_base_model:
    input:
        model=rules.pretrain_base_model.output.model,
        manifest=rules.build_data.output.manifest,
        config=f"{BASE_WORK}/s{{seed}}/config.yaml",
    output:
        profile=f"{BASE_WORK}/s{{seed}}/profile/profile.npz",
        calibration=f"{BASE_WORK}/s{{seed}}/profile/routing_calibration.npz",
        heldout=f"{BASE_WORK}/s{{seed}}/profile/routing_heldout.npz",
        summary=f"{BASE_RESULTS}/s{{seed}}/profile/profile.json",
    params:
        settings=base_settings("profile", "seed"),
        data=data_dir,
        outdir=output_dir,
    log:
        text=f"logs/profile_base_model/{RUN}_s{{seed}}.log",
        json=f"logs/profile_base_model/{RUN}_s{{seed}}.jsonl",
    benchmark:
        f"benchmarks/profile_base_model/{RUN}_s{{seed}}.tsv"
    wildcard_constraints:
        seed=BASE_SEED_PATTERN,
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        mem_mb=8000,
        runtime=60,
        gpus=0,             # the gpu and slurm profiles give it one
    shell:
        "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
        " occult profile --config {input.config} --threads {threads} --model {input.model}"
        " --data {params.data} --out {params.outdir} --log-json {log.json} 2>&1 | tee {log.text}"
        " && cp {params.outdir}/profile.json {output.summary}"


rule place_base_experts:
    input:
        profile=rules.profile_base_model.output.profile,
        calibration=rules.profile_base_model.output.calibration,
        heldout=rules.profile_base_model.output.heldout,
        config=f"{BASE_WORK}/s{{seed}}/config.yaml",
    output:
        placements=base_placement_files("{seed}"),
        table=f"{BASE_RESULTS}/s{{seed}}/placement/expected_ct.csv",
    params:
        settings=base_settings("placement", "seed"),
        profile=profile_dir,
        outdir=output_dir,
    log:
        text=f"logs/place_base_experts/{RUN}_s{{seed}}.log",
        json=f"logs/place_base_experts/{RUN}_s{{seed}}.jsonl",
    benchmark:
        f"benchmarks/place_base_experts/{RUN}_s{{seed}}.tsv"
    wildcard_constraints:
        seed=BASE_SEED_PATTERN,
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    shell:
        "occult place --config {input.config} --profile {params.profile} --out {params.outdir}"
        " --table {output.table} --log-json {log.json} 2>&1 | tee {log.text}"


# A routing sample of each base model to keep beside its results (as rule sample_routing does for the run).
rule sample_base_routing:
    input:
        trace=f"{BASE_WORK}/s{{seed}}/profile/routing_{{split}}.npz",
    output:
        sample=f"{BASE_RESULTS}/s{{seed}}/profile/routing_{{split}}_sample.npz",
    params:
        tokens=16384,
    log:
        text=f"logs/sample_base_routing/{RUN}_s{{seed}}_{{split}}.log",
        json=f"logs/sample_base_routing/{RUN}_s{{seed}}_{{split}}.jsonl",
    benchmark:
        f"benchmarks/sample_base_routing/{RUN}_s{{seed}}_{{split}}.tsv"
    wildcard_constraints:
        seed=BASE_SEED_PATTERN,
        split="calibration|heldout",
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=10,
    shell:
        "python -m occult.harness.routing_sample --src {input.trace} --out {output.sample} --tokens {params.tokens}"
        " --log-json {log.json} > {log.text} 2>&1"


# How far each model's routing follows the expert groups it was initialised with (occult.routing.inheritance),
# beside its placements: the run's own model ({prefix} = "") and each base model ({prefix} = bases/s<s>/).
rule routing_inheritance:
    input:
        calibration=f"{WORK}/{{prefix}}profile/routing_calibration.npz",
        heldout=f"{WORK}/{{prefix}}profile/routing_heldout.npz",
        model=f"{WORK}/{{prefix}}model/base",
    output:
        table=report(f"{RESULTS}/{{prefix}}placement/inheritance.csv", category="Placement",
                     caption="../report/inheritance.rst"),
    log:
        text=f"logs/routing_inheritance/{RUN}_{{prefix}}inheritance.log",
        json=f"logs/routing_inheritance/{RUN}_{{prefix}}inheritance.jsonl",
    benchmark:
        f"benchmarks/routing_inheritance/{RUN}_{{prefix}}inheritance.tsv"
    wildcard_constraints:
        prefix="(bases/s[0-9]+/)?",
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=8000,
        runtime=20,
    shell:
        "python -m occult.routing.inheritance --routing {input.calibration} {input.heldout}"
        " --model-config {input.model}/config.json --out {output.table} --log-json {log.json} > {log.text} 2>&1"


# The family's claims pooled over its base models (occult.report.quality_pooled), with every base
# model's tables, routing samples and inheritance table: the grid's one target.
rule quality_base_grid:
    input:
        scores=expand(f"{BASE_RESULTS}/s{{seed}}/evaluated.json", seed=BASE_SEEDS),
        tables=expand(f"{BASE_RESULTS}/s{{seed}}/tables/accuracy.csv", seed=BASE_SEEDS),
        inheritance=expand(f"{BASE_RESULTS}/s{{seed}}/placement/inheritance.csv", seed=BASE_SEEDS),
        samples=expand(f"{BASE_RESULTS}/s{{seed}}/profile/routing_{{split}}_sample.npz", seed=BASE_SEEDS,
                       split=["calibration", "heldout"]),
    output:
        table=f"{BASE_RESULTS}/verdicts_pooled.csv",
        bases=f"{BASE_RESULTS}/verdicts_pooled_bases.csv",
        figure=report(f"{FIGURES}/bases/verdicts_pooled.png", category="Quality study",
                      caption="../report/verdicts_pooled.rst"),
    params:
        family=model_family(),
        runs=" ".join(f"{BASE_RESULTS}/s{s}" for s in BASE_SEEDS),
        devices=CFG.finetune.devices,
    log:
        text=f"logs/quality_base_grid/{RUN}.log",
        json=f"logs/quality_base_grid/{RUN}.jsonl",
    benchmark:
        f"benchmarks/quality_base_grid/{RUN}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=10,
    shell:
        "python -m occult.report.quality_pooled --family {params.family} --runs {params.runs}"
        " --devices {params.devices} --out {output.table} --figure {output.figure}"
        " --log-json {log.json} > {log.text} 2>&1"
