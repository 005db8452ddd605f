rule eval_variant:
    input:
        model=variant_model,
        manifest=rules.build_data.output.manifest,
        profile=rules.profile_coactivation.output.profile,
        placements=PLACEMENT_FILES,
    output:
        scores=f"{RESULTS}/evaluate/{{variant}}.json",
    params:
        config=RESOLVED_CONFIG,
        settings=settings("evaluate", "finetune", "data"),
        data=data_dir,
        profile=profile_dir,
        placements=placement_dir,
    log:
        text=f"logs/eval_variant/{RUN}_{{variant}}.log",
        json=f"logs/eval_variant/{RUN}_{{variant}}.jsonl",
    benchmark:
        f"benchmarks/eval_variant/{RUN}_{{variant}}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=8000,
        runtime=120,
        gpus=0,             # the gpu and slurm profiles give it one
    shell:
        "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
        " occult evaluate --config {params.config} --threads {threads} --variant {wildcards.variant}"
        " --model {input.model} --data {params.data} --profile {params.profile}"
        " --placements {params.placements} --out {output.scores} --log-json {log.json} 2>&1 | tee {log.text}"


# The quality study's tables, verdicts and figure from a committed GPU run (docs/quality.md):
# one job per results/<machine>/quality_<version>/ holding evaluate/<arm>.json; CPU only.
rule plot_quality:
    input:
        scores=quality_eval_jsons,
    output:
        accuracy=report(
            "results/{machine}/quality_{version}/tables/accuracy.csv",
            category="Quality study (GPU)",
            caption="../report/accuracy.rst",
        ),
        verdicts="results/{machine}/quality_{version}/tables/verdicts.json",
        figure=report(
            "figures/{machine}/quality_{version}/accuracy.png",
            category="Quality study (GPU)",
            caption="../report/accuracy.rst",
        ),
    params:
        run_dir=quality_run_dir,
        figures=quality_figures_dir,
    log:
        text="logs/plot_quality/{machine}_{version}.log",
        json="logs/plot_quality/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/plot_quality/{machine}_{version}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "python -m occult.stages.evaluate --summarise {params.run_dir} --figures {params.figures}"
        " --log-json {log.json} > {log.text} 2>&1"


# Two committed runs of one recipe on two base models, paired document by document: how far the base
# model moves each arm and each difference from the reference arm (docs/quality.md); CPU only.
rule quality_replicates:
    input:
        unpack(replicate_inputs),
    output:
        table="results/{machine}/quality_{version}/tables/replicates.csv",
        figure=report(
            "figures/{machine}/quality_{version}/replicates.png",
            category="Quality study (GPU)",
            caption="../report/replicates.rst",
        ),
    log:
        text="logs/quality_replicates/{machine}_{version}.log",
        json="logs/quality_replicates/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/quality_replicates/{machine}_{version}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "python -m occult.stages.evaluate --replicates {input.spec} --out {output.table} --figure {output.figure}"
        " --log-json {log.json} > {log.text} 2>&1"


# lm-eval on every arm of the quality grid (rule finetune_quality_arms; {grid} as there), then its
# tables, verdicts and figure, laid out as for a committed GPU run (rule plot_quality). Each arm's
# scores are saved under results/<run>/<grid>/evaluate as it finishes and skipped when the job runs
# again; the declared output, written once all are scored, lists them.
rule evaluate_quality_arms:
    input:
        unpack(grid_inputs),
        arms=rules.finetune_quality_arms.output.done,
    output:
        done=f"{RESULTS}/{{grid}}/evaluated.json",
    params:
        config=grid_config,
        settings=grid_settings("evaluate", "finetune", "data"),
        data=data_dir,
        profile=profile_dir,
        placements=placement_dir,
        arms=f"{WORK}/{{grid}}/finetune",
        scores=f"{RESULTS}/{{grid}}/evaluate",
    log:
        text=f"logs/evaluate_quality_arms/{RUN}/{{grid}}.log",
        json=f"logs/evaluate_quality_arms/{RUN}/{{grid}}.jsonl",
    benchmark:
        f"benchmarks/evaluate_quality_arms/{RUN}/{{grid}}.tsv"
    wildcard_constraints:
        grid=GRID_PATTERN,
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        mem_mb=32000,
        runtime=240,
        gpus=0,             # the gpu and slurm profiles give it one
    shell:
        "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
        " python -m occult.stages.evaluate --config {params.config} --model {input.model} --arms {params.arms}"
        " --data {params.data} --profile {params.profile} --placements {params.placements}"
        " --out {params.scores} --done {output.done} --log-json {log.json} 2>&1 | tee {log.text}"


