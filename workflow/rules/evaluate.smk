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
    shell:
        "occult evaluate --config {params.config} --threads {threads} --variant {wildcards.variant}"
        " --model {input.model} --data {params.data} --profile {params.profile}"
        " --placements {params.placements} --out {output.scores} --log-json {log.json} 2>&1 | tee {log.text}"
