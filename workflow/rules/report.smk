rule make_report:
    input:
        loss=rules.pretrain_model.output.loss if CFG.model.source in ("scratch", "upcycle") else [],
        structure=rules.pretrain_model.output.structure if CFG.model.source in ("scratch", "upcycle") else [],
        profile=rules.profile_coactivation.output.profile,
        placement_table=rules.place_experts.output.table,
        placement_study=rules.study_placement.output.study,
        placements=PLACEMENT_FILES,
        bench=rules.bench_layer.output.csv,
        scores=expand(f"{RESULTS}/evaluate/{{variant}}.json", variant=VARIANTS),
    output:
        config=report(f"{RESULTS}/config.yaml", category="Configuration", caption="../report/config.rst"),
        ablation=report(f"{RESULTS}/tables/ct_ablation.csv", category="Tables", caption="../report/ct_ablation.rst"),
        accuracy=report(f"{RESULTS}/tables/accuracy.csv", category="Tables", caption="../report/accuracy.rst"),
        placement=report(f"{RESULTS}/tables/placement_summary.csv", category="Tables", caption="../report/placement.rst"),
        fig_ablation=report(f"{FIGURES}/ct_ablation.png", category="Figures", caption="../report/ct_ablation.rst"),
        fig_latency=report(f"{FIGURES}/latency_vs_ct.png", category="Figures", caption="../report/latency_vs_ct.rst"),
        fig_accuracy=report(f"{FIGURES}/accuracy.png", category="Figures", caption="../report/accuracy.rst"),
        fig_heatmaps=report(f"{FIGURES}/coactivation_heatmaps.png", category="Figures", caption="../report/heatmaps.rst"),
        fig_placement=report(f"{FIGURES}/expected_ct_vs_devices.png", category="Figures", caption="../report/placement.rst"),
        fig_study=report(f"{FIGURES}/placement_study.png", category="Figures", caption="../report/placement_study.rst"),
    params:
        config=RESOLVED_CONFIG,
        results=results_dir,
        figures=figures_dir,
    log:
        text=f"logs/make_report/{RUN}.log",
        json=f"logs/make_report/{RUN}.jsonl",
    benchmark:
        f"benchmarks/make_report/{RUN}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "occult report --config {params.config} --results {params.results} --figures {params.figures}"
        " --log-json {log.json} 2>&1 | tee {log.text}"


CLAIMS_SPEC = "results/paper/claims_spec.yaml"
# In `rule all` wherever the spec is (the repository; not a bare working directory).
CLAIMS_OUTPUTS = ["results/paper/claims.csv", "figures/paper/claims.png"] if Path(CLAIMS_SPEC).is_file() else []


def claims_inputs(wildcards) -> list[str]:
    """Every committed result file the claims spec reads (occult.report.claims)."""
    from occult.report.claims import spec_inputs

    return spec_inputs(CLAIMS_SPEC)


rule reproduce_paper:
    input:
        spec=CLAIMS_SPEC,
        results=claims_inputs,
    output:
        table=report("results/paper/claims.csv", category="Claims of the paper", caption="../report/claims.rst"),
        figure=report("figures/paper/claims.png", category="Claims of the paper", caption="../report/claims.rst"),
    log:
        text="logs/reproduce_paper/claims.log",
        json="logs/reproduce_paper/claims.jsonl",
    benchmark:
        "benchmarks/reproduce_paper/claims.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "python -m occult.report.claims --spec {input.spec} --out {output.table} --figure {output.figure}"
        " --log-json {log.json} > {log.text} 2>&1"


rule write_config_reference:
    input:
        schema="config/schema.yaml",
        defaults="config/config.yaml",
    output:
        page="docs/configuration.md",
    log:
        text="logs/write_config_reference/configuration.log",
        json="logs/write_config_reference/configuration.jsonl",
    benchmark:
        "benchmarks/write_config_reference/configuration.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    shell:
        "python -m occult.report.config_reference --schema {input.schema} --defaults {input.defaults}"
        " --out {output.page} --log-json {log.json} > {log.text} 2>&1"
