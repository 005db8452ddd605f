# The latency placement prices layers with the simulate stage's calibrated cost model; without a
# simulate section, with the model shipped with the package.
COST_MODEL = (f"{RESULTS}/simulate/cost_model.json"
              if CFG.simulate is not None and "latency" in CFG.placement.methods else None)


def cost_model_flag(wildcards, input) -> str:
    return f"--cost-model {input.cost_model}" if COST_MODEL else ""


rule place_experts:
    input:
        profile=rules.profile_coactivation.output.profile,
        calibration=rules.profile_coactivation.output.calibration,
        heldout=rules.profile_coactivation.output.heldout,
        cost_model=COST_MODEL or [],
    output:
        placements=PLACEMENT_FILES,
        table=report(f"{RESULTS}/placement/expected_ct.csv", category="Placement", caption="../report/placement.rst"),
    params:
        config=RESOLVED_CONFIG,
        settings=settings("placement", "seed"),
        profile=profile_dir,
        outdir=output_dir,
        cost_model=cost_model_flag,
    log:
        text=f"logs/place_experts/{RUN}.log",
        json=f"logs/place_experts/{RUN}.jsonl",
    benchmark:
        f"benchmarks/place_experts/{RUN}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    shell:
        "occult place --config {params.config} --profile {params.profile} --out {params.outdir}"
        " --table {output.table} {params.cost_model} --log-json {log.json} 2>&1 | tee {log.text}"


rule study_placement:
    input:
        calibration=rules.profile_coactivation.output.calibration,
        heldout=rules.profile_coactivation.output.heldout,
        cost_model=COST_MODEL or [],
    output:
        study=report(f"{RESULTS}/placement/study.csv", category="Placement", caption="../report/placement_study.rst"),
        sensitivity=f"{RESULTS}/placement/study_sensitivity.csv",
        tradeoff=report(
            f"{RESULTS}/placement/latency_tradeoff.csv", category="Placement", caption="../report/placement_latency.rst"
        ),
        replicas=report(
            f"{RESULTS}/placement/latency_replicas.csv", category="Placement", caption="../report/placement_latency.rst"
        ),
        summary=report(
            f"{RESULTS}/placement/latency_summary.csv", category="Placement", caption="../report/placement_latency.rst"
        ),
        figure=report(
            f"{FIGURES}/placement_latency.png", category="Placement", caption="../report/placement_latency.rst"
        ),
    params:
        config=RESOLVED_CONFIG,
        settings=settings("placement", "seed"),
        profile=profile_dir_of_traces,
        synthetic=" ".join(CFG.placement.study_synthetic),
        seed=CFG.seed,
        rounds=CFG.placement.swap_rounds,
        shape=f"--hidden {CFG.model.hidden_size} --ffn {CFG.model.expert_ffn}",
        cost_model=cost_model_flag,
    log:
        text=f"logs/study_placement/{RUN}.log",
        json=f"logs/study_placement/{RUN}.jsonl",
    benchmark:
        f"benchmarks/study_placement/{RUN}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    shell:
        "python -m occult.stages.placement_study --profile-dir {params.profile} --out {output.study}"
        " --sensitivity-out {output.sensitivity} --synthetic {params.synthetic} --seed {params.seed}"
        " --swap-rounds {params.rounds} {params.shape} {params.cost_model} --tradeoff-out {output.tradeoff}"
        " --replicas-out {output.replicas} --summary-out {output.summary} --tradeoff-figure {output.figure}"
        " --log-json {log.json} 2>&1 | tee {log.text}"


# The figure of a committed placement study of a GPU run's routing sample (CPU only). The study
# itself is a committed result: `python -m occult.stages.placement_study --profile-dir
# results/<machine>/quality_<version>/profile ...` (docs/placement.md gives the command).
rule plot_placement_study_gpu:
    input:
        study="results/{machine}/quality_{version}/placement_study/study.csv",
    output:
        figure=report(
            "figures/{machine}/quality_{version}/placement_study.png",
            category="Placement",
            caption="../report/placement_study.rst",
        ),
    log:
        text="logs/plot_placement_study_gpu/{machine}_{version}.log",
        json="logs/plot_placement_study_gpu/{machine}_{version}.jsonl",
    benchmark:
        "benchmarks/plot_placement_study_gpu/{machine}_{version}.tsv"
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
        "python -m occult.stages.placement_study --plot {input.study} --figure {output.figure}"
        " --log-json {log.json} > {log.text} 2>&1"