rule summarise_quality_arms:
    input:
        scores=rules.evaluate_quality_arms.output.done,
    output:
        accuracy=report(
            f"{RESULTS}/{{grid}}/tables/accuracy.csv", category="Quality study", caption="../report/accuracy.rst"
        ),
        verdicts=f"{RESULTS}/{{grid}}/tables/verdicts.json",
        figure=report(f"{FIGURES}/{{grid}}/accuracy.png", category="Quality study", caption="../report/accuracy.rst"),
    params:
        run_dir=f"{RESULTS}/{{grid}}",
        figures=f"{FIGURES}/{{grid}}",
    log:
        text=f"logs/summarise_quality_arms/{RUN}/{{grid}}.log",
        json=f"logs/summarise_quality_arms/{RUN}/{{grid}}.jsonl",
    benchmark:
        f"benchmarks/summarise_quality_arms/{RUN}/{{grid}}.tsv"
    wildcard_constraints:
        grid=GRID_PATTERN,
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "python -m occult.stages.evaluate --summarise {params.run_dir} --figures {params.figures}"
        " --log-json {log.json} > {log.text} 2>&1"


def committed_routing_samples(wildcards) -> list[str]:
    """The routing samples a committed quality run keeps (profile/routing_*_sample.npz)."""
    run_dir = Path("results") / wildcards.machine / f"quality_{wildcards.version}"
    return sorted(str(p) for p in (run_dir / "profile").glob("routing_*_sample.npz"))


def pooled_inputs(wildcards) -> dict[str, list[str] | str]:
    """A committed run's pooled.yaml, the evaluations of every run it names (docs/quality.md) and
    the inheritance table of each that keeps routing samples (rule quality_inheritance)."""
    from occult.report.quality_pooled import spec_runs

    spec = Path("results") / wildcards.machine / f"quality_{wildcards.version}" / "pooled.yaml"
    runs = spec_runs(spec)
    return {"spec": str(spec), "scores": sorted(str(p) for run in runs for p in (run / "evaluate").glob("*.json")),
            "inheritance": sorted(str(run / "tables" / "inheritance.csv") for run in runs
                                  if any((run / "profile").glob("routing_*_sample.npz"))
                                  and (run / "model" / "config.json").is_file())}


# How far a committed run's routing still follows the expert groups its model was initialised with
# (occult.routing.inheritance; docs/quality.md): beside its accuracy table; CPU only.
rule quality_inheritance:
    input:
        routing=committed_routing_samples,
        config="results/{machine}/quality_{version}/model/config.json",
    output:
        table=report(
            "results/{machine}/quality_{version}/tables/inheritance.csv",
            category="Quality study (GPU)",
            caption="../report/inheritance.rst",
        ),
    log:
        text="logs/quality_inheritance/{machine}_{version}.log",
        json="logs/quality_inheritance/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/quality_inheritance/{machine}_{version}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=10,
    shell:
        "python -m occult.routing.inheritance --routing {input.routing} --model-config {input.config}"
        " --out {output.table} --log-json {log.json} > {log.text} 2>&1"


# The quality claims pooled over the base models of each model family that a committed run's
# pooled.yaml names (occult.report.quality_pooled; docs/quality.md); CPU only.
rule quality_pooled:
    input:
        unpack(pooled_inputs),
    output:
        table="results/{machine}/quality_{version}/tables/verdicts_pooled.csv",
        bases="results/{machine}/quality_{version}/tables/verdicts_pooled_bases.csv",
        figure=report(
            "figures/{machine}/quality_{version}/verdicts_pooled.png",
            category="Quality study (GPU)",
            caption="../report/verdicts_pooled.rst",
        ),
    log:
        text="logs/quality_pooled/{machine}_{version}.log",
        json="logs/quality_pooled/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/quality_pooled/{machine}_{version}.tsv"
    wildcard_constraints:
        machine="[^/]+",
        version="[^/]+",
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "python -m occult.report.quality_pooled --spec {input.spec} --out {output.table} --figure {output.figure}"
        " --log-json {log.json} > {log.text} 2>&1"
