rule eval_variant:
    input:
        model=variant_model,
        manifest=rules.build_data.output.manifest,
        profile=rules.profile_coactivation.output.profile,
        placements=PLACEMENT_FILES,
    output:
        scores=f"{RESULTS}/evaluate/{{variant}}.json",
    params:
        settings=settings("evaluate", "finetune", "data"),
        data=f"{WORK}/data",
        profile=f"{WORK}/profile",
        placements=f"{RESULTS}/placement",
    log:
        f"logs/eval_variant/{RUN}_{{variant}}.log",
    benchmark:
        f"benchmarks/eval_variant/{RUN}_{{variant}}.tsv"
    threads: 1
    resources:
        mem_mb=8000,
        runtime=120,
    shell:
        "occult evaluate --config {RESOLVED_CONFIG} --threads {threads} --variant {wildcards.variant}"
        " --model {input.model} --data {params.data} --profile {params.profile}"
        " --placements {params.placements} --out {output.scores} 2>&1 | tee {log}"
