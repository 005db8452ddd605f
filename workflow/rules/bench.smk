rule bench_layer:
    input:
        profile=rules.profile_coactivation.output.profile,
        heldout=rules.profile_coactivation.output.heldout,
        placements=PLACEMENT_FILES,
    output:
        csv=f"{RESULTS}/bench/ep_cpu.csv",
    params:
        config=RESOLVED_CONFIG,
        settings=settings("bench", "model", "seed"),
        profile=profile_dir,
        placements=placement_dir,
    log:
        text=f"logs/bench_layer/{RUN}.log",
        json=f"logs/bench_layer/{RUN}.jsonl",
    benchmark:
        f"benchmarks/bench_layer/{RUN}.tsv"
    conda:
        "../../environment.yml"
    threads: 2
    resources:
        mem_mb=8000,
        runtime=60,
    shell:
        "OMP_NUM_THREADS=1 occult bench --config {params.config} --profile {params.profile}"
        " --placements {params.placements} --out {output.csv} --log-json {log.json} 2>&1 | tee {log.text}"
