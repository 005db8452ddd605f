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
        settings=settings("finetune", "seed"),
        data=f"{WORK}/data",
        profile=f"{WORK}/profile",
        placements=f"{RESULTS}/placement",
    log:
        f"logs/finetune_variant/{RUN}_{{variant}}.log",
    benchmark:
        f"benchmarks/finetune_variant/{RUN}_{{variant}}.tsv"
    threads: 1
    resources:
        mem_mb=8000,
        runtime=120,
        gpus=0,
    shell:
        "occult finetune --config {RESOLVED_CONFIG} --threads {threads} --variant {wildcards.variant}"
        " --model {input.model} --data {params.data} --profile {params.profile}"
        " --placements {params.placements} --out {output.model} --log {output.loss} 2>&1 | tee {log}"
