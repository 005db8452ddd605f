rule profile_coactivation:
    input:
        model=f"{WORK}/model/base",
        manifest=rules.build_data.output.manifest,
    output:
        profile=f"{WORK}/profile/profile.npz",
        calibration=f"{WORK}/profile/routing_calibration.npz",
        heldout=f"{WORK}/profile/routing_heldout.npz",
        summary=f"{RESULTS}/profile/profile.json",
    params:
        config=RESOLVED_CONFIG,
        settings=settings("profile", "seed"),
        data=data_dir,
        outdir=output_dir,
    log:
        text=f"logs/profile_coactivation/{RUN}.log",
        json=f"logs/profile_coactivation/{RUN}.jsonl",
    benchmark:
        f"benchmarks/profile_coactivation/{RUN}.tsv"
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        mem_mb=8000,
        runtime=60,
        gpus=0,             # the gpu and slurm profiles give it one
    shell:
        "python -m occult.harness.gpu_slots --gpus {resources.gpus} --"
        " occult profile --config {params.config} --threads {threads} --model {input.model}"
        " --data {params.data} --out {params.outdir} --log-json {log.json} 2>&1 | tee {log.text}"
        " && cp {params.outdir}/profile.json {output.summary}"
