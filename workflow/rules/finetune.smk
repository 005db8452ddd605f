rule finetune_variant:
    input:
        model=f"{WORK}/model/base",
        manifest=rules.build_data.output.manifest,
        profile=rules.profile_coactivation.output.profile,
        placements=PLACEMENT_FILES,
    output:
        model=directory(f"{WORK}/finetune/{{variant}}"),
        loss=f"{RESULTS}/finetune/{{variant}}_log.csv",
    params:
        config=RESOLVED_CONFIG,
        settings=settings("finetune", "seed"),
        data=data_dir,
        profile=profile_dir,
        placements=placement_dir,
    log:
        text=f"logs/finetune_variant/{RUN}_{{variant}}.log",
        json=f"logs/finetune_variant/{RUN}_{{variant}}.jsonl",
    benchmark:
        f"benchmarks/finetune_variant/{RUN}_{{variant}}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        mem_mb=8000,
        runtime=120,
        gpus=0,
    shell:
        "occult finetune --config {params.config} --threads {threads} --variant {wildcards.variant}"
        " --model {input.model} --data {params.data} --profile {params.profile}"
        " --placements {params.placements} --out {output.model} --log {output.loss}"
        " --log-json {log.json} 2>&1 | tee {log.text}"
