# What the quality study adds on a GPU machine besides its own rules (pretrain_model, ...,
# finetune_quality_arms, evaluate_quality_arms, summarise_quality_arms), for the configured run:
# the training step's time under each expert kernel before the long pre-training, and small
# samples of the routing traces to keep beside the results. Never part of `rule all`; with
#   snakemake --workflow-profile workflow/profiles/gpu --configfile config/presets/upcycle.yaml \
#       results/upcycle/quality/tables/accuracy.csv results/upcycle/model/trainbench.csv \
#       results/upcycle/profile/routing_heldout_sample.npz
# one GPU machine runs the whole study (docs/deploy.md).

if CFG.model.source in ("scratch", "upcycle"):

    rule bench_train_step:
        output:
            csv=f"{RESULTS}/model/trainbench.csv",
        params:
            config=RESOLVED_CONFIG,
            settings=settings("model", "pretrain", "seed"),
            steps=10,
            warmup=3,
        log:
            text=f"logs/bench_train_step/{RUN}.log",
            json=f"logs/bench_train_step/{RUN}.jsonl",
        benchmark:
            f"benchmarks/bench_train_step/{RUN}.tsv"
        conda:
            "../../environment.yml"
        threads: 2
        resources:
            gpus=1,
            mem_mb=32000,
            runtime=20,
        shell:
            "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
            " python -m occult.harness.trainbench --config {params.config} --out {output.csv}"
            " --steps {params.steps} --warmup {params.warmup} --log-json {log.json} > {log.text} 2>&1"


rule sample_routing:
    input:
        trace=f"{WORK}/profile/routing_{{split}}.npz",
    output:
        sample=f"{RESULTS}/profile/routing_{{split}}_sample.npz",
    params:
        tokens=16384,
    log:
        text=f"logs/sample_routing/{RUN}_{{split}}.log",
        json=f"logs/sample_routing/{RUN}_{{split}}.jsonl",
    benchmark:
        f"benchmarks/sample_routing/{RUN}_{{split}}.tsv"
    wildcard_constraints:
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
