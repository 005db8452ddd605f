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
        "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
        " occult finetune --config {params.config} --threads {threads} --variant {wildcards.variant}"
        " --model {input.model} --data {params.data} --profile {params.profile}"
        " --placements {params.placements} --out {output.model} --log {output.loss}"
        " --log-json {log.json} 2>&1 | tee {log.text}"


# The quality study's whole grid (occult.routing.variants.quality_arms: every D of the study, the gate
# ablation, full fine-tuning; finetune.quality_arms: core keeps D = finetune.devices) where
# finetune.quality_grid is set (presets mini, upcycle, upcycle-drop): every arm in one job, data encoded
# once. {grid} is `quality` (the run's own model) or `bases/s<seed>` (a base model of
# workflow/rules/quality_grid.smk). Each arm is saved under work/<run>/<grid>/finetune as it finishes
# and skipped when the job runs again; the declared output, written once all are saved, lists them
# (docs/quality.md; on a GPU machine: docs/deploy.md).
rule finetune_quality_arms:
    input:
        unpack(grid_inputs),
    output:
        done=f"{WORK}/{{grid}}/finetuned.json",
    params:
        config=grid_config,
        settings=grid_settings("finetune", "seed"),
        data=data_dir,
        profile=profile_dir,
        placements=placement_dir,
        arms=f"{WORK}/{{grid}}/finetune",
        logs=f"{RESULTS}/{{grid}}/finetune",
    log:
        text=f"logs/finetune_quality_arms/{RUN}/{{grid}}.log",
        json=f"logs/finetune_quality_arms/{RUN}/{{grid}}.jsonl",
    benchmark:
        f"benchmarks/finetune_quality_arms/{RUN}/{{grid}}.tsv"
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
        " python -m occult.stages.finetune --config {params.config} --model {input.model} --data {params.data}"
        " --profile {params.profile} --placements {params.placements} --out {params.arms}"
        " --logs {params.logs} --done {output.done} --log-json {log.json} 2>&1 | tee {log.text}"
